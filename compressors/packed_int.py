"""Uniform integer weights in compressed-tensors' `pack-quantized` layout.

Stock transformers (and vLLM, for the schemes it serves) open these artifacts. Layout, per
quantized linear `<name>`:
    <name>.weight_packed  int32 [out, ceil(in * bits / 32)]: row-wise dense bit packing, code i
                          at bits [i*b, i*b + b) of the row, stored as q + 2^(b-1) (unsigned)
    <name>.weight_scale   fp16  [out, groups]
    <name>.weight_shape   int64 [2]
and `quantization_config` in config.json (quant_method "compressed-tensors", one config group
per distinct grid, targeting modules by name, so per-layer mixed settings fit the format).

Only symmetric grids are written: with transformers 5.23 and compressed-tensors 0.20, a packed
asymmetric zero point does not load back (its packed shape is rejected as a size mismatch).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from compressors.grid import GridSpec, QuantizedLinear
from pipelines.errors import require

FORMAT = "pack-quantized"


def _weight_args(spec: GridSpec):
    from compressed_tensors.quantization import QuantizationArgs

    per_channel = spec.group_size == -1
    return QuantizationArgs(
        num_bits=spec.bits, type="int", symmetric=spec.symmetric,
        strategy="channel" if per_channel else "group", group_size=None if per_channel else spec.group_size,
    )


def save_pack_quantized(model: nn.Module, quantized: dict[str, QuantizedLinear], folder: Path) -> None:
    """Write `model` with the given linears (full module names) replaced by their packed form.
    The model is compressed in place; do not use it afterwards."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, apply_quantization_config

    require(bool(quantized), "nothing to quantize: every linear was skipped")
    require(
        all(q.spec.symmetric for q in quantized.values()),
        "asymmetric grids cannot be written as compressed-tensors that transformers reloads; use --symmetric true",
    )
    by_spec: dict[GridSpec, list[str]] = {}
    for name, q in quantized.items():
        by_spec.setdefault(q.spec, []).append(name)
    config = QuantizationConfig(
        config_groups={
            f"group_{i}": QuantizationScheme(targets=names, weights=_weight_args(spec))
            for i, (spec, names) in enumerate(sorted(by_spec.items(), key=lambda item: item[1][0]))
        },
        ignore=[],
    )
    modules = dict(model.named_modules())
    for name, q in quantized.items():
        modules[name].weight.data = q.dequantized().to(modules[name].weight.dtype)
    apply_quantization_config(model, config)
    for name, q in quantized.items():
        module = modules[name]
        module.weight_scale = nn.Parameter(q.scale.half(), requires_grad=False)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=FORMAT)
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(folder)


def unpack_int32(packed: torch.Tensor, bits: int, columns: int) -> torch.Tensor:
    """Torch reference for the layout: signed codes [out, columns] from `weight_packed`."""
    position = torch.arange(columns) * bits
    word, offset = position // 32, position % 32
    words = packed.to(torch.int64) & 0xFFFFFFFF  # int32 -> unsigned bits
    value = words[:, word] >> offset
    spill = offset + bits > 32  # codes that straddle two words (3 bits)
    if spill.any():
        value[:, spill] |= words[:, word[spill] + 1] << (32 - offset[spill])
    return ((value & ((1 << bits) - 1)) - (1 << (bits - 1))).to(torch.int8)


# --------------------------------------------------------------------------- kernels
#
# Triton kernels read the packed layout directly: code k of row n sits in word k // (32 / b)
# at bit (k % (32 / b)) * b, for b in KERNEL_BITS (32 % b == 0, so no code straddles two
# words; 3-bit weights are served by the torch reference). Scales are looked up per element
# (group k // group_size), so any group size, per-channel included, and any K work, with no
# alignment between blocks and groups required.

import os  # noqa: E402

if not torch.cuda.is_available():
    # Without a GPU Triton runs only in its interpreter, and it decides per kernel when the
    # kernel is *defined* (below), so the choice is made here, not by whoever calls first.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

KERNEL_BITS = (2, 4, 8)


@triton.jit
def _dequantized_tile(packed_ptr, scale_ptr, rn, rk, N, K, stride_pn, stride_sn, group_size, BITS: tl.constexpr):
    """Weights [BLOCK_N, BLOCK_K] (fp32) of rows rn and columns rk, zero outside the matrix."""
    PER_WORD: tl.constexpr = 32 // BITS
    mask = (rn[:, None] < N) & (rk[None, :] < K)
    words = tl.load(packed_ptr + rn[:, None] * stride_pn + rk[None, :] // PER_WORD, mask=mask, other=0)
    codes = ((words >> ((rk[None, :] % PER_WORD) * BITS)) & ((1 << BITS) - 1)) - (1 << (BITS - 1))
    scale = tl.load(scale_ptr + rn[:, None] * stride_sn + rk[None, :] // group_size, mask=mask, other=0.0)
    return codes.to(tl.float32) * scale.to(tl.float32)


@triton.jit
def _dequantize_kernel(packed_ptr, scale_ptr, out_ptr, N, K, stride_pn, stride_sn, stride_on, group_size,
                       BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    w = _dequantized_tile(packed_ptr, scale_ptr, rn, rk, N, K, stride_pn, stride_sn, group_size, BITS)
    mask = (rn[:, None] < N) & (rk[None, :] < K)
    tl.store(out_ptr + rn[:, None] * stride_on + rk[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemv_kernel(x_ptr, packed_ptr, scale_ptr, y_ptr, N, K, stride_pn, stride_sn, group_size,
                 BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Batch 1 (decode): y[n] = sum_k x[k] w[n, k]; bound by reading the packed weights once."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
        w = _dequantized_tile(packed_ptr, scale_ptr, rn, rk, N, K, stride_pn, stride_sn, group_size, BITS)
        acc += tl.sum(w * x[None, :], axis=1)
    tl.store(y_ptr + rn, acc.to(y_ptr.dtype.element_ty), mask=rn < N)


@triton.jit
def _gemm_kernel(x_ptr, packed_ptr, scale_ptr, y_ptr, M, N, K, stride_xm, stride_pn, stride_sn, stride_ym, group_size,
                 BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Batches > 1: y[M, N] = x[M, K] @ w[N, K]^T, dequantizing each weight tile once per M block."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        w = _dequantized_tile(packed_ptr, scale_ptr, rn, rk, N, K, stride_pn, stride_sn, group_size, BITS)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@dataclass(frozen=True)
class PackedWeight:
    """One linear's packed weight as stored: codes packed along K, fp16 scales [N, groups]."""

    packed: torch.Tensor  # int32 [N, ceil(K * bits / 32)]
    scale: torch.Tensor  # [N, groups]
    bits: int
    columns: int  # K

    @property
    def group_size(self) -> int:
        return self.columns // self.scale.shape[1]

    @property
    def rows(self) -> int:
        return self.packed.shape[0]


def dequantize_reference(weight: PackedWeight) -> torch.Tensor:
    """Torch reference: fp32 weights [N, K]."""
    codes = unpack_int32(weight.packed.cpu(), weight.bits, weight.columns).to(weight.packed.device)
    return codes.float() * weight.scale.float().repeat_interleave(weight.group_size, dim=1)


def matmul_reference(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    return (x.float() @ dequantize_reference(weight).T).to(x.dtype)


def dequantize_triton(weight: PackedWeight, dtype=torch.float16, block_n: int = 64, block_k: int = 64) -> torch.Tensor:
    out = torch.empty(weight.rows, weight.columns, dtype=dtype, device=weight.packed.device)
    grid = (triton.cdiv(weight.rows, block_n), triton.cdiv(weight.columns, block_k))
    _dequantize_kernel[grid](
        weight.packed, weight.scale, out, weight.rows, weight.columns, weight.packed.stride(0), weight.scale.stride(0),
        out.stride(0), weight.group_size, BITS=weight.bits, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return out


def matmul_triton(x: torch.Tensor, weight: PackedWeight, block_m: int = 16, block_n: int = 64, block_k: int = 64) -> torch.Tensor:
    """x [M, K] @ dequantized(weight)^T, fused; the GEMV kernel serves M == 1."""
    x = x.contiguous()
    M, K = x.shape
    y = torch.empty(M, weight.rows, dtype=x.dtype, device=x.device)
    common = dict(group_size=weight.group_size, BITS=weight.bits, BLOCK_N=block_n, BLOCK_K=block_k)
    if M == 1:
        _gemv_kernel[(triton.cdiv(weight.rows, block_n),)](
            x, weight.packed, weight.scale, y, weight.rows, K, weight.packed.stride(0), weight.scale.stride(0), **common
        )
    else:
        _gemm_kernel[(triton.cdiv(M, block_m), triton.cdiv(weight.rows, block_n))](
            x, weight.packed, weight.scale, y, M, weight.rows, K, x.stride(0), weight.packed.stride(0), weight.scale.stride(0),
            y.stride(0), BLOCK_M=block_m, **common,
        )
    return y
