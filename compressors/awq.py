"""AWQ (Lin et al., 2023): activation-aware weight quantization.

Weights that meet large activations matter most. AWQ scales each input channel j of a linear
by s_j = E|x_j|^alpha (moving 1/s_j into the op that produces x, which keeps the float model
unchanged), so those weights land on a finer grid, then clips each group's range. Both alpha
(per group of linears reading one input) and the clip ratio (per row and group) are searched
to minimize the output error on calibration data.

The output error of a candidate weight W' needs no stored activations: with Sigma = E[x x^T],
E||x W^T - x W'^T||^2 = tr((W - W') Sigma (W - W')^T), so the search runs on the calibration
statistics alone.
"""

from __future__ import annotations

import torch

from compressors.grid import GridSpec, QuantizedLinear, dequantize, grid_for_range, group_range, quantize, round_to_nearest

ALPHAS = [i / 20 for i in range(20)]
CLIP_RATIOS = [1.0 - i / 20 for i in range(11)]  # 1.0 down to 0.5


def output_error(delta: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Per-row E||x delta_r||^2 for weight errors `delta` [rows, in]."""
    return ((delta @ sigma) * delta).sum(dim=1)


def search_scales(weights: list[tuple[torch.Tensor, GridSpec]], sigma: torch.Tensor, abs_mean: torch.Tensor) -> torch.Tensor:
    """Input-channel scales s [in] for linears that share one input, each with its own grid (a
    plan may give q and k/v different ones): the alpha in [0, 1) whose scales minimize the
    summed output error of RTN on W * s (alpha 0 is plain RTN)."""
    magnitude = abs_mean.float().clamp(min=1e-4)
    best_loss, best_scales = None, torch.ones_like(magnitude)
    for alpha in ALPHAS:
        scales = magnitude**alpha
        scales = scales / (scales.max() * scales.min()).sqrt()  # keep the scales centred on 1
        loss = sum(output_error(w - round_to_nearest(w * scales, spec).dequantized() / scales, sigma).sum() for w, spec in weights)
        if best_loss is None or loss < best_loss:
            best_loss, best_scales = loss, scales
    return best_scales


def clip_ratios(weight: torch.Tensor, sigma: torch.Tensor, spec: GridSpec) -> torch.Tensor:
    """Per row and group [rows, groups]: the ratio that the group's range is clipped by, the one
    whose RTN minimizes that group's share of the output error (the group's diagonal block of
    Sigma). AWQ rounds with these; GPTQ can fit its static grids with them (`clip_search`).
    All groups are scored in one batched product per ratio (a loop over groups costs more in
    per-call overhead than in arithmetic at these sizes)."""
    rows, columns = weight.shape
    width = spec.group_width(columns)
    groups = columns // width
    w = weight.float().reshape(rows, groups, width).transpose(0, 1).contiguous()  # [groups, rows, width]
    low, high = group_range(w)  # the same for every ratio
    blocks = torch.stack([sigma[g * width : (g + 1) * width, g * width : (g + 1) * width] for g in range(groups)])
    best_loss = torch.full((groups, rows), float("inf"))
    best_clip = torch.ones(groups, rows)
    for ratio in CLIP_RATIOS:
        scale, zero = grid_for_range(low, high, spec, ratio)
        delta = torch.sub(w, dequantize(quantize(w, scale, zero, spec), scale, zero))
        loss = torch.bmm(delta, blocks).mul_(delta).sum(dim=2)
        better = loss < best_loss
        best_loss, best_clip = torch.where(better, loss, best_loss), best_clip.masked_fill(better, ratio)
    return best_clip.T


def quantize_with_clipping(weight: torch.Tensor, sigma: torch.Tensor, spec: GridSpec) -> QuantizedLinear:
    """RTN whose range is clipped per row and group by `clip_ratios`."""
    return round_to_nearest(weight, spec, clip_ratios(weight, sigma, spec))


def awq_layer(layer, arch, config, stats: dict, plan: dict[str, GridSpec]) -> dict[str, QuantizedLinear]:
    """Scale, then quantize, the planned linears of one decoder layer, in place.

    `stats`: linear path in the layer -> its input statistics; `plan`: linear path -> grid
    (linears missing from it stay dense but are still rescaled, as their input changes). Each
    input group folds its scales into the op before it: the RMSNorm for q/k/v and gate/up,
    up_proj's rows for down_proj, and v_proj's rows for o_proj when every query head has its
    own value head (with grouped KV heads one value channel feeds several o_proj columns,
    which could not take different scales)."""
    q, k, v, o = arch.attention
    gate, up, down = arch.mlp
    groups = [
        ((q, k, v), arch.attention_norm),
        ((gate, up), arch.mlp_norm),
        ((down,), up),
    ]
    if config.num_key_value_heads == config.num_attention_heads:
        groups.append(((o,), v))

    # 1. search each group's scales on the original weights, then fold them in
    sigma = {name: stats[name].second_moment.float() for name in stats}
    for members, previous in groups:
        planned = [m for m in members if m in plan]
        if not planned:
            continue
        s = search_scales([(layer.get_submodule(m).weight.data.float(), plan[m]) for m in planned], sigma[members[0]], stats[members[0]].abs_mean)
        for member in members:
            layer.get_submodule(member).weight.data *= s.to(layer.get_submodule(member).weight.dtype)
            sigma[member] = sigma[member] / s[:, None] / s[None, :]  # the input is now x / s
        before = layer.get_submodule(previous)
        if isinstance(before, torch.nn.Linear):
            before.weight.data /= s[:, None].to(before.weight.dtype)
            if before.bias is not None:
                before.bias.data /= s.to(before.bias.dtype)
        else:  # RMSNorm: out = norm(x) * (offset + weight)
            before.weight.data = ((arch.norm_offset + before.weight.data.float()) / s - arch.norm_offset).to(before.weight.dtype)

    # 2. quantize each planned linear with its clip search, on the statistics of its new input
    return {name: quantize_with_clipping(layer.get_submodule(name).weight.data.float(), sigma[name], plan[name]) for name in plan}
