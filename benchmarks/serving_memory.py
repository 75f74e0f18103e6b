"""Host memory and time to load a packed artifact for serving, side by side with the dense loads.

    .venv/bin/python benchmarks/serving_memory.py [ARTIFACT ...] [--baseline-tree DIR]

Each load runs in a fresh process (one thread), which reports its resident memory after the
imports, its peak (ru_maxrss) after the load, the load's wall time and the bytes the loaded
model holds (parameters and buffers, each tensor once):
- `serving`: `pipelines.serving.load_for_serving`, what `lmpress generate`, `latency` and the
  model card's snippet load: packed linears as PackedLinears (`pipelines.models.load_stored`).
- `dense`: `pipelines.models.load_model`, as `lmpress evaluate` loads (compressed-tensors
  decompressed, as stock transformers runs it).
- `transformers`: stock `AutoModelForCausalLM.from_pretrained` (compressed-tensors artifacts only).
- with `--baseline-tree DIR` (a checkout of another commit, e.g. `git worktree add DIR REV`),
  `serving` again with that tree's code, in the same run.
Default artifacts: the pipeline's `artifacts/quantized` and `artifacts/quantized-searched`
(compressed-tensors pack-quantized) and `artifacts/pruned/compressed` (lmpress-packed, 2:4).
Each load runs twice; the run with the lower peak is kept (load times vary on a shared machine). Results: benchmarks/results/serving_memory.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# run in a child: prints one JSON line
CHILD = r"""
import json, resource, sys, time
import torch
from transformers import AutoModelForCausalLM
from pipelines.serving import load_for_serving
from pipelines.models import load_model
import pipelines

def rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

loader, artifact = sys.argv[1], sys.argv[2]
assert pipelines.__file__.startswith(sys.argv[3]), pipelines.__file__  # the tree's code, not the installed one
imports = rss_mib()
start = time.perf_counter()
if loader == "transformers":
    model = AutoModelForCausalLM.from_pretrained(artifact, dtype=torch.float32, use_safetensors=True)
else:
    model = (load_for_serving(artifact) if loader == "serving" else load_model(artifact)).model
seconds = time.perf_counter() - start
tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
held = sum(t.numel() * t.element_size() for t in tensors.values() if not t.is_meta)
print(json.dumps({"imports_MiB": round(imports), "peak_MiB": round(rss_mib()), "load_s": round(seconds, 2), "model_MiB": round(held / 2**20)}))
"""


def measure(loader: str, artifact: str, tree: Path, repeats: int = 2) -> dict:
    return min((_measure_once(loader, artifact, tree) for _ in range(repeats)), key=lambda run: run["peak_MiB"])


def _measure_once(loader: str, artifact: str, tree: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "LMPRESS_QUIET": "1"}
    # run in the tree: `python -c` puts its working folder first on the path
    result = subprocess.run([sys.executable, "-c", CHILD, loader, str(ROOT / artifact), str(tree)], env=env, cwd=tree, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{loader} load of {artifact} failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _commit(tree: Path) -> str:
    """The tree's commit, marked + where its tracked files differ from it."""
    head = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    changed = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, check=True).stdout
    return head + ("+" if changed.strip() else "")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("artifacts", nargs="*", default=["artifacts/quantized", "artifacts/quantized-searched", "artifacts/pruned/compressed"])
    parser.add_argument("--baseline-tree", type=Path, help="a checkout of another commit: its serving load is measured too")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "serving_memory")
    args = parser.parse_args()

    rows = []
    for artifact in args.artifacts:
        settings = json.loads((ROOT / artifact / "config.json").read_text()).get("quantization_config") or {}
        runs = [("serving", ROOT), ("dense", ROOT)]
        runs += [("transformers", ROOT)] if settings.get("quant_method") == "compressed-tensors" else []
        runs += [("serving", args.baseline_tree.resolve())] if args.baseline_tree else []
        for loader, tree in runs:
            row = {"artifact": artifact, "format": settings.get("format", "dense"), "loader": loader + ("" if tree == ROOT else " (baseline)"),
                   **measure(loader, artifact, tree)}
            row["peak_over_imports_MiB"] = row["peak_MiB"] - row["imports_MiB"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    report = {"commit": _commit(ROOT), "baseline_commit": _commit(args.baseline_tree) if args.baseline_tree else None, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    columns = ["artifact", "format", "loader", "model_MiB", "imports_MiB", "peak_MiB", "peak_over_imports_MiB", "load_s"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
