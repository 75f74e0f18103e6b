"""KV-head merging on the real model: KV-cache size and held-out quality per method.

    .venv/bin/python benchmarks/kvmerge_quality.py [--calibration artifacts/calibration]
        [--reference artifacts/reference] [--runs mean:1,aligned:1,aligned:1:heal,...]

Run spec: METHOD:KV_HEADS[:SAMPLES][:heal] (`lmpress kv-merge --method METHOD --kv-heads
KV_HEADS`, fitted on SAMPLES calibration windows, default 32; `heal` adds --heal-steps, default
32 batches of 2 windows at lr 1e-4). Each command runs in its own process (wall time and peak
memory from its lineage), then `evaluate` on held-out Austen and pydoc text against the base's
cached reference. Results: benchmarks/results/kvmerge_quality.{json,md}.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("LMPRESS_QUIET", "1")

import torch  # noqa: E402

from benchmarks._report import flatten, quality_arguments, run_stage, write_quality_table, evaluation_config, scratch_directory  # noqa: E402
from pipelines.stages import evaluate  # noqa: E402

DEFAULT_RUNS = "mean:1,aligned:1:16,aligned:1,aligned:1:64,aligned:1:32:heal,mean:1:32:heal"


def main() -> None:
    parser = quality_arguments(DEFAULT_RUNS, "kvmerge_quality")
    parser.add_argument("--heal-steps", type=int, default=32)
    parser.add_argument("--heal-lr", type=float, default=1e-4)
    args = parser.parse_args()
    torch.set_num_threads(1)

    evaluation = evaluation_config(args.reference)
    base = flatten(evaluate(args.model, args.reference, None, evaluation))
    rows = [{"run": "base (fp32)", "KV bytes/token (fp16)": base["kv_cache_bytes_per_token_fp16"], **base}]
    work = scratch_directory()
    for spec in args.runs.split(","):
        method, kv_heads, *rest = spec.split(":")
        samples = next((flag for flag in rest if flag.isdigit()), "32")
        command = ["kv-merge", "--model", args.model, "--calibration", str(args.calibration), "--method", method, "--kv-heads", kv_heads, "--samples", samples]
        if "heal" in rest:
            command += ["--heal-steps", str(args.heal_steps), "--heal-lr", str(args.heal_lr), "--batch-size", "2"]
        out = work / spec.replace(":", "_")
        report, run = run_stage(command, out, "structure.json")
        metrics = flatten(evaluate(str(out), args.reference, None, evaluation))
        row = {
            "run": spec, "KV bytes/token (fp16)": report["kv_cache_bytes_per_token_fp16"]["after"],
            "stage s": round(run["wall_time_s"], 1), "peak MB": round(run["peak_rss_bytes"] / 2**20),
            "heal KL first/last": f"{report['recovery_kl']['first']:.3f}/{report['recovery_kl']['last']:.3f}" if "recovery_kl" in report else "",
            **metrics,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(write_quality_table(rows, args.out, "KV bytes/token (fp16)", ("stage s", "peak MB", "heal KL first/last")))


if __name__ == "__main__":
    main()
