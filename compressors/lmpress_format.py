"""lmpress's own packed format, for what compressed-tensors cannot carry: codebook weights
(SqueezeLLM) and asymmetric integer grids (whose packed zero points transformers 5.23 +
compressed-tensors 0.20 do not load back), mixed per linear in one artifact.

A HF model folder (config.json, tokenizer, model.safetensors). Tensors, per packed linear
`<name>`:
    <name>.weight             int32 [out, ceil(in * bits / 32)]: codes packed along the row as
                              in compressed-tensors' pack-quantized (compressors/packed_int.py);
                              under the dense weight's own key, so that stock transformers
                              stops with a size mismatch instead of loading a model with
                              random weights (it only warns about an unknown quant_method)
    <name>.weight_shape       int64 [2]
  codebook linears:
    <name>.weight_codebook    fp16 [out, 2^bits]: row n's values; a code is an index into it
  integer linears:
    <name>.weight_scale       fp16 [out, groups]
    <name>.weight_zero_point  int8 [out, groups] (asymmetric only): w = (q - zero) * scale
Every other tensor is stored dense, as saved by transformers. config.json carries
    "quantization_config": {"quant_method": "lmpress", "format": "lmpress-packed", "version": 1,
                            "modules": {<name>: {"kind": "codebook", "bits": 3} or
                                        {"kind": "int", "bits": 4, "group_size": 64, "symmetric": false}}}
lmpress's loader (`load_model`) builds the model and swaps in kernel-backed PackedLinear layers.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from compressors.packed_int import PackedWeight
from pipelines.errors import require

QUANT_METHOD = "lmpress"
FORMAT = "lmpress-packed"
VERSION = 1


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    return pack_to_int32(codes.to(torch.int8), bits)


def save_lmpress_packed(model: nn.Module, quantized: dict, folder: Path) -> None:
    """Write `model` with the given linears (full module names -> CodebookLinear or
    QuantizedLinear) stored packed, everything else dense."""
    from compressors.grid import QuantizedLinear

    require(bool(quantized), "nothing to quantize: every linear was skipped")
    state = dict(model.state_dict())
    modules = {}
    for name, q in quantized.items():
        rows, columns = (q.codes if isinstance(q, QuantizedLinear) else q.indices).shape
        state[f"{name}.weight_shape"] = torch.tensor([rows, columns])
        if isinstance(q, QuantizedLinear):
            state[f"{name}.weight"] = _pack(q.codes, q.spec.bits)
            state[f"{name}.weight_scale"] = q.scale.half()
            if not q.spec.symmetric:
                state[f"{name}.weight_zero_point"] = q.zero.to(torch.int8)
            modules[name] = {"kind": "int", "bits": q.spec.bits, "group_size": q.spec.group_size, "symmetric": q.spec.symmetric}
        else:  # CodebookLinear: indices stored as signed codes, the packer's convention
            state[f"{name}.weight"] = _pack(q.indices.to(torch.int16) - (1 << (q.bits - 1)), q.bits)
            state[f"{name}.weight_codebook"] = q.codebook.half()
            modules[name] = {"kind": "codebook", "bits": q.bits}
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
        f"{folder} holds lmpress format {settings.get('format')} v{settings.get('version')}; this lmpress reads {FORMAT} v{VERSION}",
    )
    weights = {}
    for name, module in settings["modules"].items():
        columns = int(tensors(f"{name}.weight_shape")[1])
        packed = tensors(f"{name}.weight")
        if module["kind"] == "codebook":
            weights[name] = PackedWeight(packed, None, module["bits"], columns, codebook=tensors(f"{name}.weight_codebook").half())
        else:
            zero = tensors(f"{name}.weight_zero_point") if not module["symmetric"] else None
            weights[name] = PackedWeight(packed, tensors(f"{name}.weight_scale").half(), module["bits"], columns, zero)
    return weights
