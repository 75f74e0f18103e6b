"""Uniform integer weights in compressed-tensors' `pack-quantized` layout.

Stock transformers (and vLLM, for the schemes it serves) open these artifacts. Layout, per
quantized linear `<name>`:
    <name>.weight_packed  int32 [out, ceil(in * bits / 32)]: row-wise dense bit packing, code i
                          at bits [i*b, i*b + b) of the row, stored as q + 2^(b-1) (unsigned)
    <name>.weight_scale   fp16  [out, groups]
    <name>.weight_shape   int64 [2]
  asymmetric grids (llm-compressor's W4A16_ASYM layout, which vLLM serves at 4 bits):
    <name>.weight_zero_point  int32 [ceil(out * bits / 32), groups]: the signed zero points
                          (w = (q - zero) * scale) packed as the codes are, but down the columns
and `quantization_config` in config.json (quant_method "compressed-tensors", one config group
per distinct grid, targeting modules by name, so per-layer mixed settings fit the format).

Stock transformers (5.23, compressed-tensors 0.20) opens asymmetric grids only dequantized,
`from_pretrained(..., quantization_config=CompressedTensorsConfig(dequantize=True))`: its
compressed load builds the zero points at their unpacked shape and rejects the packed ones as a
size mismatch (compressed-tensors' meta-device compress skips the zero-point packing;
llm-compressor issue 1618), for llm-compressor's own W4A16_ASYM checkpoints too.
"""

from __future__ import annotations

import functools
import json
import math
import struct
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch
from torch import nn

from compressors.grid import GridSpec
from pipelines.errors import require

FORMAT = "pack-quantized"


def _weight_args(spec: GridSpec, act_order: bool = False):
    """compressed-tensors' description of the grid; `act_order`: GPTQ ran in activation order
    with static groups ("weight", which 0.20 also spells "static"): recorded, and nothing to
    load, since the groups stay in column order and need no g_idx."""
    from compressed_tensors.quantization import QuantizationArgs

    per_channel = spec.group_size == -1
    return QuantizationArgs(
        num_bits=spec.bits, type="int", symmetric=spec.symmetric,
        strategy="channel" if per_channel else "group", group_size=None if per_channel else spec.group_size,
        actorder="weight" if act_order else None,
    )


def config_group_of(name: str, quantization_config: dict) -> dict | None:
    """The config group (as config.json holds it) that compressed-tensors itself applies to the
    linear `name`, by its own matching: an exact name first, then `re:` patterns matched from
    the name's start, then a class name; None where `ignore` lists it or no group targets it.
    Another tool's checkpoint then reads as stock transformers and vLLM read it."""
    from compressed_tensors.utils.match import is_match, match_targets

    linear = torch.nn.Linear(1, 1, device="meta")  # what every packed module is, for class targets such as "Linear"
    groups = {target: group for group in quantization_config.get("config_groups", {}).values() for target in group["targets"]}
    if not is_match(name, linear, groups, quantization_config.get("ignore") or ()):
        return None
    return groups[match_targets(name, linear, groups)[0]]


def has_zero_points(quantization_config: dict) -> bool:
    """Whether a compressed-tensors config (as config.json holds it) has a group whose weight
    grid is asymmetric, so its linears store packed zero points."""
    groups = (quantization_config.get("config_groups") or {}).values() if quantization_config.get("quant_method") == "compressed-tensors" else ()
    return any(not (group.get("weights") or {}).get("symmetric", True) for group in groups)


def require_groups(key: str, scale: torch.Tensor, columns: int, group_size: int | None) -> None:
    """The scales `key` hold one group a `group_size` of the `columns` inputs (None: one a row),
    as the config says; else the group size the kernels work out would decode other weights."""
    groups = 1 if group_size is None else columns // group_size
    require(
        (group_size is None or columns % group_size == 0) and scale.shape[1] == groups,
        f"{key} holds {scale.shape[1]} groups a row, not those of {columns} inputs in groups of {group_size or columns} its config "
        "gives; restore the artifact's own config.json",
    )


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed codes [out, in] -> int32 words [out, ceil(in * bits / 32)], compressed-tensors' packer."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    return pack_to_int32(codes.to(torch.int8), bits)


def pack_zero_points(zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed zero points [out, groups] -> int32 [ceil(out * bits / 32), groups], packed down the
    columns as compressed-tensors (and so vLLM) stores them."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    return pack_to_int32(zero.to(torch.int8), bits, packed_dim=0).contiguous()


def unpack_zero_points(packed: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
    """`pack_zero_points` undone: int8 [rows, groups], row-major as the kernels index it (the
    unpacker returns a transposed view). Load time only, so compressed-tensors' own unpacker
    serves (the kernels read the zero points unpacked)."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    return unpack_from_int32(packed, bits, torch.Size((rows, packed.shape[1])), packed_dim=0).contiguous()


def save_pack_quantized(model: nn.Module, packed: dict[str, "PackedWeight"], grids: dict[str, GridSpec], folder: Path, act_order: bool = False) -> None:
    """Write `model` with the given linears (full module names -> their PackedWeight, on the
    grid `grids[name]`, GPTQ's in activation order where `act_order`) in compressed-tensors'
    pack-quantized form. The linears' own weights
    are not read (a stage may have released them); compressed-tensors supplies the config. The
    model gets compressed-tensors' quantization schemes attached; do not use it afterwards."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, QuantizationStatus, apply_quantization_config

    require(bool(packed), "nothing to quantize: every linear was skipped")
    by_spec: dict[GridSpec, list[str]] = {}
    for name in packed:
        by_spec.setdefault(grids[name], []).append(name)
    config = QuantizationConfig(
        config_groups={
            f"group_{i}": QuantizationScheme(targets=names, weights=_weight_args(spec, act_order))
            for i, (spec, names) in enumerate(sorted(by_spec.items(), key=lambda item: item[1][0]))
        },
        ignore=[],
    )
    state = {key: value for key, value in model.state_dict().items() if key.removesuffix(".weight") not in packed}
    for name, weight in packed.items():
        state[f"{name}.weight_packed"] = weight.unit_order().packed
        state[f"{name}.weight_scale"] = weight.scale
        state[f"{name}.weight_shape"] = torch.tensor([weight.rows, weight.columns])
        if weight.zero is not None:
            state[f"{name}.weight_zero_point"] = pack_zero_points(weight.zero, weight.bits)
    apply_quantization_config(model, config)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=FORMAT)
    compressor.quantization_config.quantization_status = QuantizationStatus.COMPRESSED  # as written: packed
    model.save_pretrained(folder, state_dict=state)
    compressor.update_config(folder)


def unpack_int32(packed: torch.Tensor, bits: int, columns: int) -> torch.Tensor:
    """Torch reference for the layout: signed codes [out, columns] from `weight_packed`, on its
    device (the positions are worked out on the CPU: whether any code spills needs no sync)."""
    position = torch.arange(columns) * bits
    word, offset = position // 32, position % 32
    spill = offset + bits > 32  # codes that straddle two words (3 bits)
    spills = bool(spill.any())
    word, offset, spill = (t.to(packed.device) for t in (word, offset, spill))
    words = packed.to(torch.int64) & 0xFFFFFFFF  # int32 -> unsigned bits
    value = words[:, word] >> offset
    if spills:
        value[:, spill] |= words[:, word[spill] + 1] << (32 - offset[spill])
    return ((value & ((1 << bits) - 1)) - (1 << (bits - 1))).to(torch.int8)


# The interleaved layout, a repack made at load time for the tensor cores (never written to an
# artifact). A tensor-core fragment of 16-bit weights (mma / wgmma, the GEMM's first operand)
# gives thread q of each 4 the columns 8 p + 2 q + b of a k-block (p = 0, 1, ...; b = 0, 1).
# So in each tile of 4 consecutive units of whole codes (4-bit: 4 words, 32 columns), unit q
# holds exactly those columns, code p + b * codes / 2 standing for column 8 p + 2 q + b: each
# thread loads whole words and decodes them straight into its operand registers, with no trip
# through shared memory to reorder the tile, and with 4 bits the two codes of a half2 register
# (columns 2 q and 2 q + 1) sit 16 bits apart in a word, where one lop3 extracts both. Marlin
# repacks its weights at load time for the same reason.
INTERLEAVE_UNITS = 4
# Codes unpacked at a time when a weight changes layout: unpacking and packing take some 25 bytes a
# code in passing (1.4 GB for a whole 4096 x 14336 layer, benchmarks/repack_cost.py), which a repack
# at serving time must not claim.
REPACK_CODES = 1 << 20


def interleave_order(codes: torch.Tensor, per_unit: int, inverse: bool = False) -> torch.Tensor:
    """Codes [N, K] in column order -> the interleaved layout's order (`inverse`: back), in
    tiles of INTERLEAVE_UNITS units of `per_unit` codes (K a whole number of tiles): a tile's
    columns [p, q, b] (column 8 p + 2 q + b) are stored as [q, b, p] (unit q, code p + b * per_unit / 2)."""
    rows, columns = codes.shape
    tiles = (rows, columns // (INTERLEAVE_UNITS * per_unit))
    half = per_unit // 2
    if inverse:
        return codes.reshape(*tiles, INTERLEAVE_UNITS, 2, half).permute(0, 1, 4, 2, 3).reshape(rows, columns)
    return codes.reshape(*tiles, half, INTERLEAVE_UNITS, 2).permute(0, 1, 3, 4, 2).reshape(rows, columns)


# --------------------------------------------------------------------------- kernels
#
# One set of Triton kernels serves every packed weight lmpress writes: b-bit codes packed
# along K as above (code k of row n at bits [k*b, k*b + b) of the row's words; for b = 3 a
# code may straddle two words), decoded either on a uniform grid, (code - zero) * scale with
# scale/zero per (row, group k // group_size), or through a per-row codebook, codebook[n, code]
# (SqueezeLLM, compressors/squeezellm.py); or plain fp16 values. Any of these may hold only the
# kept half of a 2:4 sparse weight, located through its bitmask (`pack_sparse24`): the tile
# decode maps each dense column to its stored one, so the GEMV reads half the weight bytes.
# Scales are looked up per element, so any group size, per-channel included, and any K work,
# with no alignment between blocks and groups required.

import os  # noqa: E402

import triton  # noqa: E402  (compressors/__init__.py picked the interpreter if there is no GPU)
import triton.language as tl  # noqa: E402
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: E402
from pipelines.errors import LmpressError  # noqa: E402


def check_triton_backend(device: torch.device) -> None:
    """On the CPU the kernels need Triton's interpreter, which only works when it was chosen
    before anything imported triton."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise LmpressError(
            "Triton kernels on the CPU need its interpreter: set TRITON_INTERPRET=1, or import lmpress before "
            "transformers/bitsandbytes/triton"
        )


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def pdl_launch(device: torch.device) -> dict:
    """The grid kernels' launch settings for programmatic dependent launch (PDL: CUDA, compute
    capability 9.0 or newer; LMPRESS_PDL=0 turns it off), or none. A kernel launched so may
    start while the one before it in the stream is still running, so it must read nothing that
    kernel may write, nor write anything, until griddepcontrol.wait returns (`_await_inputs`).
    Why: a batch-1 layer is a few microseconds of streamed weights. Fitted over two layer sizes
    on an H100, the served GEMV took a fixed 3.2 us a call (its launch, the first loads' round
    trip, the last wave) plus the bytes at 2.35 TB/s (benchmarks/results/gemv_stages_h100.md):
    that fixed part, which PDL lets overlap the previous kernel's tail, is what keeps batch 1
    short of 3x fp16."""
    if device.type != "cuda" or os.environ.get("LMPRESS_PDL") == "0":
        return {}
    hopper_or_newer = _capability(device.index if device.index is not None else torch.cuda.current_device())[0] >= 9
    return {"PDL": True, "launch_pdl": True} if hopper_or_newer else {}


KERNEL_BITS = (2, 3, 4, 8, 16)  # 16: fp16 values (2:4 sparse weights that are not quantized)


@triton.jit
def _weight_tile(packed_ptr, table_ptr, zero_ptr, bitmask_ptr, rn, rk, N, K, stride_pn, stride_tn, stride_zn, stride_bn, group_size,
                 BITS: tl.constexpr, CODEBOOK: tl.constexpr, HAS_ZERO: tl.constexpr, SPARSE24: tl.constexpr):
    """Weights [BLOCK_N, BLOCK_K] (fp32) of rows rn and columns rk, zero outside the matrix."""
    inside = (rn[:, None] < N) & (rk[None, :] < K)
    column = rk[None, :]  # the stored column holding w[n, k]
    if SPARSE24:  # 2:4: row n stores the kept values of each group of 4 in order; bit k of its mask says if k is kept
        byte = tl.load(bitmask_ptr + rn[:, None] * stride_bn + rk[None, :] // 8, mask=inside, other=0).to(tl.int32)
        nibble = (byte >> (((rk[None, :] // 4) % 2) * 4)) & 15
        slot = rk[None, :] % 4
        below = nibble & ((1 << slot) - 1)  # kept slots before this one in its group
        inside = inside & (((nibble >> slot) & 1) == 1)
        column = (rk[None, :] // 4) * 2 + (below & 1) + ((below >> 1) & 1) + ((below >> 2) & 1)
    if BITS == 16:  # fp16 values, stored as they are
        value = tl.load(packed_ptr + rn[:, None] * stride_pn + column, mask=inside, other=0.0).to(tl.float32)
    else:
        code = _codes_at(packed_ptr, rn, column, inside, stride_pn, BITS)
        if CODEBOOK:
            value = tl.load(table_ptr + rn[:, None] * stride_tn + code, mask=inside, other=0.0).to(tl.float32)
        else:
            group = column // group_size
            q = _exact_codes(code, False) - (1 << (BITS - 1))
            if HAS_ZERO:
                q -= tl.load(zero_ptr + rn[:, None] * stride_zn + group, mask=inside, other=0).to(tl.float32)
            value = q * tl.load(table_ptr + rn[:, None] * stride_tn + group, mask=inside, other=0.0).to(tl.float32)
    return value


@triton.jit
def _codes_at(packed_ptr, rn, column, inside, stride_pn, BITS: tl.constexpr):
    """Unsigned codes of rows rn at stored columns `column`, one word load per code."""
    position = column * BITS
    offset = (position % 32).to(tl.uint32)
    row = packed_ptr + rn[:, None] * stride_pn + position // 32
    code = tl.load(row, mask=inside, other=0).to(tl.uint32, bitcast=True) >> offset
    if 32 % BITS != 0:  # codes straddling two words take their high bits from the next one
        spill = inside & (offset + BITS > 32)
        high = tl.load(row + 1, mask=spill, other=0).to(tl.uint32, bitcast=True)
        code = code | (high << ((32 - offset) % 32))
    return (code & ((1 << BITS) - 1)).to(tl.int32)


@triton.jit
def _dequantize_kernel(packed_ptr, table_ptr, zero_ptr, bitmask_ptr, out_ptr, N, K, stride_pn, stride_tn, stride_zn, stride_bn, stride_on, group_size,
                       BITS: tl.constexpr, CODEBOOK: tl.constexpr, HAS_ZERO: tl.constexpr, SPARSE24: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    w = _weight_tile(packed_ptr, table_ptr, zero_ptr, bitmask_ptr, rn, rk, N, K, stride_pn, stride_tn, stride_zn, stride_bn, group_size,
                         BITS, CODEBOOK, HAS_ZERO, SPARSE24)
    mask = (rn[:, None] < N) & (rk[None, :] < K)
    tl.store(out_ptr + rn[:, None] * stride_on + rk[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemv_kernel(x_ptr, packed_ptr, table_ptr, zero_ptr, bitmask_ptr, y_ptr, N, K, stride_pn, stride_tn, stride_zn, stride_bn, group_size,
                 BITS: tl.constexpr, CODEBOOK: tl.constexpr, HAS_ZERO: tl.constexpr, SPARSE24: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Batch 1 (decode): y[n] = sum_k x[k] w[n, k]; bound by reading the packed weights once."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
        w = _weight_tile(packed_ptr, table_ptr, zero_ptr, bitmask_ptr, rn, rk, N, K, stride_pn, stride_tn, stride_zn, stride_bn, group_size,
                         BITS, CODEBOOK, HAS_ZERO, SPARSE24)
        acc += tl.sum(w * x[None, :], axis=1)
    tl.store(y_ptr + rn, acc.to(y_ptr.dtype.element_ty), mask=rn < N)


@triton.jit
def _accumulate_dot(acc, a, b):
    """acc + a @ b on the tensor cores, the fp32 (decoded) operand cast to the other's dtype;
    fp32 activations multiply in full fp32 as torch's matmul does (Triton's default for them
    is tf32)."""
    if a.dtype == tl.float32 and b.dtype == tl.float32:
        acc += tl.dot(a, b, input_precision="ieee")
    elif a.dtype == tl.float32:
        acc += tl.dot(a.to(b.dtype), b)
    else:
        acc += tl.dot(a, b.to(a.dtype))
    return acc


@triton.jit
def _gemm_kernel(x_ptr, packed_ptr, table_ptr, zero_ptr, bitmask_ptr, y_ptr, M, N, K, stride_xm, stride_pn, stride_tn, stride_zn, stride_bn, stride_ym, group_size,
                 BITS: tl.constexpr, CODEBOOK: tl.constexpr, HAS_ZERO: tl.constexpr, SPARSE24: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Batches > 1: y[M, N] = x[M, K] @ w[N, K]^T, dequantizing each weight tile once per M block."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        w = _weight_tile(packed_ptr, table_ptr, zero_ptr, bitmask_ptr, rn, rk, N, K, stride_pn, stride_tn, stride_zn, stride_bn, group_size,
                         BITS, CODEBOOK, HAS_ZERO, SPARSE24)
        acc = _accumulate_dot(acc, x, tl.trans(w))
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@dataclass(frozen=True)
class PackedWeight:
    """One linear's weight [N, K] as stored: codes packed along K, decoded with fp16 scales
    [N, groups] (and int zero points [N, groups] for asymmetric grids) or, for codebook
    weights, a per-row fp16 codebook [N, 2^bits] (scale None); bits 16: fp16 values as they
    are. With a `bitmask` the weight is 2:4 sparse and only its kept half is stored (see
    `pack_sparse24`): K / 2 stored columns, groups counted over those."""

    packed: torch.Tensor  # int32 [N, ceil(stored * bits / 32)], or fp16 [N, stored] for bits 16
    scale: torch.Tensor | None  # [N, groups]
    bits: int
    columns: int  # K
    zero: torch.Tensor | None = None  # [N, groups], in code units: w = (q - zero) * scale
    codebook: torch.Tensor | None = None  # [N, 2^bits]
    bitmask: torch.Tensor | None = None  # uint8 [N, ceil(K / 8)]: 2:4 sparse
    interleaved: bool = False  # codes in the interleaved layout (`interleave_order`), for serving

    @property
    def stored_columns(self) -> int:
        return self.columns // 2 if self.bitmask is not None else self.columns

    @property
    def group_size(self) -> int | None:
        """In stored columns (a 2:4 weight's group of G inputs holds G / 2 stored values)."""
        return None if self.scale is None else self.stored_columns // self.scale.shape[1]

    @property
    def rows(self) -> int:
        return self.packed.shape[0]

    @property
    def kind(self) -> str:
        base = "fp16" if self.bits == 16 else "codebook" if self.codebook is not None else "asymmetric" if self.zero is not None else "symmetric"
        return f"2:4 {base}" if self.bitmask is not None else base

    def _map(self, fn) -> "PackedWeight":
        apply = lambda t: None if t is None else fn(t)  # noqa: E731
        return PackedWeight(
            apply(self.packed), apply(self.scale), self.bits, self.columns, apply(self.zero), apply(self.codebook), apply(self.bitmask),
            self.interleaved,
        )

    def to(self, device) -> "PackedWeight":
        return self._map(lambda t: t.to(device))

    def clone(self) -> "PackedWeight":
        return self._map(torch.clone)

    def first_rows(self, rows: int) -> "PackedWeight":
        """The weight of this linear's first `rows` outputs (every stored tensor is [N, ...])."""
        return self._map(lambda t: t[:rows])

    @property
    def nbytes(self) -> int:
        """Bytes stored (and read once by a GEMV)."""
        parts = (self.packed, self.scale, self.zero, self.codebook, self.bitmask)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def codes(self) -> torch.Tensor:
        """Signed codes [N, stored columns] in column order, on the weight's device (not for bits 16)."""
        codes = unpack_int32(self.packed, self.bits, self.stored_columns)
        return interleave_order(codes, unit_codes(self.bits), inverse=True) if self.interleaved else codes

    def can_interleave(self) -> bool:
        """Whether the interleaved layout serves this weight: one the whole-unit kernels take,
        not 2:4, in whole tiles of 4 units, each tile inside one group."""
        if self.bitmask is not None or not _takes_fast_grid(self):
            return False
        tile = INTERLEAVE_UNITS * unit_codes(self.bits)
        one_group = self.scale is None or self.scale.shape[1] == 1
        return self.columns % tile == 0 and (one_group or self.group_size % tile == 0)

    def interleave(self) -> "PackedWeight":
        """This weight in the interleaved layout (`interleave_order`), which only the whole-unit
        kernels read (`matmul_triton`); `dequantize_reference` and `codes` read both."""
        require(self.can_interleave() and not self.interleaved, "this weight has no interleaved layout")
        return self._repacked(interleaved=True)

    def unit_order(self) -> "PackedWeight":
        """This weight in the artifact's layout (itself unless interleaved): what writers store."""
        return self._repacked(interleaved=False) if self.interleaved else self

    def _repacked(self, interleaved: bool) -> "PackedWeight":
        """This weight's codes packed in the other layout, on its own device (no round trip through
        the CPU at serving time), REPACK_CODES codes' worth of rows at a time."""
        rows = max(1, REPACK_CODES // self.stored_columns)
        per_unit = unit_codes(self.bits)
        blocks = [
            pack_codes(interleave_order(unpack_int32(block, self.bits, self.stored_columns), per_unit, inverse=not interleaved), self.bits)
            for block in self.packed.split(rows)
        ]
        return replace(self, packed=torch.cat(blocks), interleaved=interleaved)

    @functools.cached_property
    def _launch(self) -> tuple:
        """(whether the whole-unit grid kernels take it, tensors, strides, constexpr flags) of
        `matmul_triton`'s launch, worked out once per weight: a served linear launches once a
        token, and re-deriving these each call was a third of lmpress' own host time a call
        (benchmarks/forward_overhead.py). A PackedWeight's tensors are never swapped in place
        (`replace` and `_map` make a new one), so the cache cannot go stale."""
        tensors, strides, flags = self._kernel_args()
        grid = _takes_fast_grid(self)
        if grid:
            one_group = self.scale is None or self.scale.shape[1] == 1  # codebooks have none
            flags = {key: value for key, value in flags.items() if key != "group_size"} | {"GROUP": 0 if one_group else self.group_size,
                                                                                           "INTERLEAVED": self.interleaved}
        return grid, tensors, strides, flags

    def _kernel_args(self) -> tuple:
        table = self.codebook if self.codebook is not None else self.scale if self.scale is not None else self.packed
        zero = self.zero if self.zero is not None else table  # an unused pointer still needs a tensor
        bitmask = self.bitmask if self.bitmask is not None else table
        tensors = (self.packed, table, zero, bitmask)
        return tensors, tuple(t.stride(0) for t in tensors), dict(
            group_size=self.group_size or 1, BITS=self.bits, CODEBOOK=self.codebook is not None, HAS_ZERO=self.zero is not None,
            SPARSE24=self.bitmask is not None,
        )


def spill_to_disk(weights: dict[str, PackedWeight], file: Path) -> None:
    """Write the weights to `file` (safetensors; `read_spilled` gives them back). A layer-by-
    layer stage keeps its finished layers there, not in memory, until it writes its artifact:
    its peak is then one layer's work, not the whole packed model, and no tensor it keeps is
    allocated among a layer's transients (where, kept, it would pin the heap)."""
    from safetensors.torch import save_file

    tensors, layout = {}, {}  # the tensor fields go in as tensors, the others (bits, columns) as metadata
    for name, weight in weights.items():
        values = {field.name: getattr(weight, field.name) for field in fields(weight)}
        tensors.update({f"{name}.{key}": value for key, value in values.items() if isinstance(value, torch.Tensor)})
        layout[name] = {key: value for key, value in values.items() if value is not None and not isinstance(value, torch.Tensor)}
    save_file(tensors, file, metadata={"layout": json.dumps(layout)})


def read_spilled(file: Path) -> dict[str, PackedWeight]:
    """The weights `spill_to_disk` wrote, their tensors memory maps of the file."""
    from safetensors import safe_open

    with safe_open(file, "pt") as stored:  # each tensor keeps the map alive after the file handle closes
        keys, layout = set(stored.keys()), json.loads(stored.metadata()["layout"])
        read = lambda key: stored.get_tensor(key) if key in keys else None  # noqa: E731
        return {
            name: PackedWeight(**{f.name: read(f"{name}.{f.name}") for f in fields(PackedWeight) if f.name not in other}, **other)
            for name, other in layout.items()
        }


def pack_sparse24(values: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' sparse-24-bitmask layout: the kept entries of each row in column
    order, [N, K / 2], and the mask packed 8 columns a byte, least significant bit first
    (numpy.packbits(..., bitorder="little")), [N, ceil(K / 8)]. `keep` must hold exactly 2 of
    every 4 columns. `values` may be weights or integer codes."""
    rows, columns = keep.shape
    require(
        columns % 4 == 0 and bool((keep.reshape(rows, -1, 4).sum(dim=2) == 2).all()),
        "a 2:4 weight keeps exactly 2 of every 4 inputs; prune it with --pattern 2:4 first",
    )
    return values[keep].reshape(rows, columns // 2), pack_bitmask(keep)


def pack_bitmask(keep: torch.Tensor) -> torch.Tensor:
    """A bool mask [N, K] as bytes [N, ceil(K / 8)], 8 columns a byte, least significant bit
    first (`unpack_bitmask` inverts it)."""
    rows, columns = keep.shape
    padded = torch.nn.functional.pad(keep, (0, -columns % 8)).reshape(rows, -1, 8).to(torch.int32)
    return (padded << torch.arange(8, dtype=torch.int32, device=keep.device)).sum(dim=2).to(torch.uint8)


def unpack_bitmask(bitmask: torch.Tensor, columns: int) -> torch.Tensor:
    """Torch reference: the keep mask [N, K] from its packed bytes."""
    bits = (bitmask.to(torch.int32)[:, :, None] >> torch.arange(8, dtype=torch.int32, device=bitmask.device)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :columns].bool()


def random_packed_weight(bits: int, rows: int, columns: int, group: int | None, kind: str = "symmetric", seed: int = 0) -> PackedWeight:
    """A random packed weight of any stored kind, for kernel tests and timings (a kernel's
    speed does not depend on the values). `kind`: symmetric or asymmetric grid with `group`
    inputs per scale (None or -1: one scale per row), codebook, or "2:4 <kind>": a random
    2-of-4 mask whose kept half is stored fp16 (bits 16) or on a grid over the kept half."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    g = torch.Generator().manual_seed(seed)
    if kind.startswith("2:4"):
        keep = (torch.rand(rows, columns // 4, 4, generator=g).argsort(dim=2) < 2).reshape(rows, columns)
        values, bitmask = pack_sparse24(torch.randn(rows, columns, generator=g).half(), keep)
        if bits == 16:
            return PackedWeight(values, None, 16, columns, bitmask=bitmask)
        half = None if group in (None, -1) else group // 2
        kept = random_packed_weight(bits, rows, columns // 2, half, kind.split()[1], seed + 1)
        return PackedWeight(kept.packed, kept.scale, bits, columns, kept.zero, bitmask=bitmask)
    codes = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (rows, columns), generator=g, dtype=torch.int8)
    if kind == "codebook":
        return PackedWeight(pack_to_int32(codes, bits), None, bits, columns, codebook=(torch.randn(rows, 1 << bits, generator=g) / 50).half())
    groups = 1 if group in (None, -1) else columns // group
    scale = (torch.rand(rows, groups, generator=g) * 0.02 + 0.001).half()
    zero = torch.randint(-3, 3, scale.shape, generator=g, dtype=torch.int8) if kind == "asymmetric" else None
    return PackedWeight(pack_to_int32(codes, bits), scale, bits, columns, zero)


def dequantize_reference(weight: PackedWeight) -> torch.Tensor:
    """Torch reference: fp32 weights [N, K]."""
    if weight.bits == 16:
        values = weight.packed.float()
    else:
        codes = weight.codes().long()
        if weight.codebook is not None:
            values = torch.gather(weight.codebook.float(), 1, codes + (1 << (weight.bits - 1)))
        else:
            expand = lambda t: t.float().repeat_interleave(weight.group_size, dim=1)  # noqa: E731
            zero = expand(weight.zero) if weight.zero is not None else 0.0
            values = (codes.float() - zero) * expand(weight.scale)
    if weight.bitmask is None:
        return values
    dense = torch.zeros(weight.rows, weight.columns, device=values.device)
    dense[unpack_bitmask(weight.bitmask, weight.columns)] = values.flatten()
    return dense


def matmul_reference(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    return (x.float() @ dequantize_reference(weight).T).to(x.dtype)


# On the CPU, 4-bit grids serve bf16 activations through torch's own int4 kernel
# (aten._weight_int4pack_mm_for_cpu, the one torchao's int4 weight-only CPU path calls), from its
# packed form: w = (u - 8) * scale + offset for unsigned codes u, a bf16 (scale, offset) pair a
# group. lmpress's signed codes q = u - 8 and w = (q - zero) * scale give offset = -zero * scale.
# It takes groups of 32, 64, 128 or 256 inputs and rows in multiples of 16; a larger group (per
# channel included) runs as its 256-, 128-, 64- or 32-wide parts, each with the group's scale,
# which is exact. Scales and offsets round to bf16, as every weight of a bf16 dense copy would.
CPU_INT4_GROUPS = (256, 128, 64, 32)
CPU_INT4_REPACK_CODES = 1 << 16  # codes repacked at a time (`cpu_int4`)


@dataclass(frozen=True)
class CpuInt4Weight:
    """A 4-bit grid in torch's CPU int4 layout (`cpu_int4`), ready for `matmul_cpu_int4`."""

    packed: torch.Tensor  # uint8 [N, K / 2], torch's own packing
    scales_and_offsets: torch.Tensor  # bf16 [K / group, N, 2]
    group: int


def cpu_int4_group(weight: PackedWeight) -> int | None:
    """The group torch's CPU int4 kernel runs `weight` in, or None where it cannot: not a 4-bit
    grid (codebook, 2:4, other widths), rows not a multiple of 16, groups not of 32 or more
    (a multiple of 32)."""
    if weight.bits != 4 or weight.scale is None or weight.codebook is not None or weight.bitmask is not None or weight.rows % 16:
        return None
    return next((group for group in CPU_INT4_GROUPS if weight.group_size % group == 0), None)


def cpu_int4(weight: PackedWeight, block_rows: int | None = None) -> CpuInt4Weight:
    """`weight` (one `cpu_int4_group` takes) repacked for torch's CPU int4 kernel, `block_rows`
    rows at a time (a multiple of 64; by default about CPU_INT4_REPACK_CODES codes): unpacked a
    whole layer at a time (some 20 bytes a code in passing), serving's first forward on
    SmolLM2-135M peaked 300-500 MB above where it settled, the allocator keeping the freed
    blocks. torch packs rows in blocks of 64 (then 32 and 16 at the tail), so parts of 64-row
    multiples concatenate."""
    group = cpu_int4_group(weight)
    require(group is not None, f"torch's CPU int4 kernel cannot run this {weight.bits}-bit {weight.kind} {weight.rows} x {weight.columns} weight")
    block_rows = block_rows or max(64, CPU_INT4_REPACK_CODES // weight.columns // 64 * 64)
    assert block_rows % 64 == 0, "torch's CPU int4 layout concatenates only in blocks of 64 rows"
    parts = lambda t: t.float().repeat_interleave(weight.group_size // group, dim=1).T  # noqa: E731  ([K / group, N])
    scale = parts(weight.scale)
    offset = -parts(weight.zero) * scale if weight.zero is not None else torch.zeros_like(scale)
    packed = torch.cat([
        torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight._map(lambda t: t[start : start + block_rows]).codes().to(torch.int32) + 8, 1)  # noqa: B023
        for start in range(0, weight.rows, block_rows)
    ])
    return CpuInt4Weight(packed, torch.stack([scale, offset], dim=-1).to(torch.bfloat16), group)


def matmul_cpu_int4(x: torch.Tensor, weight: CpuInt4Weight) -> torch.Tensor:
    """x [M, K] (bf16) @ W^T by torch's CPU int4 kernel. Against the fp32 dense copy the CPU
    otherwise serves from, it ran a 4-bit layer 1.23-1.43x faster at one row (SmolLM2's 576- and
    1536-wide layers) and 4.18x at 4096x4096, 0.89-1.09x as fast at 128 rows, its weight in an
    eighth of the bytes (benchmarks/results/cpu_serving.md)."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), weight.packed, weight.group, weight.scales_and_offsets)  # (it refuses strided x)


def dequantize_triton(weight: PackedWeight, dtype=torch.float16, block_n: int = 64, block_k: int = 64) -> torch.Tensor:
    check_triton_backend(weight.packed.device)
    assert not weight.interleaved, "the general kernels read codes in column order"
    out = torch.empty(weight.rows, weight.columns, dtype=dtype, device=weight.packed.device)
    tensors, strides, flags = weight._kernel_args()
    grid = (triton.cdiv(weight.rows, block_n), triton.cdiv(weight.columns, block_k))
    _dequantize_kernel[grid](*tensors, out, weight.rows, weight.columns, *strides, out.stride(0), **flags, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


# --------------------------------------------------------------------------- fast grid path
#
# The common serving case, a uniform grid of 2, 3, 4 or 8 bits or a codebook of 2 to 4 bits, and
# 2:4 weights on a grid of 2, 4 or 8 bits, gets kernels of its own. They work on units of whole
# codes: a 32-bit word, or for 3 bits three words holding 32 codes (codes 10 and 21 straddle
# two words), in tiles [BLOCK_N, UNITS]. Code j of every unit sits at the same bits, so the
# GEMV takes code j of all units at once, with shifts fixed at compile time: that slice is
# the columns j, j + CODES, j + 2 CODES, ... so it meets the matching strided slice of x, and
# a sum over k may run in that order. The GEMM spreads a unit's codes to column order. The
# words are loaded once each (the general tile above loads a word per code). A unit's codes
# share one group as long as the group size, in stored columns, is a multiple of the codes
# per unit (32 for 3 bits, 8 for 4 bits), per-channel included. A 2:4 word's codes are spread
# over the twice as many dense columns they stand for (`_sparse24_code`), zeros included, so
# the tile meets x's dense columns in order. A codebook's codes are looked up in their rows'
# tables with one load per code: 2^bits values a row stay in L1. (tl.gather from tables held
# in registers compiles to about 8 warp shuffles per code on sm_90, per
# benchmarks/kernel_sass.py.) On a GPU Triton's autotuner picks the launch shape per layer
# shape; the interpreter takes the first. Grids and codebooks (not 2:4) may also be served in
# the interleaved layout (`interleave_order`, INTERLEAVED): only which column a code stands for
# changes (`_code_columns`), and the GEMM puts its decoded tile back in column order
# (`_column_order`), which for 16-bit activations is a renaming of the registers its tensor-core
# fragments already hold.


def _tuned(kernel, configs: list, key: list[str]):
    """(kernel to launch, launch settings to pass): autotuned on a GPU; under the interpreter,
    where timing means nothing, or with LMPRESS_AUTOTUNE=0 (GPU tests, which need no timing and
    run every configuration by hand), the first configuration."""
    if os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("LMPRESS_AUTOTUNE") == "0":
        return kernel, dict(configs[0].kwargs)
    return triton.autotune(configs, key=key, prune_configs_by={"early_config_prune": _split_k_fits}, do_bench=_quick_bench)(kernel), {}


def _quick_bench(call, quantiles):
    """The tuner's timing of one launch shape: 25 ms of runs after 5 ms of warm-up, not Triton's
    100 after 25. These kernels take 5 to 100 us, so that is still over a hundred runs (each
    after an L2 flush), and each layer shape and kind a model serves should cost about 0.6 s of
    timing over the 19 GEMV launch shapes instead of 2.4 s (19 x 30 ms against 19 x 125 ms:
    arithmetic, not yet timed on a GPU)."""
    return triton.testing.do_bench(call, warmup=5, rep=25, quantiles=quantiles)


def _split_k(config: dict, **launch) -> "triton.Config":
    """A launch shape; with SPLIT_K > 1, slices of K run as separate programs whose partial sums
    are added atomically into y, so y is zeroed before each launch (the config's pre_hook).
    This fills the GPU when N / BLOCK_N programs alone would leave SMs idle. On sm_90 an fp16
    atomic add compiles to a compare-and-swap loop (fp32 to one REDG): the tuner's timing
    weighs that against the programs gained."""
    zero_y = (lambda args: args["y_ptr"].zero_()) if config["SPLIT_K"] > 1 else None
    return triton.Config(config, pre_hook=zero_y, **launch)


def _split_k_fits(configs: list, named_args: dict, **kwargs) -> list:
    """Split-K adds partial sums in y's dtype: fine in fp16 (11 bits) and fp32, too coarse in
    bf16 (8 bits), where only whole-K launches are tried."""
    if named_args["y_ptr"].dtype == torch.bfloat16:
        return [config for config in configs if config.kwargs["SPLIT_K"] == 1]
    return configs


@triton.jit
def _k_slice(total_units, UNITS: tl.constexpr, AXIS: tl.constexpr):
    """The units [start, end) that this program's slice of K covers: K's blocks of UNITS units
    shared out evenly among the programs along grid axis AXIS, which are never more than the
    blocks (`k_slices`), so no slice is empty. Saying so (tl.assume) lets the compiler drop the
    path that skips the loop: LLVM placed its zeroed accumulator after the loop, and ptxas then
    serialized every wgmma of the GEMM on sm_90 (C7515; benchmarks/kernel_sass.py --check)."""
    blocks = tl.cdiv(total_units, UNITS)
    index, slices = tl.program_id(AXIS), tl.num_programs(AXIS)
    start = index * blocks // slices * UNITS
    end = tl.minimum((index + 1) * blocks // slices * UNITS, total_units)
    tl.assume(end > start)
    return start, end


@triton.jit
def _write(pointers, values, mask, SPLIT_K: tl.constexpr):
    """Store a result, or with split-K add this slice's part to the zeroed output."""
    if SPLIT_K == 1:
        tl.store(pointers, values.to(pointers.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(pointers, values.to(pointers.dtype.element_ty), mask=mask, sem="relaxed")


# the 128-byte line at a pointer ($1) brought into L2: a hint, with no value and nothing to wait
# for (Triton has no prefetch of its own); $0, unused, because an inline asm needs a result
PREFETCH_L2 = "{\nprefetch.global.L2 [$1];\nmov.u32 $0, 0;\n}"
_PREFETCH_L2 = tl.constexpr(PREFETCH_L2)


@triton.jit
def _prefetch_l2(pointers):
    tl.inline_asm_elementwise(_PREFETCH_L2, "=r,l", [pointers], dtype=tl.int32, is_pure=False, pack=1)


@triton.constexpr_function
def _lines(words: int) -> int:
    """128-byte lines (32 words) to ask for to cover `words` from a line's start, as a power of 2."""
    return triton.next_power_of_2(triton.cdiv(words, 32))


@triton.jit
def _await_inputs(packed_ptr, table_ptr, zero_ptr, bitmask_ptr, rn, u0, N, stored, stride_pn, stride_tn, stride_zn, stride_bn,
                  GROUP: tl.constexpr, BITS: tl.constexpr, HAS_ZERO: tl.constexpr, SPARSE24: tl.constexpr,
                  UNITS: tl.constexpr, SPANS: tl.constexpr, CODES: tl.constexpr, PDL: tl.constexpr):
    """Launched as a programmatic dependent (PDL, `pdl_launch`), a program may start before the
    kernel ahead of it in the stream has finished. Until then it only prefetches into L2 the
    words of its first block (a line each 32 words) and the line of each row's first scales or
    codebook, zero points and 2:4 mask bytes, which serving never writes, so that the loop's
    first loads find them in L2 and not a device-memory round trip away; then it waits for that
    kernel (griddepcontrol.wait: complete, its writes visible) before it reads x or writes y,
    and lets the next kernel launch. Without PDL: nothing."""
    if PDL:
        rw = u0 * SPANS + tl.arange(0, _lines(UNITS * SPANS)) * 32
        inside = (rn[:, None] < N) & (rw[None, :] < tl.cdiv(stored * BITS, 32))
        _prefetch_l2(tl.where(inside, packed_ptr + rn[:, None] * stride_pn + rw[None, :], packed_ptr))
        group = u0 * CODES // GROUP if GROUP else 0
        _prefetch_l2(tl.where(rn < N, table_ptr + rn * stride_tn + group, table_ptr))
        if HAS_ZERO:
            _prefetch_l2(tl.where(rn < N, zero_ptr + rn * stride_zn + group, zero_ptr))
        if SPARSE24:  # a word's 2 * CODES dense columns take CODES / 4 mask bytes
            _prefetch_l2(tl.where(rn < N, bitmask_ptr + rn * stride_bn + u0 * (CODES // 4), bitmask_ptr))
        gdc_wait()
        gdc_launch_dependents()


@triton.constexpr_function
def unit_words(bits: int) -> int:
    """Words a unit of whole codes spans: one, or three for 3 bits (32 codes in 96 bits)."""
    assert bits in (2, 3, 4, 8), f"the grid kernels take 2, 3, 4 or 8-bit codes, not {bits}"
    return bits if 32 % bits else 1


@triton.constexpr_function
def unit_codes(bits: int) -> int:
    """Whole codes a unit holds."""
    return 32 * unit_words(bits) // bits


@triton.constexpr_function
def block_units(bits: int, words: int, sparse24: bool = False) -> int:
    """Units a block takes: WORDS words, or for 3 bits the columns of WORDS 4-bit words; 2:4
    weights half as many (each stored code stands for two dense columns)."""
    units = words // 4 if unit_words(bits) == 3 else words
    units = units // 2 if sparse24 else units
    assert units >= 1, f"a launch shape of {words} words leaves no whole unit of {bits}-bit codes"
    return units


@triton.jit
def _grid_words(packed_ptr, rn, u0, N, stored, stride_pn, BITS: tl.constexpr, UNITS: tl.constexpr, SPANS: tl.constexpr, i: tl.constexpr,
                EVEN: tl.constexpr):
    """Word i of each unit [BLOCK_N, UNITS] of rows rn from unit u0 on, zero outside the matrix.
    EVEN: the block lies inside the rows' words (`_whole_blocks`), so only rows are masked: a
    mask that varies along the words would keep the compiler from loading several at once."""
    rw = (u0 + tl.arange(0, UNITS)) * SPANS + i
    if EVEN:
        inside = rn[:, None] < N
    else:
        inside = (rn[:, None] < N) & (rw[None, :] < tl.cdiv(stored * BITS, 32))
    return tl.load(packed_ptr + rn[:, None] * stride_pn + rw[None, :], mask=inside, other=0)


@triton.jit
def _unit_words(packed_ptr, rn, u0, N, stored, stride_pn, BITS: tl.constexpr, UNITS: tl.constexpr, SPANS: tl.constexpr, EVEN: tl.constexpr = False):
    """A unit's words (the same tensor thrice when a unit is one word), loaded once each."""
    first = _grid_words(packed_ptr, rn, u0, N, stored, stride_pn, BITS, UNITS, SPANS, 0, EVEN)
    if SPANS == 3:
        second = _grid_words(packed_ptr, rn, u0, N, stored, stride_pn, BITS, UNITS, SPANS, 1, EVEN)
        third = _grid_words(packed_ptr, rn, u0, N, stored, stride_pn, BITS, UNITS, SPANS, 2, EVEN)
    else:
        second = first
        third = first
    return first, second, third


@triton.jit
def _unit_code(first, second, third, j: tl.constexpr, BITS: tl.constexpr):
    """Code j (unsigned) of every unit: bits [j * BITS, j * BITS + BITS) of its words, all
    positions known at compile time, so a code is a shift and a mask, and a straddling one
    (3 bits: codes 10 and 21) two shifts, two masks and an OR."""
    WORD: tl.constexpr = j * BITS // 32
    SHIFT: tl.constexpr = j * BITS % 32
    if WORD == 0:
        low = first
        high = second
    elif WORD == 1:
        low = second
        high = third
    else:
        low = third
        high = third
    code = low >> SHIFT  # arithmetic shift: the mask below drops the copied sign bits
    if SHIFT + BITS > 32:
        code = (code & ((1 << (32 - SHIFT)) - 1)) | (high << (32 - SHIFT))
    return code & ((1 << BITS) - 1)


@triton.jit
def _unit_codes(first, second, third, BITS: tl.constexpr, CODES: tl.constexpr, SPANS: tl.constexpr):
    """Every code of every unit [BLOCK_N, UNITS, CODES] (unsigned), in column order."""
    bit = tl.arange(0, CODES) * BITS
    if SPANS == 1:
        codes = (first[:, :, None] >> bit[None, None, :]) & ((1 << BITS) - 1)
    else:  # each position's word and shift follow from its index; a straddling code takes its high bits from the next word
        bit = bit[None, None, :]
        low = tl.where(bit < 32, first[:, :, None], tl.where(bit < 64, second[:, :, None], third[:, :, None]))
        high = tl.where(bit < 32, second[:, :, None], third[:, :, None])
        shift = bit % 32
        codes = low.to(tl.uint32, bitcast=True) >> shift
        codes = tl.where(shift + BITS > 32, codes | (high.to(tl.uint32, bitcast=True) << ((32 - shift) % 32)), codes)
        codes = (codes & ((1 << BITS) - 1)).to(tl.int32, bitcast=True)
    return codes


@triton.jit
def _sparse24_keep(bitmask_ptr, rn, u0, N, K, stride_bn, BITS: tl.constexpr, UNITS: tl.constexpr):
    """2:4: the keep bits of the 2 * CODES dense columns each word [BLOCK_N, UNITS] stands
    for (bit d: column d kept), from their mask bytes."""
    DENSE: tl.constexpr = 2 * unit_codes(BITS)
    rw = u0 + tl.arange(0, UNITS)
    keep = tl.zeros((rn.shape[0], UNITS), dtype=tl.int32)
    for b in tl.static_range(DENSE // 8):
        byte = rw * (DENSE // 8) + b
        inside = (rn[:, None] < N) & (byte[None, :] < tl.cdiv(K, 8))
        keep |= tl.load(bitmask_ptr + rn[:, None] * stride_bn + byte[None, :], mask=inside, other=0).to(tl.int32) << (8 * b)
    return keep


@triton.jit
def _sparse24_code(word, keep, d, BITS: tl.constexpr):
    """2:4: the unsigned code at dense column d of each word, and whether d is kept (else the
    weight is zero). d is a constant (the GEMV's loop) or positions broadcast against the words
    (the GEMM's tile). Dense group g of 4 columns holds stored codes 2g and 2g + 1: a kept
    column takes the second if a kept column lies below it in its group. Both candidates sit at
    bits that follow from d alone: with a constant d a column costs two fixed shifts, two mask
    tests and a select (the general tile loads a mask byte, a word and x per column and
    counts kept bits by hand)."""
    group = keep >> (d // 4 * 4)
    kept = ((group >> (d % 4)) & 1) != 0
    second = (group & ((1 << (d % 4)) - 1)) != 0
    code = tl.where(second, word >> ((d // 4 * 2 + 1) * BITS), word >> (d // 4 * 2 * BITS)) & ((1 << BITS) - 1)
    return code, kept


@triton.jit
def _code_columns(units, j, CODES: tl.constexpr, INTERLEAVED: tl.constexpr):
    """The column that code j of each unit stands for: u * CODES + j in unit order; in the
    interleaved layout (`interleave_order`; 4 = INTERLEAVE_UNITS) column 8 p + 2 (u % 4) + b
    of the unit's tile of 4, where j = p + b * CODES / 2."""
    if INTERLEAVED:
        HALF: tl.constexpr = CODES // 2
        columns = units // 4 * (4 * CODES) + 8 * (j % HALF) + 2 * (units % 4) + j // HALF
    else:
        columns = units * CODES + j
    return columns


@triton.jit
def _column_order(tile, INTERLEAVED: tl.constexpr):
    """A decoded tile [BLOCK_N, UNITS, COLUMNS] as [BLOCK_N, UNITS * COLUMNS] in column order;
    interleaved (`interleave_order`): each tile of 4 units [q, b, p] put back as [p, q, b]. With
    16-bit weights that is a relabelling of the registers the tensor cores read, no data moves."""
    rows: tl.constexpr = tile.shape[0]
    units: tl.constexpr = tile.shape[1]
    codes: tl.constexpr = tile.shape[2]
    if INTERLEAVED:
        tile = tl.permute(tl.reshape(tile, (rows, units // 4, 4, 2, codes // 2)), (0, 1, 4, 2, 3))
    return tl.reshape(tile, (rows, units * codes))


@triton.jit
def _x_at(x_ptr, columns, K, EVEN: tl.constexpr):
    """x at the given columns as fp32, 0 past K (EVEN: none is, so no mask to split the loads)."""
    if EVEN:
        x = tl.load(x_ptr + columns)
    else:
        x = tl.load(x_ptr + columns, mask=columns < K, other=0.0)
    return x.to(tl.float32)


@triton.constexpr_function
def group_units(group: int, codes: int, units: int) -> int:
    """Consecutive units of a block that share one load of scales: a run inside one group
    (`group` stored columns, 0 for one group a row) that divides the block's `units`, so runs
    start where blocks do; at most a quarter of the block, since on sm_90 loads of 4 runs a row
    compiled to the fewest instructions of 1, 2, 4 or 8 (benchmarks/kernel_sass.py --gemm-layouts)."""
    return min(units if group == 0 else math.gcd(units, group // codes), max(1, units // 4))


@triton.jit
def _group_scales(scale_ptr, zero_ptr, rn, u0, N, stored, stride_sn, stride_zn, GROUP: tl.constexpr, BITS: tl.constexpr, HAS_ZERO: tl.constexpr,
                  UNITS: tl.constexpr, CODES: tl.constexpr):
    """Per unit [BLOCK_N, UNITS] the scale and the offset (2^(bits-1) + zero point) of the
    group it lies in: value = (code - offset) * scale (GROUP a constant: finding the group is a
    shift, not a division, about 20 instructions a unit on sm_90). One load per run of units in
    one group (`group_units`), spread to its units in registers; a load per unit cost the int4
    loops 6 to 23% more instructions on sm_90 (kernel_sass.py --gemv-layouts, --gemm-layouts).
    Either layout: an interleaved tile of 4 units lies inside one group."""
    SHARED: tl.constexpr = group_units(GROUP, CODES, UNITS)
    first_column = (u0 + tl.arange(0, UNITS // SHARED) * SHARED) * CODES
    inside = (rn[:, None] < N) & (first_column[None, :] < stored)
    group = first_column[None, :] // GROUP if GROUP else tl.zeros_like(first_column)[None, :]
    scale = tl.load(scale_ptr + rn[:, None] * stride_sn + group, mask=inside, other=0.0).to(tl.float32)
    offset = tl.zeros_like(scale) + (1 << (BITS - 1))
    if HAS_ZERO:
        offset += tl.load(zero_ptr + rn[:, None] * stride_zn + group, mask=inside, other=0).to(tl.float32)
    return _spread(scale, SHARED), _spread(offset, SHARED)


@triton.jit
def _spread(values, SHARED: tl.constexpr):
    """Per run [BLOCK_N, RUNS] -> per unit [BLOCK_N, RUNS * SHARED]: each run's value for its units."""
    rows: tl.constexpr = values.shape[0]
    runs: tl.constexpr = values.shape[1]
    return tl.reshape(tl.broadcast_to(values[:, :, None], (rows, runs, SHARED)), (rows, runs * SHARED))


@triton.jit
def _exact_codes(codes, FP16: tl.constexpr):
    """Unsigned integer codes (< 2^10) as exact floats, by integer logic and one float
    subtraction instead of a conversion instruction. OR-ing the code into the low mantissa bits
    of 2^23 (fp16: 2^10) makes the float 2^23 + code exactly (the "magic number" decode of
    FasterTransformer and Marlin). Where ptxas would emit I2F, which GPUs issue at 16 a clock
    per SM against 64 to 128 FMAs (the CUDA guide's throughput table), this removes it: the
    GEMM's decoded tiles lose all of theirs on sm_90 (benchmarks/kernel_sass.py counts them)."""
    if FP16:  # one return: compiled Triton would also type the return after a static branch
        value = (codes | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0
    else:
        value = (codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    return value


# The 4-bit GEMV's decode on a GPU, in PTX: Triton has no packed half2 arithmetic, and decoding
# one code per fp32 operation (`_exact_codes`) costs a shift, a mask, an OR and a subtraction a
# code. Here lop3 drops two codes at once into the low mantissa bits of a half2 of 1024s
# (0x6400: the "magic number" decode of FasterTransformer and Marlin), so one sub / fma per
# half2 gives two codes minus the offset 8, exactly; the halves widen to fp32 and multiply x in
# fp32, so the sum is the fp32 path's. Pairs are (code c, code c + 4): h0 = codes 0 and 4
# (bits 0-3, 16-19), h1 = 1 and 5 (times 16, bits 4-7 and 20-23: scaled back by 1/16 and
# offset by 64 + 8 = 72), h2 / h3 the same of the word shifted right by 8. Constants: 0x6408 =
# 1032.0, 0x2c00 = 1/16, 0xd480 = -72.0 (fp16). Measured on an H100 against the fp32 path at
# its best launch: 4096x4096 10.8 -> 8.4 us, 4096x14336 25.1 -> 20.6, 14336x4096 24.7 -> 21.9
# (benchmarks/gemv_variants.py, mode 1). The interpreter, which cannot run PTX, takes
# `_centered_dot4`, the same sum in Triton.
HALF2_NIBBLES4 = """
    shr.u32 t, $1, 8;
    lop3.b32 h0, $1, 0x000f000f, 0x64006400, 0xea;
    lop3.b32 h1, $1, 0x00f000f0, 0x64006400, 0xea;
    lop3.b32 h2, t, 0x000f000f, 0x64006400, 0xea;
    lop3.b32 h3, t, 0x00f000f0, 0x64006400, 0xea;
"""  # the word $1's codes under 1024s: h0 = (1024 + code 0, 1024 + code 4), h1 = (1024 + 16 code 1, ...), h2 / h3 of codes 2, 6 / 3, 7
HALF2_DECODE4 = """
    mov.b32 c1, 0x64086408;
    mov.b32 c2, 0x2c002c00;
    mov.b32 c3, 0xd480d480;""" + HALF2_NIBBLES4 + """    sub.f16x2 h0, h0, c1;
    fma.rn.f16x2 h1, h1, c2, c3;
    sub.f16x2 h2, h2, c1;
    fma.rn.f16x2 h3, h3, c2, c3;
"""  # the word $1 -> (code - 8) as half2 h0..h3 (registers t, h0-h3, c1-c3 declared by the caller)
_DOT4_PTX = tl.constexpr("""{
    .reg .b32 t, h0, h1, h2, h3, c1, c2, c3;
    .reg .b16 l0, u0, l1, u1, l2, u2, l3, u3;
    .reg .f32 f0, f1, f2, f3, f4, f5, f6, f7;""" + HALF2_DECODE4 + """
    mov.b32 {l0, u0}, h0;
    mov.b32 {l1, u1}, h1;
    mov.b32 {l2, u2}, h2;
    mov.b32 {l3, u3}, h3;
    cvt.f32.f16 f0, l0;
    cvt.f32.f16 f4, u0;
    cvt.f32.f16 f1, l1;
    cvt.f32.f16 f5, u1;
    cvt.f32.f16 f2, l2;
    cvt.f32.f16 f6, u2;
    cvt.f32.f16 f3, l3;
    cvt.f32.f16 f7, u3;
    mul.f32 $0, f0, $2;
    fma.rn.f32 $0, f1, $3, $0;
    fma.rn.f32 $0, f2, $4, $0;
    fma.rn.f32 $0, f3, $5, $0;
    fma.rn.f32 $0, f4, $6, $0;
    fma.rn.f32 $0, f5, $7, $0;
    fma.rn.f32 $0, f6, $8, $0;
    fma.rn.f32 $0, f7, $9, $0;
}""")


# The GEMM's decode of 4- and 8-bit words on a GPU: a word's codes to fp16 weights, (code -
# offset) * scale, two at a time. 4 bits: `HALF2_DECODE4` gives pairs (code j, code j + 4)
# minus 8; 8 bits: prmt drops bytes 0 and 2 (1 and 3) under 0x64 bytes, 1024 + code as half2,
# and a half2 subtraction of 1024 + 128 leaves code - 128. Both exact; then a half2
# subtraction takes the zero point (asymmetric; exact: integers below 2^11) and a half2
# multiply applies the scale, rounding once as the Triton path's fp16 product does, so the tile
# is the same to the bit. For 4 bits about 13 instructions a word where Triton's decode takes a
# shift, a mask, a bit-or, a packing move and two fp16 operations a code
# (benchmarks/kernel_sass.py --gemm-layouts). Outputs $0..$(n - 1): the word's n codes in
# order; inputs: $n the scale, $(n + 1) the zero point (fp16), $(n + 2) the word.
HALF2_DECODE8 = """
    mov.b32 c1, 0x64806480;
    prmt.b32 h0, $1, 0x64646464, 0x4240;
    prmt.b32 h1, $1, 0x64646464, 0x4341;
    sub.f16x2 h0, h0, c1;
    sub.f16x2 h1, h1, c1;
"""  # the word $1 -> (code - 128) as half2 h0 (codes 0, 2), h1 (codes 1, 3)


def _prmt(dest: str, a: str, b: str, picks: list[tuple[int, int]]) -> str:
    """prmt: byte i of dest is byte picks[i][1] of a (picks[i][0] = 0) or of b (1)."""
    selector = sum((4 * source + byte) << (4 * i) for i, (source, byte) in enumerate(picks))
    return f"    prmt.b32 {dest}, {a}, {b}, {selector:#06x};\n"


def _half2_decode3(words: list[str]) -> str:
    """3 bits: a unit's 32 codes run through its 3 words (code j at bit 3 j of the 96; codes 10
    and 21 straddle words), so no shift of one word reaches them all. But codes j and j + 16 lie
    48 bits apart: a prmt that puts run bytes {b, b + 1} in the low half of x_b and {b + 6, b + 7}
    in the high half places both at the same bit k = 3 j - 8 b of their halves, and with
    b = floor(3 j / 8) every k is at most 7, inside the fp16 mantissa. Then, as for 4 bits, lop3
    under 0x6400 makes 1024 + 2^k code per half and one fma by 2^-k minus 2^(10-k) + 4 leaves
    code - 4, exactly: half2 h_j holds codes j and j + 16 (8 prmts, two where the four bytes
    span three words, and 16 lop3 and 16 fma for 32 codes). Registers y, x0-x5, m0-m7, c0-c7."""
    lines = []
    for b in range(6):
        run = [b, b + 1, min(b + 6, 11), min(b + 7, 11)]  # byte 12 is past the run: a filler whose bits no code uses
        low = b // 4
        far = [r for r in run if r // 4 != low]  # never empty: bytes b and b + 6 lie in different words
        if len({r // 4 for r in far}) == 1:
            high = far[0] // 4
            lines.append(_prmt(f"x{b}", words[low], words[high], [(int(r // 4 != low), r % 4) for r in run]))
        else:  # three words: the bytes past the first word gathered into y first
            near = far[0] // 4
            lines.append(_prmt("y", words[near], words[near + 1], [(int(r // 4 != near), r % 4) for r in far]))
            lines.append(_prmt(f"x{b}", words[low], "y", [(0, r % 4) if r // 4 == low else (1, far.index(r)) for r in run]))
    half = lambda value: struct.unpack("<H", struct.pack("<e", value))[0] * 0x10001  # noqa: E731  (fp16 bits, in both halves)
    for k in range(8):
        lines.append(f"    mov.b32 m{k}, {half(2.0 ** -k):#010x};\n    mov.b32 c{k}, {half(-(2.0 ** (10 - k) + 4)):#010x};\n")
    for j in range(16):
        b, k = divmod(3 * j, 8)
        lines.append(f"    lop3.b32 h{j}, x{b}, {(7 << k) * 0x10001:#010x}, 0x64006400, 0xea;\n    fma.rn.f16x2 h{j}, h{j}, m{k}, c{k};\n")
    return "".join(lines)


def _half2_decode_ptx(bits: int, zero: bool, scaled: bool = True) -> str:
    """scaled=False: code - 2^(bits - 1) itself (the scale operand unread), for the GEMV."""
    codes = unit_codes(bits)
    pairs = codes // 2  # pair i holds codes i and i + pairs
    if bits == 3:  # inputs: scale, zero point, the unit's three words
        decode = _half2_decode3([f"${codes + 2 + i}" for i in range(3)])
    else:
        decode = {4: HALF2_DECODE4, 8: HALF2_DECODE8}[bits].replace("$1", f"${codes + 2}")
    unzero = f"    mov.b32 z, {{${codes + 1}, ${codes + 1}}};\n" + "".join(f"    sub.f16x2 h{i}, h{i}, z;\n" for i in range(pairs))
    own = ["y", *(f"x{b}" for b in range(6)), *(f"m{k}" for k in range(8)), *(f"c{k}" for k in range(8))] if bits == 3 else ["t", "c1", "c2", "c3"]
    registers = ", ".join([f"h{i}" for i in range(max(pairs, 4))] + ["s", "z"] + own)
    return ("{\n    .reg .b32 " + registers + ";\n" + f"    mov.b32 s, {{${codes}, ${codes}}};\n" + decode
            + (unzero if zero else "")
            + "".join((f"    mul.rn.f16x2 h{i}, h{i}, s;\n" if scaled else "") + f"    mov.b32 {{${i}, ${i + pairs}}}, h{i};\n" for i in range(pairs)) + "}")


_DECODE4_PTX = tl.constexpr(_half2_decode_ptx(4, zero=False))
_DECODE4_ZERO_PTX = tl.constexpr(_half2_decode_ptx(4, zero=True))
_DECODE8_PTX = tl.constexpr(_half2_decode_ptx(8, zero=False))
_DECODE8_ZERO_PTX = tl.constexpr(_half2_decode_ptx(8, zero=True))
_DECODE3_PTX = tl.constexpr(_half2_decode_ptx(3, zero=False))
_DECODE3_ZERO_PTX = tl.constexpr(_half2_decode_ptx(3, zero=True))
_CENTERED3_PTX = tl.constexpr(_half2_decode_ptx(3, zero=False, scaled=False))


@triton.jit
def _in_code_order32(c, rows: tl.constexpr, units: tl.constexpr):
    """The 32 decoded codes c[j] [rows, units] of each 3-bit unit as a tile [rows, units, 32] in
    code order. Each join adds a new last axis, so in the reshape the first join's axis is the
    slowest and the last join's the fastest: the first joins pair codes 16 apart (one half2 of
    the decode each), the last pairs neighbours, and [.., a, b, d, e, f] holds code
    16 a + 8 b + 4 d + 2 e + f."""
    p0, p1, p2, p3 = tl.join(c[0], c[16]), tl.join(c[1], c[17]), tl.join(c[2], c[18]), tl.join(c[3], c[19])
    p4, p5, p6, p7 = tl.join(c[4], c[20]), tl.join(c[5], c[21]), tl.join(c[6], c[22]), tl.join(c[7], c[23])
    p8, p9, p10, p11 = tl.join(c[8], c[24]), tl.join(c[9], c[25]), tl.join(c[10], c[26]), tl.join(c[11], c[27])
    p12, p13, p14, p15 = tl.join(c[12], c[28]), tl.join(c[13], c[29]), tl.join(c[14], c[30]), tl.join(c[15], c[31])
    q0, q1, q2, q3 = tl.join(p0, p8), tl.join(p1, p9), tl.join(p2, p10), tl.join(p3, p11)
    q4, q5, q6, q7 = tl.join(p4, p12), tl.join(p5, p13), tl.join(p6, p14), tl.join(p7, p15)
    r0, r1, r2, r3 = tl.join(q0, q4), tl.join(q1, q5), tl.join(q2, q6), tl.join(q3, q7)
    return tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), (rows, units, 32))


@triton.jit
def _fp16_tile(codes, word, second, third, scale, offset, HALF2: tl.constexpr, HAS_ZERO: tl.constexpr, BITS: tl.constexpr):
    """The decoded tile [BLOCK_N, UNITS, CODES] in fp16, (code - offset) * scale with the
    unsigned codes [BLOCK_N, UNITS, CODES] and scale / offset per unit: code - offset is exact
    in fp16 and the product rounds once, as the fp32 product cast to fp16 did. HALF2 (3-, 4- or
    8-bit grids, on a GPU): decoded from the unit's words (word, second, third: `_unit_words`) in
    PTX (`_half2_decode_ptx`), the same values."""
    scale = scale.to(tl.float16)
    if HALF2:
        rows: tl.constexpr = word.shape[0]
        units: tl.constexpr = word.shape[1]
        zero = (offset - (1 << (BITS - 1))).to(tl.float16)
        if BITS == 3:
            c = tl.inline_asm_elementwise(
                _DECODE3_ZERO_PTX if HAS_ZERO else _DECODE3_PTX, "=h," * 32 + "h,h,r,r,r", [scale, zero, word, second, third],
                dtype=(tl.float16,) * 32, is_pure=True, pack=1)
            tile = _in_code_order32(c, rows, units)
        elif BITS == 4:
            c0, c1, c2, c3, c4, c5, c6, c7 = tl.inline_asm_elementwise(
                _DECODE4_ZERO_PTX if HAS_ZERO else _DECODE4_PTX, "=h,=h,=h,=h,=h,=h,=h,=h,h,h,r", [scale, zero, word],
                dtype=(tl.float16,) * 8, is_pure=True, pack=1)
            # join adds a last axis: [.., d, e, f] holds code 4 d + 2 e + f, so the reshape lists codes 0..7 in order
            tile = tl.reshape(tl.join(tl.join(tl.join(c0, c4), tl.join(c2, c6)), tl.join(tl.join(c1, c5), tl.join(c3, c7))), (rows, units, 8))
        else:
            c0, c1, c2, c3 = tl.inline_asm_elementwise(
                _DECODE8_ZERO_PTX if HAS_ZERO else _DECODE8_PTX, "=h,=h,=h,=h,h,h,r", [scale, zero, word],
                dtype=(tl.float16,) * 4, is_pure=True, pack=1)
            tile = tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), (rows, units, 4))  # [d, e]: code 2 d + e
    else:
        tile = (_exact_codes(codes, True) - offset.to(tl.float16)[:, :, None]) * scale[:, :, None]
    return tile


@triton.jit
def _split_code_order32(x):
    """x [UNITS, 32], code order in each unit, as 32 tensors [UNITS], x_j for code j: the
    inverse of `_in_code_order32` (each split takes the last, fastest axis: first neighbours,
    last the codes 16 apart)."""
    units: tl.constexpr = x.shape[0]
    s0, s1 = tl.split(tl.reshape(x, (units, 2, 2, 2, 2, 2)))  # [u, a, b, d, e, f]: code 16 a + 8 b + 4 d + 2 e + f
    r0, r2 = tl.split(s0)
    r1, r3 = tl.split(s1)
    q0, q4 = tl.split(r0)
    q1, q5 = tl.split(r1)
    q2, q6 = tl.split(r2)
    q3, q7 = tl.split(r3)
    p0, p8 = tl.split(q0)
    p1, p9 = tl.split(q1)
    p2, p10 = tl.split(q2)
    p3, p11 = tl.split(q3)
    p4, p12 = tl.split(q4)
    p5, p13 = tl.split(q5)
    p6, p14 = tl.split(q6)
    p7, p15 = tl.split(q7)
    c0, c16 = tl.split(p0)
    c1, c17 = tl.split(p1)
    c2, c18 = tl.split(p2)
    c3, c19 = tl.split(p3)
    c4, c20 = tl.split(p4)
    c5, c21 = tl.split(p5)
    c6, c22 = tl.split(p6)
    c7, c23 = tl.split(p7)
    c8, c24 = tl.split(p8)
    c9, c25 = tl.split(p9)
    c10, c26 = tl.split(p10)
    c11, c27 = tl.split(p11)
    c12, c28 = tl.split(p12)
    c13, c29 = tl.split(p13)
    c14, c30 = tl.split(p14)
    c15, c31 = tl.split(p15)
    return (c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15,
            c16, c17, c18, c19, c20, c21, c22, c23, c24, c25, c26, c27, c28, c29, c30, c31)


@triton.jit
def _centered_dot3(first, second, third, xs, PTX: tl.constexpr):
    """sum_j (code_j - 4) x_j over the 32 codes of each 3-bit unit [BLOCK_N, UNITS] (its words
    first, second, third), xs[j] [UNITS] (fp32). On a GPU the GEMM's PTX decode without the
    scale (`_CENTERED3_PTX`: code - 4, exact in fp16) replaces a shift, a mask (an OR for the two
    straddling codes) and two fp32 operations a code by about one instruction a code before the
    conversion and the fma; under the interpreter the same sum in Triton."""
    dot = tl.zeros(first.shape, dtype=tl.float32)
    if PTX:
        unread = tl.zeros(first.shape, dtype=tl.float16)  # the scale and zero point operands
        c = tl.inline_asm_elementwise(_CENTERED3_PTX, "=h," * 32 + "h,h,r,r,r", [unread, unread, first, second, third],
                                      dtype=(tl.float16,) * 32, is_pure=True, pack=1)
        for j in tl.static_range(32):
            dot += c[j].to(tl.float32) * xs[j][None, :]
    else:
        for j in tl.static_range(32):
            dot += (_exact_codes(_unit_code(first, second, third, j, 3), False) - 4.0) * xs[j][None, :]
    return dot


@triton.jit
def _centered_dot4(word, x0, x1, x2, x3, x4, x5, x6, x7, PTX: tl.constexpr):
    """sum_j (code_j - 8) x_j over the 8 codes of each 4-bit word [BLOCK_N, UNITS], x_j [UNITS]
    (fp32): in PTX on a GPU (`_DOT4_PTX`), in Triton under the interpreter, the same fp32 sum."""
    if PTX:
        shape: tl.constexpr = word.shape
        dot = tl.inline_asm_elementwise(
            _DOT4_PTX, "=f,r,f,f,f,f,f,f,f,f",
            [word, tl.broadcast_to(x0[None, :], shape), tl.broadcast_to(x1[None, :], shape), tl.broadcast_to(x2[None, :], shape),
             tl.broadcast_to(x3[None, :], shape), tl.broadcast_to(x4[None, :], shape), tl.broadcast_to(x5[None, :], shape),
             tl.broadcast_to(x6[None, :], shape), tl.broadcast_to(x7[None, :], shape)],
            dtype=tl.float32, is_pure=True, pack=1)
    else:
        dot = (_exact_codes(word & 15, False) - 8.0) * x0[None, :]
        dot += (_exact_codes((word >> 4) & 15, False) - 8.0) * x1[None, :]
        dot += (_exact_codes((word >> 8) & 15, False) - 8.0) * x2[None, :]
        dot += (_exact_codes((word >> 12) & 15, False) - 8.0) * x3[None, :]
        dot += (_exact_codes((word >> 16) & 15, False) - 8.0) * x4[None, :]
        dot += (_exact_codes((word >> 20) & 15, False) - 8.0) * x5[None, :]
        dot += (_exact_codes((word >> 24) & 15, False) - 8.0) * x6[None, :]
        dot += (_exact_codes((word >> 28) & 15, False) - 8.0) * x7[None, :]
    return dot


@triton.jit
def _grid_gemv_kernel(x_ptr, packed_ptr, table_ptr, zero_ptr, bitmask_ptr, y_ptr, N, K, stride_pn, stride_tn, stride_zn, stride_bn,
                      GROUP: tl.constexpr, BITS: tl.constexpr, HAS_ZERO: tl.constexpr, CODEBOOK: tl.constexpr, SPARSE24: tl.constexpr,
                      PTX: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_N: tl.constexpr, WORDS: tl.constexpr, SPLIT_K: tl.constexpr,
                      EVEN: tl.constexpr, STAGES: tl.constexpr = 1, PDL: tl.constexpr = False):
    """Batch 1. Grids: per unit, sum_j code_j x[k_j] in fp32, then (that - offset * sum_j x[k_j])
    * scale; 4-bit grids: sum_j (code_j - 8) x[k_j] (`_centered_dot4`; PTX: decoded in half2 on
    a GPU), minus zero * sum_j x[k_j] if asymmetric, times the scale; 3-bit grids the same with
    code_j - 4 (`_centered_dot3`). Codebooks (table_ptr):
    sum_j codebook[code_j] x[k_j]. 2:4 grids: per unit, sum over its dense columns of the kept
    (code - offset) x[k], times the scale. k_j: `_code_columns` (INTERLEAVED: the interleaved
    layout); 3- and 4-bit grids load the block's x in one contiguous run and split it by code, which
    on sm_90 took 1-25% off the unit-order loop against a strided load per code
    (benchmarks/kernel_sass.py --gemv-layouts). Program (i, s) covers rows block i over slice s of K.
    STAGES > 1: the loop's loads are copied STAGES - 1 blocks ahead into shared memory (cp.async;
    Triton pipelines loads that feed no tl.dot only when tl.range is told to). On an H100 that
    made unit order up to 1.16x faster at its best launch and interleaved 4-bit slower at every
    launch (benchmarks/results/gemv_stages_h100.md), so both kinds of launch are tuned."""
    SPANS: tl.constexpr = unit_words(BITS)
    CODES: tl.constexpr = unit_codes(BITS)
    UNITS: tl.constexpr = block_units(BITS, WORDS, SPARSE24)
    SHARE: tl.constexpr = 2 if SPARSE24 else 1  # dense columns per stored one
    stored = K // SHARE
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N, UNITS), dtype=tl.float32)
    start, end = _k_slice(tl.cdiv(stored, CODES), UNITS, AXIS=1)
    _await_inputs(packed_ptr, table_ptr, zero_ptr, bitmask_ptr, rn, start, N, stored, stride_pn, stride_tn, stride_zn, stride_bn,
                  GROUP, BITS, HAS_ZERO, SPARSE24, UNITS, SPANS, CODES, PDL)
    for u0 in tl.range(start, end, UNITS, num_stages=STAGES):
        u0 = tl.multiple_of(u0, UNITS)  # slices start at whole blocks: the words' alignment, for wide loads
        first, second, third = _unit_words(packed_ptr, rn, u0, N, stored, stride_pn, BITS, UNITS, SPANS, EVEN)
        units = u0 + tl.arange(0, UNITS)
        if CODEBOOK:
            for j in tl.static_range(CODES):
                x = _x_at(x_ptr, _code_columns(units, j, CODES, INTERLEAVED), K, EVEN)
                codes = _unit_code(first, second, third, j, BITS)
                value = tl.load(table_ptr + rn[:, None] * stride_tn + codes, mask=rn[:, None] < N, other=0.0)
                acc += value.to(tl.float32) * x[None, :]
        else:
            scale, offset = _group_scales(table_ptr, zero_ptr, rn, u0, N, stored, stride_tn, stride_zn, GROUP, BITS, HAS_ZERO, UNITS, CODES)
            codes_x = tl.zeros((BLOCK_N, UNITS), dtype=tl.float32)
            if SPARSE24:  # the offset per kept column, since which columns count differs by row
                keep = _sparse24_keep(bitmask_ptr, rn, u0, N, K, stride_bn, BITS, UNITS)
                for d in tl.static_range(2 * CODES):
                    x = _x_at(x_ptr, units * (2 * CODES) + d, K, EVEN)
                    code, kept = _sparse24_code(first, keep, d, BITS)
                    codes_x += tl.where(kept, _exact_codes(code, False) - offset, 0.0) * x[None, :]
            elif BITS == 4 or BITS == 3:  # the block's x in one contiguous run, split by code
                x = _x_at(x_ptr, u0 * CODES + tl.arange(0, UNITS * CODES), K, EVEN)
                if INTERLEAVED:
                    x = tl.permute(tl.reshape(x, (UNITS // 4, CODES // 2, 4, 2)), (0, 2, 3, 1))
                if BITS == 4:
                    x = tl.reshape(x, (UNITS, 2, 2, 2))  # code 4 a + 2 b + c
                    even, odd = tl.split(x)
                    x0, x2 = tl.split(even)
                    x1, x3 = tl.split(odd)
                    x0, x4 = tl.split(x0)
                    x2, x6 = tl.split(x2)
                    x1, x5 = tl.split(x1)
                    x3, x7 = tl.split(x3)
                    codes_x = _centered_dot4(first, x0, x1, x2, x3, x4, x5, x6, x7, PTX)
                    if HAS_ZERO:  # offset = 8 + zero point: the 8 is in the dot
                        codes_x -= (offset - 8.0) * (x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7)[None, :]
                else:
                    xs = _split_code_order32(tl.reshape(x, (UNITS, CODES)))
                    codes_x = _centered_dot3(first, second, third, xs, PTX)
                    if HAS_ZERO:  # offset = 4 + zero point: the 4 is in the dot
                        # x's sum from its 32 split parts, not tl.sum over the permuted, reshaped x:
                        # Triton 3.6 (the H100 image's) reduced that over the wrong lanes, off by
                        # order 1 (kernel_sass.py --check with 3.6 on PYTHONPATH; 3.9 is right)
                        x_sum = xs[0]
                        for j in tl.static_range(1, 32):
                            x_sum += xs[j]
                        codes_x -= (offset - 4.0) * x_sum[None, :]
            else:
                x_sum = tl.zeros((UNITS,), dtype=tl.float32)
                for j in tl.static_range(CODES):
                    x = _x_at(x_ptr, _code_columns(units, j, CODES, INTERLEAVED), K, EVEN)
                    codes_x += _exact_codes(_unit_code(first, second, third, j, BITS), False) * x[None, :]
                    x_sum += x
                codes_x -= offset * x_sum[None, :]
            acc += codes_x * scale
    _write(y_ptr + rn, tl.sum(acc, axis=1), rn < N, SPLIT_K)


@triton.jit
def _grid_gemm_kernel(x_ptr, packed_ptr, table_ptr, zero_ptr, bitmask_ptr, y_ptr, M, N, K, stride_xm, stride_pn, stride_tn, stride_zn, stride_bn,
                      stride_ym, M_BUCKET, GROUP: tl.constexpr, BITS: tl.constexpr, HAS_ZERO: tl.constexpr, CODEBOOK: tl.constexpr, SPARSE24: tl.constexpr,
                      PTX: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WORDS: tl.constexpr, SPLIT_K: tl.constexpr,
                      EVEN: tl.constexpr, PDL: tl.constexpr = False):
    """Batches > 1: y^T = w x^T, the decoded weight tile [BLOCK_N, UNITS * COLUMNS] (codes
    spread to column order; 2:4: to the dense columns, zeros included) being the tensor cores'
    first operand, which on Hopper may stay in registers. Measured on an H100 against splitting
    the tile by bit position (eight small products per tile) and against w as the second
    operand: this was fastest (benchmarks/results/kernel_speed.md). 4-bit words with fp16
    activations are decoded in half2 (PTX, `_fp16_tile`). In the interleaved layout each thread
    decodes whole words straight into its fragment; unit order sends the tile through shared
    memory to reorder it (benchmarks/results/gemm_layouts_sass.md). Program (i, j, s) covers
    slice s of K."""
    SPANS: tl.constexpr = unit_words(BITS)
    CODES: tl.constexpr = unit_codes(BITS)
    UNITS: tl.constexpr = block_units(BITS, WORDS, SPARSE24)
    COLUMNS: tl.constexpr = 2 * CODES if SPARSE24 else CODES  # dense columns a unit covers
    SHARE: tl.constexpr = 2 if SPARSE24 else 1  # dense columns per stored one
    stored = K // SHARE
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    start, end = _k_slice(tl.cdiv(stored, CODES), UNITS, AXIS=2)
    _await_inputs(packed_ptr, table_ptr, zero_ptr, bitmask_ptr, rn, start, N, stored, stride_pn, stride_tn, stride_zn, stride_bn,
                  GROUP, BITS, HAS_ZERO, SPARSE24, UNITS, SPANS, CODES, PDL)
    for u0 in range(start, end, UNITS):
        u0 = tl.multiple_of(u0, UNITS)  # slices start at whole blocks: the words' alignment, for wide loads
        first, second, third = _unit_words(packed_ptr, rn, u0, N, stored, stride_pn, BITS, UNITS, SPANS, EVEN)
        if SPARSE24:
            keep = _sparse24_keep(bitmask_ptr, rn, u0, N, K, stride_bn, BITS, UNITS)
            codes, kept = _sparse24_code(first[:, :, None], keep[:, :, None], tl.arange(0, 2 * CODES)[None, None, :], BITS)
        else:
            codes = _unit_codes(first, second, third, BITS, CODES, SPANS)
        if CODEBOOK:  # fp16 as stored; other activations take it as fp32, cast for the product as the general tile's are
            w = tl.load(table_ptr + rn[:, None, None] * stride_tn + codes, mask=rn[:, None, None] < N, other=0.0)
            if x_ptr.dtype.element_ty != tl.float16:
                w = w.to(tl.float32)
        else:
            scale, offset = _group_scales(table_ptr, zero_ptr, rn, u0, N, stored, stride_tn, stride_zn, GROUP, BITS, HAS_ZERO, UNITS, CODES)
            if x_ptr.dtype.element_ty == tl.float16:  # decode to fp16 directly
                w = _fp16_tile(codes, first, second, third, scale, offset, PTX and BITS != 2 and not SPARSE24, HAS_ZERO, BITS)
            else:
                w = (_exact_codes(codes, False) - offset[:, :, None]) * scale[:, :, None]
            if SPARSE24:
                w = tl.where(kept, w, 0.0)
        w = _column_order(w, INTERLEAVED)
        rk = u0 * COLUMNS + tl.arange(0, UNITS * COLUMNS)
        inside = rm[:, None] < M
        if not EVEN:  # (a mask that varies along K would split x's wide loads)
            inside = inside & (rk[None, :] < K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=inside, other=0.0)
        acc = _accumulate_dot(acc, w, tl.trans(x))
    _write(y_ptr + rm[:, None] * stride_ym + rn[None, :], tl.trans(acc), (rm[:, None] < M) & (rn[None, :] < N), SPLIT_K)


# Launch shapes for the autotuner to time (BLOCK_N, WORDS[, BLOCK_M], SPLIT_K; warps, stages). The
# first of each list is what the interpreter runs; tests run every one of them there. The GEMV's:
# small row blocks over long runs of words; on an H100 the tuner picked BLOCK_N 8 for every kind,
# and 8 x 128 words was the fastest int4 shape at all three layer shapes timed
# (benchmarks/results/gemv_int4_h100.md); then the 4 of 20 launches that copy blocks ahead
# (STAGES > 1) with the least time over the three layer shapes in unit order, the layout they sped
# up (benchmarks/results/gemv_stages_h100.md). The GEMM's: split-K shapes give a 4096-row layer
# more programs than an H100's 132 SMs (64 x 64, split 4: 256) to hide each one's latency.
GEMV_CONFIGS = [
    _split_k({"BLOCK_N": n, "WORDS": w, "SPLIT_K": split, "STAGES": stages}, num_warps=warps, num_stages=3)
    for n, w, split, warps, stages in [
        (16, 64, 1, 4, 1), (8, 128, 1, 4, 1), (4, 256, 1, 4, 1), (8, 256, 1, 8, 1), (4, 128, 1, 4, 1), (8, 64, 1, 4, 1), (2, 512, 1, 4, 1),
        (16, 128, 1, 4, 1), (32, 64, 1, 4, 1), (4, 512, 1, 4, 1), (8, 128, 2, 4, 1), (4, 256, 2, 4, 1), (8, 64, 4, 4, 1), (16, 64, 2, 4, 1),
        (4, 128, 4, 4, 1),
        (8, 128, 1, 4, 3), (16, 64, 1, 4, 3), (16, 128, 1, 4, 3), (8, 128, 1, 4, 2),
    ]
]
GEMM_CONFIGS = [
    _split_k({"BLOCK_M": m, "BLOCK_N": n, "WORDS": w, "SPLIT_K": split}, num_warps=warps, num_stages=stages)
    for m, n, w, split, warps, stages in [
        (16, 64, 16, 1, 4, 4), (16, 128, 16, 1, 4, 3), (16, 64, 32, 1, 4, 3), (32, 64, 16, 1, 4, 4), (32, 128, 32, 1, 8, 3),
        (64, 64, 16, 1, 4, 4), (64, 128, 32, 1, 8, 3), (16, 128, 32, 1, 8, 4),
        (16, 64, 16, 2, 4, 4), (16, 64, 32, 4, 4, 3), (16, 128, 32, 4, 8, 3), (32, 64, 16, 4, 4, 4), (64, 64, 16, 2, 4, 4), (64, 128, 32, 2, 8, 3),
        (64, 64, 16, 4, 4, 4),
    ]
]


def _k_blocks(K: int, meta: dict) -> tuple[int, bool]:
    """K's blocks for a launch shape (`meta`: BITS, WORDS, SPARSE24), and whether all are whole:
    stored columns in whole units, units in whole blocks."""
    sparse, codes = meta["SPARSE24"], unit_codes(meta["BITS"])
    stored = K // (2 if sparse else 1)
    units, block = triton.cdiv(stored, codes), block_units(meta["BITS"], meta["WORDS"], sparse)
    return triton.cdiv(units, block), stored % codes == 0 and units % block == 0


def _whole_blocks(args: dict) -> bool:
    """Whether every block of K is whole (slices start at block boundaries): then no word needs
    a mask along K."""
    return _k_blocks(args["K"], args)[1]


def k_slices(K: int, meta: dict) -> int:
    """Programs along K for a launch shape: SPLIT_K, or one a block where K has fewer blocks."""
    return min(meta["SPLIT_K"], _k_blocks(K, meta)[0])


_grid_gemv = triton.heuristics({"EVEN": _whole_blocks})(_grid_gemv_kernel)
_grid_gemm = triton.heuristics({"EVEN": _whole_blocks})(_grid_gemm_kernel)
# What the tuner's pick is kept per: the layer shape and every setting that changes the compiled
# code (EVEN follows from K). GROUP too: a searched plan serves several group sizes at one layer shape.
# PDL is passed only where on (`pdl_launch`): a key the call lacks is left out of it.
GEMV_KEY = ["N", "K", "GROUP", "BITS", "HAS_ZERO", "CODEBOOK", "SPARSE24", "PTX", "INTERLEAVED", "PDL"]
GEMM_KEY = ["N", "K", "M_BUCKET", "GROUP", "BITS", "HAS_ZERO", "CODEBOOK", "SPARSE24", "PTX", "INTERLEAVED", "PDL"]
_GEMV = _tuned(_grid_gemv, GEMV_CONFIGS, key=GEMV_KEY)
_GEMM = _tuned(_grid_gemm, GEMM_CONFIGS, key=GEMM_KEY)


def _takes_fast_grid(weight: PackedWeight) -> bool:
    """Whole codes per unit (a word; for 3 bits three words); on a grid, each unit within one
    group; codebooks of 2 to 4 bits (an 8-bit codebook's 256 fp16 entries a row would not
    stay in L1); 2:4 weights on grids of 2, 4 or 8 bits."""
    if weight.bits not in (2, 3, 4, 8) or (weight.bitmask is not None and (weight.codebook is not None or weight.bits == 3)):
        return False
    if weight.codebook is not None:
        return weight.bits <= 4
    return weight.scale.shape[1] == 1 or weight.group_size % unit_codes(weight.bits) == 0


def _grid_matmul(x: torch.Tensor, weight: PackedWeight, y: torch.Tensor, config: "triton.Config | None" = None) -> torch.Tensor:
    """The fast grid kernels: GEMV for one row of x, GEMM for more; autotuned, or with the given
    launch shape (one of GEMV_CONFIGS / GEMM_CONFIGS: how tests run each shape the tuner may pick)."""
    M, K = x.shape
    _, tensors, strides, flags = weight._launch
    flags = flags | pdl_launch(x.device)
    if config is None:
        kernel, settings = _GEMV if M == 1 else _GEMM
    else:
        kernel, settings = (_grid_gemv if M == 1 else _grid_gemm), config.all_kwargs()
        if config.pre_hook is not None:
            config.pre_hook({"y_ptr": y})
    if M == 1:
        grid = lambda meta: (triton.cdiv(weight.rows, meta["BLOCK_N"]), k_slices(K, meta))  # noqa: E731

        def grid_gemv(out: torch.Tensor, copy: PackedWeight = weight) -> torch.Tensor:  # `copy`: another copy of the weight, when timed
            _, copy_tensors, copy_strides, _ = copy._launch
            kernel[grid](x, *copy_tensors, out, weight.rows, K, *copy_strides, **flags, PTX=x.is_cuda, **settings)
            return out

        # fp16 int4 on CUDA: the Gluon GEMV where it timed faster for this layer (compressors/packed_int_gluon.py)
        launch = None if config is not None else packed_int_gluon.served_launch(x, weight, grid_gemv)
        return grid_gemv(y) if launch is None else packed_int_gluon.run(x, weight, y, launch)
    else:
        grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]), triton.cdiv(weight.rows, meta["BLOCK_N"]), k_slices(K, meta))  # noqa: E731
        kernel[grid](x, *tensors, y, M, weight.rows, K, x.stride(0), *strides, y.stride(0),
                     M_BUCKET=min(triton.next_power_of_2(M), 128), **flags, PTX=x.is_cuda, **settings)
    return y


def matmul_triton(x: torch.Tensor, weight: PackedWeight, block_m: int = 16, block_n: int = 64, block_k: int = 64, tune: bool = True) -> torch.Tensor:
    """x [M, K] @ dequantized(weight)^T, fused: the fast grid kernels where they apply, else the
    general tile kernels; a GEMV kernel serves M == 1. tune=False: the grid kernels launch their
    first launch shape instead of the autotuned one (a check of the decode, not a timing)."""
    M, K = x.shape
    require(K == weight.columns, f"x has {K} inputs; the weight takes {weight.columns}")  # the kernels would read past it or stop short
    if not x.is_cuda:
        check_triton_backend(x.device)
    x = x.contiguous()
    y = torch.empty(M, weight.rows, dtype=x.dtype, device=x.device)
    grid, tensors, strides, flags = weight._launch
    if grid:
        return _grid_matmul(x, weight, y, None if tune else (GEMV_CONFIGS if M == 1 else GEMM_CONFIGS)[0])
    assert not weight.interleaved, "the general kernels read codes in column order"
    if M == 1:
        _gemv_kernel[(triton.cdiv(weight.rows, block_n),)](
            x, *tensors, y, weight.rows, K, *strides, **flags, BLOCK_N=block_n, BLOCK_K=block_k,
        )
    else:
        _gemm_kernel[(triton.cdiv(M, block_m), triton.cdiv(weight.rows, block_n))](
            x, *tensors, y, M, weight.rows, K, x.stride(0), *strides, y.stride(0), **flags,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        )
    return y


from compressors import packed_int_gluon  # noqa: E402  (last: it takes its decode PTX from this module)
