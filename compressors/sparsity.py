"""Sparsity patterns, the score-based pruners (magnitude, Wanda) and the training-free mask
refinement that runs on top of any pruner.

A pattern is unstructured at some ratio (each output row loses the same share of its inputs,
Wanda's per-output comparison group, used here for every score so that only the score
differs between methods) or N:M (N nonzeros kept in every M consecutive inputs of a row; 2:4
is the one sparse tensor cores run).

Masks are boolean [out, in] with True = kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipelines.errors import LmpressError, require

PRUNE_METHODS = ("magnitude", "wanda", "sparsegpt")


@dataclass(frozen=True)
class SparsityPattern:
    sparsity: float = 0.5  # share of weights set to zero (N:M: 1 - N/M)
    n: int = 0  # N:M: kept per group; 0 = unstructured
    m: int = 0

    @property
    def structured(self) -> bool:
        return self.m > 0

    @property
    def is_24(self) -> bool:
        """The pattern sparse tensor cores (and lmpress's 2:4 format) serve."""
        return (self.n, self.m) == (2, 4)

    def __str__(self) -> str:
        return f"{self.n}:{self.m}" if self.structured else f"{self.sparsity:g}"

    def check_width(self, columns: int, name: str) -> None:
        require(
            not self.structured or columns % self.m == 0,
            f"pattern {self} needs input widths divisible by {self.m}; {name} is {columns} wide: skip it with --skip or use another pattern",
        )


def parse_pattern(text: str | float) -> SparsityPattern:
    """'2:4' / '4:8' (N:M: N kept in every M) or a ratio such as '0.5' (unstructured)."""
    text = str(text).strip()
    if ":" in text:
        parts = text.split(":")
        require(
            len(parts) == 2 and all(p.strip().isdigit() for p in parts),
            f"pattern must look like N:M, e.g. 2:4 or 4:8 (got '{text}')",
        )
        n, m = (int(p) for p in parts)
        require(0 < n < m, f"pattern {text}: N must be at least 1 and below M (2:4 keeps 2 weights of every 4)")
        return SparsityPattern(1 - n / m, n, m)
    try:
        sparsity = float(text)
    except ValueError:
        raise LmpressError(f"sparsity must be a ratio like 0.5 or a pattern like 2:4 (got '{text}')") from None
    require(0 <= sparsity < 1, f"sparsity must be in [0, 1) (got {text}); 0.5 zeroes half the weights")
    return SparsityPattern(sparsity)


def keep_mask(score: torch.Tensor, pattern: SparsityPattern) -> torch.Tensor:
    """Keep the highest-scoring weights: per row for unstructured, per group of M for N:M.
    Ties break toward the lower column (a stable sort), so masks are deterministic."""
    rows, columns = score.shape
    if pattern.structured:
        groups = score.reshape(rows, columns // pattern.m, pattern.m)
        order = torch.argsort(groups, dim=2, descending=True, stable=True)
        keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(2, order[..., : pattern.n], True)
        return keep.reshape(rows, columns)
    pruned = int(round(pattern.sparsity * columns))
    order = torch.argsort(score, dim=1, stable=True)
    return torch.ones_like(score, dtype=torch.bool).scatter_(1, order[:, :pruned], False)


def magnitude_score(weight: torch.Tensor) -> torch.Tensor:
    return weight.float().abs()


def wanda_score(weight: torch.Tensor, second_moment: torch.Tensor) -> torch.Tensor:
    """Wanda (Sun et al., 2023): |W_ij| * ||X_j||, the input's norm from E[x_j^2]."""
    return weight.float().abs() * second_moment.diagonal().clamp_min(0).sqrt()[None, :]


def reconstruction_error(weight: torch.Tensor, pruned: torch.Tensor, second_moment: torch.Tensor) -> torch.Tensor:
    """The calibration objective per output row: E[((W - W') x)^2] = d Sigma d^T, d = W - W'."""
    d = weight.float() - pruned.float()
    return ((d @ second_moment.float()) * d).sum(dim=1)


def refine_mask(
    weight: torch.Tensor,
    pruned: torch.Tensor,
    keep: torch.Tensor,
    second_moment: torch.Tensor,
    pattern: SparsityPattern,
    cycles: int = 50,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Training-free mask refinement in the manner of DSnoT (Zhang et al., 2023): each cycle, in
    every row, grow the pruned weight whose return lowers the reconstruction error most, and
    prune the kept weight (in the same group of M for N:M) that raises it least; the swap is
    made only where the pair lowers the error. No gradients and no weight updates: a grown
    weight gets its original value back, a pruned one goes to zero. Where DSnoT estimates the
    error from the inputs' mean and variance, this uses the exact objective d Sigma d^T from the
    second moment the calibration stage stores, so the error never rises (the tests check it).
    Sparsity per row (and per group) is unchanged. Returns the refined (pruned weight, mask)."""
    W = weight.float()
    current, keep = pruned.float().clone(), keep.clone()
    sigma = second_moment.float()
    diag = sigma.diagonal()
    rows, columns = W.shape
    row_index = torch.arange(rows)
    gradient = (W - current) @ sigma  # g = d Sigma, kept current under each swap
    for _ in range(cycles):
        # growing p: d_p goes from W_p - current_p to 0, a step of -a with a = W_p - current_p
        a = W - current
        grow_change = torch.where(keep, torch.inf, -2 * a * gradient + a**2 * diag)
        grow = grow_change.argmin(dim=1)
        a_grow = a[row_index, grow]
        gradient_after = gradient - a_grow[:, None] * sigma[grow]
        # pruning k: d_k rises by b = current_k
        b = current
        prune_change = 2 * b * gradient_after + b**2 * diag
        candidates = keep.clone()
        if pattern.structured:  # stay inside the grown weight's group, so N:M holds
            group = torch.arange(columns) // pattern.m
            candidates &= group[None, :] == (grow // pattern.m)[:, None]
        prune_change = torch.where(candidates, prune_change, torch.inf)
        prune = prune_change.argmin(dim=1)
        # the pair's exact change: both single-coordinate changes plus their cross term
        b_prune = current[row_index, prune]
        total = grow_change[row_index, grow] + prune_change[row_index, prune]
        error = (gradient * a).sum(dim=1)
        better = total < -1e-6 * error  # a real decrease, not float noise
        if not better.any():
            break
        r, p, k = row_index[better], grow[better], prune[better]
        gradient[r] = gradient_after[r] + b_prune[better][:, None] * sigma[k]
        current[r, p], keep[r, p] = W[r, p], True
        current[r, k], keep[r, k] = 0.0, False
    return current, keep
