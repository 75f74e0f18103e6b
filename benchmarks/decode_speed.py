"""CPU decoding speed of models against their base, measured side by side.

    .venv/bin/python benchmarks/decode_speed.py --base smollm2-135m MODEL [MODEL ...] [--out FILE]

Greedy decoding at batch 1 on one thread: 64 new tokens after a fixed prompt. Base and model
are timed alternately (base, model, base, model, ...) so that whatever else the machine is
doing slows both alike; the ratio is the median model speed over the median base speed.
Results: JSON and markdown beside `--out`.
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

from pipelines.models import load_model  # noqa: E402

PROMPT = "It is a truth universally acknowledged"


@torch.no_grad()
def seconds_per_decode(loaded, new_tokens: int) -> float:
    ids = loaded.tokenizer(PROMPT, return_tensors="pt").input_ids
    start = time.perf_counter()
    loaded.model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return time.perf_counter() - start


def side_by_side(base, model, new_tokens: int = 64, rounds: int = 5) -> tuple[float, float]:
    """(model tokens/s, base tokens/s): medians of alternating timings, after a warm-up each."""
    seconds_per_decode(base, 4)
    seconds_per_decode(model, 4)
    base_times, model_times = [], []
    for _ in range(rounds):
        base_times.append(seconds_per_decode(base, new_tokens))
        model_times.append(seconds_per_decode(model, new_tokens))
    return new_tokens / statistics.median(model_times), new_tokens / statistics.median(base_times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", default="smollm2-135m")
    parser.add_argument("models", nargs="+")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "decode_speed")
    args = parser.parse_args()
    torch.set_num_threads(1)

    base = load_model(args.base)
    rows = []
    for spec in args.models:
        model = load_model(spec)
        speed, base_speed = side_by_side(base, model, args.new_tokens, args.rounds)
        params = sum(p.numel() for p in model.model.parameters())
        rows.append({"model": spec, "params (M)": round(params / 1e6, 1), "tokens/s": round(speed, 2), "base tokens/s": round(base_speed, 2),
                     "speed vs base": round(speed / base_speed, 3)})
        print(json.dumps(rows[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=2) + "\n")
    lines = ["| model | params (M) | tokens/s | base tokens/s | speed vs base |", "|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['params (M)']} | {r['tokens/s']} | {r['base tokens/s']} | {r['speed vs base']} |" for r in rows]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
