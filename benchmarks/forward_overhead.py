"""lmpress' own host time per PackedLinear call: everything a decode step runs in Python
before Triton's autotuner and launcher take over (those are stubbed out), so it runs on the CPU.

On a GPU an eager decode step of a small model is bound by this host time, not by the kernels
(`benchmarks/results/latency_h100.md`: 110-260 us a packed call against 24-31 us for cuBLAS).
With `--baseline REV` the same measurement runs on another commit's tree (a git worktree made
here) in alternating rounds, so the two are compared side by side in one run:

    python benchmarks/forward_overhead.py --baseline ed0f558 --out benchmarks/results/forward_overhead
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KINDS = {"int4 g64": (4, 64), "int3 g64": (3, 64), "int8 g64": (8, 64)}


def measure(calls: int) -> dict:
    """Microseconds per forward of each kind at batch 1 and 16, the Triton launch stubbed."""
    import time

    import torch

    import compressors  # noqa: F401  (selects Triton's interpreter before triton is imported)
    from compressors import packed_int
    from compressors.kernels import PackedLinear
    from compressors.packed_int import random_packed_weight

    class Launch:  # stands in for an autotuned kernel: `kernel[grid](...)` does nothing
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    packed_int._GEMV = packed_int._GEMM = (Launch(), {})
    result = {}
    for name, (bits, group) in KINDS.items():
        layer = PackedLinear(random_packed_weight(bits, 576, 576, group, "symmetric", 0), None)
        layer._kernels[torch.device("cpu")] = 0  # the kernel path, as on a GPU (the CPU otherwise serves a dense copy)
        for batch in (1, 16):
            x = torch.randn(1, batch, 576)
            for _ in range(500):
                layer(x)
            start = time.perf_counter()
            for _ in range(calls):
                layer(x)
            result[f"{name} batch {batch}"] = (time.perf_counter() - start) / calls * 1e6
    return result


def run_in(tree: Path, calls: int) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", PYTHONPATH=str(tree))
    code = f"import sys, json; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); from forward_overhead import measure; print(json.dumps(measure({calls})))"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tree, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", help="a commit to measure side by side (a git worktree of it is made and removed)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    trees = {"head": ROOT}
    with tempfile.TemporaryDirectory() as scratch:
        if args.baseline:
            trees[args.baseline] = Path(scratch) / "baseline"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(trees[args.baseline]), args.baseline], check=True)
        try:
            rounds = {version: [] for version in trees}
            for _ in range(args.rounds):  # alternating, so drift in this machine's speed hits both alike
                for version, tree in trees.items():
                    rounds[version].append(run_in(tree, args.calls))
        finally:
            if args.baseline:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(trees[args.baseline])], check=True)
    medians = {version: {case: statistics.median(r[case] for r in runs) for case in runs[0]} for version, runs in rounds.items()}
    versions = list(trees)
    lines = ["| call | " + " | ".join(f"{v} us" for v in versions) + (" | baseline / head |" if len(versions) > 1 else " |"),
             "|---|" + "---|" * (len(versions) + (len(versions) > 1))]
    for case in medians["head"]:
        ratio = f" | {medians[versions[1]][case] / medians['head'][case]:.2f}x" if len(versions) > 1 else ""
        lines.append(f"| {case} | " + " | ".join(f"{medians[v][case]:.1f}" for v in versions) + ratio + " |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.with_suffix(".json").write_text(json.dumps({"rounds": args.rounds, "calls": args.calls, "median_us": medians}, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(
            "lmpress' host time per PackedLinear call before Triton's launch (stubbed), 576x576, median of "
            f"{args.rounds} alternating rounds of {args.calls} calls, one thread:\n\n{table}\n")


if __name__ == "__main__":
    main()
