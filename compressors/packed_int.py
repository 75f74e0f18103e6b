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
