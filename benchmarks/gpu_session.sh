#!/usr/bin/env bash
# One lent GPU's minutes (15 in all, starting included), spent in order of what matters now,
# each step of benchmarks/gpu_check.sh under its own time limit so the call comes back with what
# it has. Prepare here, on the CPU machine, first:
#   bash benchmarks/gpu_wheels.sh                                        # into .whl/ (the image's transformers breaks graph capture)
#   .venv/bin/python benchmarks/artifact_slice.py artifacts/quantized .gpu/quantized --layers 0
#   .venv/bin/python benchmarks/artifact_slice.py artifacts/quantized-searched .gpu/quantized-searched --layers 0
#   echo /.gpu/ >> .git/info/exclude
# then call the device tool's run with carry [".gpu", ".whl"], timeout_s 580 and the command
#   OUT=$OUT bash benchmarks/gpu_session.sh
# and give the machine back. Afterwards, here: refit the L1 wavefront model on the new sweep,
#   .venv/bin/python benchmarks/gemv_l1_model.py --timings FILES_AT/gluon/gemv_gluon.json --out /tmp/l1
# where FILES_AT is where the run's files came back.
#
# The steps: (1) every Gluon launch timed (the x-in-shared-memory ones are untimed so far; the fit
# predicts 3.05-3.6x fp16 at the large shapes); (2) served int4 at batch 1, as serving picks now;
# (3) the compiled tests of the Gluon GEMV and CUDA-graph decoding; (4) the tensor-core GEMV's sweep
# (the lead for batches 2-8); (5) `lmpress validate` on the slices, with whatever time is left.
set -u
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/lmpress-gpu}
BUDGET=${BUDGET:-560}
step() {
    local limit=$1
    shift
    echo "=== $* (limit ${limit}s) at ${SECONDS}s"
    timeout -k 5 "$limit" "$@"
    echo "=== rc $? at ${SECONDS}s"  # (timeout signals the step's whole process group: its compile workers too)
}
# the sweep compiles 32 launches x 2 layouts, the shared-memory ones once per K as well (about 100
# kernels, the served ones first on 14 processes; stop 60's 48 took 57 s with their timing), and
# times each at 3 shapes: it gets the most time
step 220 bash benchmarks/gpu_check.sh gluon
step 160 env SPEED_ARGS="--kinds int4-interleaved --batches 1" bash benchmarks/gpu_check.sh speed
step 70 env TESTS_K="gluon_gemv_matches or cuda_graphs or wrong_width" bash benchmarks/gpu_check.sh tests
left=$((BUDGET - 60 - SECONDS))
[ $left -gt 30 ] && step $((left < 120 ? left : 120)) bash benchmarks/gpu_check.sh mma
left=$((BUDGET - SECONDS))
[ $left -gt 30 ] && step $left bash benchmarks/gpu_check.sh validate
grep -E "passed|failed|best (half2|fp32)| best: " "$OUT/gpu_check.log" | tail -12
