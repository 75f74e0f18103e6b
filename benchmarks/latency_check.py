"""Does the latency model predict real models? A decode step of assembled models, measured side
by side with the base, against what the latency table predicted for their plans.

    .venv/bin/python benchmarks/latency_check.py --base smollm2-135m --latency artifacts/latency-cpu.json \
        MODEL:SEARCH_DIR [MODEL:SEARCH_DIR ...] [--rounds 7] [--out FILE]

Each MODEL is the searched plan assembled by the stages (search.json's "assemble" hint) and
served as `lmpress generate` serves it (packed linears through their kernels where the device
has them); SEARCH_DIR holds the search.json whose "latency" block gave the prediction. The
step is timed exactly as `lmpress latency` times it (pipelines/latency.py:decode_step_seconds,
the table's batch, context and repeats), base and model alternately, so whatever else the
machine does slows both alike; the ratio is the median model step over the median base step.
Results: JSON and markdown beside --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("LMPRESS_QUIET", "1")

import torch  # noqa: E402

from pipelines.latency import LatencyConfig, LatencyTable, decode_step_seconds  # noqa: E402
from pipelines.serving import load_for_serving  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", default="smollm2-135m")
    parser.add_argument("--latency", type=Path, required=True)
    parser.add_argument("models", nargs="+", help="MODEL:SEARCH_DIR pairs")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "latency_check")
    args = parser.parse_args()

    table = LatencyTable(args.latency).table
    config = LatencyConfig(**table["params"])
    device = config.torch_device()
    dtype = getattr(torch, table["dtype"])  # the table's own (bf16 on a CPU with native bf16 since stop 73), as `generate` serves
    torch.set_num_threads(table["threads"])
    base = load_for_serving(args.base, str(device), dtype).model
    rows = []
    for pair in args.models:
        folder, search = pair.split(":")
        predicted = json.loads((Path(search) / "search.json").read_text())["latency"]
        model = load_for_serving(folder, str(device), dtype).model
        base_times, model_times = [], []
        for _ in range(args.rounds):
            base_times.append(decode_step_seconds(base, config, device))
            model_times.append(decode_step_seconds(model, config, device))
        base_step, model_step = statistics.median(base_times), statistics.median(model_times)
        row = {
            "model": folder, "blocks": model.config.num_hidden_layers, "device": table["device"],
            "predicted_base_ms": round(predicted["base_step_ms"], 2), "predicted_ms": round(predicted["searched_step_ms"], 2),
            "predicted_ratio": round(predicted["searched_step_ms"] / predicted["base_step_ms"], 4),
            "measured_base_ms": round(1e3 * base_step, 2), "measured_ms": round(1e3 * model_step, 2),
            "measured_ratio": round(model_step / base_step, 4),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        del model

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"latency_table": str(args.latency), "params": table["params"], "rows": rows}, indent=2) + "\n")
    columns = ["blocks", "predicted_base_ms", "predicted_ms", "predicted_ratio", "measured_base_ms", "measured_ms", "measured_ratio"]
    lines = [f"Decode step on {table['device']} ({table['threads']} thread(s), batch {config.batch}, context {config.context}): "
             "the latency table's prediction against a measurement side by side with the base.", "",
             "| model | " + " | ".join(columns) + " |", "|" + "---|" * (len(columns) + 1)]
    lines += [f"| {r['model']} | " + " | ".join(str(r[c]) for c in columns) + " |" for r in rows]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
