#!/usr/bin/env bash
# Set up (if needed) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH" OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRITON_INTERPRET=1
# One worker per core (tests pin torch to one thread each); --durations lists the slowest
# tests, to keep the suite under 20 minutes.
exec .venv/bin/python -m pytest -q -n auto --maxprocesses 4 --dist worksteal --durations=15 "$@"
