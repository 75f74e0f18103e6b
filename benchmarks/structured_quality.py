"""Width pruning and layer dropping on the real model: size, quality and CPU speed.

    .venv/bin/python benchmarks/structured_quality.py [--calibration artifacts/calibration]
        [--reference artifacts/reference] [--runs width:flap:0.9,drop:influence:3:rec,...]

Run spec: width:SCORER:KEEP[:nobias][:rec] (prune-structured keeping KEEP of the parameters;
magnitude runs without bias compensation, the naive baseline; `nobias` turns it off for the
others too) or drop:SCORER:N[:rec] (drop-layers, scorer influence or last); `rec` adds the
recovery distillation (--recovery-steps, default 16 batches of 2 calibration windows: about
4 minutes on one core; 64 steps take about 20).

Each command runs in its own process (its wall time and peak memory from the lineage), then
`evaluate` on held-out Austen and pydoc text against the base's cached reference, and greedy
decoding speed on one thread (batch 1, 64 new tokens; base and pruned model timed alternately,
5 rounds each, medians: benchmarks/decode_speed.py), as tokens/s and as a ratio to the base.
Results: benchmarks/results/structured_quality.{json,md}.
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
from benchmarks.decode_speed import side_by_side  # noqa: E402
from pipelines.models import load_model  # noqa: E402
from pipelines.stages import evaluate  # noqa: E402

DEFAULT_RUNS = ",".join([
    *(f"width:{run}" for keep in ("0.9", "0.8", "0.7") for run in (f"flap:{keep}", f"magnitude:{keep}")),
    "width:flap:0.8:nobias", "width:flap:0.9:rec", "width:flap:0.7:rec",
    *(f"drop:{run}" for n in (3, 6) for run in (f"influence:{n}", f"last:{n}")), "drop:influence:6:rec",
])


def main() -> None:
    parser = quality_arguments(DEFAULT_RUNS, "structured_quality")
    parser.add_argument("--recovery-steps", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)

    evaluation = evaluation_config(args.reference)
    base_model = load_model(args.model)
    base = flatten(evaluate(args.model, args.reference, None, evaluation))
    rows = [{"run": "base (fp32)", "params (M)": round(base["parameters"] / 1e6, 1), "speed vs base": 1.0, **base}]
    work = scratch_directory()
    for spec in args.runs.split(","):
        kind, scorer, amount, *flags = spec.split(":")
        out = work / spec.replace(":", "_")
        common = ["--model", args.model, "--calibration", str(args.calibration), "--scorer", scorer]
        if "rec" in flags:
            common += ["--recovery-steps", str(args.recovery_steps)]
        if kind == "width":
            bias = "false" if scorer == "magnitude" or "nobias" in flags else "true"
            report, run = run_stage(["prune-structured", *common, "--target-params", amount, "--bias-compensation", bias], out, "structure.json")
        else:
            report, run = run_stage(["drop-layers", *common, "--n", amount], out, "structure.json")
        speed, base_speed = side_by_side(base_model, load_model(str(out)))
        metrics = flatten(evaluate(str(out), args.reference, None, evaluation))
        row = {
            "run": spec, "params (M)": round(report["params_after"] / 1e6, 1), "tokens/s": round(speed, 1), "speed vs base": round(speed / base_speed, 2),
            "stage s": round(run["wall_time_s"], 1), "peak MB": round(run["peak_rss_bytes"] / 2**20),
            "recovery KL first/last": f"{report['recovery_kl']['first']:.3f}/{report['recovery_kl']['last']:.3f}" if "recovery_kl" in report else "",
            "dropped": report.get("dropped_layers", ""), **metrics,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    columns = ("tokens/s", "speed vs base", "stage s", "peak MB", "recovery KL first/last", "dropped")
    print(write_quality_table(rows, args.out, "params (M)", columns))


if __name__ == "__main__":
    main()
