#!/usr/bin/env bash
# Everything lmpress checks on a CUDA GPU, in one go (a lent GPU machine is paid by the minute):
#   tests     the kernel tests, compiled for the GPU instead of interpreted (the 4-bit GEMV's PTX
#             decode runs only there);
#   validate  `lmpress validate` on each artifact (or artifact slice, benchmarks/artifact_slice.py)
#             found under $SLICES (default .gpu/);
#   speed     benchmarks/kernel_speed.py at realistic layer shapes ($SPEED_ARGS are passed on; the
#             autotuner compiles each launch shape for each stored kind, serially, so on an H100
#             all 8 kinds at 3 batches take longer than one 10-minute call: name a few with --kinds);
#             with .gpu-baseline/packed_int.py (an earlier version of the kernels, e.g.
#             `git show REV:compressors/packed_int.py`) it is timed side by side too; with --pdl-off in
#             $SPEED_ARGS, each kind also with programmatic dependent launch off (LMPRESS_PDL=0);
#   gemv      benchmarks/gemv_variants.py --production: the int4 GEMV at every launch shape the tuner
#             may pick, both layouts, at realistic layer shapes (compiled first on $COMPILE_WORKERS)
#   gluon     benchmarks/gemv_gluon.py: the batch-1 int4 GEMV written in Gluon (no barrier in its loop;
#             compressors/packed_int_gluon.py), at each of its launches, beside fp16 and the grid
#             GEMV (autotuned, both layouts), and what serving picked per shape (the faster)
#   mma       benchmarks/gemv_mma.py: the batch-1 int4 GEMV on the tensor cores (an experiment, each
#             word decoded into its mma.sync fragment), at each of its launches, beside fp16 and the
#             served GEMV
#   profile   benchmarks/gemv_profile.py under Nsight Compute (ncu): DRAM throughput, occupancy, issue
#             and warp stall counters of the fastest batch-1 launches and cuBLAS fp16, into $OUT
#   latency   `lmpress latency --random-weights` on the GPU: the table `search --budget-latency`
#             counts in (its launches compiled first, in parallel: kernel_speed.py --levels),
#             from a model's config.json and a level database's manifest.json alone
#             (the weights do not travel), prepared here with
#               mkdir -p .gpu-latency/model .gpu-latency/levels
#               cp ~/.cache/lmpress/models/smollm2-135m/config.json .gpu-latency/model/
#               cp artifacts/levels/manifest.json .gpu-latency/levels/     (the pipeline's database, or another)
#   decode    benchmarks/decode_graphs.py: `lmpress generate`'s greedy decoding, transformers' generate,
#             the eager static-cache loop and its CUDA-graph replays, dense and with every decoder
#             linear packed (bits4g64), from the same $LATENCY/model/config.json (random weights), its
#             launches compiled first as for latency (at batch 1 and the prompt's 32 rows too)
# Reports go to $OUT (default /tmp/lmpress-gpu), the full log to $OUT/gpu_check.log. Packages the
# machine lacks (compressed-tensors, bitsandbytes and their needs) may be carried as wheels in .whl/
# (`bash benchmarks/gpu_wheels.sh` fetches compressed-tensors and the pinned transformers; carry [".whl"]).
#
# TESTS_K replaces the tests' selection (e.g. "every_tuned and pipelined": the GEMV launches that
# copy blocks ahead).
#
#   bash benchmarks/gpu_check.sh [tests] [validate] [speed] [gemv] [gluon] [mma] [profile] [latency] [decode]   (default: all but gemv, gluon, mma, profile and decode)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/lmpress-gpu}
SLICES=${SLICES:-.gpu}
STEPS=${*:-tests validate speed latency}
LATENCY=${LATENCY:-.gpu-latency}
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/lmpress-site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/lmpress-site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRITON_INTERPRET=0 TRITON_PRINT_AUTOTUNING=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$LOG"
status=0
if [[ " $STEPS " == *" tests "* ]]; then
    # no autotuning (LMPRESS_AUTOTUNE=0): the tests run every launch shape by hand; compiling them
    # is the cost, so it is spread over the machine's cores
    LMPRESS_AUTOTUNE=0 python3 -m pytest -q -p no:cacheprovider -n "${TEST_WORKERS:-8}" tests/test_kernels.py \
        -k "${TESTS_K:-fused or dequantize or self_check or packed_linear or references or fast_grid or every_tuned or split_k or gluon_gemv_matches or cuda_graphs}" \
        >>"$LOG" 2>&1 || status=1
    grep -E "passed|failed" "$LOG" | tail -1
fi
if [[ " $STEPS " == *" validate "* ]]; then
    for slice in "$SLICES"/*/; do
        name=$(basename "$slice")
        python3 -m pipelines.cli validate "$slice" --out "$OUT/validate_$name.json" >>"$LOG" 2>&1 || { status=1; echo "validate $name failed"; continue; }
        python3 - "$OUT/validate_$name.json" "$name" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
speed = [e["speedup_vs_fp16"] for e in report["layers"].values() if "speedup_vs_fp16" in e]
error = report["max_rel_error"]  # None where no kernel serves a layer (2:4 fp16 values: a dense copy)
print(sys.argv[2], report["device"], "gpu_validated", report["gpu_validated"], "max rel error", "none" if error is None else f"{error:.2e}",
      "speedup vs fp16 at batch 1/16/64 (min-max over layers):",
      " / ".join(f"{min(s[b] for s in speed):.2f}-{max(s[b] for s in speed):.2f}" for b in ("1", "16", "64")) if speed else "none timed")
PY
    done
fi
if [[ " $STEPS " == *" speed "* ]]; then
    baseline=()
    [ -f .gpu-baseline/packed_int.py ] && baseline=(--baseline .gpu-baseline/packed_int.py)
    python3 benchmarks/kernel_speed.py --out "$OUT/kernel_speed" --compile-workers "${COMPILE_WORKERS:-14}" ${baseline[@]+"${baseline[@]}"} ${SPEED_ARGS:-} >>"$LOG" 2>&1 || { status=1; tail -30 "$LOG"; }
    cat "$OUT/kernel_speed.md" 2>/dev/null
fi
if [[ " $STEPS " == *" gemv "* ]]; then
    python3 benchmarks/gemv_variants.py --production --compile-workers "${COMPILE_WORKERS:-14}" --out "$OUT/gemv" >>"$LOG" 2>&1 || { status=1; tail -30 "$LOG"; }
    grep -E "autotuned .* best launch" "$LOG" | tail -6
fi
if [[ " $STEPS " == *" gluon "* ]]; then
    python3 benchmarks/gemv_gluon.py --compile-workers "${COMPILE_WORKERS:-14}" --out "$OUT/gluon" >>"$LOG" 2>&1 || { status=1; tail -30 "$LOG"; }
    grep -E "best (half2|fp32)|Error" "$LOG" | tail -12
fi
if [[ " $STEPS " == *" mma "* ]]; then
    python3 benchmarks/gemv_mma.py --compile-workers "${COMPILE_WORKERS:-14}" --out "$OUT/mma" >>"$LOG" 2>&1 || { status=1; tail -30 "$LOG"; }
    grep -E " best: |Error" "$LOG" | tail -6
fi
if [[ " $STEPS " == *" profile "* ]]; then
    # Nsight Compute's counters of the fastest batch-1 launches and cuBLAS fp16 (benchmarks/gemv_profile.py);
    # --clock-control none: the card's clocks are left as they are
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
    "$NCU" --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis -f -o "$OUT/gemv_profile" \
        python3 benchmarks/gemv_profile.py >>"$LOG" 2>&1 || { status=1; tail -30 "$LOG"; }
    "$NCU" --import "$OUT/gemv_profile.ncu-rep" --page details --csv >"$OUT/gemv_profile_details.csv" 2>>"$LOG" || status=1
    "$NCU" --import "$OUT/gemv_profile.ncu-rep" --page raw --csv >"$OUT/gemv_profile_raw.csv" 2>>"$LOG" || status=1
    grep -E "^profiled:" "$LOG" | tail -10
fi
for step in latency decode; do
    [[ " $STEPS " == *" $step "* ]] || continue
    if [ -f "$LATENCY/model/config.json" ] && [ -f "$LATENCY/levels/manifest.json" ]; then
        # the tuner would compile each level's launches one after another (over 200 s on an H100)
        batches=1
        [ "$step" = decode ] && batches=1,32
        python3 benchmarks/kernel_speed.py --levels "$LATENCY/levels" --batches "$batches" --compile-workers "${COMPILE_WORKERS:-14}" >>"$LOG" 2>&1
        if [ "$step" = latency ]; then
            python3 -m pipelines.cli latency --model "$LATENCY/model" --levels "$LATENCY/levels" --random-weights --device cuda \
                --out "$OUT/latency.json" >>"$LOG" 2>&1 || status=1
            tail -4 "$LOG"
        else
            python3 benchmarks/decode_graphs.py --model "$LATENCY/model" --level bits4g64 --out "$OUT/decode" >>"$LOG" 2>&1 || { status=1; tail -30 "$LOG"; }
            cat "$OUT/decode/decode_graphs.md" 2>/dev/null
        fi
    else
        echo "$step: $LATENCY/model/config.json and $LATENCY/levels/manifest.json are missing (see the top of this script)"
    fi
done
exit $status
