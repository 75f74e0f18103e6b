#!/usr/bin/env bash
# Fetches, into .whl/, the wheels benchmarks/gpu_check.sh installs on a GPU machine that has torch,
# Triton and transformers but reaches no registry: compressed-tensors and its needs (the kernel
# tests import it), and transformers at the version lmpress pins (the image's 5.17 copies a CPU
# scalar to the GPU while a CUDA graph captures its eager attention mask, so decoding's graph
# capture fails there; seen on an H200 in stop 60). Versions are the set-up's own (.venv), for
# the GPU image's Python 3.12 on x86-64. Carry them with the run: carry [".whl"].
set -euo pipefail
cd "$(dirname "$0")/.."
names=(compressed-tensors pydantic pydantic-core loguru annotated-types typing-inspection transformers)
mkdir -p .whl
for name in "${names[@]}"; do
    version=$(.venv/bin/pip show "$name" | sed -n 's/^Version: //p')
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "$name==$version"
done
ls .whl
