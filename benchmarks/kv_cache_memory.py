"""KV-cache memory of long-context generation on the CPU: a base model and its KV-merged
descendants, measured side by side in one run.

    .venv/bin/python benchmarks/kv_cache_memory.py --base smollm2-135m [NAME=]MODEL [...] [--context 2048]

Each model generates `--new-tokens` greedy tokens after `--context` tokens of held-out text
(Pride and Prejudice, never calibration text), in its own subprocess so memory figures do not
mix. Reported per model: the KV cache's bytes as allocated (summed over the cache's key and
value tensors after generation), the same per token, the process's peak resident memory growth
during generation (VmHWM reset after loading; includes the prefill's activations, which do not
shrink with fewer KV heads) and decode speed; and the ratios to the base. Results: JSON and
markdown beside `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("LMPRESS_QUIET", "1")


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(model: str, context: int, new_tokens: int) -> dict:
    """One model's generation, in this process."""
    import torch

    from calibrate.corpora import leading_windows, tokenize_part
    from pipelines.models import load_model

    torch.set_num_threads(1)
    loaded = load_model(model)
    prompt = leading_windows(tokenize_part("austen-heldout", loaded.tokenizer), 1, context)
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS mark to the current RSS
    before = _status_kb("VmRSS")
    start = time.perf_counter()
    with torch.no_grad():
        out = loaded.model.generate(
            prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True,
        )
    seconds = time.perf_counter() - start
    cache = out.past_key_values
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    cache_bytes = sum(t.numel() * t.element_size() for t in tensors)
    tokens = tensors[0].shape[-2]
    return {
        "model": model,
        "kv_heads": loaded.config.num_key_value_heads,
        "cached_tokens": tokens,
        "kv_cache_bytes": cache_bytes,
        "kv_cache_bytes_per_token": cache_bytes // tokens,
        "cache_dtype": str(tensors[0].dtype),
        "peak_rss_growth_mb": round((_status_kb("VmHWM") - before) / 1024, 1),
        "generate_seconds": round(seconds, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", default="smollm2-135m")
    parser.add_argument("models", nargs="*")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "kv_cache_memory")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure this model and print JSON
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.context, args.new_tokens)))
        return
    if not args.models:
        parser.error("name at least one model to compare with the base")

    rows = []
    for spec in (args.base, *args.models):
        name, _, model = spec.rpartition("=")
        command = [sys.executable, __file__, "--one", model, "--context", str(args.context), "--new-tokens", str(args.new_tokens)]
        result = subprocess.run(command, capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        rows.append({**json.loads(result.stdout.strip().splitlines()[-1]), "name": name or model})
        print(rows[-1], flush=True)
    base = rows[0]
    for row in rows:
        row["kv_cache_vs_base"] = round(row["kv_cache_bytes"] / base["kv_cache_bytes"], 4)
        row["speed_vs_base"] = round(base["generate_seconds"] / row["generate_seconds"], 3)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"context": args.context, "new_tokens": args.new_tokens, "rows": rows}, indent=2) + "\n")
    lines = [
        f"Generation after {args.context} tokens of held-out text, {args.new_tokens} new tokens, CPU, 1 thread, fp32.",
        "",
        "| model | KV heads | cached tokens | KV cache MB | bytes/token | vs base | peak RSS growth MB | generate s | speed vs base |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['kv_heads']} | {r['cached_tokens']} | {r['kv_cache_bytes'] / 2**20:.1f} | {r['kv_cache_bytes_per_token']} "
            f"| {r['kv_cache_vs_base']:.3f} | {r['peak_rss_growth_mb']} | {r['generate_seconds']} | {r['speed_vs_base']:.2f} |"
        )
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
