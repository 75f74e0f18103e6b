"""Quality, wall time and peak memory of each pruning method on the real model.

    .venv/bin/python benchmarks/prune_quality.py [--calibration artifacts/calibration]
        [--reference artifacts/reference] [--runs wanda:2:4,wanda:2:4:refine,...]

Each run is one `lmpress prune` process (so its peak memory is its own, read from the
artifact's lineage), then `evaluate` on held-out Austen and pydoc text against the base's
cached reference (never the calibration text). The calibration objective, the layer output
error E||(W - W')x||^2 summed over every pruned linear, comes from the stage's pruning.json,
before and after refinement. Results: benchmarks/results/prune_quality.{json,md}.

Run spec: method:pattern[:refine][:seq][:wN][:noclip][:shrinkS] with pattern 0.5 or 2:4 (written 2-4 on
the command line is fine too); without ':seq' the stored statistics of the unpruned model are
used (no forward passes), with it each layer's statistics are re-collected on the pruned model.
':w4' (sparsegpt) quantizes the kept weights to 4 bits in the same pass (group size 64), and
':noclip' fits those grids min-max instead of with the clip search; ':shrinkS' sets
--hessian-shrinkage to S (shrink0: SparseGPT's Hessian as published).
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

from benchmarks._report import flatten, quality_arguments, run_stage, write_quality_table, evaluation_config, scratch_directory, spec_value  # noqa: E402
from pipelines.stages import evaluate  # noqa: E402

DEFAULT_RUNS = ",".join(
    f"{method}:{pattern}{refine}" for pattern in ("0.5", "2-4") for method in ("magnitude", "wanda", "sparsegpt") for refine in ("", ":refine")
)


def main() -> None:
    parser = quality_arguments(DEFAULT_RUNS, "prune_quality")
    args = parser.parse_args()

    evaluation = evaluation_config(args.reference)
    rows = [{"run": "base (fp32)", **flatten(evaluate(args.model, args.reference, None, evaluation))}]
    work = scratch_directory()
    for spec in args.runs.split(","):
        method, pattern, *flags = spec.split(":")
        out = work / spec.replace(":", "_")
        command = [
            "prune", "--model", args.model, "--calibration", str(args.calibration),
            "--method", method, "--pattern", pattern.replace("-", ":"), "--sequential", "true" if "seq" in flags else "false",
        ]
        command += ["--refine"] if "refine" in flags else []
        bits = next((flag[1:] for flag in flags if flag.startswith("w")), None)  # ':w4' -> --bits 4
        command += ["--bits", bits] if bits else []
        command += ["--clip-search", "false"] if "noclip" in flags else []
        shrinkage = spec_value(flags, "shrink", None)
        command += ["--hessian-shrinkage", f"{shrinkage:g}"] if shrinkage is not None else []
        report, run = run_stage(command, out, "pruning.json")
        row = {
            "run": spec, "sparsity": report["sparsity"], "objective": f"{report['objective']:.1f}",
            "refined objective": f"{report['refined_objective']:.1f}" if "refined_objective" in report else "",
            "stage s": round(run["wall_time_s"], 1), "peak MB": round(run["peak_rss_bytes"] / 2**20),
            **flatten(evaluate(str(out), args.reference, None, evaluation)),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(write_quality_table(rows, args.out, "sparsity", ("objective", "refined objective", "stage s", "peak MB")))


if __name__ == "__main__":
    main()
