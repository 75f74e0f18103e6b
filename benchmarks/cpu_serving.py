"""CPU serving of a packed artifact: bf16 activations with torch's int4 kernel for the 4-bit
grids (what `lmpress generate --dtype auto` serves on CPUs with AVX512-BF16 or AMX) against the
fp32 dense copy the CPU served from before, side by side in one run, on one thread.

    .venv/bin/python benchmarks/cpu_serving.py [--model artifacts/quantized] [--base smollm2-135m]
        [--reference artifacts/reference] [--out benchmarks/results/cpu_serving]

1. layers: a random 4-bit group-64 linear at SmolLM2-135M's shapes and at 4096x4096, x of 1 to
   128 rows: torch's int4 kernel (bf16 x) against the fp32 dense copy and a bf16 dense copy,
   timed alternately (median of rounds).
2. decoding: `lmpress generate`'s path (`load_for_serving`, `greedy_decode`), 64 greedy tokens
   after a fixed prompt, for the base and the model in float32 and in bfloat16. Each run is its
   own process, so its resident memory is its own; the configurations alternate round by round
   and the median tokens/s is reported, with the resident memory after decoding (VmRSS) and its
   peak (VmHWM, loading included).
3. quality: KL(base || model) and top-1 agreement with the base on the reference cache's held-out
   windows (never calibration text), the model served in float32 and in bfloat16, and the base
   in bfloat16 (what bf16 alone costs).

Results: JSON and markdown beside `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("LMPRESS_QUIET", "1")

import torch  # noqa: E402

PROMPT = "It is a truth universally acknowledged"
LAYER_SHAPES = [(576, 576), (1536, 576), (576, 1536), (4096, 4096)]  # (N, K): SmolLM2-135M's q/o, gate/up, down; a 7B-class layer
LAYER_ROWS = (1, 4, 16, 128)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _seconds(call, budget: float = 0.2) -> float:
    """Mean seconds of `call` over at least `budget` seconds, after one warm-up call."""
    call()
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < budget:
        call()
        runs += 1
    return (time.perf_counter() - start) / runs


def layer_table(rounds: int = 3) -> list[dict]:
    """Part 1: per layer shape and rows, microseconds of each path (medians of alternating rounds)."""
    from compressors import packed_int

    table = []
    for rows, columns in LAYER_SHAPES:
        weight = packed_int.random_packed_weight(4, rows, columns, 64)
        dense = packed_int.dequantize_reference(weight)
        dense_bf16, int4 = dense.bfloat16(), packed_int.cpu_int4(weight)
        for m in LAYER_ROWS:
            x = torch.randn(m, columns, generator=torch.Generator().manual_seed(0))
            x_bf16 = x.bfloat16()
            calls = {
                "fp32 dense": lambda: torch.nn.functional.linear(x, dense),  # noqa: B023
                "bf16 dense": lambda: torch.nn.functional.linear(x_bf16, dense_bf16),  # noqa: B023
                "int4 (bf16 x)": lambda: packed_int.matmul_cpu_int4(x_bf16, int4),  # noqa: B023
            }
            times = {name: [] for name in calls}
            for _ in range(rounds):
                for name, call in calls.items():
                    times[name].append(_seconds(call))
            us = {name: statistics.median(values) * 1e6 for name, values in times.items()}
            error = packed_int.matmul_cpu_int4(x_bf16, int4).float() - packed_int.matmul_reference(x, weight)
            table.append({
                "shape": f"{rows}x{columns}", "rows": m, "us": {name: round(value, 1) for name, value in us.items()},
                "int4_vs_fp32_dense": round(us["fp32 dense"] / us["int4 (bf16 x)"], 2),
                "int4_vs_bf16_dense": round(us["bf16 dense"] / us["int4 (bf16 x)"], 2),
                "int4_rel_error": (error.norm() / packed_int.matmul_reference(x, weight).norm()).item(),
            })
            print(json.dumps(table[-1]), flush=True)
    return table


def decode_once(spec: str, dtype: str, new_tokens: int) -> dict:
    """One configuration's decoding, in this process (part 2's child)."""
    from pipelines.serving import greedy_decode, load_for_serving

    torch.set_num_threads(1)
    loaded = load_for_serving(spec, "cpu", DTYPES[dtype])
    ids = loaded.tokenizer(PROMPT, return_tensors="pt").input_ids
    greedy_decode(loaded.model, ids, 4)  # warm-up: PackedLinears make their serving form at their first call
    times = []
    for _ in range(3):
        start = time.perf_counter()
        tokens, _ = greedy_decode(loaded.model, ids, new_tokens)
        times.append(time.perf_counter() - start)
    return {
        "tokens_per_s": new_tokens / statistics.median(times), "rss_mb": _status_mb("VmRSS"), "peak_rss_mb": _status_mb("VmHWM"),
        "text": loaded.tokenizer.decode(tokens[0, ids.shape[1]:]),
    }


def decode_table(runs: dict[str, tuple[str, str]], new_tokens: int, rounds: int) -> dict:
    """Part 2: each run (name -> (spec, dtype)) in its own process, the runs alternating round by round."""
    results = {name: [] for name in runs}
    for _ in range(rounds):
        for name, (spec, dtype) in runs.items():
            child = subprocess.run(
                [sys.executable, __file__, "--decode-once", spec, dtype, "--new-tokens", str(new_tokens)],
                capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
            results[name].append(json.loads(child.stdout.strip().splitlines()[-1]))
    table = {}
    for name, (spec, dtype) in runs.items():
        table[name] = {
            "model": spec, "dtype": dtype, "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in results[name]), 2),
            "rss_mb": round(statistics.median(r["rss_mb"] for r in results[name])), "peak_rss_mb": round(statistics.median(r["peak_rss_mb"] for r in results[name])),
            "text": results[name][0]["text"],
        }
        print(json.dumps({name: table[name]}), flush=True)
    return table


def quality_table(runs: dict[str, tuple[str, str]], reference: Path) -> dict:
    """Part 3: KL to the base and top-1 agreement per held-out corpus of the reference cache."""
    from pipelines.evaluation import LMHead
    from pipelines.serving import load_for_serving
    from pipelines.stages import reference_metrics

    manifest = json.loads((reference / "manifest.json").read_text())
    head = LMHead.load(reference / "lm_head.safetensors", "rebuild it with `lmpress evaluate`")
    table = {}
    for name, (spec, dtype) in runs.items():
        model = load_for_serving(spec, "cpu", DTYPES[dtype]).model
        table[name] = {corpus: reference_metrics(model, reference, corpus, head, batch_size=4) for corpus in manifest["corpora"]}
        print(json.dumps({name: table[name]}), flush=True)
    return table


def markdown(result: dict) -> str:
    lines = [
        f"# CPU serving: bf16 with torch's int4 kernel against the fp32 dense copy ({result['date']})", "",
        f"`python benchmarks/cpu_serving.py` on {result['cpu']}, one thread, torch {result['torch']}. "
        f"Model: `{result['model']}`; base: `{result['base']}`.", "",
        "## Layers (random 4-bit group-64 weights; us per call, medians of alternating rounds)", "",
        "| N x K | rows | fp32 dense | bf16 dense | int4 (bf16 x) | int4 vs fp32 dense | int4 vs bf16 dense | int4 rel. error |", "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["layers"]:
        us = row["us"]
        lines.append(f"| {row['shape']} | {row['rows']} | {us['fp32 dense']} | {us['bf16 dense']} | {us['int4 (bf16 x)']} | "
                     f"{row['int4_vs_fp32_dense']}x | {row['int4_vs_bf16_dense']}x | {row['int4_rel_error']:.1e} |")
    lines += ["", f"## Greedy decoding, {result['new_tokens']} tokens (`generate`'s path; each run its own process, median of {result['rounds']} rounds)", "",
              "| run | dtype | tokens/s | vs base fp32 | RSS after MB | peak RSS MB |", "|---|---|---|---|---|---|"]
    base_speed = result["decode"]["base fp32"]["tokens_per_s"]
    for name, row in result["decode"].items():
        lines.append(f"| {name} | {row['dtype']} | {row['tokens_per_s']} | {row['tokens_per_s'] / base_speed:.2f}x | {row['rss_mb']} | {row['peak_rss_mb']} |")
    corpora = list(next(iter(result["quality"].values())))
    lines += ["", "## Quality on held-out text (the reference cache's windows; KL(base || run) per token, top-1 agreement with the base)", "",
              "| run | " + " | ".join(f"{c} KL | {c} top-1" for c in corpora) + " |", "|---|" + "---|---|" * len(corpora)]
    for name, row in result["quality"].items():
        lines.append(f"| {name} | " + " | ".join(f"{row[c]['kl_to_base']:.4f} | {row[c]['top1_agreement']:.4f}" for c in corpora) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="artifacts/quantized")
    parser.add_argument("--base", default="smollm2-135m")
    parser.add_argument("--reference", type=Path, default=Path("artifacts/reference"))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--parts", default="layers,decode,quality")
    parser.add_argument("--decode-once", nargs=2, metavar=("SPEC", "DTYPE"))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cpu_serving")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.decode_once:
        print(json.dumps(decode_once(*args.decode_once, args.new_tokens)))
        return
    import platform

    parts = args.parts.split(",")
    runs = {"base fp32": (args.base, "float32"), "base bf16": (args.base, "bfloat16"),
            "model fp32 (dense copy)": (args.model, "float32"), "model bf16 (int4 kernel)": (args.model, "bfloat16")}
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")), platform.processor())
    result = {
        "date": time.strftime("%Y-%m-%d"), "cpu": cpu, "torch": torch.__version__, "model": args.model, "base": args.base,
        "new_tokens": args.new_tokens, "rounds": args.rounds,
        "layers": layer_table() if "layers" in parts else [],
        "decode": decode_table(runs, args.new_tokens, args.rounds) if "decode" in parts else {},
        "quality": quality_table({name: runs[name] for name in ("base bf16", "model fp32 (dense copy)", "model bf16 (int4 kernel)")}, args.reference)
        if "quality" in parts else {},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    if all(result[part] for part in ("layers", "decode", "quality")):
        args.out.with_suffix(".md").write_text(markdown(result))
    print(f"written {args.out}.json")


if __name__ == "__main__":
    main()
