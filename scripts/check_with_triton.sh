#!/usr/bin/env bash
# benchmarks/kernel_sass.py (default: --check) compiled by another Triton than the one installed,
# by default 3.6.0, the H100 image's: a GPU runs what its own compiler makes of the kernels, and
# compilers differ (3.6 reduced a permuted tensor over the wrong lanes where 3.9 did not). The
# wheel comes from the package registry once, into $LMPRESS_CACHE/triton-VERSION, and goes first on
# PYTHONPATH; the rest of .venv stays as it is.
#   bash scripts/check_with_triton.sh [VERSION] [kernel_sass.py arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:-3.6.0}
shift || true
SITE=${LMPRESS_CACHE:-$HOME/.cache/lmpress}/triton-$VERSION
if [ ! -d "$SITE/triton" ]; then
    wheels=$(mktemp -d)
    trap 'rm -rf "$wheels" "$SITE.partial"' EXIT
    .venv/bin/python -m pip download -q --no-deps "triton==$VERSION" -d "$wheels"
    .venv/bin/python -m pip install -q --no-deps --target "$SITE.partial" "$wheels"/*.whl
    mv "$SITE.partial" "$SITE"
fi
PYTHONPATH="$SITE:$PWD" OMP_NUM_THREADS=1 exec .venv/bin/python benchmarks/kernel_sass.py "${@:---check}"
