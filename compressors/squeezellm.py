"""SqueezeLLM: non-uniform quantization onto a per-output-channel codebook.

Each output row gets its own 2^b fp16 values (its lookup table), found by k-means over the
row's weights, each weight weighted by its sensitivity; every weight is stored as the index of
its nearest table entry (Kim et al., 2023, "SqueezeLLM: Dense-and-Sparse Quantization").

Sensitivity: the paper weighs weights by the Fisher information (squared gradients of the
loss). lmpress uses the diagonal of the layer's GPTQ Hessian instead, E[x_j^2] of input column
j, which the calibration stage already measures: the output error of changing w_ij by d is
d^2 * E[x_j^2] when the other columns are left alone, so weighting by it is the layer-wise
version of the same criterion, and needs no backward pass through the model.

With the full Hessian at hand (`hessian=`), the indices can also be chosen by GPTQ's error
feedback onto the same tables (compressors/gptq.py) instead of rounding each weight to its
nearest entry alone: method `squeezellm-gptq`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from pipelines.errors import require

CODEBOOK_BITS = (2, 3, 4)


@dataclass
class CodebookLinear:
    """A linear's weight on per-row codebooks: indices [out, in] and codebook [out, 2^bits]
    (fp16 values, kept as fp32 holding fp16-exact numbers)."""

    indices: torch.Tensor  # uint8
    codebook: torch.Tensor
    bits: int

    def dequantized(self) -> torch.Tensor:
        return torch.gather(self.codebook, 1, self.indices.long())


def check_bits(bits: int) -> None:
    require(bits in CODEBOOK_BITS, f"squeezellm takes bits {', '.join(map(str, CODEBOOK_BITS))} (got {bits}); use rtn, gptq or awq for 8 bits")


def squeezellm_quantize(
    weight: torch.Tensor, sensitivity: torch.Tensor, bits: int, hessian: torch.Tensor | None = None, damp: float = 0.01,
    act_order: bool = True, max_iter: int = 50, shrinkage: float = 0.0,
) -> CodebookLinear:
    """Weighted k-means (scikit-learn) of each row of `weight` [out, in] into 2^bits values,
    with per-column weights `sensitivity` [in]; then each weight's index is its nearest entry,
    or, given the `hessian` E[x x^T], GPTQ's choice (`damp` and `shrinkage` regularize its
    Hessian). Deterministic: the centroids start at the row's sensitivity-weighted quantiles, so
    no random restarts are needed."""
    from sklearn.cluster import KMeans
    from sklearn.exceptions import ConvergenceWarning
    from threadpoolctl import threadpool_limits

    check_bits(bits)
    levels = 1 << bits
    w = weight.detach().double().cpu().numpy()
    s = sensitivity.detach().double().cpu().clamp(min=1e-12).numpy()  # k-means needs positive weights
    quantiles = (np.arange(levels) + 0.5) / levels
    codebook = np.empty((w.shape[0], levels))
    # one row is a tiny problem: threads only add overhead (3 ms/row single-threaded); a row
    # with fewer distinct values than table entries (a dead channel) is fine, not a warning
    with threadpool_limits(1), warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        for row, values in enumerate(w):
            order = np.argsort(values, kind="stable")
            cumulative = np.cumsum(s[order]) / s.sum()
            start = values[order][np.searchsorted(cumulative, quantiles).clip(max=len(values) - 1)]
            start = start + np.arange(levels) * 1e-12 * max(1.0, np.abs(start).max())  # distinct, even for constant rows
            kmeans = KMeans(levels, init=start.reshape(-1, 1), n_init=1, max_iter=max_iter, tol=0).fit(values.reshape(-1, 1), sample_weight=s)
            codebook[row] = np.sort(kmeans.cluster_centers_[:, 0])
    # values are stored as fp16: pick indices against the fp16 table the artifact holds
    table = torch.from_numpy(codebook).half().float()
    if hessian is not None:
        from compressors.gptq import gptq_quantize
        from compressors.grid import GridSpec

        return gptq_quantize(weight, hessian, GridSpec(bits, -1), damp, act_order, codebook=table, shrinkage=shrinkage)
    indices = nearest_entry(weight.float().cpu(), table)
    return CodebookLinear(indices.to(torch.uint8), table, bits)


def entry_boundaries(table: torch.Tensor) -> torch.Tensor:
    """Midpoints between consecutive entries of each (ascending) table row."""
    return ((table[:, 1:] + table[:, :-1]) / 2).contiguous()


def nearest_entry(weight: torch.Tensor, table: torch.Tensor, boundaries: torch.Tensor | None = None) -> torch.Tensor:
    """Index of the nearest table entry for each weight; pass `boundaries` when calling in a loop."""
    return torch.searchsorted(entry_boundaries(table) if boundaries is None else boundaries, weight.contiguous())
