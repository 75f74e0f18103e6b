"""Cost of the load-time repack into the interleaved layout (`PackedWeight.interleave`), side by
side with another version of the kernels' module, in one run.

    python benchmarks/repack_cost.py [--shape 4096x14336] [--bits 4] [--baseline FILE] [--device cpu]

Per version: the seconds one `interleave()` of a random N x K layer takes (after a warm-up
repack of a few rows, so imports and first-use allocations are not counted) and the peak
resident memory it adds (on CUDA: peak allocated device memory). Each version runs in a process
of its own, since a process's peak memory cannot be reset. `--baseline` names another
compressors/packed_int.py, e.g. `git show 535bfa0:compressors/packed_int.py > /tmp/base.py`.
Results: benchmarks/results/repack_cost.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(module_file: Path, rows: int, columns: int, bits: int, device: torch.device) -> dict:
    """One version's repack of one random layer, in this process."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.kernel_speed import load_kernels

    packed_int = load_kernels(module_file)
    generator = torch.Generator().manual_seed(0)
    words = torch.randint(-(2**31), 2**31 - 1, (rows, columns * bits // 32), dtype=torch.int32, generator=generator).to(device)
    scale = torch.rand(rows, columns // 128, dtype=torch.float16, generator=generator).to(device)
    weight = packed_int.PackedWeight(words, scale, bits, columns)
    packed_int.PackedWeight(words[:8].clone(), scale[:8], bits, columns).interleave()  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    before = peak_bytes(device)
    start = time.perf_counter()
    interleaved = weight.interleave()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    added = peak_bytes(device) - before
    assert torch.equal(interleaved.unit_order().packed, words), "the repack does not round-trip"
    return {"seconds": round(seconds, 3), "peak_added_MB": round(added / 2**20, 1), "packed_MB": round(words.numel() * 4 / 2**20, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="4096x14336", help="N x K (out x in)")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--baseline", type=Path, help="another compressors/packed_int.py to measure side by side")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "repack_cost")
    parser.add_argument("--one", type=Path, help=argparse.SUPPRESS)  # internal: measure this module file here
    args = parser.parse_args()
    rows, columns = (int(v) for v in args.shape.split("x"))
    if args.one is not None:
        print(json.dumps(measure(args.one, rows, columns, args.bits, torch.device(args.device))))
        return
    versions = {"head": ROOT / "compressors" / "packed_int.py"} | ({"baseline": args.baseline} if args.baseline else {})
    results = {}
    for name, module_file in versions.items():
        command = [sys.executable, __file__, "--one", str(module_file), "--shape", args.shape, "--bits", str(args.bits), "--device", args.device]
        results[name] = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
    report = {"shape": args.shape, "bits": args.bits, "device": args.device, "torch_threads": torch.get_num_threads(),
              "baseline": str(args.baseline) if args.baseline else None, "results": results}
    lines = [f"Repack into the interleaved layout, {args.shape} int{args.bits} g128, {args.device} "
             f"(`python benchmarks/repack_cost.py --shape {args.shape} --bits {args.bits} --device {args.device}"
             + (f" --baseline {args.baseline}`" if args.baseline else "`") + "), each version in its own process.", "",
             "| version | seconds | peak memory added (MB) | packed weight (MB) |", "|---|---|---|---|"]
    lines += [f"| {name} | {r['seconds']} | {r['peak_added_MB']} | {r['packed_MB']} |" for name, r in results.items()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
