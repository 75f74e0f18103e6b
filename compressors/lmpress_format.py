"""lmpress's own packed format, for what compressed-tensors cannot carry: codebook weights
(SqueezeLLM) and 2:4 sparse weights, plain or quantized on a symmetric or asymmetric grid (the
compressed-tensors 0.20 release dropped its sparse compressors), mixed per linear. Dense
integer grids, asymmetric ones too, are compressed-tensors (compressors/packed_int.py).

A HF model folder (config.json, tokenizer, model.safetensors). Tensors, per packed linear
`<name>` of dense shape [out, in]:
    <name>.weight             the stored values, under the dense weight's own key so that stock
                              transformers stops with a size mismatch instead of loading a model
                              with random weights (it only warns about an unknown quant_method):
                              int32 [out, ceil(stored * bits / 32)], codes packed along the row
                              as in compressed-tensors' pack-quantized (compressors/packed_int.py),
                              or fp16 [out, stored] (bits 16: 2:4 sparse, not quantized)
    <name>.weight_shape       int64 [2]
  codebook linears:
    <name>.weight_codebook    fp16 [out, 2^bits]: row n's values; a code is an index into it
  integer linears:
    <name>.weight_scale       fp16 [out, groups]
    <name>.weight_zero_point  int8 [out, groups] (asymmetric only): w = (q - zero) * scale
  2:4 sparse linears (stored = in / 2, compressed-tensors' sparse-24-bitmask layout):
    <name>.weight_bitmask     uint8 [out, ceil(in / 8)]: bit k % 8 of byte k // 8 set where input k
                              is kept; the stored values are the kept ones, row by row in order
Every other tensor is stored dense, as saved by transformers. config.json carries
    "quantization_config": {"quant_method": "lmpress", "format": "lmpress-packed", "version": 2,
                            "modules": {<name>: {"bits": 3, "decode": "codebook"|"grid"|"fp16",
                                                 "group_size": 64, "symmetric": true, "sparse24": false}}}
(group_size counts dense input columns). lmpress's loader (`load_model`) builds the model and
swaps in kernel-backed PackedLinear layers.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from compressors.packed_int import PackedWeight, pack_codes, require_groups
from pipelines.errors import require

QUANT_METHOD = "lmpress"
FORMAT = "lmpress-packed"
VERSION = 2


def packed_weight(compressed) -> PackedWeight:
    """The stored form of a QuantizedLinear, CodebookLinear or PrunedLinear."""
    from compressors.grid import QuantizedLinear
    from compressors.packed_int import pack_sparse24
    from compressors.sparsegpt import PrunedLinear

    if isinstance(compressed, PrunedLinear):  # 2:4: only the kept half is stored
        q = compressed.quantized
        values, bitmask = pack_sparse24(compressed.weight.half() if q is None else q.codes, compressed.keep)
        if q is None:
            return PackedWeight(values, None, 16, compressed.keep.shape[1], bitmask=bitmask)
        zero = None if q.spec.symmetric else q.zero.to(torch.int8)
        return PackedWeight(pack_codes(values, q.spec.bits), q.scale.half(), q.spec.bits, compressed.keep.shape[1], zero, bitmask=bitmask)
    if isinstance(compressed, QuantizedLinear):
        zero = None if compressed.spec.symmetric else compressed.zero.to(torch.int8)
        return PackedWeight(pack_codes(compressed.codes, compressed.spec.bits), compressed.scale.half(), compressed.spec.bits, compressed.codes.shape[1], zero)
    # CodebookLinear: indices stored as signed codes, the packer's convention
    codes = compressed.indices.to(torch.int16) - (1 << (compressed.bits - 1))
    return PackedWeight(pack_codes(codes, compressed.bits), None, compressed.bits, codes.shape[1], codebook=compressed.codebook.half())


def save_lmpress_packed(model: nn.Module, packed: dict[str, PackedWeight], folder: Path) -> None:
    """Write `model` with the given linears (full module names -> their PackedWeight, see
    `packed_weight`) stored packed, everything else dense. The linears' own weights are not
    read (a stage may have released them)."""
    require(bool(packed), "nothing to compress: every linear was skipped")
    state = dict(model.state_dict())
    modules = {}
    for name, weight in packed.items():
        state[f"{name}.weight"] = weight.unit_order().packed
        state[f"{name}.weight_shape"] = torch.tensor([weight.rows, weight.columns])
        for suffix, tensor in (("scale", weight.scale), ("zero_point", weight.zero), ("codebook", weight.codebook), ("bitmask", weight.bitmask)):
            if tensor is not None:
                state[f"{name}.weight_{suffix}"] = tensor
        decode = "fp16" if weight.bits == 16 else "codebook" if weight.codebook is not None else "grid"
        modules[name] = {"bits": weight.bits, "decode": decode, "sparse24": weight.bitmask is not None}
        if decode == "grid":
            sparse = 2 if weight.bitmask is not None else 1
            modules[name].update(group_size=weight.group_size * sparse, symmetric=weight.zero is None)
    model.save_pretrained(folder, state_dict=state)
    config_file = Path(folder) / "config.json"
    config = json.loads(config_file.read_text())
    config["quantization_config"] = {"quant_method": QUANT_METHOD, "format": FORMAT, "version": VERSION, "modules": dict(sorted(modules.items()))}
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def is_lmpress_packed(config: dict) -> bool:
    return (config.get("quantization_config") or {}).get("quant_method") == QUANT_METHOD


def read_packed_weights(folder: Path, config: dict, tensors) -> dict[str, PackedWeight]:
    """Module name -> PackedWeight; `tensors(key)` reads one stored tensor."""
    settings = config["quantization_config"]
    require(
        settings.get("format") == FORMAT and settings.get("version") == VERSION,
        f"{folder} holds lmpress format {settings.get('format')} v{settings.get('version')}; this lmpress reads {FORMAT} v{VERSION}: re-run the stage that wrote it",
    )
    weights = {}
    for name, module in settings["modules"].items():
        optional = lambda suffix, wanted: tensors(f"{name}.weight_{suffix}") if wanted else None  # noqa: E731
        weights[name] = PackedWeight(
            tensors(f"{name}.weight"),
            optional("scale", module["decode"] == "grid"),
            module["bits"],
            int(tensors(f"{name}.weight_shape")[1]),
            optional("zero_point", module["decode"] == "grid" and not module["symmetric"]),
            optional("codebook", module["decode"] == "codebook"),
            optional("bitmask", module["sparse24"]),
        )
        if module["decode"] == "grid":
            require_groups(f"{name}.weight_scale", weights[name].scale, weights[name].columns, module["group_size"])
    return weights
