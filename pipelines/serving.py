"""Serve packed artifacts with their kernels, validate the kernels on the artifact's own
tensors, and generate text."""

from __future__ import annotations

import copy
import math
import shutil
from pathlib import Path

import torch

from pipelines.artifact import file_sha256, read_safetensors, require_keys, require_output_path, write_json, writing
from pipelines.errors import LmpressError, require
from pipelines.models import (
    LoadedModel, check_weight_files, config_json, cpu_multiplies_bf16, load_config, load_model, load_tokenizer, resolve_model, weight_files,
)

VALIDATION_FILE = "validation.json"
BATCHES = (1, 16, 64)
INTERPRETED_ROWS = 96  # under the interpreter: 6 GEMV row blocks of 16, 1.5 GEMM ones of 64 (a partial last block)
# largest relative error (against the output's largest magnitude) a kernel may show against its
# torch reference; fp16 accumulation over 14336 inputs stays near 1e-3
VALIDATION_TOLERANCE = 1e-2


def _grid_of(name: str, quantization_config: dict, folder: Path) -> dict:
    """The weights' settings of the config group that applies to packed linear `name`."""
    from compressors.packed_int import config_group_of

    group = config_group_of(name, quantization_config)
    require(group is not None, f"{folder}/config.json has no quantization config group that targets {name}, which is packed; restore the artifact's own config.json")
    return group["weights"]


def _group_size(grid: dict) -> int | None:
    """A config group's weights' group size; None per channel."""
    return grid.get("group_size") if grid.get("strategy") == "group" else None


def require_groups_in_order(folder: Path) -> None:
    """Refuse, in one line, a pack-quantized artifact whose `weight_g_idx` (a column's group,
    stored by llm-compressor's GPTQ with actorder="group") puts a linear's columns in groups out
    of order. lmpress' kernels read contiguous groups, and compressed-tensors 0.20, which removed
    that ordering, ignores the tensor: transformers would decode other weights without a word.
    A g_idx of contiguous groups is the stored order itself and loads."""
    from safetensors import safe_open

    folder = Path(folder)
    settings = config_json(folder).get("quantization_config") or {}
    for file in weight_files(folder):
        with safe_open(file, framework="pt") as handle:
            for key in (key for key in handle.keys() if key.endswith(".weight_g_idx")):
                name, g_idx = key.removesuffix(".weight_g_idx"), handle.get_tensor(key).long()
                group_size = _group_size(_grid_of(name, settings, folder))
                require(
                    torch.equal(g_idx, torch.arange(g_idx.numel()) // (group_size or g_idx.numel())),
                    f"{name} has its columns in groups out of order (weight_g_idx, GPTQ's actorder=\"group\"), which neither lmpress' "
                    "kernels nor compressed-tensors 0.20 decode: quantize with `lmpress quantize` (its --act-order keeps groups "
                    "contiguous) or with actorder=\"weight\"",
                )


def packed_weights(folder: Path) -> dict:
    """Module name -> PackedWeight, read straight from the files of a compressed-tensors
    pack-quantized artifact or an lmpress-packed one."""
    from safetensors import safe_open

    from compressors import lmpress_format
    from compressors.packed_int import FORMAT, PackedWeight, require_groups
    from pipelines.stages import COMPRESSED_FOLDER

    folder = Path(folder)
    config = config_json(folder)
    settings = config.get("quantization_config") or {}
    handles = {}
    for file in weight_files(folder):
        handle = safe_open(file, framework="pt")
        handles.update({key: handle for key in handle.keys()})

    def tensor(key: str) -> torch.Tensor:
        require(key in handles, f"{folder} has no tensor {key}; the artifact is damaged: re-create it")
        return handles[key].get_tensor(key)

    if lmpress_format.is_lmpress_packed(config):
        return lmpress_format.read_packed_weights(folder, config, tensor)
    require(
        settings.get("quant_method") != "bitsandbytes",
        f"{folder} is a bitsandbytes model: bitsandbytes' own kernels serve it, lmpress has none of its own to validate",
    )
    require(
        not (folder / COMPRESSED_FOLDER / "config.json").is_file(),
        f"{folder} is a pruning artifact; validate its served form, {folder / COMPRESSED_FOLDER}",
    )
    require(
        settings.get("quant_method") == "compressed-tensors" and settings.get("format") == FORMAT,
        f"{folder} is not a {FORMAT} compressed-tensors or {lmpress_format.FORMAT} artifact; quantize it with `lmpress quantize`",
    )
    require_groups_in_order(folder)
    weights = {}
    for key in sorted(k for k in handles if k.endswith(".weight_packed")):
        name = key.removesuffix(".weight_packed")
        grid, packed, columns = _grid_of(name, settings, folder), tensor(key), int(tensor(f"{name}.weight_shape")[1])
        bits, scale = grid["num_bits"], tensor(f"{name}.weight_scale").half()
        words = -(-columns * bits // 32)  # a row's codes, packed densely into int32 words
        require(
            packed.shape[1] == words,
            f"{key} holds {packed.shape[1]} words a row, not the {words} of {columns} {bits}-bit codes its config group gives it; "
            "restore the artifact's own config.json",
        )
        require_groups(f"{name}.weight_scale", scale, columns, _group_size(grid))
        weights[name] = PackedWeight(packed, scale, bits, columns, _zero_points(name, grid, packed.shape[0], scale, tensor, handles))
    return weights


def _zero_points(name: str, grid: dict, rows: int, scale: torch.Tensor, tensor, handles) -> torch.Tensor | None:
    """The linear's zero points unpacked, int8 [rows, groups], where its grid is asymmetric;
    None where it is symmetric (a zero point stored anyway is a config edited by hand)."""
    from compressors.packed_int import unpack_zero_points

    key = f"{name}.weight_zero_point"
    if grid.get("symmetric", True):
        require(key not in handles, f"{name} stores zero points but its config group is symmetric; restore the artifact's own config.json")
        return None
    packed, bits = tensor(key), grid["num_bits"]
    words = -(-rows * bits // 32)  # the zero points are packed down the columns
    require(
        packed.dtype == torch.int32 and tuple(packed.shape) == (words, scale.shape[1]),
        f"{key} is {packed.dtype} {list(packed.shape)}, not int32 {[words, scale.shape[1]]}: the {rows} x {scale.shape[1]} "
        f"{bits}-bit zero points packed down the columns; re-create the artifact",
    )
    return unpack_zero_points(packed, bits, rows)


def swap_in_packed_linears(model, weights: dict) -> None:
    """Replace each named linear by a kernel-backed PackedLinear holding its packed weight."""
    from compressors.kernels import PackedLinear

    for name, weight in weights.items():
        parent, child = name.rsplit(".", 1)
        module = model.get_submodule(parent)
        setattr(module, child, PackedLinear(weight, getattr(module, child).bias))


def dense_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A plain float copy of a model as loaded, quantized ones included: every packed or
    quantization-annotated linear becomes a fresh nn.Linear holding its (dequantized) weight,
    and the quantization config is gone, so the copy trains and saves as a plain checkpoint."""
    from compressors import packed_int
    from compressors.kernels import PackedLinear

    plain_model = copy.deepcopy(model)
    for name, module in list(plain_model.named_modules()):
        packed = isinstance(module, PackedLinear)
        if not packed and not (isinstance(module, torch.nn.Linear) and set(module.state_dict()) - {"weight", "bias"}):
            continue
        weight = packed_int.dequantize_reference(module.weight_packed) if packed else module.weight.detach()
        plain = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
        with torch.no_grad():
            plain.weight.copy_(weight)
            if module.bias is not None:
                plain.bias.copy_(module.bias)
        parent, child = name.rsplit(".", 1)
        setattr(plain_model.get_submodule(parent), child, plain)
    plain_model.hf_quantizer = None
    plain_model.config.__dict__.pop("quantization_config", None)
    return plain_model


def load_for_serving(spec: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> LoadedModel:
    """The model with every packed linear a kernel-backed PackedLinear, read from the files
    without a dense copy (`load_stored`), its other weights in `dtype`; a plain model as it is."""
    loaded = load_model(spec, dtype, packed=True)
    loaded.model.to(device)
    return loaded


SERVING_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def serving_dtype(name: str, device: str, speculative: bool = False) -> torch.dtype:
    """The activations' dtype `generate` serves in. `auto`: float16 on a GPU, the dtype the
    kernels are validated and timed in (the batch-1 Gluon GEMV serves only it); bfloat16 on a
    CPU that multiplies it natively (`cpu_multiplies_bf16`), where torch's int4 kernel serves
    4-bit grids from their packed form (`PackedLinear`; benchmarks/results/cpu_serving.md:
    GPTQ W4 decoded 2.45x faster than its fp32 dense copy, in 0.59x the memory); float32
    elsewhere, and for `speculative` decoding, which promises the target's own greedy text: it
    verifies the draft's tokens in one pass over several positions, and in bf16 that rounds
    otherwise than one token a pass (the pipeline's draft and W4 target diverged within 64 tokens;
    in fp32 they agreed)."""
    require(name in ("auto", *SERVING_DTYPES), f"--dtype must be auto, float32, bfloat16 or float16 (got '{name}'); pass e.g. --dtype auto")
    if name != "auto":
        return SERVING_DTYPES[name]
    if speculative:
        return torch.float32
    return torch.float16 if device == "cuda" else torch.bfloat16 if cpu_multiplies_bf16() else torch.float32


def validate(folder: Path, out: Path | None = None) -> dict:
    """Run each kernel on the artifact's own tensors against its torch reference at batch 1,
    16 and 64. On a GPU every packed linear is checked and timed against the dense fp16 layer;
    without one the kernels run in Triton's interpreter, which executes every program in
    Python, on the first INTERPRETED_ROWS rows of one linear of each distinct shape (all its
    columns, so every group and unit; several row blocks, the last one partial), and no speed
    is claimed. A report written into the artifact (no `out`) comes with the kernel sources it
    vouches for, bundled anew: an artifact validated again after a kernel change ships the
    kernels that were checked, not the ones it was made with."""
    gpu = torch.cuda.is_available()
    from compressors.kernels import KERNELS, serving_layout, weight_seconds

    folder = Path(folder).expanduser()
    if out is not None and Path(out).expanduser().resolve() == (folder / VALIDATION_FILE).resolve():
        out = None  # the artifact's own report, as without --out
    if out is not None:
        require_output_path(out, directory=False)
    for ok, problem in ((folder.is_dir(), "is not a folder"), ((folder / "config.json").is_file(), "has no config.json, so holds no model")):
        require(ok, f"{folder} {problem}; pass a quantized or pruned artifact such as artifacts/quantized")
    check_weight_files(folder)
    device = torch.device("cuda" if gpu else "cpu")
    dtype = torch.float16 if gpu else torch.float32
    weights = packed_weights(folder)
    if not gpu:
        representatives = {}
        for name, weight in weights.items():
            representatives.setdefault((weight.rows, weight.columns, weight.bits, weight.group_size, weight.kind), name)
        weights = {name: weights[name] for name in representatives.values()}
    generator = torch.Generator().manual_seed(0)
    layers, used = {}, set()
    for name, weight in weights.items():
        kernel = next((k for k in KERNELS if k.supports(weight)), None)
        if kernel is None:
            layers[name] = {"kernel": None, "note": f"no kernel serves {weight.kind} weights: torch runs them from a dense copy"}
            continue
        used.add(kernel)  # no self_check here: it tries every decode path on small weights (6 s in the interpreter); this tries the artifact's
        shape = [weight.rows, weight.columns]
        weight = serving_layout(weight.to(device) if gpu else weight.first_rows(INTERPRETED_ROWS), device)
        entry = {
            "kernel": kernel.name, "shape": shape, "rows_checked": weight.rows, "bits": weight.bits,
            "decode": weight.kind + (f", group {weight.group_size} stored values" if weight.scale is not None else "")
            + (", interleaved" if weight.interleaved else ""),
            "max_abs_error": {}, "max_rel_error": {},
        }
        dense = kernel.reference(torch.eye(weight.columns, device=device, dtype=dtype), weight).T.contiguous() if gpu else None
        for batch in BATCHES:
            x = torch.randn(batch, weight.columns, generator=generator).to(device, dtype)
            got, expected = kernel.run(x, weight).float(), kernel.reference(x, weight).float()
            error, size = (got - expected).abs().max().item(), expected.abs().max().item()
            finite = math.isfinite(error) and math.isfinite(size)  # a NaN or inf output is a failure, not a number (nor valid JSON)
            entry["max_abs_error"][str(batch)] = error if finite else None
            entry["max_rel_error"][str(batch)] = error / max(size, 1e-12) if finite else None
            if gpu:
                entry.setdefault("speedup_vs_fp16", {})[str(batch)] = (
                    weight_seconds(lambda w: x @ w.T, dense) / weight_seconds(lambda w: kernel.run(x, w), weight)
                )
        layers[name] = entry
    checked = [entry for entry in layers.values() if entry.get("kernel")]
    scope = f"all {len(layers)} packed linears" if gpu else f"{len(layers)} linears, one per distinct shape/bits/group"
    if not checked:
        scope = f"no kernel serves {scope} (torch runs them from a dense copy)"
    elif not gpu:
        scope += f", its first {INTERPRETED_ROWS} rows"
    report = {
        "device": torch.cuda.get_device_name() if gpu else "cpu (Triton interpreter)",
        "gpu_validated": gpu and bool(checked),  # true only where a kernel ran on the GPU
        "checked": scope,
        "kernels": {k.name: {"sources": k.source_hashes()} for k in sorted(used, key=lambda k: k.name)},
        "max_rel_error": worst_error([worst_error(e["max_rel_error"].values()) for e in checked]) if checked else None,
        "tolerance": VALIDATION_TOLERANCE,
        "layers": layers,
    }
    report["passed"] = not validation_failures(report)
    if out is None:  # the artifact's own report vouches for the kernel copies it carries
        out = folder / VALIDATION_FILE
        with writing(folder):
            out.unlink(missing_ok=True)  # no old report may vouch for kernels half replaced, should this stop before the new one
            bundle_kernels(folder)
    write_json(Path(out).expanduser(), report)
    return report


def kernel_sources(entry: dict) -> dict[str, str]:
    """A validation report's kernel entry as {bundled path: sha256}. Reports before the Gluon
    GEMV (one file per kernel) held one `source` and its `sha256`: they still vouch for it."""
    return entry["sources"] if "sources" in entry else {entry["source"]: entry["sha256"]}


def validation_failures(report: dict, folder: Path | None = None) -> list[str]:
    """What is wrong with a validation report: a layer above the tolerance, or (given the
    artifact's folder) a bundled kernel source that is not the one validated."""
    failures = []
    for name, entry in sorted(report.get("layers", {}).items()):
        worst = worst_error(entry["max_rel_error"].values()) if entry.get("kernel") else 0.0
        if worst is None:
            failures.append(f"{name} gives NaN or inf where its torch reference does not, or both do")
        elif worst > VALIDATION_TOLERANCE:
            failures.append(f"{name} is off its torch reference by {worst:.3g} (tolerance {VALIDATION_TOLERANCE:g})")
    for name, kernel in sorted(report.get("kernels", {}).items()) if folder is not None else ():
        for path, sha256 in kernel_sources(kernel).items():
            if not (Path(folder) / path).is_file() or file_sha256(Path(folder) / path) != sha256:
                failures.append(f"{path} is missing or is not the {name} source that was validated")
    return failures


def worst_error(errors) -> float | None:
    """The largest of a report's errors; None (a failure) where any is None: not finite."""
    errors = list(errors)
    return None if any(error is None for error in errors) else max(errors)


def bundle_kernels(folder: Path) -> None:
    """Copy the kernel sources an artifact needs into it, next to its validation report."""
    from compressors.kernels import KERNELS

    (Path(folder) / "kernels").mkdir(exist_ok=True)
    for source in {source for kernel in KERNELS for source in kernel.sources}:
        shutil.copy(source, Path(folder) / "kernels" / source.name)


def load_draft(spec: str, target: LoadedModel, allow_other_target: bool = False) -> tuple[torch.nn.Module, torch.Tensor | None]:
    """A draft model for `target` and its vocabulary map (the target token id of each draft
    LM-head row; None: the full vocabulary). Checked to share the target's tokenizer and, when
    `lmpress draft` made it, to have been distilled against this very target (its lineage and
    weights): a mismatch is an error, or with `allow_other_target` a warning."""
    from compressors.draft import trim_lm_head
    from pipelines.artifact import model_chain, model_identity, read_lineage
    from pipelines.progress import stderr
    from pipelines.stages import VOCAB_TRIM_FILE, check_draft_fits

    folder = resolve_model(spec)
    check_draft_fits(folder, target.folder)
    lineage = read_lineage(folder)
    record = lineage["chain"][-1] if lineage else {}
    if record.get("stage") == "draft":
        expected, lineage_file = record.get("target"), folder / "lineage.json"
        require(isinstance(expected, dict), f"{lineage_file} names no target model for this draft; re-run `lmpress draft`")
        require_keys(expected, ("model", "lineage_hash", "weights_sha256"), lineage_file, "re-run `lmpress draft`")
        actual = model_identity(target.spec, target.folder, model_chain(target.spec, target.folder, target.config))
        changed = [what for what, key in (("lineage", "lineage_hash"), ("weights", "weights_sha256")) if expected[key] != actual[key]]
        if changed:
            message = (
                f"draft {spec} was distilled against {expected['model']} (lineage {expected['lineage_hash'][:12]}, weights "
                f"{expected['weights_sha256'][:12]}); {target.spec} differs in its {' and '.join(changed)} "
                f"({actual['lineage_hash'][:12]}, {actual['weights_sha256'][:12]}): re-run `lmpress draft --target {target.spec}`"
            )
            if not allow_other_target:
                raise LmpressError(message + ", or pass --allow-other-target to pair them anyway")
            stderr.print(f"warning: {message}", markup=False, highlight=False)
    model = load_model(spec).model
    trim = folder / VOCAB_TRIM_FILE
    token_ids = read_safetensors(trim, f"re-run `lmpress draft` for {spec}")["token_ids"] if trim.is_file() else None
    if token_ids is not None:
        trim_lm_head(model, token_ids)
    return model, token_ids


@torch.no_grad()
def greedy_decode(model: torch.nn.Module, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | list[int] | None = None,
                  cuda_graph: bool = False) -> tuple[torch.Tensor, bool]:
    """Greedy decoding of `input_ids` [1, n]: the argmax at each step (as `speculative_greedy`,
    so in fp32 a draft changes the number of forwards, not the text), `max_new_tokens` new tokens or
    up to and including an end-of-text one. Returns the tokens [1, n + new] and whether a CUDA
    graph ran the steps.

    The KV cache is transformers' StaticCache, so every step after the prompt is the same
    fixed-shape forward over tensors at fixed addresses (the cache, the token in and out, its
    position). With `cuda_graph` that step is captured once and replayed per token. Why: run
    eagerly, each step re-runs the Python of transformers, of PackedLinear and of Triton's
    launcher. On an H100 that host time was 110-260 us per packed linear against a few us of
    kernel time, and a packed linear was 4-8x slower than fp16 per eager call
    (benchmarks/results/latency_h100.md). A replay launches the step's kernels with no Python.
    Kernels are compiled, autotuned and picked in two warm-up steps on a throwaway cache before
    capture, since a capture cannot time or synchronize. A capture that fails warns and the
    steps run eagerly: the same tokens, slower."""
    from transformers import StaticCache

    from compressors.kernels import capture_graph
    from compressors.speculative import stop_tokens, until_stop
    from pipelines.progress import stderr

    prompt, device = input_ids.shape[1], input_ids.device
    stops = stop_tokens(eos_token_id, device)

    def new_cache():
        return StaticCache(config=model.config, max_cache_len=prompt + max_new_tokens)

    def decode_step(cache, token: torch.Tensor, position: torch.Tensor, finite: torch.Tensor):
        """One step: token [1, 1] at position [1] in, the next token out in its place; `finite`
        stays true while every logit has been finite (checked once, after the loop)."""
        def step():
            logits = model(input_ids=token, position_ids=position.view(1, 1), past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            token.copy_(logits[:, -1].argmax(-1, keepdim=True))
            finite.logical_and_(logits.isfinite().all())
            position.add_(1)
        return step

    cache = new_cache()
    logits = model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    token, finite = logits[:, -1].argmax(-1, keepdim=True), logits.isfinite().all()
    position = torch.full((1,), prompt, dtype=torch.long, device=device)
    step, graphed = decode_step(cache, token, position, finite), False
    if cuda_graph and max_new_tokens > 1:
        try:
            # the warm-up steps run on a throwaway cache, token, position and flag: the real ones are untouched
            step, graphed = capture_graph(step, warm_up=decode_step(new_cache(), token.clone(), position.clone(), finite.clone())).replay, True
        except RuntimeError as error:  # e.g. an op that synchronizes; the steps are still right eagerly
            stderr.print(f"warning: CUDA graph capture failed ({str(error).splitlines()[0][:200]}); decoding eagerly", markup=False, highlight=False)
    new = [token.clone()]
    while len(new) < max_new_tokens and not torch.isin(new[-1], stops).any():
        step()
        new.append(token.clone())
    # argmax of a nan or inf row is a token all the same: without this, an overflow decodes as gibberish
    require(bool(finite), f"the model's logits overflowed {str(logits.dtype).removeprefix('torch.')} (inf or nan); "
            + ("pass --dtype bfloat16 or --dtype float32: float16 ends at 65504" if logits.dtype == torch.float16 else "pass --dtype float32"))
    return until_stop(torch.cat([input_ids, *new], dim=1), prompt, stops, max_new_tokens), graphed


def generate(spec: str, prompt: str, max_new_tokens: int = 40, draft: str | None = None, lookahead: int | None = None, allow_other_target: bool = False,
             cuda_graphs: bool = True, dtype: str = "auto") -> str:
    """Greedy continuation (`greedy_decode`: on a GPU each step a CUDA graph's replay unless
    `cuda_graphs` is off) in `dtype` (`serving_dtype`); with a `draft`, by speculative decoding
    (in fp32: the text plain decoding gives in fp32, in fewer target forwards; the counts go to
    stderr, as does a note where the dtype differs from plain decoding's)."""
    from compressors.speculative import speculative_greedy
    from pipelines.progress import stderr

    require(bool(prompt.strip()), "the prompt is empty; pass some text to continue, e.g. \"Once upon a time\"")
    require(max_new_tokens > 0, f"--max-new-tokens must be positive (got {max_new_tokens}); pass e.g. --max-new-tokens 40")
    require(draft is not None or lookahead is None, "--lookahead sets how many tokens a draft proposes; pass --draft MODEL with it, or leave it out")
    lookahead = 4 if lookahead is None else lookahead
    require(lookahead > 0, f"--lookahead must be positive (got {lookahead}); pass e.g. --lookahead 4")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    activations, plain = serving_dtype(dtype, device, speculative=draft is not None), serving_dtype(dtype, device)
    if draft is not None and activations != plain:
        stderr.print("note: with --draft, --dtype auto serves float32, whose text is the target's own; without --draft it would serve "
                     f"{str(plain).removeprefix('torch.')}", markup=False, highlight=False)
    elif draft is not None and activations != torch.float32:
        stderr.print(f"note: in {dtype} the speculative text may differ from plain decoding's; --dtype float32 keeps it the same", markup=False, highlight=False)
    # The prompt is checked against the context from the config and tokenizer alone, before the
    # weights load: a too-long request is told so at once, not after a load and its progress bars.
    folder = resolve_model(spec)
    tokenizer = load_tokenizer(folder)
    inputs = tokenizer(prompt, return_tensors="pt").to(device)
    context, length = getattr(load_config(folder), "max_position_embeddings", None), inputs["input_ids"].shape[1]
    require(
        context is None or length + max_new_tokens <= context,
        f"the prompt's {length} tokens and --max-new-tokens {max_new_tokens} exceed the model's context of {context} tokens; "
        f"pass --max-new-tokens {context - length} or less" if length < context else f"shorten the prompt below {context} tokens",
    )
    loaded = load_for_serving(spec, device, activations)
    eos = loaded.model.generation_config.eos_token_id
    if draft is None:
        output, _ = greedy_decode(loaded.model, inputs["input_ids"], max_new_tokens, eos, cuda_graph=cuda_graphs and device == "cuda")
    else:
        model, token_ids = load_draft(draft, loaded, allow_other_target)
        model.to(device, activations)
        token_ids = None if token_ids is None else token_ids.to(device)
        result = speculative_greedy(loaded.model, model, inputs["input_ids"], max_new_tokens, lookahead, token_ids, eos)
        output = result.tokens
        stderr.print(
            f"speculative: {result.new_tokens} tokens in {result.target_forwards} target forwards "
            f"({result.tokens_per_target_forward:.2f} per forward), {result.accepted}/{result.proposed} proposals accepted",
            markup=False, highlight=False,
        )
    return tokenizer.decode(output[0, length:], skip_special_tokens=True)
