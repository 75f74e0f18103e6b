"""The stages. Each is one function that the CLI and `dvc repro` both call, configured by a
typed config whose fields are the keys of its params.yaml section and the record in the
lineage manifest."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from calibrate.corpora import check_disjoint, leading_windows, sample_windows, tokenize_part
from calibrate.runner import LayerRunner
from calibrate.stats import CALIBRATION_FORMAT, LayerStatisticsCollector
from pipelines.artifact import (
    StageRun,
    atomic_directory,
    chain_hash,
    model_chain,
    read_json,
    write_json,
    write_lineage,
)
from pipelines.errors import require
from pipelines.evaluation import LMHead, score_windows, size_metrics
from pipelines.models import layer_linears, load_model
from pipelines.progress import progress_bar


def require_directory_target(out: Path) -> None:
    """Fail before any work when the output cannot become a directory."""
    require(not Path(out).is_file(), f"output path {out} is a file; pass a directory path or remove the file")


def require_positive(**values: int) -> None:
    for name, value in values.items():
        require(value > 0, f"{name.replace('_', '-')} must be positive (got {value}); pass e.g. --{name.replace('_', '-')} 8")


# --------------------------------------------------------------------------- calibrate


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
    require_directory_target(out)
    run = StageRun()
    loaded = load_model(model)
    samples = sample_windows(config.corpus, loaded.tokenizer, config.samples, config.seq_len, config.seed)
    with atomic_directory(out) as tmp, progress_bar("calibrate: layers", loaded.config.num_hidden_layers) as advance:
        (tmp / "stats").mkdir()
        runner = LayerRunner(loaded.model, samples.input_ids, config.batch_size, on_layer_done=lambda _: advance())
        groups, tokens = None, None
        for index, layer in runner:
            with LayerStatisticsCollector(layer_linears(loaded.model, layer), loaded.config) as collector:
                runner.forward(layer)
            require(groups in (None, collector.group), f"layer {index} shares inputs differently from layer 0")
            groups, tokens = collector.group, collector.tokens
            save_file(collector.tensors(), tmp / "stats" / f"layer_{index:03d}.safetensors")
        save_file({"input_ids": samples.input_ids.contiguous()}, tmp / "samples.safetensors")
        calibration = {
            "corpus": config.corpus,
            "data_sha256": samples.data_hash(),
            "sample_ids": samples.sample_ids,
            "documents": samples.documents,
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
    corpora: str = "austen-heldout,pydoc-heldout"
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
    require_directory_target(reference)
    require(out is None or not Path(out).is_dir(), f"metrics path {out} is a directory; pass a .json file path")
    loaded = load_model(model)
    chain = model_chain(model, loaded.folder, loaded.config)
    calibration_documents = [doc for record in chain for doc in record.get("calibration", {}).get("documents", [])]
    windows = {}
    for corpus in config.corpus_list:
        part = tokenize_part(corpus, loaded.tokenizer)
        check_disjoint(calibration_documents, part.documents, corpus)
        windows[corpus] = (leading_windows(part, config.windows, config.seq_len), part.documents)

    building = not (reference / "manifest.json").is_file()
    is_base = len(chain) == 1 and base in (None, model)
    if building:
        _build_reference(loaded if is_base else load_model(base or chain[0]["model"]), reference, windows, config)
    manifest = read_json(reference / "manifest.json", f"delete {reference} so it is rebuilt")
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

    metrics = {"model": model, "lineage_hash": chain_hash(chain), **size_metrics(loaded.model, loaded.folder)}
    head = LMHead.load(reference / "lm_head.safetensors")
    for corpus, (tokens, _) in windows.items():
        require(corpus in manifest["corpora"], f"reference {reference} has no '{corpus}'; pass another --reference path")
        entry = manifest["corpora"][corpus]
        if building and is_base:  # the reference *is* this model's output, scored once just now
            metrics[corpus] = {"perplexity": entry["base_perplexity"], "kl_to_base": 0.0, "top1_agreement": 1.0, "tokens": entry["tokens"]}
            continue
        cached = load_file(reference / f"{corpus}.safetensors")
        require(bool(torch.equal(cached["input_ids"], tokens)), f"reference {reference} holds other '{corpus}' tokens; the tokenizers differ")
        with progress_bar(f"evaluate {corpus}", tokens.shape[0]) as advance:
            scores = score_windows(loaded.model, tokens, (head, cached["hidden"]), config.batch_size, on_batch=advance)
        metrics[corpus] = {
            "perplexity": round(scores.perplexity, 4),
            "kl_to_base": round(scores.kl_sum / scores.tokens, 6),
            "top1_agreement": round(scores.top1_agree / scores.tokens, 6),
            "tokens": scores.tokens,
        }
    if out is not None:
        write_json(Path(out), metrics)
    return metrics


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
