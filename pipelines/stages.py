"""The stages. Each is one function that the CLI and `dvc repro` both call, configured by a
typed config whose fields are the keys of its params.yaml section and the record in the
lineage manifest."""

from __future__ import annotations

import gc
import re
import shutil
from contextlib import closing
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from calibrate.corpora import check_disjoint, check_text_disjoint, held_out_text_in, leading_windows, sample_windows, tokenize_part
from calibrate.runner import LayerRunner, release_free_memory
from calibrate.stats import BLOCK_INFLUENCE, CALIBRATION_FORMAT, LayerStatisticsCollector
from compressors.grid import GridSpec
from compressors.structured import BlockInfluence, keep_layers
from pipelines.artifact import (
    StageRun,
    atomic_directory,
    base_record,
    chain_hash,
    model_chain,
    read_json,
    read_lineage,
    read_safetensors,
    require_keys,
    require_output_path,
    write_json,
    write_lineage,
)
from pipelines.errors import LmpressError, require, require_input
from pipelines.evaluation import LMHead, score_windows, size_metrics
from pipelines.models import (
    architecture_of, cpu_multiplies_bf16, decoder_layers, head_dim_of, is_quantized, layer_linears, load_config, load_model, map_weights, release_weights,
    resolve_model,
)
from pipelines.progress import progress_bar, stderr


def require_positive(**values: int) -> None:
    for name, value in values.items():
        require(value > 0, f"{name.replace('_', '-')} must be positive (got {value}); pass e.g. --{name.replace('_', '-')} 8")


# --------------------------------------------------------------------------- calibrate

HELD_OUT_REPEATED = "held_out_repeated"  # the calibration record's named held-out documents that a user file repeats


@dataclass
class CalibrateConfig:
    corpus: str = "austen-calib+pydoc-calib"
    samples: int = 128
    seq_len: int = 512
    batch_size: int = 8
    seed: int = 0

    def validate(self) -> None:
        require_positive(samples=self.samples, seq_len=self.seq_len, batch_size=self.batch_size)


def calibrate(model: str, out: Path, config: CalibrateConfig) -> Path:
    """Sample token windows, walk the model layer by layer and store per-linear statistics."""
    config.validate()
    require_output_path(out, directory=True, inputs=(model,), kind="calibrate")
    run = StageRun()
    repeated = held_out_text_in(config.corpus)  # before the model loads: a user file's copies are held in memory
    if repeated:
        stderr.print(
            f"warning: the calibration text repeats held-out text ({', '.join(repeated[:3])}); evaluating on it will be "
            "refused, so evaluate on other text", markup=False, highlight=False,
        )
    loaded = load_model(model)
    samples = sample_windows(config.corpus, loaded.tokenizer, config.samples, config.seq_len, config.seed)
    with atomic_directory(out) as tmp, progress_bar("calibrate: layers", loaded.config.num_hidden_layers) as advance:
        (tmp / "stats").mkdir()
        with closing(LayerRunner(loaded.model, samples.input_ids, config.batch_size, on_layer_done=lambda _: advance(), scratch=tmp)) as runner:
            groups, tokens = None, None
            for index, layer in runner:
                influence = BlockInfluence()  # what depth pruning ranks layers by, batch by batch: no copy of the layer's inputs
                handle = layer.register_forward_hook(influence.hook, with_kwargs=True)
                try:
                    with LayerStatisticsCollector(layer_linears(loaded.model, layer), loaded.config) as collector:
                        runner.forward(layer)
                finally:
                    handle.remove()
                require(groups in (None, collector.group), f"layer {index} shares inputs differently from layer 0")
                groups, tokens = collector.group, collector.tokens
                save_file({**collector.tensors(), BLOCK_INFLUENCE: torch.tensor(influence.value)}, tmp / "stats" / f"layer_{index:03d}.safetensors")
        save_file({"input_ids": samples.input_ids.contiguous()}, tmp / "samples.safetensors")
        calibration = {
            "corpus": config.corpus,
            "data_sha256": samples.data_hash(),
            "sample_ids": samples.sample_ids,
            "documents": samples.documents,
            **({HELD_OUT_REPEATED: repeated} if repeated else {}),
        }
        write_json(
            tmp / "manifest.json",
            {"format": CALIBRATION_FORMAT, **asdict(config), **calibration, "tokens": tokens, "groups": groups},
        )
        parent = model_chain(model, loaded.folder, loaded.config)
        write_lineage(tmp, parent, {"stage": "calibrate", "params": asdict(config), "seed": config.seed, "calibration": calibration}, run)
    return Path(out)


# --------------------------------------------------------------------------- evaluate

REFERENCE_FORMAT = "lmpress-reference/2"


@dataclass
class EvaluateConfig:
    corpora: str = "austen-heldout,pydoc-heldout,reuters-heldout"  # the calibration domains' held-out text, and newswire (out of domain)
    windows: int = 16
    seq_len: int = 512
    batch_size: int = 4

    def validate(self) -> None:
        require_positive(windows=self.windows, seq_len=self.seq_len, batch_size=self.batch_size)
        require(bool(self.corpus_list), "no evaluation corpus given; pass e.g. --corpora austen-heldout,pydoc-heldout")

    @property
    def corpus_list(self) -> list[str]:
        return [name.strip() for name in self.corpora.split(",") if name.strip()]


def evaluate(model: str, reference: Path, out: Path | None, config: EvaluateConfig, base: str | None = None) -> dict:
    """Perplexity, KL to the base and top-1 agreement on held-out text, plus size metrics.

    The base's side of the comparison is cached in `reference`; when it does not exist yet it
    is built from `base` (default: the base recorded in the model's lineage, or the model
    itself, which is then scored once)."""
    config.validate()
    reference = Path(reference)
    require_output_path(reference, directory=True, inputs=(model, base))
    if out is not None:
        require_output_path(out, directory=False)
    loaded = load_model(model)
    chain = model_chain(model, loaded.folder, loaded.config)
    if base is not None and base != model and read_lineage(loaded.folder) is None:
        # a model lmpress did not make (another tool's output): the user names its base
        base_folder = resolve_model(base)
        chain = [base_record(base, base_folder, load_config(base_folder)), {"stage": "external", **chain[0]}]
    windows = {corpus: held_out_windows(corpus, loaded.tokenizer, chain, config.windows, config.seq_len) for corpus in config.corpus_list}

    building = not (reference / "manifest.json").is_file()
    require(
        not building or not reference.exists() or not any(reference.iterdir()),
        f"{reference} is not a reference cache (no manifest.json) and is not empty; pass a new --reference path, where one is built",
    )
    is_base = len(chain) == 1 and base in (None, model)
    if building:
        _build_reference(loaded if is_base else load_model(base or chain[0]["model"]), reference, windows, config)
    rebuild = rebuild_reference(reference)
    manifest = read_json(reference / "manifest.json", rebuild)
    require(
        isinstance(manifest, dict) and manifest.get("format") == REFERENCE_FORMAT,
        f"{reference} is not an lmpress reference cache ({REFERENCE_FORMAT}); pass a new --reference path, where one is built",
    )
    require_keys(manifest, ("base", "windows", "seq_len", "corpora"), reference / "manifest.json", rebuild)
    require(
        manifest["base"]["weights_sha256"] == chain[0]["weights_sha256"],
        f"reference {reference} was built from another base model than {model}'s; pass another --reference path",
    )
    settings = {"windows": config.windows, "seq_len": config.seq_len}
    require(
        {key: manifest[key] for key in settings} == settings,
        f"reference {reference} was built with windows={manifest['windows']}, seq_len={manifest['seq_len']}; "
        "use those or pass another --reference path",
    )

    missing = [corpus for corpus in windows if corpus not in manifest["corpora"]]
    require(
        not missing,
        f"reference {reference} holds no {', '.join(missing)}; pass --corpora {','.join(manifest['corpora'])} (what it holds) or another --reference path",
    )

    metrics = {"model": model, "lineage_hash": chain_hash(chain), **size_metrics(loaded.model, loaded.folder)}
    head = LMHead.load(reference / "lm_head.safetensors", rebuild)
    for corpus, (tokens, _) in windows.items():
        entry = manifest["corpora"][corpus]
        if building and is_base:  # the reference *is* this model's output, scored once just now
            metrics[corpus] = {"perplexity": entry["base_perplexity"], "kl_to_base": 0.0, "top1_agreement": 1.0, "tokens": entry["tokens"]}
            continue
        with progress_bar(f"evaluate {corpus}", tokens.shape[0]) as advance:
            metrics[corpus] = reference_metrics(loaded.model, reference, corpus, head, config.batch_size, tokens, on_batch=advance)
        metrics[corpus]["base_perplexity"] = entry["base_perplexity"]
    if out is not None:
        write_json(Path(out), metrics)
    return metrics


def rebuild_reference(reference: Path) -> str:
    """How to mend a damaged reference cache (the end of its errors)."""
    return f"delete {reference} so it is rebuilt"


def reference_metrics(model, reference: Path, corpus: str, head: LMHead, batch_size: int, tokens: torch.Tensor | None = None, on_batch=None) -> dict:
    """Perplexity, KL to the base and top-1 agreement of `model` on a reference's cached
    windows of `corpus` (checked to be `tokens` when given)."""
    cached = read_safetensors(Path(reference) / f"{corpus}.safetensors", rebuild_reference(reference))
    require(
        tokens is None or bool(torch.equal(cached["input_ids"], tokens)),
        f"reference {reference} holds other '{corpus}' tokens; the tokenizers differ",
    )
    scores = score_windows(model, cached["input_ids"], (head, cached["hidden"]), batch_size, on_batch=on_batch)
    return {
        "perplexity": round(scores.perplexity, 4),
        "kl_to_base": round(scores.kl_sum / scores.tokens, 6),
        "top1_agreement": round(scores.top1_agree / scores.tokens, 6),
        "tokens": scores.tokens,
    }


def number_list(text: str, kind, option: str) -> list:
    """A comma-separated option such as '2,3,4' as numbers of `kind`, or a clear error."""
    try:
        return [kind(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        raise LmpressError(f"{option} takes comma-separated numbers such as 2,3 (got '{text}')") from None


def held_out_windows(corpus: str, tokenizer, chain: list[dict], windows: int, seq_len: int,
                     options: tuple[str, str] = ("--windows", "--seq-len")) -> tuple[torch.Tensor, list[str]]:
    """The first `windows` windows of held-out `corpus` and its documents, checked to share no
    document, and where a user file is involved no text, with the calibration data of any stage
    in `chain`; `options` name the two settings in the error for too little text."""
    part = tokenize_part(corpus, tokenizer)
    require_held_out(corpus, part.documents, chain)
    return leading_windows(part, windows, seq_len, options), part.documents


def require_held_out(corpus: str, documents: list[str], chain: list[dict]) -> None:
    """`corpus` (its document ids `documents`) shares no document, and where a user file is
    involved no text, with the calibration data of any stage in `chain`."""
    calibrations = [record["calibration"] for record in chain if "calibration" in record]
    calibration_documents = [doc for calibration in calibrations for doc in calibration.get("documents", [])]
    check_disjoint(calibration_documents + [doc for calibration in calibrations for doc in calibration.get(HELD_OUT_REPEATED, [])],
                   documents, corpus)
    check_text_disjoint([calibration["corpus"] for calibration in calibrations if "corpus" in calibration], calibration_documents, corpus)


def _build_reference(base, reference: Path, windows: dict, config: EvaluateConfig) -> None:
    corpora = {}
    with atomic_directory(reference) as tmp:
        LMHead.of(base.model).save(tmp / "lm_head.safetensors")
        for corpus, (tokens, documents) in windows.items():
            with progress_bar(f"reference {corpus}", tokens.shape[0]) as advance:
                scores = score_windows(base.model, tokens, None, config.batch_size, on_batch=advance)
            save_file({"input_ids": tokens.contiguous(), "hidden": scores.hidden.contiguous()}, tmp / f"{corpus}.safetensors")
            corpora[corpus] = {"documents": documents, "tokens": scores.tokens, "base_perplexity": round(scores.perplexity, 4)}
        base_record = model_chain(base.spec, base.folder, base.config)[0]
        manifest = {"format": REFERENCE_FORMAT, "base": base_record, "windows": config.windows, "seq_len": config.seq_len}
        write_json(tmp / "manifest.json", {**manifest, "corpora": corpora})


# --------------------------------------------------------------------------- layer walk


def walk_layers(loaded, calib, config, process, advance, finished=None, true_sequential=False, scratch: Path | None = None) -> None:
    """Call `process(index, layer, statistics)` for every decoder layer, in order. With
    `config.sequential` the statistics are collected by the layer runner on the model as
    compressed so far (each layer sees the already-compressed layers' outputs, the way GPTQ,
    SparseGPT and Wanda run); otherwise they are the calibration artifact's stored ones, of
    the uncompressed model (no forward passes). Without `calib` no statistics are needed.
    `true_sequential` (sequential only) calls `process` once per group of linears that read
    one tensor (q/k/v, o, gate/up, down), each group's statistics collected after the groups
    before it are compressed, so o_proj sees the compressed q/k/v's outputs and so on (GPTQ's
    true-sequential mode, AutoGPTQ's and GPTQModel's default; `LayerRunner.forward_true_sequential`,
    which keeps two of the groups' inputs in a file); `statistics` then holds that
    group's linears only. The runner's scratch files (the hidden states, and those inputs) go
    in `scratch` (a temporary folder by default). `finished(index, layer)` is called once the
    walk is done with a layer (its outputs, if any, have gone on to the next one), then
    `advance()`."""
    layers = decoder_layers(loaded.model)
    arch = architecture_of(loaded.config)

    def done(index: int) -> None:
        if finished is not None:
            finished(index, layers[index])
        advance()

    if calib is not None and config.sequential:
        with closing(LayerRunner(loaded.model, calib.input_ids, config.batch_size, on_layer_done=done, dtype=FORWARD_DTYPES[config.forward_dtype],
                                 scratch=scratch)) as runner:
            embedding = next(name for name, p in loaded.model.named_parameters() if p is loaded.model.get_input_embeddings().weight)
            map_weights(loaded, [embedding])  # the runner is done with it: a fresh map drops the pages its first pass read
            for index, layer in runner:
                if true_sequential:
                    runner.forward_true_sequential(layer, arch, lambda statistics: process(index, layer, statistics))
                    continue
                with LayerStatisticsCollector({name: layer.get_submodule(name) for name in arch.linears}, loaded.config) as collector:
                    runner.forward(layer, propagate=False, until=layer.get_submodule(arch.linears[-1]))  # the moments taken, down need not run
                statistics = collector.statistics()
                del collector  # its fp64 sums and buffers, before the compressor's own working memory
                process(index, layer, statistics)
                del statistics  # not held through the layer's outputs pass, where it would pin the heap's top
        return
    base_index = base_layer_indices(read_lineage(loaded.folder))
    for index, layer in enumerate(layers):
        statistics = calib.layer(base_index[index] if base_index else index) if calib is not None else {}
        for local, stats in statistics.items():  # the base's inputs: a structured-pruned model's are narrower
            width = layer.get_submodule(local).in_features
            require(
                stats.second_moment.shape[0] == width,
                f"the calibration's stored statistics are the base model's, where {local} reads {stats.second_moment.shape[0]} "
                f"features; this model's layer {index} reads {width}: pass --sequential true to collect them on this model",
            )
        process(index, layer, statistics)
        done(index)
        release_free_memory()  # as the runner does after each layer


def base_layer_indices(lineage: dict | None) -> list[int] | None:
    """For a model whose chain dropped layers: the base model's index of each of its layers
    (the stored calibration statistics are the base's, by the base's layer index)."""
    indices = None
    for record in (lineage or {}).get("chain", []):
        if "kept_layers" in record:
            indices = [indices[i] for i in record["kept_layers"]] if indices else list(record["kept_layers"])
    return indices


def begin_stage(stage: str, model: str, calibration: Path | None, out: Path, needs_calibration: str | None, other_inputs: tuple = ()):
    """What every compression stage (named `stage`, as its lineage record) does first: check the output path and that calibration is
    given where needed (before any loading), start the clock, load the model, and open the
    calibration artifact checked against the model's base. `needs_calibration` names the
    command and options that need it (see `needed_by`), None where it is optional;
    `other_inputs` are the stage's other local inputs (a level database, a plan), which its
    output must not replace either. Returns
    (run, loaded, chain, calib). A quantized model is refused: every stage computes on dense
    weights and writes them dense (a stage that shrank a decompressed model wrote a quantization
    config over dense layers, which no loader opens), so quantizing comes last."""
    require_output_path(out, directory=True, inputs=(model, calibration, *other_inputs), kind=stage)
    require_calibration(calibration, needs_calibration)
    require(
        not is_quantized(resolve_model(model)),
        f"{model} is quantized already; start from the model it was made from (the base, or a pruned or merged artifact) and quantize last",
    )
    run = StageRun()
    loaded = load_model(model)
    chain = model_chain(model, loaded.folder, loaded.config)
    return run, loaded, chain, open_calibration(calibration, chain)


def needed_by(command: str, options: dict[str, bool]) -> str | None:
    """The command with the options that need calibration, for the error that names them
    (`drop-layers --recovery-steps 10`); None when none does."""
    needing = [option for option, needs in options.items() if needs]
    return " ".join([command, *needing]) if needing else None


def require_calibration(calibration: Path | None, needed_by: str | None) -> None:
    require(calibration is not None or needed_by is None, f"{needed_by} needs --calibration (run `lmpress calibrate`)")


def open_calibration(calibration: Path | None, chain: list[dict]):
    """The calibration artifact, checked to belong to this model's base; None when not given."""
    from calibrate.stats import CalibrationData

    if calibration is None:
        return None
    calib = CalibrationData(calibration)
    calib.check_model(chain[0]["weights_sha256"])
    return calib


def calibration_record(calib) -> dict:
    """What a stage's lineage records about the calibration data it used."""
    if calib is None:
        return {}
    return {
        "seed": calib.manifest["seed"],
        "calibration": {
            **{key: calib.manifest[key] for key in ("corpus", "data_sha256", "sample_ids", "documents", HELD_OUT_REPEATED) if key in calib.manifest},
            "tokens_per_sample": calib.manifest["seq_len"],
        },
    }


# --------------------------------------------------------------------------- quantize

CODEBOOK_METHODS = ("squeezellm", "squeezellm-gptq")
QUANTIZE_METHODS = ("rtn", "gptq", "awq", *CODEBOOK_METHODS, "nf4", "int8")
CALIBRATED_METHODS = ("gptq", "awq", *CODEBOOK_METHODS)
PER_LINEAR_METHODS = ("gptq", *CODEBOOK_METHODS)  # each linear from its own input statistics (AWQ scales a layer's linears together)
FORWARD_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BITSANDBYTES_METHODS = ("nf4", "int8")  # bitsandbytes' own formats, which fix bits, group size and symmetry (FIXED_SETTINGS)
ACT_ORDER_METHODS = ("gptq", "squeezellm-gptq")  # the methods with GPTQ's error feedback: they take an act-order, a damp and a shrinkage
HESSIAN_SHRINKAGE = 0.25  # the default: the error feedback's Hessian a quarter of the way to its diagonal (compressors/gptq.py)
# The settings a method's format fixes, and that format in words (for the refusal of another value):
# a value the method would ignore is refused, so that the lineage records only what ran.
FIXED_SETTINGS = {
    "nf4": ({"bits": 4, "group_size": 64, "symmetric": True}, "bitsandbytes' NF4, 4 bits in blocks of 64 with absmax scales"),
    "int8": ({"bits": 8, "group_size": -1, "symmetric": True}, "bitsandbytes' LLM.int8, 8 bits with an absmax scale per output row"),
    **dict.fromkeys(CODEBOOK_METHODS, ({"group_size": -1, "symmetric": True}, "per-row codebooks, with no groups and no zero point")),
}
DEFAULT_GRID = {"bits": 4, "group_size": 64}  # where the method leaves them free


def resolve_forward_dtype(name: str) -> str:
    """The sequential passes' dtype; `auto` is bfloat16 where the CPU multiplies it natively
    (`cpu_multiplies_bf16`; same quality) and float32 elsewhere."""
    require(name in ("auto", *FORWARD_DTYPES), f"forward dtype must be auto, float32 or bfloat16 (got '{name}')")
    if name != "auto":
        return name
    return "bfloat16" if cpu_multiplies_bf16() else "float32"


def resolve_where_it_applies(value: bool | None, applies: bool, refusal: str) -> bool:
    """An on/off option as a stage runs it: None (the default) is on wherever it applies, an
    explicit on elsewhere is refused with `refusal`. The resolved value is what the lineage
    records."""
    require(not value or applies, refusal)
    return applies if value is None else value


def check_hessian_regularization(damp: float, shrinkage: float) -> None:
    """The two settings of the Hessian that GPTQ's and SparseGPT's error feedback inverts."""
    require(0 < damp < 1, f"damp must be in (0, 1) (got {damp}); 0.01 is the usual value")
    require(
        0 <= shrinkage <= 1,
        f"hessian shrinkage must be in [0, 1] (got {shrinkage}); {HESSIAN_SHRINKAGE} is the default, 0 the published GPTQ and SparseGPT",
    )


def resolve_clip_search(clip_search: bool | None, fits_grids: bool, needs: str) -> bool:
    """--clip-search: on wherever GPTQ or SparseGPT fit the grids (RTN's and AWQ's are their own)."""
    return resolve_where_it_applies(clip_search, fits_grids, f"--clip-search clips the grids GPTQ and SparseGPT fit: use it with {needs}, or pass --clip-search false")


@dataclass
class QuantizeConfig:
    method: str = "gptq"
    bits: int | None = None  # None: the method's (DEFAULT_GRID, or what FIXED_SETTINGS fixes)
    group_size: int | None = None  # the same
    symmetric: bool = True
    act_order: bool | None = None  # GPTQ's column order; None: on where it applies (ACT_ORDER_METHODS)
    damp: float = 0.01
    hessian_shrinkage: float = HESSIAN_SHRINKAGE  # the error feedback's input correlations shrunk toward 0 by this fraction
    clip_search: bool | None = None  # gptq: clip each group's grid by AWQ's output-error search; None: on where it applies
    sequential: bool = True
    true_sequential: bool | None = None  # sequential gptq / squeezellm: each group of linears sees the groups before it compressed; None: on where it applies
    forward_dtype: str = "auto"  # auto | float32 | bfloat16: the layers' dtype in the sequential passes (auto: resolve_forward_dtype)
    skip: str = ""  # comma-separated regexes of linear names left dense
    overrides: str = ""  # YAML file: {regex of linear names: {bits, group_size, symmetric}}
    batch_size: int = 2  # sequential passes: as fast as 4 or 8, with a lower memory peak (W3: 673 vs 720 MB; smaller transients to fragment the heap)

    def validate(self) -> None:
        require(self.method in QUANTIZE_METHODS, f"unknown method '{self.method}'; use one of {', '.join(QUANTIZE_METHODS)}")
        check_hessian_regularization(self.damp, self.hessian_shrinkage)
        self.resolve_format()
        self.act_order = resolve_where_it_applies(
            self.act_order, self.method in ACT_ORDER_METHODS,
            f"--act-order orders GPTQ's columns: use it with --method {' or '.join(ACT_ORDER_METHODS)}, or pass --act-order false",
        )
        self.clip_search = resolve_clip_search(self.clip_search, self.method == "gptq", "--method gptq")
        if self.method in CODEBOOK_METHODS:
            from compressors.squeezellm import check_bits

            check_bits(self.bits)
        require_positive(batch_size=self.batch_size)
        self.forward_dtype = resolve_forward_dtype(self.forward_dtype)  # the lineage records the dtype that ran
        self.true_sequential = resolve_where_it_applies(
            self.true_sequential, self.sequential and self.method in PER_LINEAR_METHODS,
            f"--true-sequential takes --sequential true and a method that quantizes each linear from its own inputs "
            f"({', '.join(PER_LINEAR_METHODS)}); pass --true-sequential false",
        )
        self.default_grid()

    def ran_with(self) -> dict:
        """The settings as the lineage records them: those the method never reads are None, so
        one artifact has one record whatever they were given as (a pipeline whose params switch
        the method still passes them all)."""
        unread = []
        if self.method not in CALIBRATED_METHODS:  # no statistics, so no passes to run
            unread += ["sequential", "true_sequential", "forward_dtype", "batch_size"]
        if self.method not in ACT_ORDER_METHODS:  # no GPTQ error feedback to damp
            unread += ["damp", "hessian_shrinkage"]
        return {**asdict(self), **dict.fromkeys(unread)}

    def resolve_format(self) -> None:
        """bits, group size and symmetry as the method runs them: what its format fixes (a
        different value given is refused, not ignored), else the value given, else DEFAULT_GRID."""
        fixed, format_name = FIXED_SETTINGS.get(self.method, ({}, ""))
        for setting, value in fixed.items():
            given = getattr(self, setting)
            option = f"--{setting.replace('_', '-')}"
            require(
                given is None or given == value,
                f"{self.method} quantizes to {format_name}: leave out {option} (or pass {option} {str(value).lower()}; got {str(given).lower()})",
            )
            setattr(self, setting, value)
        for setting, value in DEFAULT_GRID.items():
            if getattr(self, setting) is None:
                setattr(self, setting, value)

    def default_grid(self) -> GridSpec:
        return GridSpec(self.bits, self.group_size, self.symmetric)


def load_overrides(path: str) -> dict:
    """The per-layer plan file: {regex of full linear names: {bits, group_size, symmetric}}."""
    import yaml

    if not path:
        return {}
    require_input(path, False, "overrides", "pass a YAML file of {regex: {bits: 3}}, such as a search's plan.yaml")
    try:
        overrides = yaml.load(Path(path).read_text(), Loader=_unique_key_loader()) or {}
    except UnicodeDecodeError:
        raise LmpressError(f"{path} is not a text file; pass a YAML file of {{regex: {{bits: 3}}}}") from None
    except yaml.YAMLError as error:
        where = getattr(error, "problem_mark", None)
        raise LmpressError(
            f"{path} is not valid YAML{f' (line {where.line + 1})' if where else ''}: {getattr(error, 'problem', None) or error}; "
            "fix it, or write it with `lmpress search` (plan.yaml)"
        ) from None
    require(isinstance(overrides, dict), f"{path} must map linear-name regexes to settings")
    return overrides


def _unique_key_loader():
    """yaml's safe loader, refusing a key given twice in one mapping (by default the last
    silently wins: a plan with a repeated regex would not do what it says)."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            keys = [self.construct_object(key, deep=deep) for key, _ in node.value]
            repeated = next((key for i, key in enumerate(keys) if key in keys[:i]), None)
            if repeated is not None:
                raise yaml.constructor.ConstructorError(None, None, f"'{repeated}' is given twice", node.start_mark)
            return super().construct_mapping(node, deep=deep)

    return Loader


def compiled_regex(pattern: str, option: str):
    try:
        return re.compile(pattern)
    except re.error as error:
        raise LmpressError(f"{option} '{pattern}' is not a valid regular expression ({error}); escape dots and brackets, e.g. model\\.layers\\.0\\.") from None


def planned_linears(model, skip: str, overrides: dict, default):
    """(full name, module, setting) for every decoder linear not matched by a `skip` regex
    (comma-separated, searched); the setting is the first override whose regex matches the
    whole name, else `default`. A skip or override regex that matches no linear at all (a
    typo, a plan made for another model), or an override whose every match is skipped or taken
    by an earlier one (so it never applies), is an error once the walk is done, not a silent no-op."""
    skips = [compiled_regex(pattern.strip(), "--skip") for pattern in skip.split(",") if pattern.strip()]
    regexes = [(compiled_regex(str(regex), "override"), value) for regex, value in overrides.items()]
    prefix = architecture_of(model.config).layers
    matched, kept, applied = set(), set(), set()  # overrides matching a linear, one left to compress, one they decide
    for index, layer in enumerate(decoder_layers(model)):
        for local, module in layer_linears(model, layer).items():
            name = f"{prefix}.{index}.{local}"
            matches = [(regex.pattern, value) for regex, value in regexes if regex.fullmatch(name)]
            matched.update(pattern for pattern, _ in matches)
            if not any(pattern.search(name) for pattern in skips):
                kept.update(pattern for pattern, _ in matches)
                applied.update(pattern for pattern, _ in matches[:1])
                yield name, module, matches[0][1] if matches else default
    example = f"names look like {prefix}.0.mlp.down_proj"
    linears = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]  # lm_head too: never compressed, skipping it is no mistake
    unskipped = {pattern.pattern for pattern in skips if not any(pattern.search(name) for name in linears)}
    require(not unskipped, f"--skip '{min(unskipped, default='')}' matches no linear of this model ({example}); fix the regex")
    for reached, why in (  # the earliest reason an override is idle, checked in this order
        (matched, f"matches no linear of this model ({example} and must match whole); fix the regex, or use a plan made for this model"),
        (kept, "never applies: --skip leaves every linear it matches dense; drop one of the two"),
        (applied, "never applies: an earlier override matches every linear it does (the first match wins); move it above the broader one or narrow that one"),
    ):
        idle = [regex.pattern for regex, _ in regexes if regex.pattern not in reached]
        require(not idle, f"override '{min(idle, default='')}' {why}")


def quantization_plan(model, config: QuantizeConfig, overrides: dict) -> dict[str, GridSpec]:
    """Full linear name -> grid: the default, then overrides (first matching regex wins),
    minus skipped linears; every grid checked against its linear's input width."""
    plan = {}
    for name, module, settings in planned_linears(model, config.skip, overrides, {}):
        require(
            isinstance(settings, dict) and set(settings) <= {"bits", "group_size", "symmetric"},
            f"override for '{name}' must set only bits, group_size, symmetric",
        )
        grid = GridSpec(
            settings.get("bits", config.bits), settings.get("group_size", config.group_size),
            settings.get("symmetric", config.symmetric),
        )
        if config.method in CODEBOOK_METHODS:  # per-row codebooks: no groups, bits only
            from compressors.squeezellm import check_bits

            require(set(settings) <= {"bits"}, f"squeezellm overrides set only bits (got {sorted(settings)} for '{name}')")
            check_bits(grid.bits)
        elif config.method not in BITSANDBYTES_METHODS:
            grid.check_width(module.in_features, name)
        elif config.method == "nf4" and not torch.cuda.is_available():
            require(
                module.in_features % 64 == 0,
                f"nf4 on the CPU needs input widths that are multiples of 64 (bitsandbytes' CPU kernel); {name} is "
                f"{module.in_features} wide: leave it dense with --skip, or use rtn, gptq, awq or squeezellm",
            )
        plan[name] = grid
    return plan


def sparse_24_masks(model, chain: list[dict], plan: dict) -> dict[str, torch.Tensor]:
    """Linear name -> keep mask, for the planned linears of a pruned parent that are 2:4 (at
    most 2 nonzeros in every 4 inputs); the mask is completed to exactly 2 per group, as the
    2:4 layout stores, should a kept weight be zero itself."""
    from compressors.sparsity import keep_mask, magnitude_score, parse_pattern

    if not any(record.get("stage") == "prune" for record in chain):
        return {}
    masks = {}
    modules = dict(model.named_modules())
    for name in plan:
        weight = modules[name].weight.data
        if weight.shape[1] % 4 == 0 and bool(((weight.reshape(weight.shape[0], -1, 4) != 0).sum(dim=2) <= 2).all()):
            masks[name] = keep_mask(magnitude_score(weight), parse_pattern("2:4"))
    return masks


def quantize(model: str, calibration: Path | None, out: Path, config: QuantizeConfig) -> Path:
    """Quantize every decoder linear (RTN; GPTQ, AWQ or SqueezeLLM from the calibration data,
    walking the model layer by layer so each layer sees the already-quantized inputs, or from
    the stored statistics) and write a compressed-tensors artifact (asymmetric grids too, with
    packed zero points), or an lmpress-packed one for codebooks and 2:4 sparse weights."""
    from compressors.awq import awq_layer
    from compressors.gptq import gptq_quantize_together
    from compressors.grid import round_to_nearest
    from compressors.lmpress_format import packed_weight, save_lmpress_packed
    from compressors.packed_int import read_spilled, save_pack_quantized, spill_to_disk
    from compressors.sparsegpt import PrunedLinear, sparsegpt_prune
    from compressors.squeezellm import squeezellm_quantize
    from pipelines.serving import validate

    config.validate()
    overrides = load_overrides(config.overrides)  # first: a plan that is not a file is that mistake, not an output inside it
    run, loaded, chain, calib = begin_stage("quantize", model, calibration, out, needed_by("quantize", {f"--method {config.method}": config.method in CALIBRATED_METHODS}),
                                             (config.overrides,))
    plan = quantization_plan(loaded.model, config, overrides)
    arch = architecture_of(loaded.config)
    prefix = arch.layers
    packed = {}  # linear name -> PackedWeight, as stored
    if config.method in BITSANDBYTES_METHODS:
        require(not overrides, f"{config.method} (bitsandbytes) takes no per-layer overrides; use rtn, gptq or awq")
        with atomic_directory(out) as tmp:
            _quantize_bitsandbytes(loaded, plan, config.method, tmp)
            write_lineage(tmp, chain, {"stage": "quantize", "params": config.ran_with()}, run)
        return Path(out)

    def quantize_layer(index, layer, stats):  # stats: of the linears to quantize now (true-sequential: one group's)
        todo = [local for local in arch.linears if not stats or local in stats]
        layer_plan = {local: plan[f"{prefix}.{index}.{local}"] for local in todo if f"{prefix}.{index}.{local}" in plan}
        if config.method == "rtn":
            results = {local: round_to_nearest(layer.get_submodule(local).weight.data, grid) for local, grid in layer_plan.items()}
        elif config.method == "gptq":
            results, together = {}, {}
            for local, grid in layer_plan.items():
                weight, keep = layer.get_submodule(local).weight.data, sparse.get(f"{prefix}.{index}.{local}")
                if keep is None:  # linears reading one input (one Hessian tensor) on one grid run as one sweep
                    together.setdefault((id(stats[local].second_moment), grid), []).append(local)
                else:  # GPTQ whose error feedback leaves the pruned weights at zero (SparseGPT with its mask fixed)
                    results[local] = sparsegpt_prune(weight, stats[local].second_moment, None, config.damp, grid=grid, keep=keep,
                                                     clip_search=config.clip_search, shrinkage=config.hessian_shrinkage).quantized
            for (_, grid), members in together.items():
                weights = [layer.get_submodule(local).weight.data for local in members]
                quantized = gptq_quantize_together(weights, stats[members[0]].second_moment, grid, config.damp, config.act_order, config.clip_search,
                                                   config.hessian_shrinkage)
                results.update(zip(members, quantized))
        elif config.method in CODEBOOK_METHODS:
            hessian = lambda local: stats[local].second_moment if config.method == "squeezellm-gptq" else None  # noqa: E731
            results = {
                local: squeezellm_quantize(
                    layer.get_submodule(local).weight.data, stats[local].second_moment.diagonal(), grid.bits, hessian(local),
                    config.damp, config.act_order, shrinkage=config.hessian_shrinkage,
                )
                for local, grid in layer_plan.items()
            }
        else:
            results = awq_layer(layer, arch, loaded.config, stats, layer_plan)
        finished = {}
        for local, q in results.items():
            module, name = layer.get_submodule(local), f"{prefix}.{index}.{local}"
            module.weight.data = q.dequantized()  # what the next layers' inputs go through
            # a 2:4 parent stays 2:4: rtn, awq and masked gptq keep zeros at zero, so only the kept half is stored
            finished[name] = packed_weight(PrunedLinear(module.weight.data.float(), sparse[name], q) if name in sparse else q)
        if finished:
            spill_to_disk(finished, spilled / f"{next(iter(finished))}.safetensors")
            packed.update(dict.fromkeys(finished))  # read back once every layer is done

    def release_layer(index, layer):  # its quantized linears are packed now; their weights go
        release_weights(layer.get_submodule(local) for local in arch.linears if f"{prefix}.{index}.{local}" in packed)

    map_weights(loaded)  # so that releasing a layer's weights gives their memory back
    sparse = sparse_24_masks(loaded.model, chain, plan)
    require(
        not (sparse and config.method in CODEBOOK_METHODS),
        f"{config.method} codebooks do not keep pruned weights at zero; quantize a 2:4 model with rtn, gptq or awq",
    )
    with atomic_directory(out) as tmp, progress_bar(f"quantize ({config.method})", loaded.config.num_hidden_layers) as advance:
        spilled = tmp / ".layers"  # each finished layer's packed weights until the artifact is written
        spilled.mkdir()
        walk_layers(loaded, calib if config.method != "rtn" else None, config, quantize_layer, advance, release_layer, config.true_sequential, tmp)
        for file in spilled.iterdir():
            packed.update(read_spilled(file))
        if sparse or config.method in CODEBOOK_METHODS:
            save_lmpress_packed(loaded.model, packed, tmp)  # what compressed-tensors cannot carry
        else:
            save_pack_quantized(loaded.model, packed, plan, tmp, config.act_order)
        packed.clear()  # written: their memory, and the model's, goes back before the tokenizer loads and the kernels are validated
        loaded.model = None
        gc.collect()  # the model's modules reference each other: only a collection frees them (and unmaps the embedding)
        release_free_memory()
        loaded.tokenizer.save_pretrained(tmp)
        shutil.rmtree(spilled)
        validate(tmp)
        record = {"stage": "quantize", "params": config.ran_with(), "overrides": overrides, **calibration_record(calib)}
        write_lineage(tmp, chain, record, run)
    return Path(out)


def _quantize_bitsandbytes(loaded, plan: dict, method: str, folder: Path) -> None:
    """bitsandbytes quantizes at load: NF4 (blocks of 64 with absmax scales) or LLM.int8
    (per-row absmax); the planned linears are quantized, every other linear kept dense."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    keep = [name for name, module in loaded.model.named_modules() if isinstance(module, torch.nn.Linear) and name not in plan]
    if method == "nf4":
        bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32, llm_int8_skip_modules=keep)
    else:
        bnb = BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=keep)
    model = AutoModelForCausalLM.from_pretrained(loaded.folder, quantization_config=bnb, dtype=torch.float32)
    model.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)


# --------------------------------------------------------------------------- prune

PRUNE_REPORT = "pruning.json"
COMPRESSED_FOLDER = "compressed"  # the served form inside a pruning artifact


@dataclass
class PruneConfig:
    method: str = "wanda"  # magnitude | wanda | sparsegpt
    pattern: str = "2:4"  # N:M, or a ratio such as 0.5 for unstructured sparsity
    refine_cycles: int = 0  # > 0: refine each mask for up to this many swap rounds (DSnoT-style); 0: off
    bits: int = 0  # sparsegpt: also quantize the kept weights to this many bits (0: keep them fp)
    group_size: int = 64
    symmetric: bool = True
    act_order: bool = True  # GPTQ's column order, for linears a plan leaves dense but quantized
    clip_search: bool | None = None  # sparsegpt: every grid it fits (pruned or dense) clipped as quantize's are; None: on where it applies
    damp: float = 0.01
    hessian_shrinkage: float = HESSIAN_SHRINKAGE  # sparsegpt: as quantize's GPTQ
    sequential: bool = True
    forward_dtype: str = "auto"
    skip: str = ""  # comma-separated regexes of linear names left dense
    overrides: str = ""  # YAML file: {regex of linear names: pattern, e.g. "4:8" or 0.6, or {pattern, bits, group_size, symmetric}}
    batch_size: int = 2  # sequential passes: sparsegpt 2:4 took 355 s and peaked at 2483 MB against 378 s and 2581 MB at 4

    def validate(self) -> None:
        from compressors.sparsity import PRUNE_METHODS, parse_pattern

        require(self.method in PRUNE_METHODS, f"unknown pruning method '{self.method}'; use one of {', '.join(PRUNE_METHODS)}")
        parse_pattern(self.pattern)
        check_hessian_regularization(self.damp, self.hessian_shrinkage)
        require(self.refine_cycles >= 0, f"refine cycles must be 0 (off) or positive (got {self.refine_cycles})")
        require(self.bits == 0 or self.method == "sparsegpt", "only sparsegpt quantizes while pruning; pass --bits 0, or quantize afterwards")
        self.clip_search = resolve_clip_search(self.clip_search, self.method == "sparsegpt", "--method sparsegpt")
        require(
            not (self.refine and self.bits),
            "--refine changes the mask after pruning, which a joint quantization cannot follow; prune with --refine, then quantize",
        )
        if self.bits:
            self.grid()
        require_positive(batch_size=self.batch_size)
        self.forward_dtype = resolve_forward_dtype(self.forward_dtype)  # the lineage records the dtype that ran

    def grid(self, settings: dict | None = None):
        """The grid of the kept weights: the config's, or a plan entry's {bits, group_size,
        symmetric} over it; None where nothing is quantized."""
        settings = {"bits": self.bits, "group_size": self.group_size, "symmetric": self.symmetric, **(settings or {})}
        return GridSpec(settings["bits"], settings["group_size"], settings["symmetric"]) if settings["bits"] else None

    @property
    def refine(self) -> bool:
        return self.refine_cycles > 0

    def options_needing_calibration(self) -> dict[str, bool]:
        """The options, as typed, that need calibration data (see `needed_by`)."""
        return {f"--method {self.method}": self.method != "magnitude", f"--refine-cycles {self.refine_cycles}": self.refine}

    @property
    def needs_calibration(self) -> bool:
        return any(self.options_needing_calibration().values())


def pruning_plan(model, config: PruneConfig, overrides: dict) -> dict:
    """Full linear name -> (SparsityPattern, grid or None): the default, then overrides (first
    matching regex wins; a pattern, or {pattern, bits, group_size, symmetric}), minus skipped
    linears; each checked against its linear's input width."""
    from compressors.sparsegpt import check_clip_search_fits
    from compressors.sparsity import parse_pattern

    plan = {}
    for name, module, setting in planned_linears(model, config.skip, overrides, config.pattern):
        grid_settings = {}
        if isinstance(setting, dict):
            require(
                set(setting) <= {"pattern", "bits", "group_size", "symmetric"},
                f"override for '{name}' must be a pattern or set only pattern, bits, group_size, symmetric",
            )
            grid_settings = {key: value for key, value in setting.items() if key != "pattern"}
            setting = setting.get("pattern", config.pattern)
        pattern, grid = parse_pattern(setting), config.grid(grid_settings)
        pattern.check_width(module.in_features, name)
        require(grid is None or config.method == "sparsegpt", f"override for '{name}' quantizes; only --method sparsegpt quantizes while pruning")
        require(grid is None or not config.refine, "--refine changes the mask after pruning, which a joint quantization cannot follow; prune with --refine, then quantize")
        if grid is not None:
            grid.check_width(module.in_features, name)
            if config.clip_search:
                check_clip_search_fits(pattern, grid, module.in_features)
        plan[name] = pattern, grid
    return plan


def prune(model: str, calibration: Path | None, out: Path, config: PruneConfig) -> Path:
    """Prune every decoder linear (magnitude; Wanda or SparseGPT from the calibration data,
    layer-sequential or from the stored statistics), optionally refine the masks, and write
    the dense-with-zeros model (any loader opens it) plus, where a linear is 2:4 sparse or
    quantized, the compressed form lmpress serves with its kernels in `compressed/`."""
    from compressors.lmpress_format import packed_weight, save_lmpress_packed
    from compressors.gptq import gptq_quantize
    from compressors.sparsegpt import PrunedLinear, sparsegpt_prune
    from compressors.sparsity import keep_mask, magnitude_score, reconstruction_error, refine_mask, wanda_score
    from pipelines.serving import validate

    config.validate()
    overrides = load_overrides(config.overrides)  # first: a plan that is not a file is that mistake, not an output inside it
    run, loaded, chain, calib = begin_stage("prune", model, calibration, out, needed_by("prune", config.options_needing_calibration()), (config.overrides,))
    plan = pruning_plan(loaded.model, config, overrides)
    require(bool(plan), "nothing to prune: every linear was skipped")
    prefix = architecture_of(loaded.config).layers
    pruned, report = {}, {}

    def prune_layer(index, layer, stats):
        for local in architecture_of(loaded.config).linears:
            name = f"{prefix}.{index}.{local}"
            if name not in plan:
                continue
            (pattern, grid), weight = plan[name], layer.get_submodule(local).weight.data
            if config.method == "sparsegpt" and grid is not None and pattern.sparsity == 0:  # a dense linear of a plan: GPTQ
                q = gptq_quantize(weight, stats[local].second_moment, grid, config.damp, config.act_order, clip_search=config.clip_search,
                                  shrinkage=config.hessian_shrinkage)
                result = PrunedLinear(q.dequantized(), torch.ones_like(weight, dtype=torch.bool), q)
            elif config.method == "sparsegpt":
                result = sparsegpt_prune(weight, stats[local].second_moment, pattern, config.damp, grid=grid, clip_search=config.clip_search,
                                         shrinkage=config.hessian_shrinkage)
            else:
                score = magnitude_score(weight) if config.method == "magnitude" else wanda_score(weight, stats[local].second_moment)
                keep = keep_mask(score, pattern)
                result = PrunedLinear(weight.float() * keep, keep)
            entry = {"pattern": str(pattern), "weights": result.keep.numel(), "zeros": int((~result.keep).sum())}
            if local in stats:  # the calibration objective E||(W - W')x||^2, summed over output rows
                entry["objective"] = reconstruction_error(weight, result.weight, stats[local].second_moment).sum().item()
            if config.refine:
                refined, keep = refine_mask(weight, result.weight, result.keep, stats[local].second_moment, pattern, config.refine_cycles)
                result = PrunedLinear(refined, keep)
                entry["refined_objective"] = reconstruction_error(weight, refined, stats[local].second_moment).sum().item()
            weight.copy_(result.weight)  # in place: later layers see it (see quantize)
            pruned[name], report[name] = result, entry

    # magnitude needs none, but reports its objective when stored statistics are at hand
    needs_statistics = config.needs_calibration or (calib is not None and not config.sequential)
    with atomic_directory(out) as tmp, progress_bar(f"prune ({config.method})", loaded.config.num_hidden_layers) as advance:
        walk_layers(loaded, calib if needs_statistics else None, config, prune_layer, advance, scratch=tmp)
        record = {"stage": "prune", "params": asdict(config), "overrides": overrides, **calibration_record(calib)}
        write_json(tmp / PRUNE_REPORT, {"linears": report, **_pruning_summary(report)})
        # served compressed: 2:4 linears (their kept half, fp16 or quantized), other quantized ones as grids
        served = {name: result if plan[name][0].is_24 else result.quantized for name, result in pruned.items()}
        compressed = {name: form for name, form in served.items() if form is not None}
        if compressed:
            target = tmp / COMPRESSED_FOLDER
            save_lmpress_packed(loaded.model, {name: packed_weight(item) for name, item in compressed.items()}, target)
            loaded.tokenizer.save_pretrained(target)
            validate(target)
            write_lineage(target, chain, record, run)
        loaded.model.save_pretrained(tmp)  # dense with zeros (dequantized values where quantized)
        loaded.tokenizer.save_pretrained(tmp)
        write_lineage(tmp, chain, record, run)
    return Path(out)


def _pruning_summary(report: dict) -> dict:
    entries = report.values()
    summary = {"sparsity": round(sum(e["zeros"] for e in entries) / sum(e["weights"] for e in entries), 6)}
    for key in ("objective", "refined_objective"):
        if all(key in e for e in entries):
            summary[key] = sum(e[key] for e in entries)
    return summary


# --------------------------------------------------------------------------- structured pruning and layer dropping

STRUCTURE_REPORT = "structure.json"


@dataclass
class StructuredConfig:
    target_params: float = 0.8  # share of the model's parameters to keep
    scorer: str = "flap"  # flap | wanda-sp | magnitude
    bias_compensation: bool = True  # pruned units' mean output folded into a bias (Llama's mlp_bias / attention_bias)
    keep_heads: int = 0  # > 0: query heads kept per layer (whole KV groups); 0: the allocation decides
    allocation: str = "uniform"  # uniform: the same widths in every layer (a plain config) | global: per-layer widths (lmpress's loader)
    recovery_steps: int = 0  # > 0: distill from the parent for this many batches of calibration tokens
    recovery_lr: float = 5e-5
    batch_size: int = 2  # recovery: calibration windows per step

    def validate(self) -> None:
        from compressors.structured import SCORERS

        require(0 < self.target_params < 1, f"target params must be in (0, 1): the share kept, e.g. 0.75 (got {self.target_params})")
        require(self.scorer in SCORERS, f"unknown scorer '{self.scorer}'; use one of {', '.join(SCORERS)}")
        require(self.allocation in ("uniform", "global"), f"allocation must be uniform or global (got '{self.allocation}')")
        require(not (self.keep_heads and self.allocation == "global"), "--keep-heads fixes every layer's heads; use it with --allocation uniform")
        _validate_recovery(self)


@dataclass
class DropLayersConfig:
    n: int = 4  # decoder layers to drop
    scorer: str = "influence"  # influence (lowest block influence first) | last (the last n layers, the baseline)
    layers: str = ""  # comma-separated indices of the layers to drop (a searched plan); overrides n and scorer
    recovery_steps: int = 0
    recovery_lr: float = 5e-5
    batch_size: int = 2

    def validate(self) -> None:
        require(self.n > 0, f"--n must be at least 1 (got {self.n})")
        require(self.scorer in ("influence", "last"), f"unknown scorer '{self.scorer}'; use influence or last")
        self.given_layers()
        _validate_recovery(self)

    def given_layers(self) -> list[int]:
        layers = sorted(set(number_list(self.layers, int, "--layers")))
        require(all(index >= 0 for index in layers), f"--layers takes layer indices from 0 (got '{self.layers}')")
        return layers


def _validate_recovery(config) -> None:
    require(config.recovery_steps >= 0, f"recovery steps must be 0 (off) or positive (got {config.recovery_steps})")
    require(config.recovery_lr > 0, f"recovery lr must be positive (got {config.recovery_lr})")
    require_positive(batch_size=config.batch_size)


def prune_structured(model: str, calibration: Path | None, out: Path, config: StructuredConfig) -> Path:
    """Remove the lowest-scoring MLP channels and head groups until `target_params` of the
    parameters remain: the same number in every layer (a plain, smaller HF checkpoint) or,
    with global allocation, per layer (widths recorded in config.json for lmpress's loader)."""
    from compressors.structured import (
        UnitCosts, global_allocation, groups_to_drop, head_group_scores, mlp_channel_scores, prune_heads, prune_mlp,
        uniform_allocation,
    )
    from pipelines.models import LAYER_WIDTHS

    config.validate()
    run, loaded, chain, calib = begin_stage("prune-structured", model, calibration, out, needed_by("prune-structured", {
        f"--scorer {config.scorer}": config.scorer != "magnitude", "--bias-compensation true": config.bias_compensation,
        f"--recovery-steps {config.recovery_steps}": config.recovery_steps > 0,
    }))
    arch, model_config = architecture_of(loaded.config), loaded.config
    require(arch.attention[0] == "self_attn.q_proj" and arch.mlp[-1] == "mlp.down_proj", f"{model_config.model_type} is not a q/k/v/o + gate/up/down model")
    biased = config.bias_compensation
    require(
        not biased or hasattr(model_config, "mlp_bias") and hasattr(model_config, "attention_bias"),
        f"bias compensation needs a config with mlp_bias and attention_bias (Llama); {model_config.model_type} has none: "
        "pass --bias-compensation false",
    )
    layers = decoder_layers(loaded.model)
    used = ("mlp.down_proj", "self_attn.o_proj")  # the inputs whose statistics score and compensate
    stats = [{k: v for k, v in calib.layer(i).items() if k in used} if calib is not None else {} for i in range(len(layers))]
    channel_scores = [mlp_channel_scores(layer.mlp, stats[i].get("mlp.down_proj"), config.scorer) for i, layer in enumerate(layers)]
    group_scores = [head_group_scores(layer.self_attn, stats[i].get("self_attn.o_proj"), model_config, config.scorer) for i, layer in enumerate(layers)]
    before = sum(p.numel() for p in loaded.model.parameters())
    fixed_groups = groups_to_drop(model_config, config.keep_heads) if config.keep_heads else None
    remove = round(before * (1 - config.target_params))
    if biased:  # the biases compensation adds count too (an upper bound: the full widths')
        q_rows = model_config.num_attention_heads * head_dim_of(model_config)
        kv_rows = model_config.num_key_value_heads * head_dim_of(model_config)
        remove += len(layers) * (2 * model_config.intermediate_size + 2 * model_config.hidden_size + q_rows + 2 * kv_rows)
    if config.allocation == "uniform":
        uniform = uniform_allocation(channel_scores, group_scores, UnitCosts.of(model_config), remove, fixed_groups)
        drop_channels, drop_groups = [uniform[0]] * len(layers), [uniform[1]] * len(layers)
    else:
        drop_channels, drop_groups = global_allocation(channel_scores, group_scores, UnitCosts.of(model_config), remove)

    head_dim = head_dim_of(model_config)
    kept = {}
    with atomic_directory(out) as tmp:
        for i, layer in enumerate(layers):
            keep_channels = channel_scores[i].argsort(descending=True, stable=True)[: channel_scores[i].numel() - drop_channels[i]].sort().values
            keep_groups = group_scores[i].argsort(descending=True, stable=True)[: group_scores[i].numel() - drop_groups[i]].sort().values
            mean = lambda linear: stats[i][linear].mean if biased else None  # noqa: E731
            prune_mlp(layer.mlp, keep_channels, mean("mlp.down_proj"), biased or bool(getattr(model_config, "mlp_bias", False)))
            prune_heads(layer.self_attn, keep_groups, model_config, mean("self_attn.o_proj"), biased or bool(getattr(model_config, "attention_bias", False)))
            kept[i] = {"mlp_channels": keep_channels.tolist(), "kv_heads": keep_groups.tolist()}
        queries_per_group = model_config.num_attention_heads // model_config.num_key_value_heads
        widths = [{"intermediate_size": len(k["mlp_channels"]), "num_key_value_heads": len(k["kv_heads"])} for k in kept.values()]
        # the config's widths are the largest; layers that differ are listed for lmpress's loader
        model_config.intermediate_size = max(w["intermediate_size"] for w in widths)
        model_config.num_key_value_heads = max(w["num_key_value_heads"] for w in widths)
        model_config.num_attention_heads = model_config.num_key_value_heads * queries_per_group
        model_config.head_dim = head_dim  # no longer hidden_size / heads
        if any(w != widths[0] for w in widths):
            setattr(model_config, LAYER_WIDTHS, widths)
        if biased:
            model_config.mlp_bias = model_config.attention_bias = True
        report = {"params_before": before, "mlp_channels_dropped": drop_channels, "head_groups_dropped": drop_groups, "kept": kept}
        _finish_smaller_model(loaded, model, calib, _recovery(config), tmp, report, {"stage": "prune-structured", "params": asdict(config)}, chain, run)
    return Path(out)


def drop_layers(model: str, calibration: Path | None, out: Path, config: DropLayersConfig) -> Path:
    """Remove whole decoder layers: those with the lowest block influence (how much a layer
    turns its input, from the calibration statistics), or the last ones; a plain HF checkpoint."""
    config.validate()
    given = config.given_layers()
    needs_influence = config.scorer == "influence" and not given
    run, loaded, chain, calib = begin_stage("drop-layers", model, calibration, out, needed_by(
        "drop-layers", {f"--scorer {config.scorer}": needs_influence, f"--recovery-steps {config.recovery_steps}": config.recovery_steps > 0}))
    layers = decoder_layers(loaded.model)
    count = len(given) or config.n
    asked = f"--layers {config.layers}" if given else f"--n {config.n}"
    require(count < len(layers), f"{asked} would drop every layer of the {len(layers)}; drop at most {len(layers) - 1} (a quarter is a usual limit)")
    if given:
        require(given[-1] < len(layers), f"--layers names layer {given[-1]}, but the model has layers 0-{len(layers) - 1}")
        influence, dropped = None, given
    elif config.scorer == "influence":
        influence = calib.block_influence()
        dropped = sorted(sorted(range(len(layers)), key=lambda i: influence[i])[: config.n])
    else:
        influence, dropped = None, list(range(len(layers) - config.n, len(layers)))
    with atomic_directory(out) as tmp:
        kept = [i for i in range(len(layers)) if i not in dropped]
        keep_layers(loaded.model, kept)
        report = {"dropped_layers": dropped, "block_influence": influence}
        record = {"stage": "drop-layers", "params": asdict(config), "kept_layers": kept}
        _finish_smaller_model(loaded, model, calib, _recovery(config), tmp, report, record, chain, run)
    return Path(out)


# --------------------------------------------------------------------------- KV-head merging


@dataclass
class KVMergeConfig:
    kv_heads: int = 1  # KV heads per layer after merging; must divide the current count
    method: str = "aligned"  # mean (average the merged heads) | aligned (calibration-fitted, see compressors/kvmerge.py)
    samples: int = 64  # calibration windows the merge reads (evenly spread over the stored ones): grouping and the o_proj refit
    damp: float = 0.01  # ridge of the o_proj refit, relative to the mean diagonal
    heal_steps: int = 0  # > 0: distill from the parent for this many batches of calibration tokens
    heal_lr: float = 1e-4
    batch_size: int = 4  # windows per forward (merge) and per step (heal)

    def validate(self) -> None:
        from compressors.kvmerge import METHODS

        require(self.method in METHODS, f"unknown method '{self.method}'; use one of {', '.join(METHODS)}")
        require(self.kv_heads >= 1, f"--kv-heads must be at least 1 (got {self.kv_heads})")
        require(0 < self.damp < 1, f"damp must be in (0, 1) (got {self.damp}); 0.01 is the usual value")
        require(self.heal_steps >= 0, f"heal steps must be 0 (off) or positive (got {self.heal_steps})")
        require(self.heal_lr > 0, f"heal lr must be positive (got {self.heal_lr})")
        require_positive(samples=self.samples, batch_size=self.batch_size)


def _check_kv_merge_target(model: str, kv_heads: int):
    """What kv-merge needs of the model, checked on its config before any weight is read;
    returns the config."""
    from transformers import AutoModelForCausalLM

    from pipelines.models import LAYER_WIDTHS, read_config

    config = read_config(resolve_model(model))
    with torch.device("meta"):  # the module tree only, no memory
        skeleton = AutoModelForCausalLM.from_config(config)
    attention = next((m for m in skeleton.modules() if type(m).__name__.endswith("Attention")), None)
    require(
        attention is not None and all(hasattr(attention, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj")),
        f"{config.model_type} has no separate k_proj and v_proj (its attention projects keys and values together); "
        "kv-merge needs Llama-style q/k/v/o projections",
    )
    architecture_of(config)
    require(not getattr(config, LAYER_WIDTHS, None), f"{model} has per-layer widths; kv-merge needs the same KV heads in every layer")
    heads, current = config.num_attention_heads, config.num_key_value_heads
    # as many as it has is the identity merge (a sweep's unmerged point, healed like the rest); more cannot be made
    require(kv_heads <= current, f"--kv-heads {kv_heads}: the model has {current} KV heads, and merging only reduces them; pass at most {current}")
    require(heads % kv_heads == 0, f"--kv-heads {kv_heads} does not divide the {heads} query heads; use a divisor of {current}")
    require(current % kv_heads == 0, f"--kv-heads {kv_heads} does not divide the {current} KV heads into equal groups; use a divisor of {current}")
    return config


def kv_merge(model: str, calibration: Path | None, out: Path, config: KVMergeConfig) -> Path:
    """Merge each layer's KV heads into `kv_heads` (see compressors/kvmerge.py), layer by layer
    on the calibration windows (each layer is fitted on the outputs of the already-merged ones),
    optionally heal by distillation from the parent; a plain GQA checkpoint."""
    from compressors.kvmerge import AttentionHeads, AttentionInputStatistics, OutputRefit, balanced_groups, merge_heads
    from pipelines.models import kv_cache_bytes_per_token

    config.validate()
    kv_before = _check_kv_merge_target(model, config.kv_heads).num_key_value_heads
    # as many heads as it has (a sweep's unmerged point) leaves every layer as it is: the aligned
    # method's key rescaling and o_proj refit are only near-exact, and not exact at all through a
    # per-head k_norm (Qwen3, Gemma3: logits moved by 0.02)
    merging = config.kv_heads < kv_before
    grouping = 1 < config.kv_heads < kv_before  # with one group, or one head a group, there is nothing to choose
    needs_calibration = needed_by("kv-merge", {
        f"--method {config.method}": config.method == "aligned" and merging, f"--kv-heads {config.kv_heads}": grouping,
        f"--heal-steps {config.heal_steps}": config.heal_steps > 0,
    })
    run, loaded, chain, calib = begin_stage("kv-merge", model, calibration, out, needs_calibration)
    model_config = loaded.config
    require(
        config.method == "mean" or not merging or not hasattr(decoder_layers(loaded.model)[0].self_attn, "k_norm"),
        f"{model_config.model_type} normalizes each key head (k_norm), which the aligned merge's RoPE-commuting key fold "
        "cannot pass through; use --method mean",
    )
    shape = (model_config.num_attention_heads, kv_before, head_dim_of(model_config))
    softcap = getattr(model_config, "attn_logit_softcapping", None)
    seed = calib.manifest["seed"] if calib is not None else 0
    report = {"kv_heads_before": kv_before, "kv_heads_after": config.kv_heads, "groups": {}}

    def merge_layer(index: int, layer, inputs: list) -> None:
        """`inputs`: the attention's calls on the calibration batches (none without calibration)."""
        attention = layer.self_attn
        heads = AttentionHeads.of(attention, *shape)
        statistics = AttentionInputStatistics(attention, inputs) if inputs else None
        groups = balanced_groups(statistics.head_similarity if grouping else None, config.kv_heads, kv_before, seed)
        merged, order = merge_heads(heads, groups, config.method, heads.input_moment(statistics) if statistics else None)
        if config.method == "aligned":
            refit = OutputRefit(heads, merged, order, attention.scaling, softcap)
            for call in inputs:
                refit.add(call)
            merged.o = refit.solve(config.damp)
        merged.write(attention, attention.q_proj.weight.dtype)
        attention.num_key_value_groups = shape[0] // config.kv_heads  # what HF's attention repeats keys by
        report["groups"][index] = groups

    with atomic_directory(out) as tmp, progress_bar(f"kv-merge ({config.method})", model_config.num_hidden_layers) as advance:
        if not merging:  # the identity: every layer as it is
            report["groups"] = {index: [[head] for head in range(kv_before)] for index in range(model_config.num_hidden_layers)}
            advance(model_config.num_hidden_layers)
        elif needs_calibration:  # layer by layer: each layer is fitted on the outputs of the merged ones before it
            with closing(LayerRunner(loaded.model, calib.spread_samples(config.samples), config.batch_size, on_layer_done=lambda _: advance(),
                                     scratch=tmp)) as runner:
                for index, layer in runner:
                    merge_layer(index, layer, runner.capture_inputs(layer, layer.self_attn))
        else:
            for index, layer in enumerate(decoder_layers(loaded.model)):
                merge_layer(index, layer, [])
                advance()
        report["kv_cache_bytes_per_token_fp16"] = {"before": kv_cache_bytes_per_token(model_config)}
        model_config.num_key_value_heads = config.kv_heads
        report["kv_cache_bytes_per_token_fp16"]["after"] = kv_cache_bytes_per_token(model_config)
        recovery = (config.heal_steps, config.heal_lr, config.batch_size)
        _finish_smaller_model(loaded, model, calib, recovery, tmp, report, {"stage": "kv-merge", "params": asdict(config)}, chain, run)
    return Path(out)


# --------------------------------------------------------------------------- draft models

DRAFT_REPORT = "draft.json"
VOCAB_TRIM_FILE = "vocab_trim.safetensors"  # token_ids: the target token id of each draft LM-head row
GENERATE_BATCH = 16  # prompts the target continues at once: 16 sequences decode for about 3x the time of one on a CPU


@dataclass
class DraftConfig:
    layers: int = 4  # target decoder layers the draft keeps (0 with `draft`: a user-given draft instead)
    draft: str = ""  # a user-given draft: a structured-pruned copy, or any small model with the target's tokenizer
    selection: str = "influence"  # influence (the target's most influential layers, measured on its outputs) | even
    vocab_trim: int = 0  # > 0: the draft's LM head keeps this many rows, the tokens the target emits most (VOCABTRIM)
    prompts: int = 64  # calibration windows whose beginnings the target continues (FastDraft-style data)
    prompt_len: int = 128  # real-text context before the continuation (32 instead: 1.49 tokens per forward, not 1.90)
    new_tokens: int = 128  # tokens the target generates per prompt, greedily
    real_windows: int = 0  # > 0: also this many calibration windows of real text (cut to the sequences' length)
    steps: int = 200  # distillation steps (0: the undistilled draft)
    lr: float = 1e-3
    cosine_decay: bool = False  # the learning rate falls to 0 along a half cosine
    batch_size: int = 4  # sequences per distillation step
    loss: str = "kl"  # kl (forward KL to the target's distribution) | tvd (total variation distance)
    checkpoint_every: int = 25  # steps between resumable checkpoints

    def validate(self) -> None:
        from compressors.draft import SELECTIONS
        from compressors.recovery import LOSSES

        require(not (self.layers and self.draft), "pass either --layers N (a subset of the target's layers) or --draft MODEL, not both")
        require(self.layers >= 0, f"--layers must be a positive count of target layers (got {self.layers}); pass e.g. --layers 4")
        require(self.layers > 0 or bool(self.draft), "pass --layers N (target layers the draft keeps, e.g. 4) or --draft MODEL")
        require(self.selection in SELECTIONS, f"unknown selection '{self.selection}'; use one of {', '.join(SELECTIONS)}")
        require(self.loss in LOSSES, f"unknown loss '{self.loss}'; use one of {', '.join(LOSSES)}")
        require(self.vocab_trim >= 0, f"--vocab-trim must be 0 (off) or a token count such as 8192 (got {self.vocab_trim})")
        require(self.steps >= 0, f"--steps must be 0 (no distillation) or positive (got {self.steps})")
        require(self.lr > 0, f"--lr must be positive (got {self.lr})")
        require(self.real_windows >= 0, f"--real-windows must be 0 (off) or positive (got {self.real_windows})")
        require_positive(
            prompts=self.prompts, prompt_len=self.prompt_len, new_tokens=self.new_tokens, batch_size=self.batch_size,
            checkpoint_every=self.checkpoint_every,
        )


def require_within_context(model_config, prompt_len: int, new_tokens: int) -> None:
    """A prompt and its continuation fit the model's context (checked before any weight is read)."""
    context = getattr(model_config, "max_position_embeddings", None)
    require(
        context is None or prompt_len + new_tokens <= context,
        f"--prompt-len {prompt_len} and --new-tokens {new_tokens} exceed the model's context of {context} tokens; make them shorter",
    )


def check_draft_fits(draft_folder: Path, target_folder: Path) -> None:
    """A draft proposes token ids that the target verifies: both must use one tokenizer and
    one vocabulary size (checked from the configs and tokenizers, before any weight is read),
    and a draft is not the target itself."""
    from compressors.draft import tokenizer_difference
    from pipelines.models import load_tokenizer, read_config

    require(
        Path(draft_folder).resolve() != Path(target_folder).resolve(),
        f"the draft {draft_folder} is the target itself; pass a smaller model of its family, e.g. one `lmpress draft` made",
    )
    difference = tokenizer_difference(load_tokenizer(draft_folder), load_tokenizer(target_folder))
    require(
        difference is None,
        f"draft {draft_folder} does not share the target's tokenizer ({difference}); speculative decoding needs the same "
        "token ids: pick a draft of the target's model family, or build one with `lmpress draft --layers N`",
    )
    rows, target_rows = read_config(draft_folder).vocab_size, read_config(target_folder).vocab_size
    require(
        rows == target_rows,
        f"draft {draft_folder} has {rows} vocabulary rows, the target {target_rows}; resize its embeddings to the target's first",
    )


def draft(target: str, calibration: Path | None, out: Path, config: DraftConfig) -> Path:
    """A draft for speculative decoding with `target`: a subset of the target's layers (or a
    user-given model), distilled on the target's own greedy continuations of calibration
    prompts against the target's next-token distributions. The target is the model as it
    serves (a compressed artifact included), so the draft learns what that model says.
    Progress is kept beside the output and an interrupted run resumes."""
    from compressors.draft import choose_layers, emitted_vocabulary, generate_continuations, teacher_pass
    from compressors.recovery import TrainingCheckpoint, distill
    from pipelines.artifact import ResumeFolder, inputs_key, model_identity
    from pipelines.serving import dense_copy

    config.validate()
    require_output_path(out, directory=True, inputs=(target, calibration, config.draft or None), kind="draft")
    require_calibration(calibration, "draft")
    run = StageRun()
    target_folder = resolve_model(target)
    target_config = load_config(target_folder)
    if config.draft:
        draft_folder = resolve_model(config.draft)
        draft_chain = model_chain(config.draft, draft_folder, load_config(draft_folder))
        check_draft_fits(draft_folder, target_folder)
    else:
        depth = target_config.num_hidden_layers
        require(
            config.layers < depth,
            f"--layers {config.layers} is not fewer than the target's {depth} layers; a draft keeps a few, e.g. --layers {max(1, depth // 6)}",
        )
    vocabulary = target_config.vocab_size
    require(config.vocab_trim < vocabulary, f"--vocab-trim {config.vocab_trim} is not below the vocabulary's {vocabulary} tokens; use e.g. 8192, or 0 for no trim")
    require_within_context(target_config, config.prompt_len, config.new_tokens)
    loaded = load_model(target)
    chain = model_chain(target, loaded.folder, loaded.config)
    calib = open_calibration(calibration, chain)
    seq_len = calib.manifest["seq_len"]
    require(config.prompt_len <= seq_len, f"--prompt-len {config.prompt_len} is longer than the calibration windows ({seq_len} tokens)")
    length = config.prompt_len + config.new_tokens
    require(
        not config.real_windows or length <= seq_len,
        f"--real-windows cuts the calibration windows ({seq_len} tokens) into sequences of --prompt-len + --new-tokens ({length}); make those shorter",
    )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # data and training on a GPU when there is one
    identity = model_identity(target, loaded.folder, chain)
    source = model_identity(config.draft, draft_folder, draft_chain) if config.draft else None
    resume = ResumeFolder(out, inputs_key(identity, source, asdict(config), calib.manifest["data_sha256"], calib.manifest["seed"]))

    # the data: the target's continuations of calibration prompts and its final hidden states on them
    data_file = resume.file("data.safetensors")
    data = resume.read(data_file.name, load_file)
    if data is None:
        prompts = calib.spread_samples(config.prompts)[:, : config.prompt_len].contiguous()
        loaded.model.to(device)
        with progress_bar("draft: target continuations", prompts.shape[0]) as advance:
            sequences = generate_continuations(loaded.model, prompts.to(device), config.new_tokens, GENERATE_BATCH, advance).cpu()
        if config.real_windows:  # real text, as the target reads it, beside its own continuations
            real = calib.spread_samples(config.real_windows)
            length = sequences.shape[1]
            sequences = torch.cat([sequences, real[:, : real.shape[1] // length * length].reshape(-1, length)])
        hidden, influence = teacher_pass(loaded.model, sequences.to(device), config.batch_size)
        loaded.model.cpu()
        data = {
            "input_ids": sequences.contiguous(), "hidden": hidden.cpu().contiguous(), "influence": torch.tensor(influence, dtype=torch.float64),
            "generated_sequences": torch.tensor(prompts.shape[0]),
        }
        save_file(data, data_file.with_name("data.partial"))
        data_file.with_name("data.partial").replace(data_file)
    sequences, hidden = data["input_ids"], data["hidden"]
    prompted = int(data["generated_sequences"])
    generated = sequences[:prompted, config.prompt_len :]  # what the target emitted (real text follows)
    run.lap("load_and_data")

    if config.draft:
        given = load_model(config.draft)
        student, tokenizer, kept = dense_copy(given.model), given.tokenizer, None
        del given
    else:
        influence = data["influence"].tolist() if config.selection == "influence" else None
        kept = choose_layers(target_config.num_hidden_layers, config.layers, influence)
        student, tokenizer = dense_copy(loaded.model), loaded.tokenizer
        keep_layers(student, kept)
    for embedding in (student.get_input_embeddings(), student.get_output_embeddings()):
        embedding.weight.requires_grad_(False)  # the largest part, and the space the target's tokens live in: kept as is
    token_ids = emitted_vocabulary(generated, sequences[:prompted, : config.prompt_len], vocabulary, config.vocab_trim) if config.vocab_trim else None
    student.to(device)
    teacher_head, student_head = (LMHead.of(model).rows(token_ids).to(device) for model in (loaded.model, student))
    del loaded  # the teacher is its cached hidden states from here on

    def teacher_logprobs(rows, ids):  # over the kept vocabulary: the target's distribution renormalized to it
        return teacher_head.logits(hidden[rows].to(device)).float().log_softmax(dim=-1)

    def student_logits(ids):
        return student_head.logits(student.base_model(input_ids=ids.to(device), use_cache=False).last_hidden_state)

    with progress_bar("draft: distillation", config.steps) as advance:
        training = "training.safetensors"
        checkpoint = TrainingCheckpoint(resume.file(training), config.checkpoint_every, resume.read(training, TrainingCheckpoint.read))
        losses = distill(
            student, teacher_logprobs, sequences, config.steps, config.lr, config.batch_size, calib.manifest["seed"], config.loss,
            student_logits, checkpoint, on_step=lambda *_: advance(), cosine_decay=config.cosine_decay,
        )
    run.lap("distill")
    student.cpu()
    with atomic_directory(out) as tmp:
        student.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        report = {
            "target": identity,
            "layers": student.config.num_hidden_layers,
            "layers_kept": kept,
            "target_block_influence": data["influence"].tolist(),
            "vocabulary": int(token_ids.numel()) if token_ids is not None else vocabulary,
            "data": {
                "sequences": sequences.shape[0], "generated_sequences": generated.shape[0], "prompt_tokens": config.prompt_len,
                "generated_tokens": generated.numel(), "real_text_sequences": sequences.shape[0] - generated.shape[0],
            },
            "loss": {"kind": config.loss, "first": losses[0], "last": losses[-1]} if losses else None,
        }
        if token_ids is not None:
            save_file({"token_ids": token_ids.contiguous()}, tmp / VOCAB_TRIM_FILE)
            report["generated_tokens_in_vocabulary"] = round(float(torch.isin(generated, token_ids).float().mean()), 6)
        write_json(tmp / DRAFT_REPORT, report)
        write_lineage(tmp, draft_chain if config.draft else chain, {"stage": "draft", "params": asdict(config), "target": identity, **calibration_record(calib)}, run)
    resume.remove()
    return Path(out)


@dataclass
class SpeculationConfig:
    corpora: str = "austen-heldout,pydoc-heldout"
    prompts: int = 8  # held-out prompts, shared out over the corpora
    prompt_len: int = 128
    new_tokens: int = 64
    lookahead: str = "4,8"  # draft tokens proposed per target forward; each is measured

    def validate(self) -> None:
        require_positive(prompts=self.prompts, prompt_len=self.prompt_len, new_tokens=self.new_tokens)
        require(bool(self.corpus_list), "no evaluation corpus given; pass e.g. --corpora austen-heldout,pydoc-heldout")
        try:
            require(bool(self.lookaheads) and all(k > 0 for k in self.lookaheads), f"--lookahead must be positive whole numbers such as 4,8 (got {self.lookahead!r})")
        except ValueError as error:
            raise LmpressError(f"--lookahead must be comma-separated whole numbers such as 4,8 (got {self.lookahead})") from error

    @property
    def corpus_list(self) -> list[str]:
        return [name.strip() for name in self.corpora.split(",") if name.strip()]

    @property
    def lookaheads(self) -> list[int]:
        return [int(k) for k in self.lookahead.split(",") if k.strip()]


def evaluate_draft(draft_model: str, target: str, out: Path | None, config: SpeculationConfig, allow_other_target: bool = False) -> dict:
    """Speculative greedy decoding of `target` with `draft_model` on held-out prompts: new tokens
    per target forward, acceptance rate, and wall time against plain greedy decoding (run
    alternately, prompt by prompt), with the check that both give the same tokens."""
    import time

    from compressors.speculative import speculative_greedy
    from pipelines.serving import load_draft

    config.validate()
    if out is not None:
        require_output_path(out, directory=False)
    require_within_context(load_config(resolve_model(target)), config.prompt_len, config.new_tokens)
    loaded = load_model(target)
    model, token_ids = load_draft(draft_model, loaded, allow_other_target)
    chains = model_chain(target, loaded.folder, loaded.config) + model_chain(draft_model, resolve_model(draft_model), model.config)
    prompts = []
    for i, corpus in enumerate(config.corpus_list):
        share = config.prompts // len(config.corpus_list) + (i < config.prompts % len(config.corpus_list))
        prompts += [window[None] for window in held_out_windows(corpus, loaded.tokenizer, chains, share, config.prompt_len, ("--prompts", "--prompt-len"))[0]] if share else []
    metrics = {
        "draft": draft_model, "target": target, "draft_layers": model.config.num_hidden_layers,
        # what ties these numbers to the two models (a published card picks them up by these)
        "draft_lineage_hash": chain_hash(model_chain(draft_model, resolve_model(draft_model), model.config)),
        "target_lineage_hash": chain_hash(model_chain(target, loaded.folder, loaded.config)),
        "draft_vocabulary": int(token_ids.numel()) if token_ids is not None else model.config.vocab_size,
        "prompts": len(prompts), "prompt_len": config.prompt_len, "new_tokens": config.new_tokens, "lookahead": {},
    }
    eos = loaded.model.generation_config.eos_token_id
    with progress_bar("speculative decoding", len(prompts) * len(config.lookaheads)) as advance:
        for lookahead in config.lookaheads:
            forwards = accepted = proposed = new = 0
            plain_s = speculative_s = 0.0
            identical = True
            for prompt in prompts:
                start = time.perf_counter()
                # the mask given: without it transformers masks every token equal to the pad id
                plain = loaded.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=config.new_tokens, do_sample=False,
                                              pad_token_id=0)
                plain_s += time.perf_counter() - start
                start = time.perf_counter()
                result = speculative_greedy(loaded.model, model, prompt, config.new_tokens, lookahead, token_ids, eos)
                speculative_s += time.perf_counter() - start
                identical &= bool(torch.equal(result.tokens, plain))
                forwards, accepted, proposed = forwards + result.target_forwards, accepted + result.accepted, proposed + result.proposed
                new += result.new_tokens
                advance()
            metrics["lookahead"][str(lookahead)] = {
                "tokens_per_target_forward": round(new / forwards, 4),
                "acceptance_rate": round(accepted / max(proposed, 1), 4),
                "plain_s": round(plain_s, 3), "speculative_s": round(speculative_s, 3), "speedup": round(plain_s / speculative_s, 3),
                "identical_output": identical,
            }
    if out is not None:
        write_json(Path(out), metrics)
    return metrics


def _recovery(config) -> tuple[int, float, int]:
    return config.recovery_steps, config.recovery_lr, config.batch_size


def _finish_smaller_model(loaded, parent: str, calib, recovery: tuple[int, float, int], tmp: Path, report: dict, record: dict, chain, run) -> None:
    """Optional recovery by distillation from the parent (`recovery`: steps, learning rate,
    windows per step; 0 steps: none), then the checkpoint, report and lineage."""
    from compressors.recovery import distill, live_teacher

    steps, lr, batch_size = recovery
    report["params_after"] = sum(p.numel() for p in loaded.model.parameters())
    if steps:
        teacher = load_model(parent).model
        with progress_bar("recovery (distillation)", steps) as advance:
            losses = distill(
                loaded.model, live_teacher(teacher), calib.input_ids, steps, lr, batch_size,
                seed=calib.manifest["seed"], on_step=lambda *_: advance(),
            )
        report["recovery_kl"] = {"first": losses[0], "last": losses[-1]}
        del teacher
    loaded.model.save_pretrained(tmp)
    loaded.tokenizer.save_pretrained(tmp)
    write_json(tmp / STRUCTURE_REPORT, report)
    write_lineage(tmp, chain, {**record, **calibration_record(calib)}, run)
