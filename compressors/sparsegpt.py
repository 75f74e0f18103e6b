"""SparseGPT (Frantar & Alistarh, 2023): prune a linear column by column and let the kept
weights absorb each pruned weight's error through the inverse Hessian, the same Optimal Brain
Surgeon sweep GPTQ runs (compressors/gptq.py); optionally the kept weights are rounded onto a
grid in the same pass (joint sparsity + quantization).

The mask is chosen as the sweep goes, by the OBS saliency w^2 / [H^-1]_jj^2 on the weights as
updated so far: for unstructured sparsity once per block of columns, over all its rows (so
rows may differ, the layer's ratio holds); for N:M at the first column of every group of M.
A mask handed in (`keep`) is held fixed instead: GPTQ on an already-pruned weight."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compressors.gptq import error_feedback_sweep, inverse_hessian_factor, prepared
from compressors.grid import GridSpec, QuantizedLinear, dequantize, fit_grid, quantize
from compressors.sparsity import SparsityPattern


@dataclass
class PrunedLinear:
    """A pruned weight [out, in] (zeros where `keep` is False), and its grid codes if the kept
    weights were quantized too (`weight` is then their dequantized value)."""

    weight: torch.Tensor
    keep: torch.Tensor
    quantized: QuantizedLinear | None = None


def sparsegpt_prune(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    pattern: SparsityPattern | None,
    damp: float = 0.01,
    block_size: int = 128,
    grid: GridSpec | None = None,
    keep: torch.Tensor | None = None,
) -> PrunedLinear:
    """weight [out, in], hessian E[x x^T]; `pattern` picks the mask, or `keep` fixes it."""
    W, H = prepared(weight, hessian)
    rows, columns = W.shape
    Hinv = inverse_hessian_factor(H, damp)
    salience_scale = Hinv.diagonal() ** 2
    fixed = keep is not None
    keep = keep.clone() if fixed else torch.ones(rows, columns, dtype=torch.bool)
    if grid is not None:
        width = grid.group_width(columns)
        scale = torch.zeros(rows, columns // width)
        zero = torch.zeros(rows, columns // width)
        codes = torch.zeros(rows, columns)
        block_size = max(width, block_size // width * width)  # a group's grid sees its updated columns

    def choose_unstructured(block, start):
        if fixed or pattern.structured:
            return
        salience = block**2 / salience_scale[start : start + block.shape[1]][None, :]
        pruned = int(round(pattern.sparsity * salience.numel()))
        block_keep = torch.ones(salience.numel(), dtype=torch.bool)
        block_keep[torch.argsort(salience.flatten(), stable=True)[:pruned]] = False
        keep[:, start : start + block.shape[1]] = block_keep.view(salience.shape)

    def settle(block, i, column):
        if not fixed and pattern.structured and column % pattern.m == 0:
            salience = block[:, i : i + pattern.m] ** 2 / salience_scale[column : column + pattern.m][None, :]
            order = torch.argsort(salience, dim=1, stable=True)[:, : pattern.m - pattern.n]
            keep[:, column : column + pattern.m].scatter_(1, order, False)
        value = block[:, i] * keep[:, column]
        if grid is None:
            return value
        g = column // width
        if column % width == 0:
            scale[:, g : g + 1], zero[:, g : g + 1] = fit_grid(block[:, i : i + width], grid)
        codes[:, column] = quantize(value, scale[:, g], zero[:, g], grid)
        return dequantize(codes[:, column], scale[:, g], zero[:, g]) * keep[:, column]

    error_feedback_sweep(W, Hinv, settle, block_size, on_block=choose_unstructured)
    if grid is None:
        return PrunedLinear(W * keep, keep)  # the settled values, with pruned ones exact zeros
    quantized = QuantizedLinear(codes.to(torch.int8), scale, zero, grid)
    return PrunedLinear(quantized.dequantized() * keep, keep, quantized)
