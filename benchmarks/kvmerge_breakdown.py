"""Where the aligned KV-head merge loses: per layer, the relative squared error of the attention
block's output on calibration windows, for the key merge alone, the value merge alone, both with
the closed-form folds, and both after the o_proj refit.

    .venv/bin/python benchmarks/kvmerge_breakdown.py [--model smollm2-135m] [--calibration artifacts/calibration]
        [--layers 2,10,20,28] [--samples 16]

"Alone" keeps the other half exact: each member's keys replaced by their RoPE-commuting
reconstruction c_j * shared key (values untouched), or each member's values by their projection
onto the shared value head U_j * shared value (keys untouched). All heads of a layer merge into
one (multi-query attention). Layers before each measured one are the original model's.
First it prints how alike the KV heads are: the token-averaged cosine similarity between two
heads' keys and values, from the calibration artifact, over all layers.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("LMPRESS_QUIET", "1")

import torch  # noqa: E402

from calibrate.runner import LayerRunner  # noqa: E402
from calibrate.stats import CalibrationData  # noqa: E402
from compressors import kvmerge  # noqa: E402
from pipelines.models import head_dim_of, load_model  # noqa: E402


def block_error(original: kvmerge.AttentionHeads, changed: kvmerge.AttentionHeads, order, o_proj, inputs, attention) -> float:
    """E||W_o o - W' z||^2 / E||W_o o||^2 over the captured calibration batches."""
    error = norm = 0.0
    target = original.o[:, order].flatten(1).float()
    for call in inputs:
        arguments = (*kvmerge.attention_call(call), attention.scaling, None)
        o = kvmerge.attention_outputs(original, *arguments)[:, :, order].flatten(2) @ target.T
        z = kvmerge.attention_outputs(changed, *arguments).flatten(2) @ o_proj.flatten(1).float().T
        error, norm = error + (o - z).pow(2).sum().item(), norm + o.pow(2).sum().item()
    return error / norm


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--calibration", type=Path, default=Path("artifacts/calibration"))
    parser.add_argument("--layers", default="2,10,20,28")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--damp", type=float, default=0.01)
    args = parser.parse_args()
    torch.set_num_threads(1)
    layers = {int(i) for i in args.layers.split(",")}

    calibration = CalibrationData(args.calibration)
    for kind in ("k", "v"):
        means = []
        for index in range(len(list((args.calibration / "stats").glob("layer_*.safetensors")))):
            similarity = calibration.head_similarity(index)[kind]
            means.append(similarity[~torch.eye(similarity.shape[0], dtype=torch.bool)].mean().item())
        print(f"{kind} cosine between heads: mean {sum(means) / len(means):.3f}, layers {min(means):.3f} to {max(means):.3f}")

    loaded = load_model(args.model)
    config = loaded.config
    heads_count, kv_count, head_dim = config.num_attention_heads, config.num_key_value_heads, head_dim_of(config)
    per_kv = heads_count // kv_count
    runner = LayerRunner(loaded.model, calibration.spread_samples(args.samples), 4)
    print("| layer | keys alone | values alone | both, closed form | both, o_proj refit |\n|---|---|---|---|---|")
    for index, layer in runner:
        if index not in layers:
            continue
        attention = layer.self_attn
        inputs = runner.capture_inputs(layer, attention)
        heads = kvmerge.AttentionHeads.of(attention, heads_count, kv_count, head_dim)
        sigma = heads.input_moment(kvmerge.AttentionInputStatistics(attention, inputs))
        everything = [list(range(kv_count))]
        merged, order = kvmerge.merge_heads(heads, everything, "aligned", sigma)

        queries = [heads.q[j * per_kv : (j + 1) * per_kv] for j in range(kv_count)]
        shared_key, factors = kvmerge.shared_key(heads.k, sigma, kvmerge.member_query_energy(queries, sigma))
        shared_value, maps = kvmerge.shared_value(heads.v, sigma)
        keys = kvmerge.reconstructed_keys(shared_key, factors)
        values = maps @ shared_value
        identity = list(range(heads_count))
        keys_alone = kvmerge.AttentionHeads(heads.q, keys, heads.v, heads.o, None, heads.has_bias)
        values_alone = kvmerge.AttentionHeads(heads.q, heads.k, values, heads.o, None, heads.has_bias)

        refit = kvmerge.OutputRefit(heads, merged, order, attention.scaling, None)
        for call in inputs:
            refit.add(call)
        errors = [
            block_error(heads, keys_alone, identity, heads.o, inputs, attention),
            block_error(heads, values_alone, identity, heads.o, inputs, attention),
            block_error(heads, merged, order, merged.o, inputs, attention),
            block_error(heads, merged, order, refit.solve(args.damp), inputs, attention),
        ]
        print(f"| {index} | " + " | ".join(f"{e:.3f}" for e in errors) + " |", flush=True)


if __name__ == "__main__":
    main()
