#!/usr/bin/env bash
# One lent GPU's minutes (15 in all, starting included), spent in order of what matters now,
# each step of benchmarks/gpu_check.sh under its own time limit so the call comes back with what
# it has. Prepare here, on the CPU machine, first:
#   bash benchmarks/gpu_wheels.sh                                        # into .whl/ (the image's transformers breaks graph capture)
#   .venv/bin/python benchmarks/artifact_slice.py artifacts/quantized .gpu/quantized --layers 0
#   .venv/bin/python benchmarks/artifact_slice.py artifacts/quantized-searched .gpu/quantized-searched --layers 0
#   echo /.gpu/ >> .git/info/exclude; echo /.whl/ >> .git/info/exclude
# then call the device tool's run with carry [".gpu", ".whl"] and the command
#   OUT=$OUT BUDGET=430 bash benchmarks/gpu_session.sh        (timeout_s 470)
# and give the machine back at once. In stop 69 a machine started in about 30 s and this session
# ran in 281 s, so a second call fits the 15 minutes: keep BUDGET low enough to leave one. Afterwards, here: refit the L1 wavefront model on the new sweep,
#   .venv/bin/python benchmarks/gemv_l1_model.py --timings FILES_AT/gluon/gemv_gluon.json --out /tmp/l1
# where FILES_AT is where the run's files came back.
#
# The steps: (1) every Gluon launch timed, the ring launches (`stages`, stop 69) and the persistent
# rings (`persist`, stop 70: a few programs an SM, one ring and one copy of x for all their blocks), their TMA twins (`tma`,
# stop 71: the copy engine fills the ring, a tile an instruction, as cuBLAS's fp16 GEMV does; both untimed so far) and
# the pairs (HALF2=2) beside their twins, and what serving picks per shape; (2) the compiled test of every Gluon launch against the
# reference (and CUDA-graph decoding); (3) Nsight Compute's counters of the fastest launches, eight rings (two by TMA)
# and cuBLAS fp16 (do the rings stream above the 43-49% of DRAM peak the register-streamed launches reach?); (4) served int4 at
# batch 1 (kernel_speed.py: bandwidth against the measured read roof); (5) `lmpress validate` on
# the slices, with whatever time is left.
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
step 190 bash benchmarks/gpu_check.sh gluon  # (54 half2 launches, 60 in all, both layouts, 3 shapes; serving times its 54 per shape)
step 110 env TESTS_K="gluon_gemv_matches or cuda_graphs" bash benchmarks/gpu_check.sh tests
step 150 bash benchmarks/gpu_check.sh profile
left=$((BUDGET - SECONDS))
[ $left -gt 30 ] && step $((left < 100 ? left : 100)) env SPEED_ARGS="--kinds int4-interleaved --batches 1" bash benchmarks/gpu_check.sh speed
left=$((BUDGET - SECONDS))
[ $left -gt 30 ] && step $left bash benchmarks/gpu_check.sh validate
grep -E "passed|failed|best (half2|fp32|ring|persistent|TMA)|picks" "$OUT/gpu_check.log" | tail -21
