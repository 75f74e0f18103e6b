"""The uniform integer grid that RTN, GPTQ and AWQ quantize onto.

Conventions are compressed-tensors' (so the packed artifact needs no conversion): signed codes
q in [-2^(b-1), 2^(b-1) - 1], w = (q - zero) * scale, one (scale, zero) per output row and
group of `group_size` consecutive input columns (`group_size=-1`: one group per row, i.e.
per-channel). Symmetric grids have zero = 0 and scale = max|w| / (2^b - 1) * 2. Scales are
rounded to fp16, the dtype they are stored in, before any code is computed, so the codes an
algorithm picks are exactly the codes the artifact holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipelines.errors import require

SUPPORTED_BITS = (2, 3, 4, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128, -1)


@dataclass(frozen=True)
class GridSpec:
    bits: int = 4
    group_size: int = 64  # -1: per output channel
    symmetric: bool = True

    def __post_init__(self):
        whole = lambda value: isinstance(value, int) and not isinstance(value, bool)  # noqa: E731  (4.0 and True compare equal to ints)
        require(
            whole(self.bits) and self.bits in SUPPORTED_BITS,
            f"bits must be one of {', '.join(map(str, SUPPORTED_BITS))} (got {self.bits!r})",
        )
        require(
            whole(self.group_size) and self.group_size in SUPPORTED_GROUP_SIZES,
            f"group size must be one of 32, 64, 128 or -1 for per-channel (got {self.group_size!r})",
        )
        require(isinstance(self.symmetric, bool), f"symmetric must be true or false (got {self.symmetric!r})")

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    def group_width(self, columns: int) -> int:
        return columns if self.group_size == -1 else self.group_size

    def check_width(self, columns: int, name: str) -> None:
        dividing = ", ".join(str(g) for g in (32, 64, 128) if columns % g == 0)
        require(
            self.group_size == -1 or columns % self.group_size == 0,
            f"group size {self.group_size} does not divide the input width {columns} of {name}; "
            + (f"use a group size that divides it ({dividing}) or -1 (per-channel)" if dividing else "none of 32, 64, 128 does: use -1 (per-channel)"),
        )


def fit_grid(w: torch.Tensor, spec: GridSpec, clip: torch.Tensor | float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Min-max scale and zero for each row of `w` (one group): shapes [rows, 1]. `clip` < 1
    shrinks the range (clipping outliers to round the rest more finely)."""
    return grid_for_range(*group_range(w), spec, clip)


def group_range(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The range a min-max grid covers for each group along `w`'s last dim (keepdim), widened
    to include 0: kept apart from `grid_for_range` so a search over clip ratios takes it once."""
    w = w.float()
    return w.amin(dim=-1, keepdim=True).clamp(max=0), w.amax(dim=-1, keepdim=True).clamp(min=0)


def grid_for_range(low: torch.Tensor, high: torch.Tensor, spec: GridSpec, clip: torch.Tensor | float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero of the grid over [low, high] * clip (shapes as `low`)."""
    low, high = low * clip, high * clip
    if spec.symmetric:
        scale = torch.maximum(low.abs(), high) / ((spec.qmax - spec.qmin) / 2)
        scale = _fp16_scale(scale)
        zero = torch.zeros_like(scale)
    else:
        scale = _fp16_scale((high - low) / (spec.qmax - spec.qmin))
        zero = (spec.qmin - torch.round(low / scale)).clamp(spec.qmin, spec.qmax)
    return scale, zero


def _fp16_scale(scale: torch.Tensor) -> torch.Tensor:
    """The scale as stored (fp16). fp16's subnormals (down to 2^-24) serve groups of small
    weights exactly; only a scale that rounds to 0 (an all-zero group) takes the smallest one,
    as compressed-tensors does, so that it stays finite and positive."""
    stored = scale.half().float()
    return torch.where(stored > 0, stored, 2.0**-24)


def quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, spec: GridSpec) -> torch.Tensor:
    """Integer codes (as float) of `w` on the grid; scale/zero broadcast against `w`."""
    return torch.round(w / scale).add_(zero).clamp_(spec.qmin, spec.qmax)  # one temporary, not three: also run per column


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """(q - zero) * scale in fp32: exact (a code of at most 8 bits times an fp16 scale fits
    fp32's mantissa), and what compressed-tensors' decompression gives an fp32 model."""
    return (q - zero).mul_(scale)


@dataclass
class QuantizedLinear:
    """A linear's weight on the grid: codes [out, in], scale and zero [out, groups]."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    spec: GridSpec

    def split_rows(self, sizes: list[int]) -> list["QuantizedLinear"]:
        """The linears whose weights were stacked row-wise, `sizes` rows each, apart again."""
        parts = (t.split(sizes) for t in (self.codes, self.scale, self.zero))
        return [QuantizedLinear(codes.contiguous(), scale.contiguous(), zero.contiguous(), self.spec) for codes, scale, zero in zip(*parts)]

    def dequantized(self) -> torch.Tensor:
        width = self.spec.group_width(self.codes.shape[1])
        expand = lambda t: t.repeat_interleave(width, dim=1)  # noqa: E731
        return dequantize(self.codes.float(), expand(self.scale), expand(self.zero))


def round_to_nearest(weight: torch.Tensor, spec: GridSpec, clip: torch.Tensor | float = 1.0) -> QuantizedLinear:
    """RTN: each group's min-max grid, each weight rounded independently (the baseline).
    `clip`: a factor for all groups, or one per group [rows, groups]."""
    rows, columns = weight.shape
    width = spec.group_width(columns)
    groups = weight.float().reshape(rows * (columns // width), width)
    if isinstance(clip, torch.Tensor):
        clip = clip.reshape(-1, 1)
    scale, zero = fit_grid(groups, spec, clip)
    codes = quantize(groups, scale, zero, spec).reshape(rows, columns)
    return QuantizedLinear(codes.to(torch.int8), scale.reshape(rows, -1), zero.reshape(rows, -1), spec)
