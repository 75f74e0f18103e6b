"""Cut a packed artifact down to a few decoder layers, small enough to carry to a GPU machine.

    python benchmarks/artifact_slice.py ARTIFACT OUT [--layers 0]

The slice keeps the artifact's config.json (its quantization config trimmed to the kept
linears) and every tensor of the chosen decoder layers, without embeddings or head, so
`lmpress validate OUT` checks the kernels on the artifact's own packed tensors exactly as it
would on the whole artifact (one layer already holds every distinct linear shape).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipelines.models import weight_files  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("artifact", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", default="0", help="decoder layer indices, comma-separated")
    args = parser.parse_args()
    from safetensors import safe_open
    from safetensors.torch import save_file

    layers = "|".join(re.escape(index) for index in args.layers.split(","))
    kept = re.compile(rf"(.*\.)?layers\.({layers})\.")
    tensors = {}
    for file in weight_files(args.artifact):
        with safe_open(file, framework="pt") as handle:
            tensors.update({key: handle.get_tensor(key) for key in handle.keys() if kept.match(key)})
    if not tensors:
        raise SystemExit(f"error: {args.artifact} has no tensors of layers {args.layers}")
    config = json.loads((args.artifact / "config.json").read_text())
    modules = (config.get("quantization_config") or {}).get("modules")
    if modules is not None:  # lmpress format: its module list is what the reader walks
        config["quantization_config"]["modules"] = {name: entry for name, entry in modules.items() if kept.match(name + ".")}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(tensors, args.out / "model.safetensors")
    print(f"{args.out}: {len(tensors)} tensors of layers {args.layers}, {sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
