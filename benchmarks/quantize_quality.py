"""Quality, size and wall time of each quantization method on the real model.

    .venv/bin/python benchmarks/quantize_quality.py [--calibration artifacts/calibration]
        [--reference artifacts/reference] [--runs rtn:4:64,gptq:4:64,...]
        [--lm-eval austen-lastword,pydoc-lastword,reuters-lastword [--lm-eval-limit 500]]

Every run goes through the same stage functions as the CLI and DVC (quantize, then evaluate
against the base's cached reference on held-out Austen and pydoc text, never the calibration
text), and with --lm-eval also through lm-eval on those tasks (`lmpress lm-eval`). Results:
benchmarks/results/quantize_quality.{json,md}; with lm-eval, quantize_lm_eval.{json,md}.

Settings this model admits: its widths (576, 1536) are multiples of 64, not 128, so group
size 64 and per-channel (-1) are used; 4-bit group 32 sits on the GGUF Q4_1 grid the weights
came from and would prove nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("LMPRESS_QUIET", "1")

from benchmarks._report import flatten as _flatten, write_quality_table, evaluation_config, scratch_directory, spec_value  # noqa: E402
from pipelines.stages import HESSIAN_SHRINKAGE, QuantizeConfig, evaluate, quantize  # noqa: E402
from pipelines.tasks import TasksConfig, evaluate_tasks, score_metrics  # noqa: E402

DEFAULT_RUNS = "rtn:4:64,gptq:4:64,awq:4:64,nf4,rtn:3:64,gptq:3:64,awq:3:64"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--calibration", type=Path, default=Path("artifacts/calibration"))
    parser.add_argument("--reference", type=Path, default=Path("artifacts/reference"))
    parser.add_argument(
        "--runs", default=DEFAULT_RUNS,
        help="method[:bits[:group_size]][:stored][:noclip][:noact][:shrinkS][:dampD][:bf16][:whole], comma-separated (codebooks and nf4 / int8 take no "
        "group size: squeezellm-gptq:3:stored); ':stored' uses the stored statistics "
        "(no forward passes), ':noclip' turns GPTQ's clip search off (min-max groups, as the results before it were measured), "
        "':noact' turns GPTQ's act order off (groups fitted as the sweep reaches them), ':shrinkS' sets GPTQ's --hessian-shrinkage to S "
        "(shrink0: the Hessian as published; the default otherwise), ':dampD' its --damp to D, "
        "':bf16' runs the sequential passes in bfloat16 (the pipeline's setting), ':whole' collects each layer's statistics for all "
        "its linears at once (--true-sequential false; the default until 2026-11-25, when true-sequential went to one pass; "
        "'trueseq' in the runs of that time's results)",
    )
    parser.add_argument("--lm-eval", default="", help="Also score every model on these lm-eval tasks, e.g. austen-lastword,pydoc-lastword,reuters-lastword")
    parser.add_argument("--lm-eval-limit", type=int, default=TasksConfig.limit, help="Examples per lm-eval task (0: all).")
    parser.add_argument("--out", type=Path, default=None, help="Results path without suffix (default: results/quantize_quality, or quantize_lm_eval with --lm-eval)")
    args = parser.parse_args()
    out = args.out or Path(__file__).parent / "results" / ("quantize_lm_eval" if args.lm_eval else "quantize_quality")

    def task_scores(model: str) -> dict:
        if not args.lm_eval:
            return {}
        scores = evaluate_tasks(model, None, TasksConfig(tasks=args.lm_eval, limit=args.lm_eval_limit))["tasks"]
        return {f"{task} {metric}": round(entry[metric], 4) for task, entry in scores.items() for metric in score_metrics(entry)}

    evaluation = evaluation_config(args.reference)
    rows = [{"run": "base (fp32)", **_flatten(evaluate(args.model, args.reference, None, evaluation)), **task_scores(args.model)}]
    work = scratch_directory()
    for spec in args.runs.split(","):
        method, *rest = spec.split(":")
        bits, group_size = ([int(part) for part in rest if part.lstrip("-").isdigit()] + [None, None])[:2]  # unset: the method's
        config = QuantizeConfig(method=method, bits=bits, group_size=group_size,
                                sequential="stored" not in rest, clip_search=False if "noclip" in rest else None, act_order=False if "noact" in rest else None,
                                hessian_shrinkage=spec_value(rest, "shrink", HESSIAN_SHRINKAGE), damp=spec_value(rest, "damp", QuantizeConfig.damp),
                                forward_dtype="bfloat16" if "bf16" in rest else "float32", true_sequential=False if "whole" in rest else None)
        start = time.perf_counter()
        artifact = quantize(args.model, args.calibration, work / spec.replace(":", "_"), config)
        seconds = time.perf_counter() - start
        rows.append({"run": spec, "quantize_s": round(seconds, 1), **_flatten(evaluate(str(artifact), args.reference, None, evaluation)), **task_scores(str(artifact))})
        print(json.dumps(rows[-1]), flush=True)
    rows[0]["peak_rss_mb_all_runs"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)

    print(write_quality_table(rows, out, "bits_per_weight", ("quantize_s", *(key for key in rows[0] if key.endswith((" acc", " perplexity"))))))


if __name__ == "__main__":
    main()
