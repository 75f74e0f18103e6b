"""Drafts for speculative decoding, before and after distillation, for one or more targets:
tokens per target forward, acceptance and CPU wall-clock speedup on held-out prompts, identical
output, and what the distillation cost (wall time, peak memory).

    .venv/bin/python benchmarks/draft_quality.py [--target NAME=MODEL ...] [--layers 4,6,8]
        [--steps 200] [--vocab-trim 8192] [--lookahead 4,8] [--prompts 8] [--calibration artifacts/calibration]

For each target and layer count, `lmpress draft` runs as its own process (its lineage records
wall time and peak RSS). The undistilled counterpart is the same draft before training: the
same layers of the target and the same trimmed vocabulary, built here from the distilled
draft's report. Both are measured by `lmpress evaluate-draft`'s function (plain greedy and
speculative decoding alternately, prompt by prompt, one thread). Results: JSON and markdown
beside `--out` (default benchmarks/results/draft_quality, suffixed by the target names).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("LMPRESS_QUIET", "1")

import torch  # noqa: E402

from _report import scratch_directory  # noqa: E402


def undistilled_copy(target: str, distilled: Path, out: Path) -> Path:
    """The distilled draft's starting point: the same target layers, the same trimmed vocabulary."""
    import shutil

    from compressors.structured import keep_layers
    from pipelines.models import load_model
    from pipelines.serving import dense_copy
    from pipelines.stages import DRAFT_REPORT, VOCAB_TRIM_FILE

    loaded = load_model(target)
    model = dense_copy(loaded.model)
    keep_layers(model, json.loads((distilled / DRAFT_REPORT).read_text())["layers_kept"])
    model.save_pretrained(out)
    loaded.tokenizer.save_pretrained(out)
    if (distilled / VOCAB_TRIM_FILE).is_file():
        shutil.copy(distilled / VOCAB_TRIM_FILE, out / VOCAB_TRIM_FILE)
    return out


def main() -> None:
    from pipelines.stages import SpeculationConfig, evaluate_draft

    parser = argparse.ArgumentParser()
    parser.add_argument("--target", action="append", help="NAME=MODEL (repeatable); default base=smollm2-135m")
    parser.add_argument("--calibration", default="artifacts/calibration")
    parser.add_argument("--layers", default="4,6,8")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--vocab-trim", type=int, default=8192)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--lookahead", default="4,8")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "draft_quality")
    args = parser.parse_args()
    torch.set_num_threads(1)
    targets = [spec.split("=", 1) for spec in (args.target or ["base=smollm2-135m"])]
    evaluation = SpeculationConfig(prompts=args.prompts, lookahead=args.lookahead)
    rows, training = [], []
    scratch = scratch_directory()
    for name, target in targets:
        for layers in map(int, args.layers.split(",")):
            distilled = scratch / f"{name}-{layers}"
            command = [
                sys.executable, "-m", "pipelines.cli", "draft", "--target", target, "--calibration", args.calibration, "--layers", str(layers),
                "--vocab-trim", str(args.vocab_trim), "--steps", str(args.steps), "--lr", str(args.lr), "--out", str(distilled),
            ]
            subprocess.run(command, check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})  # this tree's code
            lineage = json.loads((distilled / "lineage.json").read_text())["chain"][-1]
            report = json.loads((distilled / "draft.json").read_text())
            training.append({
                "target": name, "draft layers": layers, "layers kept": report["layers_kept"], "steps": args.steps,
                "training sequences x tokens": f"{report['data']['sequences']} x {report['data']['prompt_tokens'] + report['data']['generated_tokens'] // report['data']['sequences']}",
                "KL first -> last": f"{report['loss']['first']:.3f} -> {report['loss']['last']:.3f}" if report["loss"] else "",
                "target continuations + teacher pass s": lineage["run"]["phases_s"]["load_and_data"],
                "distillation s": lineage["run"]["phases_s"]["distill"],
                "s / step": round(lineage["run"]["phases_s"]["distill"] / max(args.steps, 1), 2),
                "stage wall s": lineage["run"]["wall_time_s"], "peak RSS MB": round(lineage["run"]["peak_rss_bytes"] / 2**20),
            })
            print(json.dumps(training[-1]), flush=True)
            before = undistilled_copy(target, distilled, scratch / f"{name}-{layers}-undistilled")
            for kind, draft in (("no", before), ("yes", distilled)):
                metrics = evaluate_draft(str(draft), target, None, evaluation)
                for lookahead, entry in metrics["lookahead"].items():
                    rows.append({
                        "target": name, "draft layers": layers, "distilled": kind, "lookahead": int(lookahead),
                        "tokens per target forward": entry["tokens_per_target_forward"], "acceptance": entry["acceptance_rate"],
                        "plain s": entry["plain_s"], "speculative s": entry["speculative_s"], "speedup": entry["speedup"],
                        "identical output": entry["identical_output"],
                    })
                    print(json.dumps(rows[-1]), flush=True)
    out = args.out.with_name(f"{args.out.name}_{'_'.join(name for name, _ in targets)}")
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {
        "targets": dict(targets), "steps": args.steps, "vocab_trim": args.vocab_trim, "lr": args.lr,
        "prompts": args.prompts, "prompt_len": evaluation.prompt_len, "new_tokens": evaluation.new_tokens,
    }
    out.with_suffix(".json").write_text(json.dumps({**settings, "rows": rows, "training": training}, indent=2) + "\n")
    lines = [
        f"Targets {', '.join(f'{n} = {t}' for n, t in targets)}; drafts of the target's most influential layers, LM head trimmed to "
        f"{args.vocab_trim} tokens, distilled {args.steps} steps (lr {args.lr}) on the target's greedy continuations of calibration prompts. "
        f"Speculative greedy decoding on {args.prompts} held-out prompts (half Pride and Prejudice, half pydoc held-out) of "
        f"{evaluation.prompt_len} tokens, {evaluation.new_tokens} new tokens each; CPU, 1 thread.",
        "", *table(rows), "", "Distillation cost (the whole `lmpress draft` process: target continuations, teacher pass, training):", "",
        *table(training),
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def table(rows: list[dict]) -> list[str]:
    columns = list(rows[0])
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns), *("| " + " | ".join(str(r[c]) for c in columns) + " |" for r in rows)]


if __name__ == "__main__":
    main()
