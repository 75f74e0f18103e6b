"""Publishing an artifact to a model hub, with a model card written from what lmpress recorded.

The card is generated from the artifact alone (its lineage, config, validation report and
draft report) plus the metrics files `lmpress evaluate` / `evaluate-draft` wrote for it, which
are matched to the artifact by lineage hash, never by file name. The upload folder is the
artifact's files plus the card (README.md): `--dry-run` writes exactly that folder and uploads
nothing; a real publish writes it too (hard links, no copies) and sends it as ONE commit through
huggingface_hub (`create_commit`, not `upload_folder`, whose Xet path may split a large folder
into several commits).

The token comes from huggingface_hub's usual places (HF_TOKEN, then `hf auth login`'s stored
token); lmpress never prints it, writes it or puts it in an error message.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from pipelines.artifact import atomic_directory, chain_hash, file_sha256, read_json, output_kind, read_lineage, require_output_path, write_json
from pipelines.errors import LmpressError, require

CARD_FILE = "README.md"
DRAFT_REPORT = "draft.json"
VALIDATION_REPORT = "validation.json"
# the settings that name a stage in the card's one-line summary (all settings are in the table)
HEADLINE = {
    "quantize": ("method", "bits", "group_size", "symmetric", "overrides"),  # bits and group size: where no override applies
    "prune": ("method", "pattern", "bits"),
    "prune-structured": ("target_params", "scorer", "allocation"),
    "drop-layers": ("n", "scorer", "layers"),
    "kv-merge": ("kv_heads", "method"),
    "draft": ("layers", "draft", "vocab_trim", "steps"),
}
VLLM_BITS = (4, 8)  # compressed-tensors pack-quantized widths vLLM's WNA16 kernels serve
# with zero points: vLLM's Marlin takes uint4 with zero points; its uint8 type passes the config
# check, then fails in the kernel
VLLM_ASYMMETRIC_BITS = (4,)
VLLM_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # linears vLLM runs as one (qkv_proj, gate_up_proj)


@dataclass
class PublishConfig:
    repo_id: str
    revision: str = "main"
    private: bool = False
    dry_run: bool = False
    metrics: str = ""  # comma-separated metrics files or folders of them
    force: bool = False  # publish without lineage or with a failed validation
    timeout: float = 60.0  # seconds to wait for each answer from the hub
    endpoint: str | None = None  # default: HF_ENDPOINT, else huggingface.co

    def validate(self) -> None:
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(self.repo_id)
        except HFValidationError:
            raise LmpressError(
                f"repo id '{self.repo_id}' is not valid on the hub: use ORG/NAME with letters, digits, '-', '_' and '.' "
                "(no '--' or '..', at most 96 characters)"
            ) from None
        require(self.repo_id.count("/") == 1, f"repo id '{self.repo_id}' needs its namespace: pass --repo-id ORG/NAME")
        require(
            re.fullmatch(r"[A-Za-z0-9][\w.\-/]*", self.revision) is not None and ".." not in self.revision and not self.revision.endswith((".lock", "/")),
            f"revision '{self.revision}' is not a valid branch name; pass e.g. --revision main",
        )
        require(self.timeout > 0, f"--timeout must be positive (got {self.timeout})")


# --------------------------------------------------------------------------- what the artifact says


@dataclass
class ArtifactFacts:
    folder: Path
    config: dict
    lineage: dict | None
    validation: dict | None
    draft_report: dict | None
    metrics: dict | None  # `lmpress evaluate` output for this artifact
    base_metrics: dict | None  # the same for its base model
    draft_metrics: dict | None  # `lmpress evaluate-draft` output, when the artifact is a draft
    tasks: dict | None = None  # `lmpress lm-eval` output for this artifact
    base_tasks: dict | None = None  # the same for its base model

    @property
    def chain(self) -> list[dict]:
        return self.lineage["chain"] if self.lineage else []

    @property
    def quantization(self) -> dict:
        return self.config.get("quantization_config") or {}


def read_facts(folder: Path, metrics: str = "") -> ArtifactFacts:
    from pipelines.models import check_weight_files

    folder = Path(folder)
    require(folder.is_dir(), f"{folder} is not a folder; pass a model artifact such as artifacts/quantized")
    require(
        (folder / "config.json").is_file() and any(folder.glob("*.safetensors")),
        f"{folder} is not a model (no config.json and safetensors weights); publish a model artifact, not a calibration, levels or search folder",
    )
    check_weight_files(folder)  # a truncated or damaged weights file is never published
    lineage = read_lineage(folder)
    optional = {name: read_json(folder / name, f"re-run the stage that made {folder}") if (folder / name).is_file() else None for name in (VALIDATION_REPORT, DRAFT_REPORT)}
    facts = ArtifactFacts(
        folder, read_json(folder / "config.json", "the model folder is damaged"), lineage,
        optional[VALIDATION_REPORT], optional[DRAFT_REPORT], None, None, None,
    )
    _match_metrics(facts, metrics)
    return facts


def _metrics_files(spec: str) -> list[tuple[Path, bool]]:
    """(file, named explicitly) for each metrics file in a comma list of files and folders."""
    files = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        path = Path(part)
        require(path.exists(), f"metrics path {path} does not exist; pass the files `lmpress evaluate --out` wrote")
        files += [(file, False) for file in sorted(path.glob("*.json"))] if path.is_dir() else [(path, True)]
    return files


def _match_metrics(facts: ArtifactFacts, spec: str) -> None:
    """Keep the metrics measured on this artifact, its base and (for a draft) its speculation,
    by lineage hash; a file named explicitly that belongs to another model is an error."""
    if not facts.lineage:
        return
    own, base = facts.lineage["hash"], chain_hash(facts.chain[:1])
    for file, explicit in _metrics_files(spec):
        metrics = read_json(file, "re-run the evaluation that wrote it")
        if not isinstance(metrics, dict):  # some other JSON in a metrics folder
            require(not explicit, f"{file} is not an lmpress metrics file; pass the files `lmpress evaluate --out` wrote")
            continue
        kind = "tasks" if "lm_eval" in metrics else "metrics"  # `lmpress lm-eval` scores, or `lmpress evaluate` metrics
        if metrics.get("draft_lineage_hash") == own:
            facts.draft_metrics = metrics
        elif metrics.get("lineage_hash") == own:
            setattr(facts, kind, metrics)
        elif metrics.get("lineage_hash") == base and len(facts.chain) > 1:
            setattr(facts, f"base_{kind}", metrics)
        elif explicit:
            raise LmpressError(
                f"{file} was measured on another model than {facts.folder} (or an older version of it); "
                f"re-run `lmpress evaluate {facts.folder} --out {file}` or leave it out of --metrics"
            )


def validation_problem(facts: ArtifactFacts) -> str | None:
    """Why the artifact's kernels cannot be vouched for, or None."""
    from pipelines.serving import validation_failures

    packed = bool(facts.quantization) and facts.quantization.get("quant_method") != "bitsandbytes"
    if facts.validation is None:
        return f"{facts.folder} holds packed weights but no validation report; run `lmpress validate {facts.folder}`" if packed else None
    failures = validation_failures(facts.validation, facts.folder)
    return f"{facts.folder}'s kernel validation failed: {failures[0]} (`lmpress validate {facts.folder}` checks again and bundles the kernels it checked)" if failures else None


# --------------------------------------------------------------------------- the model card


def base_hub_id(facts: ArtifactFacts) -> str | None:
    """The base model's hub id: a built-in's source repository, or the spec when it is one."""
    from pipelines.models import _HUB_ID, BUILTIN_MODELS

    if not facts.chain:
        return None
    spec = facts.chain[0]["model"]
    builtin = BUILTIN_MODELS.get(spec)
    return builtin.hub_id if builtin else (spec if _HUB_ID.match(spec) and not Path(spec).exists() else None)


def loaders(facts: ArtifactFacts) -> tuple[bool, bool]:
    """(stock transformers opens it, vLLM serves it)."""
    quant = facts.quantization
    if facts.config.get("lmpress_layer_widths") or quant.get("quant_method") == "lmpress":
        return False, False
    if quant.get("quant_method") == "compressed-tensors":
        weights = [group.get("weights") or {} for group in (quant.get("config_groups") or {}).values()]
        widths = quant.get("format") == "pack-quantized" and all(
            w.get("num_bits") in (VLLM_BITS if w.get("symmetric", True) else VLLM_ASYMMETRIC_BITS) for w in weights
        )
        return True, widths and _fused_parts_agree(facts)
    return True, True  # plain weights or bitsandbytes, both of which transformers and vLLM load


def _fused_parts_agree(facts: ArtifactFacts) -> bool:
    """vLLM builds each layer's q/k/v and gate/up projections as one linear with one scheme
    (it refuses parts quantized differently, or some quantized and some dense): each such set's
    parts must share their weights' settings, or all be dense."""
    from safetensors import safe_open

    from compressors.packed_int import config_group_of
    from pipelines.models import weight_files

    linears = set()
    for file in weight_files(facts.folder):
        with safe_open(file, framework="pt") as handle:
            linears.update(key.removesuffix(".weight_packed").removesuffix(".weight") for key in handle.keys())
    for parts in VLLM_FUSED:
        for name in (n for n in linears if n.endswith(f".{parts[0]}")):
            prefix = name.removesuffix(parts[0])
            settings = {json.dumps((config_group_of(prefix + part, facts.quantization) or {}).get("weights"), sort_keys=True)
                        for part in parts if prefix + part in linears}
            if len(settings) > 1:
                return False
    return True


def stored_bits(facts: ArtifactFacts) -> list[int]:
    """The bit widths the weights are stored at, from the quantization config (a per-layer plan
    can mix several); [] where it names none."""
    quant = facts.quantization
    if quant.get("quant_method") == "compressed-tensors":
        widths = {(group.get("weights") or {}).get("num_bits") for group in (quant.get("config_groups") or {}).values()}
    elif quant.get("quant_method") == "lmpress":
        widths = {module.get("bits") for module in (quant.get("modules") or {}).values()} - {16}  # 16: kept in fp16
    else:
        widths = set()
    return sorted(width for width in widths if isinstance(width, int))


def _settings(params: dict, keys=None) -> str:
    keys = keys if keys is not None else sorted(params)
    return ", ".join(f"{key}={params[key]}" for key in keys if key in params and params[key] not in ("", None))


def _stage_line(record: dict) -> str:
    params = record.get("params") or {}
    return f"{record['stage']} ({_settings(params, HEADLINE.get(record['stage'], ()))})" if params else record["stage"]


def _megabytes(n) -> str:
    return f"{n / 1e6:.1f} MB" if isinstance(n, (int, float)) else "–"


def _front_matter(facts: ArtifactFacts, tags: list[str]) -> str:
    from huggingface_hub import ModelCardData

    stock, _ = loaders(facts)
    base = base_hub_id(facts)
    # the hub's relations are adapter | merge | quantized | finetune: a model that stores quantized
    # weights is "quantized"; a pruned, merged or distilled one has changed weights: "finetune"
    quantized = bool(facts.quantization)
    license_id = facts.chain[0].get("license", "unknown") if facts.chain else "unknown"
    data = ModelCardData(
        base_model=base,
        license=license_id if license_id != "unknown" else "other",
        library_name="transformers" if stock else "lmpress",
        tags=tags,
        pipeline_tag="text-generation",
        base_model_relation=("quantized" if quantized else "finetune") if base else None,
    )
    return data.to_yaml()


def _tags(facts: ArtifactFacts) -> list[str]:
    tags = ["lmpress"]
    for record in facts.chain[1:]:
        params = record.get("params") or {}
        tags.append(record["stage"])
        if record["stage"] == "quantize":
            bits = stored_bits(facts) or [params.get("bits")]
            tags += [*(f"{width}-bit" for width in bits), *(["mixed-precision"] if len(bits) > 1 else []), str(params.get("method"))]
        if record["stage"] == "prune" and ":" in str(params.get("pattern", "")):
            tags.append(f"{params['pattern']}-sparsity")
        if record["stage"] == "draft":
            tags.append("speculative-decoding")
    method = facts.quantization.get("quant_method")
    if method:
        tags.append(method)
    return list(dict.fromkeys(tag for tag in tags if tag and tag != "None"))


def _loading_section(facts: ArtifactFacts, repo_id: str) -> list[str]:
    from compressors.packed_int import has_zero_points

    stock, vllm = loaders(facts)
    method = facts.quantization.get("quant_method")
    lines = ["## How to load", ""]
    if stock:
        needs = {"compressed-tensors": " (needs `pip install compressed-tensors`)", "bitsandbytes": " (needs `pip install bitsandbytes`)"}.get(method, "")
        if has_zero_points(facts.quantization):  # transformers' compressed load rejects packed zero points (llm-compressor issue 1618)
            lines += [
                f"Stock transformers{needs}, dequantized to dense weights (its compressed load does not take the packed zero points of "
                "asymmetric grids):", "", "```python",
                "from transformers import AutoModelForCausalLM, AutoTokenizer, CompressedTensorsConfig", "",
                f'model = AutoModelForCausalLM.from_pretrained("{repo_id}", quantization_config=CompressedTensorsConfig(dequantize=True))',
            ]
        else:
            lines += [
                f"Stock transformers{needs}:", "", "```python",
                "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
                f'model = AutoModelForCausalLM.from_pretrained("{repo_id}")',
            ]
        lines += [f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")', "```", ""]
    else:
        why = "per-layer widths" if facts.config.get("lmpress_layer_widths") else "a packed format (codebooks or 2:4 sparsity) no engine reads"
        lines += [f"This model uses {why}; stock transformers cannot open it. lmpress's loader serves it with its Triton kernels (torch reference on a CPU):", ""]
    lines += [
        "With lmpress (serves packed weights with the kernels in `kernels/`):", "", "```bash",
        f'lmpress generate {repo_id} "Once upon a time"', "```", "", "```python",
        "import torch", "from pipelines.serving import load_for_serving, serving_dtype", "",
        'device = "cuda" if torch.cuda.is_available() else "cpu"',
        "# generate's dtype: fp16 on a GPU; bf16 on a CPU that multiplies it natively (torch's int4 kernel serves 4-bit grids)",
        f'loaded = load_for_serving("{repo_id}", device, serving_dtype("auto", device))  # .model, .tokenizer', "```", "",
    ]
    if vllm:
        lines += ["vLLM:", "", "```bash", f"vllm serve {repo_id}", "```", ""]
    if facts.draft_report is not None:
        target = facts.draft_report.get("target", {})
        lines += [
            f"As a speculative-decoding draft for the model it was distilled against (`{target.get('model')}`, lineage "
            f"`{str(target.get('lineage_hash'))[:16]}…`); greedy output stays identical to the target's:", "", "```python",
            f'draft = AutoModelForCausalLM.from_pretrained("{repo_id}")',
            "output = target.generate(**inputs, assistant_model=draft, do_sample=False)", "```", "",
        ]
    return lines


def _metrics_section(facts: ArtifactFacts) -> list[str]:
    metrics, base = facts.metrics, facts.base_metrics or {}
    if metrics is None:
        return ["## Quality against the base model", "", "Not measured: no `lmpress evaluate` output for this artifact was given (`--metrics`).", ""]
    corpora = [key for key, value in metrics.items() if isinstance(value, dict) and "perplexity" in value]
    rows = []
    for corpus in corpora:
        own, theirs = metrics[corpus], base.get(corpus, {})
        base_ppl = own.get("base_perplexity", theirs.get("perplexity"))
        rows += [
            (f"perplexity, {corpus}", _number(base_ppl), _number(own["perplexity"])),
            (f"KL to base (nats/token), {corpus}", "0", _number(own["kl_to_base"])),
            (f"top-1 agreement with base, {corpus}", "100%", f"{100 * own['top1_agreement']:.1f}%"),
        ]
    rows += [
        ("parameters", _count(base.get("parameters")), _count(metrics.get("parameters"))),
        ("weights on disk", _megabytes(base.get("weights_bytes")), _megabytes(metrics.get("weights_bytes"))),
        ("bits per weight (decoder linears)", _number(base.get("bits_per_weight")), _number(metrics.get("bits_per_weight"))),
        ("KV-cache bytes per token (fp16)", _count(base.get("kv_cache_bytes_per_token_fp16")), _count(metrics.get("kv_cache_bytes_per_token_fp16"))),
    ]
    tokens = ", ".join(f"{metrics[c]['tokens']} tokens of {c}" for c in corpora)
    lines = [
        "## Quality and size against the base model", "",
        f"Measured by `lmpress evaluate` on held-out text ({tokens}), whose documents are disjoint from the calibration data.", "",
        "| metric | base model | this model |", "| --- | --- | --- |",
        *(f"| {name} | {b} | {t} |" for name, b, t in rows), "",
    ]
    return lines + _draft_rows(facts)


def _tasks_section(facts: ArtifactFacts) -> list[str]:
    """The `lmpress lm-eval` scores, beside the base's where it was scored the same way."""
    from pipelines.tasks import score_metrics, stderr_key

    scores = facts.tasks
    if scores is None:
        return []
    settings = {key: scores["lm_eval"].get(key) for key in ("version", "limit", "num_fewshot")}
    base = facts.base_tasks if facts.base_tasks and all(facts.base_tasks["lm_eval"].get(k) == v for k, v in settings.items()) else {"tasks": {}}

    def cell(entry: dict, metric: str) -> str:
        return "–" if metric not in entry else f"{_number(entry[metric])} ± {_number(entry.get(stderr_key(metric)))}"

    rows = [
        f"| {task} ({entry.get('examples')} examples) | {metric} | {cell(base['tasks'].get(task, {}), metric)} | {cell(entry, metric)} |"
        for task, entry in scores["tasks"].items() for metric in score_metrics(entry)
    ]
    limit = f"the first {settings['limit']} examples of each task" if settings["limit"] else "every example"
    return [
        "## Downstream tasks", "",
        f"Scored by lm-eval {settings['version']} through `lmpress lm-eval` ({settings['num_fewshot']}-shot, {limit}), on the model as lmpress serves it; "
        "the `-lastword` tasks are held-out text's sentence-final words, disjoint from the calibration data.", "",
        "| task | metric | base model | this model |", "| --- | --- | --- | --- |", *rows, "",
    ]


def _draft_rows(facts: ArtifactFacts) -> list[str]:
    draft = facts.draft_metrics
    if draft is None:
        return []
    lines = [
        f"Speculative decoding of `{draft['target']}` with this draft (`lmpress evaluate-draft`, {draft['prompts']} held-out prompts, "
        f"{draft['new_tokens']} new tokens each, greedy):", "",
        "| draft tokens per step | acceptance rate | tokens per target forward | speedup (measured on the evaluating machine) | output identical to the target's |",
        "| --- | --- | --- | --- | --- |",
    ]
    for lookahead, entry in draft["lookahead"].items():
        lines.append(f"| {lookahead} | {100 * entry['acceptance_rate']:.1f}% | {entry['tokens_per_target_forward']} | {entry['speedup']}x | {entry['identical_output']} |")
    return [*lines, ""]


def _number(value) -> str:
    return "–" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


def _count(value) -> str:
    return "–" if value is None else f"{value:,}"


def _served_form(folder: Path) -> list[str]:
    """A dense model's kernel lines: none, or, for a pruning artifact, where its packed form is
    (the folder the prune stage writes beside the dense weights, uploaded with them)."""
    from pipelines.stages import COMPRESSED_FOLDER

    served = folder / COMPRESSED_FOLDER
    if not (served / "config.json").is_file():
        return ["No packed weights: the model runs with standard dense layers.", ""]
    size = lambda path: sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e6  # noqa: E731
    lines = [f"These are the dense weights, pruned ones zero, which any loader opens ({size(folder):.0f} MB). `{COMPRESSED_FOLDER}/` holds the "
             f"same model in lmpress's packed form ({size(served):.0f} MB), which `lmpress generate` and `lmpress evaluate` serve."]
    if (served / VALIDATION_REPORT).is_file():
        report = read_json(served / VALIDATION_REPORT, f"re-run the stage that made {folder}")
        lines[0] += f" `lmpress validate` on it ({report['device']}): {report['checked']}; see `{COMPRESSED_FOLDER}/{VALIDATION_REPORT}`."
    return [*lines, ""]


def _kernels_section(facts: ArtifactFacts) -> list[str]:
    from pipelines.serving import kernel_sources

    report = facts.validation
    if report is None and not facts.quantization:
        return ["## Kernels", "", *_served_form(facts.folder)]
    if report is None:
        return []
    if not report["kernels"]:  # e.g. 2:4 with fp16 values: validate checked the layout, but nothing ran a kernel
        return [
            "## Kernels", "",
            f"`lmpress validate` on **{report['device']}**: {report['checked']}. There is no kernel to check or time, so no speed claim.", "",
        ]
    lines = [
        "## Kernels and their validation", "",
        f"`lmpress validate` ran each kernel on this model's own tensors against its torch reference at batch 1, 16 and 64: "
        f"{report['checked']} on **{report['device']}** (`gpu_validated: {str(report['gpu_validated']).lower()}`), "
        f"largest relative error {_number(report.get('max_rel_error'))}.", "",
    ]
    if not report["gpu_validated"]:
        lines += ["No GPU has checked or timed these kernels yet: there is no speed claim. Run `lmpress validate` on a GPU to add one.", ""]
    lines += ["| kernel | source | sha256 |", "| --- | --- | --- |"]
    lines += [f"| {name} | `{path}` | `{sha256[:16]}…` |" for name, entry in sorted(report["kernels"].items()) for path, sha256 in kernel_sources(entry).items()]
    speeds = [entry["speedup_vs_fp16"] for entry in report["layers"].values() if entry.get("speedup_vs_fp16")]
    if speeds:
        lines += ["", "| batch | speed vs dense fp16 (median over layers) |", "| --- | --- |"]
        for batch in sorted(speeds[0], key=int):
            values = sorted(s[batch] for s in speeds)
            lines.append(f"| {batch} | {values[len(values) // 2]:.2f}x |")
    return [*lines, ""]


def _calibration_section(facts: ArtifactFacts) -> list[str]:
    records = [r for r in facts.chain if r.get("calibration")]
    if not records:
        return []
    lines = ["## Calibration data", ""]
    for record in records:
        calibration = record["calibration"]
        tokens = f" x {calibration['tokens_per_sample']} tokens" if "tokens_per_sample" in calibration else ""
        lines.append(
            f"- {record['stage']}: {len(calibration['sample_ids'])} samples{tokens} of `{calibration['corpus']}` "
            f"from {len(calibration['documents'])} documents, seed {record.get('seed')}, data sha256 `{calibration['data_sha256'][:16]}…`"
        )
    return [*lines, ""]


def _lineage_section(facts: ArtifactFacts) -> list[str]:
    lines = [
        "## Lineage", "",
        f"Stage by stage, from `lineage.json` (hash `{facts.lineage['hash'][:16]}…`), which holds every parameter, "
        "the calibration sample ids and the package versions:", "",
        "| # | stage | settings | wall time | peak memory |", "| --- | --- | --- | --- | --- |",
    ]
    for number, record in enumerate(facts.chain):
        run = record.get("run", {})
        settings = _settings(record["params"]) if record.get("params") else f"`{record['model']}`, weights sha256 `{record.get('weights_sha256', '')[:16]}…`"
        if record.get("overrides"):
            settings += f"; per-layer plan of {len(record['overrides'])} entries"
        lines.append(
            f"| {number} | {record['stage']} | {settings} | {str(run['wall_time_s']) + ' s' if 'wall_time_s' in run else '–'} | "
            f"{_megabytes(run.get('peak_rss_bytes'))} |"
        )
    last = facts.chain[-1]
    if "versions" in last:
        lines += ["", "Made with " + ", ".join(f"{name} {version}" for name, version in sorted(last["versions"].items())) + f", lmpress code `{last.get('code_version')}`."]
    return [*lines, ""]


def model_card(facts: ArtifactFacts, repo_id: str) -> str:
    """The README.md of the published repository: hub metadata, then what lmpress did and measured."""
    name = repo_id.split("/")[-1]
    if not facts.lineage:
        body = [
            f"# {name}", "",
            "Published with `lmpress publish --force`: this folder has no lmpress lineage manifest, so the card records only what the folder holds.", "",
            *_loading_section(facts, repo_id), *_kernels_section(facts),
        ]
        return f"---\n{_front_matter(facts, ['lmpress'])}\n---\n\n" + "\n".join(body)
    base = base_hub_id(facts) or facts.chain[0]["model"]
    stages = " → ".join(_stage_line(record) for record in facts.chain[1:]) or "no compression stage"
    license_id = facts.chain[0].get("license", "unknown")
    body = [
        f"# {name}", "",
        f"`{base}` compressed with lmpress: {stages}.", "",
        "Everything below is generated from the artifact's own records: its lineage manifest, its kernel validation report "
        "and the metrics lmpress measured on it.", "",
        *_loading_section(facts, repo_id), *_metrics_section(facts), *_tasks_section(facts), *_kernels_section(facts),
        *_lineage_section(facts), *_calibration_section(facts),
        "## License", "",
        f"Carried from the base model `{base}`: {license_id}." if license_id != "unknown" else
        "The base model's license was not recorded in the lineage; check the base model's own terms before use.", "",
    ]
    return f"---\n{_front_matter(facts, _tags(facts))}\n---\n\n" + "\n".join(body)


# --------------------------------------------------------------------------- the upload


def upload_files(folder: Path) -> list[Path]:
    """The artifact's files that are published: everything but hidden files and a stale card."""
    files = [path for path in sorted(Path(folder).rglob("*")) if path.is_file()]
    return [path for path in files if not any(part.startswith(".") for part in path.relative_to(folder).parts) and path.name != CARD_FILE]


def write_upload_folder(facts: ArtifactFacts, card: str, out: Path) -> dict[str, dict]:
    """The exact folder that is uploaded: the artifact's files (hard links where the filesystem
    allows, else copies) and the card, written atomically. Returns {path: {bytes, sha256}}."""
    with atomic_directory(out) as tmp:
        for source in upload_files(facts.folder):
            target = tmp / source.relative_to(facts.folder)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(source, target)
            except OSError:
                shutil.copy2(source, target)
        (tmp / CARD_FILE).write_text(card)
    return {str(path.relative_to(out)): {"bytes": path.stat().st_size, "sha256": file_sha256(path)} for path in sorted(out.rglob("*")) if path.is_file()}


def _hub_token() -> str:
    from huggingface_hub import get_token

    token = get_token()
    require(bool(token), "no hub token found: set HF_TOKEN to a token with write access or run `hf auth login`")
    return token


def _commit_message(facts: ArtifactFacts) -> str:
    if not facts.lineage:
        return "lmpress publish (no lineage manifest)"
    return f"lmpress: {' -> '.join(r['stage'] for r in facts.chain)} (lineage {facts.lineage['hash'][:12]})"


class _HubCall:
    """Runs one hub request and turns its failures into one-line errors that name the step,
    the status and the fix. Messages carry the server's words, never the request headers."""

    def __init__(self, endpoint: str, repo_id: str):
        self.endpoint, self.repo_id = endpoint, repo_id

    def __call__(self, step: str, request, *, committing: bool = False):
        import httpx2
        from huggingface_hub.errors import HfHubHTTPError

        try:
            return request()
        except HfHubHTTPError as error:
            status = error.response.status_code if error.response is not None else None
            said = (error.server_message or "").strip().splitlines()[0:1]
            detail = f" ({said[0]})" if said else ""
            if status == 401:
                raise LmpressError(f"the hub at {self.endpoint} rejected the token (401 while {step}){detail}; set HF_TOKEN to a valid write token or run `hf auth login`") from None
            if status == 403:
                raise LmpressError(f"the token may not write to {self.repo_id} (403 while {step}){detail}; use a namespace you own or a token with write access to it") from None
            raise LmpressError(f"the hub at {self.endpoint} answered {status} while {step}{detail}; nothing was committed; run the command again") from None
        except httpx2.TimeoutException:
            if committing:
                raise LmpressError(
                    f"the hub at {self.endpoint} did not confirm the commit in time; it may or may not have been recorded: "
                    f"check the commits of {self.repo_id} before publishing again"
                ) from None
            raise LmpressError(f"the hub at {self.endpoint} did not answer while {step} within the timeout; nothing was committed; run again or raise --timeout") from None
        except httpx2.TransportError as error:
            raise LmpressError(f"cannot reach the hub at {self.endpoint} while {step} ({type(error).__name__}); check HF_ENDPOINT and the network; nothing was committed") from None
        except ConnectionError as error:  # huggingface_hub's Xet upload path reports its failures so
            hint = "; if this hub does not speak Xet, set HF_HUB_DISABLE_XET=1" if "xet" in str(error).lower() else ""
            raise LmpressError(f"the upload to {self.endpoint} failed while {step}{hint}; nothing was committed") from None


def publish(folder: Path, config: PublishConfig, out: Path | None = None, receipt: Path | None = None) -> dict:
    """Check the artifact, write its card and upload folder, and (unless a dry run) push that
    folder to `config.repo_id` as one commit. Returns the receipt (also written to `receipt`)."""
    config.validate()
    facts = read_facts(Path(folder), config.metrics)
    require(
        facts.lineage is not None or config.force,
        f"{folder} has no lmpress lineage manifest ({folder}/lineage.json), so its card cannot say what was done to it; "
        "publish an artifact an lmpress stage made, or pass --force",
    )
    problem = validation_problem(facts)
    require(problem is None or config.force, f"{problem}; pass --force to publish it anyway")
    if receipt is not None:
        require_output_path(receipt, directory=False)
    if not config.dry_run:
        from huggingface_hub import constants

        require(not constants.HF_HUB_OFFLINE, "HF_HUB_OFFLINE is set; unset it to publish (or pass --dry-run)")
        token = _hub_token()
    card = model_card(facts, config.repo_id)
    staging = Path(out) if out is not None else Path(folder).parent / f".{Path(folder).name}.publish-{os.getpid()}"
    require_output_path(staging, directory=True, inputs=(folder,), kind=output_kind(folder))  # a copy of the artifact
    files = write_upload_folder(facts, card, staging)
    result = {
        "repo_id": config.repo_id, "revision": config.revision, "private": config.private,
        "lineage_hash": facts.lineage["hash"] if facts.lineage else None, "files": files,
        "uploaded": False, "card": CARD_FILE, "folder": str(staging) if out is not None else None,
    }
    try:
        if not config.dry_run:
            result.update(_push(staging, facts, config, token))
    finally:
        if out is None:
            shutil.rmtree(staging, ignore_errors=True)
    if receipt is not None:
        write_json(Path(receipt), result)
    result["card_text"] = card
    return result


def _push(staging: Path, facts: ArtifactFacts, config: PublishConfig, token: str) -> dict:
    import httpx2
    from huggingface_hub import CommitOperationAdd, HfApi, constants, get_session

    endpoint = (config.endpoint or constants.ENDPOINT).rstrip("/")
    get_session().timeout = httpx2.Timeout(config.timeout)  # the library's client waits forever by default
    api = HfApi(endpoint=endpoint, token=token)
    call = _HubCall(endpoint, config.repo_id)
    call("checking the token", api.whoami)
    call("creating the repository", lambda: api.create_repo(config.repo_id, private=config.private, exist_ok=True))
    if config.revision != "main":
        call(f"creating branch {config.revision}", lambda: api.create_branch(config.repo_id, branch=config.revision, exist_ok=True))
    try:  # the branch's head before: huggingface_hub skips a commit that would change nothing
        head = api.repo_info(config.repo_id, revision=config.revision).sha
    except Exception:  # noqa: BLE001 - a new repository may have no commit yet; the commit below reports real errors
        head = None
    operations = [CommitOperationAdd(path_in_repo=str(path.relative_to(staging)), path_or_fileobj=str(path)) for path in sorted(staging.rglob("*")) if path.is_file()]
    description = json.dumps({"lineage_hash": facts.lineage["hash"] if facts.lineage else None}, sort_keys=True)
    info = call(
        "uploading and committing",
        lambda: api.create_commit(config.repo_id, operations=operations, commit_message=_commit_message(facts), commit_description=description, revision=config.revision),
        committing=True,
    )
    return {
        "uploaded": True, "new_commit": info.oid != head, "endpoint": endpoint, "commit": info.oid, "commit_url": info.commit_url,
        "url": f"{endpoint}/{config.repo_id}",
    }


def card_preview(result: dict) -> str:
    """What `publish` prints: the files and the card."""
    lines = [f"{path}  {entry['bytes']:,} bytes" for path, entry in result["files"].items()]
    return "\n".join(lines) + "\n\n" + result["card_text"]

