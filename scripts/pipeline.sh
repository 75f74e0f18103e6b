#!/usr/bin/env bash
# Set up (if needed) and run the default DVC pipeline on the real model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
# dvc exp and dvc params diff need git; the checkout normally is one.
git rev-parse --git-dir >/dev/null 2>&1 || git init -q
[ -d .dvc ] || dvc init -q
dvc repro "$@"
dvc metrics show
