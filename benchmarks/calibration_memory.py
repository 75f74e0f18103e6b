"""Calibration of the real model: wall time, peak resident memory, and memory per layer.

    .venv/bin/python benchmarks/calibration_memory.py [--samples 128] [--seq-len 512]

A sampler thread reads this process's RSS every 0.1 s and, from the stats files in the
stage's temporary folder, how many layers are done; so the figures come from the very stage
function the CLI and DVC run. Peak memory should be the model plus one copy of the samples'
hidden states (each layer's outputs overwrite its inputs batch by batch, and the block influence
is summed as they do) plus the current layer's working set.

RSS is split into file-backed pages (the safetensors weights, which transformers memory-maps:
each layer's weights page in when the runner first touches it, so this part climbs to the
model's size by the last layer) and anonymous memory (activations, statistics, everything the
stage allocates), which must stay flat across layers.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("LMPRESS_QUIET", "1")

from pipelines.stages import CalibrateConfig, calibrate  # noqa: E402
from benchmarks._report import scratch_directory  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "calibration_memory.json")
    args = parser.parse_args()

    process = psutil.Process()
    work = scratch_directory()
    out = work / "calibration"
    samples: list[tuple[int, int, int]] = []  # (anonymous bytes, file-backed bytes, layers done)
    done = threading.Event()
    start = time.perf_counter()

    def sample():
        while not done.is_set():
            partial = next(iter(work.glob(".calibration.partial-*/stats")), None)
            layers = len(list(partial.glob("*.safetensors"))) if partial else 0
            memory = process.memory_info()
            samples.append((memory.rss - memory.shared, memory.shared, layers))
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    config = CalibrateConfig(samples=args.samples, seq_len=args.seq_len, batch_size=args.batch_size)
    calibrate(args.model, out, config)
    wall = time.perf_counter() - start
    done.set()
    sampler.join()

    from transformers import AutoConfig

    from pipelines.models import resolve_model

    model_config = AutoConfig.from_pretrained(resolve_model(args.model))
    layers = model_config.num_hidden_layers
    by_layer: dict[int, tuple[int, int]] = {}  # layers done -> peak (anonymous, file-backed)
    for anonymous, file_backed, layer in samples:
        if 1 <= layer < layers:
            previous = by_layer.get(layer, (0, 0))
            by_layer[layer] = (max(previous[0], anonymous), max(previous[1], file_backed))
    first, last = min(by_layer), max(by_layer)
    model_bytes = sum(f.stat().st_size for f in resolve_model(args.model).glob("*.safetensors"))
    hidden_bytes = args.samples * args.seq_len * model_config.hidden_size * 4
    stats_bytes = sum(f.stat().st_size for f in (out / "stats").glob("*.safetensors"))
    result = {
        "model": args.model,
        "samples": args.samples,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "threads": int(os.environ.get("OMP_NUM_THREADS", os.cpu_count())),
        "wall_time_s": round(wall, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "model_weights_mb": round(model_bytes / 2**20),
        "hidden_states_mb_per_copy": round(hidden_bytes / 2**20),
        "anonymous_mb_after_layer": {layer: round(a / 2**20) for layer, (a, _) in sorted(by_layer.items())},
        "file_backed_mb_after_layer": {layer: round(f / 2**20) for layer, (_, f) in sorted(by_layer.items())},
        "anonymous_growth_mb_per_layer": round((by_layer[last][0] - by_layer[first][0]) / 2**20 / max(1, last - first), 2),
        "file_backed_growth_mb_per_layer": round((by_layer[last][1] - by_layer[first][1]) / 2**20 / max(1, last - first), 2),
        "stats_mb_on_disk": round(stats_bytes / 2**20),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    summary = {k: v for k, v in result.items() if not k.endswith("_after_layer")}
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
