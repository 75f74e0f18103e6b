"""GPTQ (Frantar et al., 2022): quantize a linear's weight column by column, spreading each
column's rounding error onto the columns not yet quantized through the inverse Hessian of the
layer's reconstruction loss ||X W^T - X Q^T||^2, whose Hessian is 2 X^T X.

The whole algorithm is `gptq_quantize`; the Hessian comes from the calibration statistics
(collected on the already-quantized model's activations when the stage runs layer-sequential).
The error feedback does not care what the values are: given per-row codebooks (SqueezeLLM's
tables) instead of a uniform grid, each column is rounded to its row's nearest table entry.
"""

from __future__ import annotations

import torch

from compressors.grid import GridSpec, QuantizedLinear, fit_grid, quantize, dequantize


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    spec: GridSpec,
    damp: float = 0.01,
    act_order: bool = False,
    block_size: int = 128,
    codebook: torch.Tensor | None = None,
):
    """weight [out, in], hessian E[x x^T] [in, in] (any positive multiple of X^T X works).
    Returns a QuantizedLinear, or with `codebook` [out, levels] (rows sorted ascending) a
    CodebookLinear whose indices point into it (`spec` then only names the bits).

    With `act_order` columns are processed by decreasing Hessian diagonal (most salient first);
    groups still cover consecutive *original* columns, so their grids are fitted up front on
    the unquantized weight ("static groups") and the stored layout stays the plain one."""
    W = weight.detach().float().clone()
    H = hessian.detach().float().clone()
    rows, columns = W.shape
    width = spec.group_width(columns)

    dead = H.diagonal() == 0  # inputs never active: nothing to reconstruct
    H[dead, dead] = 1
    W[:, dead] = 0

    # Grids per group, [rows, groups]: fitted up front for static groups and per-channel (one
    # group, whose first column is the first one processed anyway), otherwise when a group's
    # first column comes up, on the weights as the error feedback has updated them so far.
    n_groups = columns // width
    scale = torch.zeros(rows, n_groups)
    zero = torch.zeros(rows, n_groups)
    static = act_order or n_groups == 1 or codebook is not None
    if codebook is not None:
        from compressors.squeezellm import CodebookLinear, entry_boundaries, nearest_entry

        boundaries = entry_boundaries(codebook)  # once, not per column
        round_column = lambda w, g: nearest_entry(w[:, None], codebook, boundaries)[:, 0].float()  # noqa: E731
        value = lambda q, g: codebook.gather(1, q[:, None].long())[:, 0]  # noqa: E731
    else:
        round_column = lambda w, g: quantize(w, scale[:, g], zero[:, g], spec)  # noqa: E731
        value = lambda q, g: dequantize(q, scale[:, g], zero[:, g])  # noqa: E731
    if static and codebook is None:
        for g in range(n_groups):
            scale[:, g : g + 1], zero[:, g : g + 1] = fit_grid(W[:, g * width : (g + 1) * width], spec)
    order = torch.argsort(H.diagonal(), descending=True) if act_order else torch.arange(columns)
    W, H = W[:, order], H[order][:, order]

    H.diagonal().add_(damp * H.diagonal().mean())
    # Upper Cholesky factor of H^-1: row i holds the updates that column i's error makes to
    # the columns after it, already scaled for the sequential elimination.
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)

    codes = torch.zeros(rows, columns)
    if not static:  # blocks hold whole groups, so a group's grid sees its updated columns
        block_size = max(width, block_size // width * width)
    for start in range(0, columns, block_size):
        end = min(start + block_size, columns)
        block, errors = W[:, start:end].clone(), torch.zeros(rows, end - start)
        for i in range(end - start):
            column = order[start + i].item()
            g = column // width
            if not static and column % width == 0:
                scale[:, g : g + 1], zero[:, g : g + 1] = fit_grid(block[:, i : i + width], spec)
            w = block[:, i]
            q = round_column(w, g)
            codes[:, start + i] = q
            error = (w - value(q, g)) / Hinv[start + i, start + i]
            block[:, i:] -= error[:, None] * Hinv[start + i, start + i : end][None, :]
            errors[:, i] = error
        W[:, end:] -= errors @ Hinv[start:end, end:]

    codes = codes[:, torch.argsort(order)]
    if codebook is not None:
        return CodebookLinear(codes.to(torch.uint8), codebook, spec.bits)
    return QuantizedLinear(codes.to(torch.int8), scale, zero, spec)
