"""Hardware counters of the batch-1 int4 GEMVs, beside cuBLAS's fp16 GEMV, for Nsight Compute.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section WarpStateStats --section SchedulerStats \
        --section MemoryWorkloadAnalysis -o OUT/gemv python3 benchmarks/gemv_profile.py
    ncu --import OUT/gemv.ncu-rep --page details --csv > OUT/gemv_details.csv

Timings (benchmarks/gemv_gluon.py) say how long each launch takes; the counters say why: DRAM
throughput against its peak, warps resident per SM, issue slots used, and what the warps wait on
(long scoreboard: a load from memory; MIO / LG throttle: the load-store queues; not selected:
issue-bound). Each kernel runs once under the profiler (ncu replays it per counter pass and
flushes the caches between passes, so the weight comes from device memory), after a warm-up
outside the profiled range that compiles it. Launches are named by their `Launch` fields,
interleaved as CUDA serves them, at the shapes where they timed fastest.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# (shape, Launch fields): per shape the fastest timed launch on an H200 (stop 69), its "pairs"
# twin (HALF2=2), a twin that streams its words through a ring in shared memory (`stages`), and
# at the large shapes persistent rings (a few programs an SM, x copied once a program), by
# cp.async and by TMA
PROFILED = [
    ("14336x4096", (1, 2, 8, 0, 1, 8, 4, 1)), ("14336x4096", (2, 2, 8, 0, 1, 8, 4, 1)), ("14336x4096", (2, 2, 8, 0, 1, 8, 4, 1, 0, 4)),
    ("14336x4096", (2, 4, 4, 0, 1, 4, 4, 1, 0, 4, 3)), ("14336x4096", (2, 4, 4, 0, 1, 4, 4, 1, 0, 4, 3, 1)),
    ("4096x14336", (1, 2, 2, 0, 0, 4)), ("4096x14336", (2, 2, 2, 0, 0, 4)), ("4096x14336", (1, 2, 2, 0, 0, 4, 4, 0, 0, 8)),
    ("4096x14336", (1, 2, 2, 0, 0, 4, 4, 0, 0, 8, 4)), ("4096x14336", (2, 2, 4, 0, 1, 4, 4, 1, 0, 8, 3)), ("4096x14336", (1, 2, 1, 0, 1, 1, 4, 0, 0, 8, 16)),
    ("4096x14336", (2, 2, 4, 0, 1, 4, 4, 1, 0, 8, 3, 1)),
    ("4096x4096", (1, 2, 2, 0, 1, 4, 4, 1)), ("4096x4096", (1, 2, 2, 0, 1, 4, 4, 1, 0, 4)),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fp16-shapes", default="4096x14336,14336x4096", help="cuBLAS fp16 GEMVs profiled too")
    args = parser.parse_args()

    import torch

    from compressors.packed_int import random_packed_weight
    from compressors.packed_int_gluon import Launch, run

    calls = []  # (name, call)
    for shape, fields in PROFILED:
        n, k = map(int, shape.split("x"))
        weight = random_packed_weight(4, n, k, 128).to("cuda").interleave()
        x = torch.randn(1, k, device="cuda", dtype=torch.float16)
        y = torch.empty(1, n, device="cuda", dtype=torch.float16)
        launch = Launch(*fields)
        calls.append((f"{shape} {launch}", lambda x=x, weight=weight, y=y, launch=launch: run(x, weight, y, launch)))
    for shape in filter(None, args.fp16_shapes.split(",")):
        n, k = map(int, shape.split("x"))
        dense = (torch.randn(n, k, device="cuda") / 50).half()
        x = torch.randn(1, k, device="cuda", dtype=torch.float16)
        calls.append((f"{shape} fp16 cuBLAS", lambda x=x, dense=dense: x @ dense.T))
    for _, call in calls:  # compiled and warm before the profiled range
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for name, call in calls:
        print(f"profiled: {name}", flush=True)  # in ncu's order: the report's kernels follow these lines
        call()
        torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
