"""Does stock transformers run the model lmpress serves? For each compressed-tensors artifact,
the held-out windows of a reference are scored twice: by lmpress's loader (`load_model`, what
`lmpress evaluate` scores) and by plain `AutoModelForCausalLM.from_pretrained`, dequantized
(`CompressedTensorsConfig(dequantize=True)`) where the artifact has packed zero points, which
transformers' compressed load rejects. Reported per corpus: each one's KL to the base and
perplexity, and the KL of the stock model to lmpress's and their top-1 agreement.

    .venv/bin/python benchmarks/stock_load_agreement.py ARTIFACT [ARTIFACT ...] --reference /tmp/ref16 [--out FILE]
    .venv/bin/python benchmarks/stock_load_agreement.py --merge A.json B.json [--out FILE]

Results: benchmarks/results/stock_load_agreement.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def agreement(artifact: Path, reference: Path) -> dict:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    from benchmarks._report import reference_corpora
    from compressors.packed_int import has_zero_points
    from pipelines.evaluation import LMHead, score_windows, size_metrics
    from pipelines.models import load_config, load_model

    settings = getattr(load_config(artifact), "quantization_config", None) or {}
    dequantize = has_zero_points(settings)
    ours = load_model(str(artifact)).model
    stock = AutoModelForCausalLM.from_pretrained(
        artifact, dtype=torch.float32, use_safetensors=True, **({"quantization_config": CompressedTensorsConfig(dequantize=True)} if dequantize else {}),
    ).eval()
    stock(torch.zeros(1, 2, dtype=torch.long))  # compressed-tensors decompresses on the first call of the whole model; the scoring calls its decoder
    base_head = LMHead.load(reference / "lm_head.safetensors", "rebuild the reference")
    row = {"artifact": artifact.name, "stock_load": "dequantize=True" if dequantize else "default", **size_metrics(ours, artifact)}
    for corpus in reference_corpora(reference):
        cached = load_file(reference / f"{corpus}.safetensors")
        mine = score_windows(ours, cached["input_ids"], (base_head, cached["hidden"]))
        theirs = score_windows(stock, cached["input_ids"], (base_head, cached["hidden"]))
        between = score_windows(stock, cached["input_ids"], (LMHead.of(ours), mine.hidden))
        row[corpus] = {
            "lmpress_kl_to_base": mine.kl_sum / mine.tokens, "stock_kl_to_base": theirs.kl_sum / theirs.tokens,
            "lmpress_perplexity": mine.perplexity, "stock_perplexity": theirs.perplexity,
            "stock_kl_to_lmpress": between.kl_sum / between.tokens, "top1_agreement": between.top1_agree / between.tokens,
            "tokens": mine.tokens,
        }
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("artifacts", type=Path, nargs="*")
    parser.add_argument("--reference", type=Path, default=ROOT / "artifacts" / "reference")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "stock_load_agreement")
    parser.add_argument("--merge", type=Path, nargs="*", help="only write the table from these earlier --out .json files (runs split over cores)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.merge:
        rows = [row for file in args.merge for row in json.loads(file.read_text())]
    else:
        rows = [agreement(artifact, args.reference) for artifact in args.artifacts]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=2) + "\n")
    lines = ["| artifact | stock load | bits/weight | corpus | KL to base: lmpress / stock | ppl: lmpress / stock | stock KL to lmpress | top-1 agreement |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        for corpus, c in ((k, v) for k, v in row.items() if isinstance(v, dict)):
            lines.append(f"| {row['artifact']} | {row['stock_load']} | {row['bits_per_weight']} | {corpus} | {c['lmpress_kl_to_base']:.4f} / "
                         f"{c['stock_kl_to_base']:.4f} | {c['lmpress_perplexity']:.2f} / {c['stock_perplexity']:.2f} | "
                         f"{c['stock_kl_to_lmpress']:.2e} | {c['top1_agreement']:.4f} |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

if __name__ == "__main__":
    main()
