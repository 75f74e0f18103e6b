"""Speculative decoding on the CPU: tokens per target forward, acceptance and wall-clock speedup
of drafts for a target, with the check that the output is the target's own greedy output.

    .venv/bin/python benchmarks/speculative_decoding.py --target smollm2-135m [NAME=]DRAFT [...]
        [--lookahead 4,8] [--prompts 8] [--prompt-len 128] [--new-tokens 64]

Prompts are the first `--prompts` windows of held-out text (half Pride and Prejudice, half
pydoc held-out; never calibration text). Per draft and lookahead, every prompt is decoded
plainly (`generate`, greedy) and speculatively, alternately, on one thread; reported are the
totals over prompts: new tokens per target forward, acceptance rate, and plain / speculative
wall time. Results: JSON and markdown beside `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("LMPRESS_QUIET", "1")

import torch  # noqa: E402

from calibrate.corpora import leading_windows, tokenize_part  # noqa: E402
from compressors.speculative import speculative_greedy  # noqa: E402
from pipelines.models import load_model  # noqa: E402


def held_out_prompts(tokenizer, count: int, length: int) -> list[torch.Tensor]:
    halves = [(corpus, (count + i) // 2) for i, corpus in enumerate(("austen-heldout", "pydoc-heldout"))]
    return [window[None] for corpus, n in halves if n for window in leading_windows(tokenize_part(corpus, tokenizer), n, length)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("drafts", nargs="+")
    parser.add_argument("--lookahead", default="4,8")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "speculative_decoding")
    args = parser.parse_args()
    torch.set_num_threads(1)

    target = load_model(args.target)
    prompts = held_out_prompts(target.tokenizer, args.prompts, args.prompt_len)
    rows = []
    for spec in args.drafts:
        name, _, path = spec.rpartition("=")
        draft = load_model(path).model
        for lookahead in map(int, args.lookahead.split(",")):
            forwards = accepted = proposed = 0
            plain_s = speculative_s = 0.0
            identical = True
            for prompt in prompts:
                start = time.perf_counter()
                greedy = target.model.generate(prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
                plain_s += time.perf_counter() - start
                start = time.perf_counter()
                result = speculative_greedy(target.model, draft, prompt, args.new_tokens, lookahead)
                speculative_s += time.perf_counter() - start
                identical &= bool(torch.equal(result.tokens, greedy))
                forwards, accepted, proposed = forwards + result.target_forwards, accepted + result.accepted, proposed + result.proposed
            row = {
                "draft": name or path, "draft layers": draft.config.num_hidden_layers, "lookahead": lookahead,
                "tokens per target forward": round((accepted + forwards) / forwards, 3), "acceptance": round(accepted / proposed, 3),
                "plain s": round(plain_s, 2), "speculative s": round(speculative_s, 2), "speedup": round(plain_s / speculative_s, 3),
                "identical output": identical,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    settings = {"target": args.target, "prompts": len(prompts), "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}
    args.out.with_suffix(".json").write_text(json.dumps({**settings, "rows": rows}, indent=2) + "\n")
    columns = list(rows[0])
    lines = [
        f"Target {args.target}; {len(prompts)} held-out prompts of {args.prompt_len} tokens, {args.new_tokens} new tokens each, greedy, CPU, 1 thread.",
        "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns),
    ]
    lines += ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
