"""What speculative decoding must beat on this machine: the cost of one target forward over n
new tokens (n = 1: plain decoding; n = k + 1: verifying k proposals) and of one draft token,
and from them the tokens per target forward at which speculation breaks even:

    break-even(k) = (k * draft(1) + target(k + 1)) / target(1)

    .venv/bin/python benchmarks/speculative_costs.py [--target MODEL] [--layers 4,6,8] [--vocab-trim 8192,0]
        [--lookahead 2,4,8]

Drafts are layer subsets of the target built in memory (a cost does not depend on which
layers or tokens are kept, nor on training), with the LM head trimmed as `lmpress draft
--vocab-trim` does. Each cost is the median of 30 timed forwards on a 128-token KV cache
(cropped back after each), one thread. Results: JSON and markdown beside `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("LMPRESS_QUIET", "1")

import torch  # noqa: E402

from compressors.draft import trim_lm_head  # noqa: E402
from compressors.structured import keep_layers  # noqa: E402
from pipelines.models import load_model  # noqa: E402
from pipelines.serving import dense_copy  # noqa: E402


@torch.no_grad()
def forward_ms(model, context: torch.Tensor, new: int, repeats: int = 30) -> float:
    from transformers import DynamicCache

    cache = DynamicCache()
    model(input_ids=context, past_key_values=cache, use_cache=True, logits_to_keep=1)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model(input_ids=context[:, :new], past_key_values=cache, use_cache=True)
        times.append(time.perf_counter() - start)
        cache.crop(-new)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--layers", default="4,6,8")
    parser.add_argument("--vocab-trim", default="8192,0")
    parser.add_argument("--lookahead", default="2,4,8")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "speculative_costs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lookaheads = [int(k) for k in args.lookahead.split(",")]
    target = load_model(args.target)
    context = torch.randint(0, target.config.vocab_size, (1, 128), generator=torch.Generator().manual_seed(0))
    target_ms = {n: round(forward_ms(target.model, context, n), 2) for n in sorted({1, *(k + 1 for k in lookaheads)})}
    rows = []
    for layers in map(int, args.layers.split(",")):
        for trim in map(int, args.vocab_trim.split(",")):
            draft = dense_copy(target.model)
            keep_layers(draft, list(range(layers)))
            if trim:
                trim_lm_head(draft, torch.arange(trim))
            draft_ms = round(forward_ms(draft, context, 1), 2)
            row = {"layers": layers, "vocabulary": trim or target.config.vocab_size, "draft ms / token": draft_ms}
            for k in lookaheads:
                row[f"break-even k={k}"] = round((k * draft_ms + target_ms[k + 1]) / target_ms[1], 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"target": args.target, "target_ms": target_ms, "rows": rows}, indent=2) + "\n")
    lines = [
        f"Target {args.target}, CPU, 1 thread, 128-token context. Target forward ms by new tokens: "
        + ", ".join(f"{n}: {ms}" for n, ms in target_ms.items()) + ".",
        "Break-even: the tokens per target forward at which speculative decoding matches plain decoding.", "",
    ]
    if rows:
        columns = list(rows[0])
        lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns), *("| " + " | ".join(str(r[c]) for c in columns) + " |" for r in rows)]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
