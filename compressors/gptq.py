"""GPTQ (Frantar et al., 2022): quantize a linear's weight column by column, spreading each
column's rounding error onto the columns not yet quantized through the inverse Hessian of the
layer's reconstruction loss ||X W^T - X Q^T||^2, whose Hessian is 2 X^T X.

The column loop (`error_feedback_sweep`) is the one SparseGPT shares (compressors/sparsegpt.py):
only what a column settles to differs (a grid point, a codebook entry, zero, or a pruned-or-
rounded value). The Hessian comes from the calibration statistics (collected on the already-
compressed model's activations when the stage runs layer-sequential).
"""

from __future__ import annotations

from typing import Callable

import torch

from compressors.grid import GridSpec, QuantizedLinear, fit_grid, quantize, dequantize


def prepared(weight: torch.Tensor, hessian: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 copies of W [out, in] and H [in, in] with never-active inputs made harmless: their
    weights are zeroed (nothing to reconstruct) and their Hessian diagonal set to 1."""
    W = weight.detach().float().clone()
    H = hessian.detach().float().clone()
    dead = H.diagonal() == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    return W, H


def inverse_hessian_factor(H: torch.Tensor, damp: float, shrinkage: float = 0.0) -> torch.Tensor:
    """Upper Cholesky factor of (H' + damp * mean(diag H') I)^-1 with H' = (1 - shrinkage) H +
    shrinkage diag(H): row i holds the updates that column i's error makes to the columns after
    it, already scaled for the elimination.

    `shrinkage` pulls the input correlations the error feedback leans on toward zero while
    keeping each input's own variance (Ledoit-Wolf's shrinkage target for a covariance; the
    same as damping each diagonal entry by a fraction of itself rather than by the mean). The
    correlations are what differs most between the calibration text and the text a model then
    reads: 0.25 lowered held-out KL at 3 and 4 bits on every text measured, most on newswire,
    which the calibration never saw (docs/results.md, "Out of domain"). 0 is GPTQ as published;
    1 leaves no error feedback at all."""
    H = H.clone()
    if shrinkage:
        variances = H.diagonal().clone()
        H.mul_(1 - shrinkage).diagonal().copy_(variances)
    H.diagonal().add_(damp * H.diagonal().mean())
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)


def fit_group_grid(w: torch.Tensor, sigma: torch.Tensor, spec: GridSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The grid of one group w [rows, width] fitted as the sweep reaches it, its range clipped
    per row by AWQ's search on the group's block of the Hessian, `sigma` [width, width]."""
    from compressors.awq import clip_ratios

    return fit_grid(w, spec, clip_ratios(w, sigma, GridSpec(spec.bits, -1, spec.symmetric)))  # -1: the whole group as one


def error_feedback_sweep(
    W: torch.Tensor,
    Hinv: torch.Tensor,
    settle: Callable[[torch.Tensor, int, int], torch.Tensor],
    block_size: int = 128,
    on_block: Callable[[torch.Tensor, int], None] | None = None,
) -> None:
    """Optimal Brain Surgeon one column at a time, in place on W [rows, columns] (columns in
    processing order). `settle(block, i, column)` gives column `column` (the block's i-th) its
    final value; the error, scaled by the inverse Hessian, moves onto the later columns: inside
    the block at once, onto later blocks in one matmul per block. `on_block(block, start)` sees
    each block before its columns settle (SparseGPT picks its unstructured mask there).

    The sweep holds each block transposed, one contiguous row per column, and hands the
    callbacks its [rows, block] view: a column is then a contiguous vector and the per-column
    rank-1 update runs on contiguous memory (2x faster than on strided columns; this loop of
    small ops is most of GPTQ's cost at these widths)."""
    rows, columns = W.shape
    diagonal = Hinv.diagonal()
    for start in range(0, columns, block_size):
        end = min(start + block_size, columns)
        block_t, errors_t = W[:, start:end].T.contiguous(), torch.zeros(end - start, rows)
        block = block_t.T
        if on_block is not None:
            on_block(block, start)
        for i in range(end - start):
            error = errors_t[i]
            torch.sub(block_t[i], settle(block, i, start + i), out=error).div_(diagonal[start + i])
            block_t[i:].addr_(Hinv[start + i, start + i : end], error, alpha=-1)  # in place: no [block, rows] temporary per column
        W[:, start:end] = block
        W[:, end:].addmm_(errors_t.T, Hinv[start:end, end:], alpha=-1)


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    spec: GridSpec,
    damp: float = 0.01,
    act_order: bool = False,
    block_size: int = 128,
    codebook: torch.Tensor | None = None,
    clip_search: bool = False,
    shrinkage: float = 0.0,
):
    """weight [out, in], hessian E[x x^T] [in, in] (any positive multiple of X^T X works).
    Returns a QuantizedLinear, or with `codebook` [out, levels] (rows sorted ascending) a
    CodebookLinear whose indices point into it (`spec` then only names the bits).

    With `act_order` columns are processed by decreasing Hessian diagonal (most salient first);
    groups still cover consecutive *original* columns, so their grids are fitted up front on
    the unquantized weight ("static groups") and the stored layout stays the plain one. With
    `clip_search` each group's range is first clipped by the ratio whose rounding loses the
    least output error, AWQ's clip search (compressors/awq.py): for static groups all at once
    on the unquantized weight, otherwise as each group comes up (`fit_group_grid`). `damp` and
    `shrinkage` regularize the Hessian the error feedback inverts (`inverse_hessian_factor`)."""
    W, H = prepared(weight, hessian)
    rows, columns = W.shape
    width = spec.group_width(columns)

    # Grids per group, [groups, rows] (a group's grid is then a contiguous vector, as the sweep's
    # columns are): fitted up front for static groups and per-channel (one group, whose first
    # column is the first one processed anyway), otherwise when a group's first column comes
    # up, on the weights as the error feedback has updated them so far.
    n_groups = columns // width
    scale = torch.zeros(n_groups, rows)
    zero = torch.zeros(n_groups, rows)
    static = act_order or n_groups == 1 or codebook is not None
    if codebook is not None:
        from compressors.squeezellm import CodebookLinear, entry_boundaries, nearest_entry

        boundaries = entry_boundaries(codebook)  # once, not per column
        round_column = lambda w, g: nearest_entry(w[:, None], codebook, boundaries)[:, 0].float()  # noqa: E731
        value = lambda q, g: codebook.gather(1, q[:, None].long())[:, 0]  # noqa: E731
    else:
        round_column = lambda w, g: quantize(w, scale[g], zero[g], spec)  # noqa: E731
        value = lambda q, g: dequantize(q, scale[g], zero[g])  # noqa: E731
    if static and codebook is None:
        clip = torch.ones(rows, n_groups)
        if clip_search:
            from compressors.awq import clip_ratios

            clip = clip_ratios(W, H, spec)
        for g in range(n_groups):
            grid = fit_grid(W[:, g * width : (g + 1) * width], spec, clip[:, g : g + 1])
            scale[g], zero[g] = (t[:, 0] for t in grid)
    order = torch.argsort(H.diagonal(), descending=True) if act_order else torch.arange(columns)
    W, H = W[:, order], H[order[:, None], order]
    codes = torch.zeros(columns, rows)  # [position, row]
    group_at = [column // width for column in order.tolist()]  # per position: Python ints, no per-column tensor indexing
    starts_group = [column % width == 0 for column in order.tolist()]

    def settle(block, i, position):
        g = group_at[position]
        if not static and starts_group[position]:
            w, sigma = block[:, i : i + width], H[position : position + width, position : position + width]
            grid = fit_group_grid(w, sigma, spec) if clip_search else fit_grid(w, spec)
            scale[g], zero[g] = (t[:, 0] for t in grid)
        codes[position] = round_column(block[:, i], g)
        return value(codes[position], g)

    if not static:  # blocks hold whole groups, so a group's grid sees its updated columns
        block_size = max(width, block_size // width * width)
    error_feedback_sweep(W, inverse_hessian_factor(H, damp, shrinkage), settle, block_size)

    codes = codes[torch.argsort(order)].T
    if codebook is not None:
        return CodebookLinear(codes.to(torch.uint8).contiguous(), codebook, spec.bits)
    return QuantizedLinear(codes.to(torch.int8).contiguous(), scale.T.contiguous(), zero.T.contiguous(), spec)


def gptq_quantize_together(weights: list[torch.Tensor], hessian: torch.Tensor, spec: GridSpec, damp: float = 0.01, act_order: bool = False,
                           clip_search: bool = False, shrinkage: float = 0.0) -> list[QuantizedLinear]:
    """`gptq_quantize` for linears that read one input (q/k/v, gate/up), so share its Hessian.
    Given the Hessian GPTQ treats every row on its own (its grid, clip search and error
    feedback are per row), so the weights stacked row-wise run as one sweep with the same
    result, while the sweep's per-column work, a loop of small ops that is GPTQ's cost at these
    widths, and the inverse Hessian are paid once instead of once per linear."""
    stacked = gptq_quantize(torch.cat([w.float() for w in weights]), hessian, spec, damp, act_order, clip_search=clip_search, shrinkage=shrinkage)
    return stacked.split_rows([w.shape[0] for w in weights])
