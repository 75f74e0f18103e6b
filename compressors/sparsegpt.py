"""SparseGPT (Frantar & Alistarh, 2023): prune a linear column by column and let the kept
weights absorb each pruned weight's error through the inverse Hessian, the same Optimal Brain
Surgeon sweep GPTQ runs (compressors/gptq.py); optionally the kept weights are rounded onto a
grid in the same pass (joint sparsity + quantization).

The mask is chosen as the sweep goes, by the OBS saliency w^2 / [H^-1]_jj^2 on the weights as
updated so far: for unstructured sparsity once per block of columns, over all its rows (so
rows may differ, the layer's ratio holds); for N:M at the first column of every group of M.
A mask handed in (`keep`) is held fixed instead: GPTQ on an already-pruned weight.

The grid of the kept weights is fitted per group when the sweep reaches the group's first
column, on the weights as updated so far: min-max over the whole group, or with `clip_search`
over the weights the group keeps, clipped per row as GPTQ's grids are (`fit_group_grid`).
The kept set is the mask where it is known by then (fixed, or unstructured: chosen per
block), else the N:M mask those weights would get now (the sweep's updates may still change
a few of its picks)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compressors.gptq import error_feedback_sweep, fit_group_grid, inverse_hessian_factor, prepared
from compressors.grid import GridSpec, QuantizedLinear, dequantize, fit_grid, quantize
from compressors.sparsity import SparsityPattern
from pipelines.errors import require


@dataclass
class PrunedLinear:
    """A pruned weight [out, in] (zeros where `keep` is False), and its grid codes if the kept
    weights were quantized too (`weight` is then their dequantized value)."""

    weight: torch.Tensor
    keep: torch.Tensor
    quantized: QuantizedLinear | None = None


def check_clip_search_fits(pattern: SparsityPattern, grid: GridSpec, columns: int) -> None:
    """The clip search fits each group's grid to the N:M mask of its columns: whole chunks of M."""
    require(
        not pattern.structured or grid.group_width(columns) % pattern.m == 0,
        f"the clip search fits each group's grid to its {pattern} mask: use a group size that is a multiple of {pattern.m}, or pass --clip-search false",
    )


def sparsegpt_prune(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    pattern: SparsityPattern | None,
    damp: float = 0.01,
    block_size: int = 128,
    grid: GridSpec | None = None,
    keep: torch.Tensor | None = None,
    clip_search: bool = False,
    shrinkage: float = 0.0,
) -> PrunedLinear:
    """weight [out, in], hessian E[x x^T]; `pattern` picks the mask, or `keep` fixes it.
    `damp` and `shrinkage` regularize the Hessian as GPTQ's (`inverse_hessian_factor`)."""
    W, H = prepared(weight, hessian)
    rows, columns = W.shape
    Hinv = inverse_hessian_factor(H, damp, shrinkage)
    salience_scale = Hinv.diagonal() ** 2
    fixed = keep is not None
    keep = keep.clone() if fixed else torch.ones(rows, columns, dtype=torch.bool)
    if grid is not None:
        width = grid.group_width(columns)
        scale = torch.zeros(rows, columns // width)
        zero = torch.zeros(rows, columns // width)
        codes = torch.zeros(rows, columns)
        block_size = max(width, block_size // width * width)  # a group's grid sees its updated columns
        if clip_search and not fixed:
            check_clip_search_fits(pattern, grid, columns)

    def choose_unstructured(block, start):
        if fixed or pattern.structured:
            return
        salience = block**2 / salience_scale[start : start + block.shape[1]][None, :]
        pruned = int(round(pattern.sparsity * salience.numel()))
        block_keep = torch.ones(salience.numel(), dtype=torch.bool)
        block_keep[torch.argsort(salience.flatten(), stable=True)[:pruned]] = False
        keep[:, start : start + block.shape[1]] = block_keep.view(salience.shape)

    def n_m_keep(block, i, column, width):
        """The N:M mask of `width` columns from `column` (the block's i-th), by OBS salience."""
        salience = block[:, i : i + width] ** 2 / salience_scale[column : column + width][None, :]
        salience = salience.view(rows, width // pattern.m, pattern.m)
        order = torch.argsort(salience, dim=2, stable=True)[..., : pattern.m - pattern.n]
        return torch.ones_like(salience, dtype=torch.bool).scatter_(2, order, False).view(rows, width)

    structured = not fixed and pattern.structured

    def settle(block, i, column):
        if structured and column % pattern.m == 0:
            keep[:, column : column + pattern.m] = n_m_keep(block, i, column, pattern.m)
        value = block[:, i] * keep[:, column]
        if grid is None:
            return value
        g = column // width
        if column % width == 0:
            group = block[:, i : i + width]
            if clip_search:
                kept = n_m_keep(block, i, column, width) if structured else keep[:, column : column + width]
                scale[:, g : g + 1], zero[:, g : g + 1] = fit_group_grid(group * kept, H[column : column + width, column : column + width], grid)
            else:
                scale[:, g : g + 1], zero[:, g : g + 1] = fit_grid(group, grid)
        codes[:, column] = quantize(value, scale[:, g], zero[:, g], grid)
        return dequantize(codes[:, column], scale[:, g], zero[:, g]) * keep[:, column]

    error_feedback_sweep(W, Hinv, settle, block_size, on_block=choose_unstructured)
    if grid is None:
        return PrunedLinear(W * keep, keep)  # the settled values, with pruned ones exact zeros
    quantized = QuantizedLinear(codes.to(torch.int8), scale, zero, grid)
    return PrunedLinear(quantized.dequantized() * keep, keep, quantized)
