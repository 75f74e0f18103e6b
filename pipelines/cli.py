"""`lmpress` command line. Each command parses options into a stage config and calls the same
stage function that the DVC pipeline calls; user mistakes print one line and exit 2."""

from __future__ import annotations

import json
import signal
import sys
from enum import Enum
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from pipelines.errors import LmpressError

app = typer.Typer(
    help="lmpress: compress Hugging Face causal LMs reproducibly (calibrate, evaluate, inspect).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out_console = Console()


class Switch(str, Enum):
    """An on/off setting written `--name true|false`, as DVC renders a boolean param."""

    true = "true"
    false = "false"

    def __bool__(self) -> bool:
        return self is Switch.true


MODEL_HELP = "Model: a local Hugging Face folder, a hub id (org/name, when online) or the built-in 'smollm2-135m'."
# the recovery options prune-structured and drop-layers share
RECOVERY_STEPS = typer.Option(0, "--recovery-steps", help="Distill from the parent for this many batches of calibration tokens (0: off).")
RECOVERY_LR = typer.Option(5e-5, "--recovery-lr", help="Learning rate of the recovery distillation.")
RECOVERY_BATCH_SIZE = typer.Option(2, "--batch-size", help="Recovery: calibration windows per step.")
SEQUENTIAL_BATCH_SIZE = typer.Option(2, "--batch-size", help="Calibration windows per forward pass of the sequential mode (more: a higher memory peak).")
# the serving dtype generate and latency share (pipelines.serving.serving_dtype)
DTYPE_OPTION = typer.Option(
    "auto", "--dtype",
    help="Activations' dtype: auto (float16 on a GPU; bfloat16 on CPUs with AVX512-BF16 or AMX, where 4-bit grids serve packed through torch's int4 kernel; float32 elsewhere and with --draft, whose promise of the target's own text only fp32 keeps), float32, bfloat16 or float16.",
)


@app.command()
def calibrate(
    out: Path = typer.Option(..., "--out", "-o", help="Directory for the calibration artifact; replaced only when complete."),
    model: str = typer.Option("smollm2-135m", help=MODEL_HELP),
    corpus: str = typer.Option(
        "austen-calib+pydoc-calib",
        help="Calibration text: named corpora (austen-calib, pydoc-calib, ...) or .txt/.jsonl files, joined with '+'; "
        "each part gives an equal share of the samples.",
    ),
    samples: int = typer.Option(128, help="Number of token windows to sample."),
    seq_len: int = typer.Option(512, "--seq-len", help="Tokens per window."),
    batch_size: int = typer.Option(8, "--batch-size", help="Windows per forward pass (memory vs speed)."),
    seed: int = typer.Option(0, help="Seed for sampling; the same seed gives byte-identical statistics."),
):
    """Sample calibration windows and store per-layer activation statistics (X^T X, means, KV-head similarity)."""
    from pipelines.stages import CalibrateConfig, calibrate as run

    config = CalibrateConfig(corpus=corpus, samples=samples, seq_len=seq_len, batch_size=batch_size, seed=seed)
    path = run(model, out, config)
    out_console.print(f"calibration written to {path}", markup=False, highlight=False)


@app.command()
def evaluate(
    model: str = typer.Argument(..., help=MODEL_HELP),
    reference: Path = typer.Option(
        Path("artifacts/reference"), help="Cache of the base model's final hidden states and LM head (exact base logits); built if missing."
    ),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Write the metrics as JSON here (a DVC metrics file)."),
    corpora: str = typer.Option(
        "austen-heldout,pydoc-heldout,reuters-heldout", help="Held-out corpora, comma-separated (reuters-heldout: newswire, a domain the default calibration never sees).",
    ),
    windows: int = typer.Option(16, help="Non-overlapping windows per corpus (the first ones: a fixed slice)."),
    seq_len: int = typer.Option(512, "--seq-len", help="Tokens per window."),
    batch_size: int = typer.Option(4, "--batch-size", help="Windows per forward pass."),
    base: Optional[str] = typer.Option(
        None, help="The model's base: builds a missing reference, and names the base of a model made by another tool (default: the model's lineage base).",
    ),
):
    """Perplexity, KL to the base and top-1 agreement on held-out text; parameters, size, bits/weight, KV bytes."""
    from pipelines.stages import EvaluateConfig, evaluate as run

    config = EvaluateConfig(corpora=corpora, windows=windows, seq_len=seq_len, batch_size=batch_size)
    metrics = run(model, reference, out, config, base)
    out_console.print(metrics_table(metrics))


@app.command("lm-eval")
def lm_eval(
    model: str = typer.Argument(..., help=MODEL_HELP),
    tasks: str = typer.Option(
        "austen-lastword,pydoc-lastword,reuters-lastword",
        help="Comma-separated: lmpress's own (a held-out corpus's sentence-final words, LAMBADA-style, offline) or any lm-eval task, e.g. hellaswag (its data from the hub).",
    ),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Write the scores as JSON here (a DVC metrics file; `publish --metrics` puts them on the card)."),
    limit: int = typer.Option(500, help="Examples per task, the first ones (0: all)."),
    num_fewshot: int = typer.Option(0, "--num-fewshot", help="Solved examples shown before each one."),
    batch_size: int = typer.Option(16, "--batch-size", help="Requests per forward pass."),
    include_path: Optional[Path] = typer.Option(None, "--include-path", help="A folder of lm-eval task YAML files: tasks of your own."),
):
    """Downstream-task accuracy through lm-eval, on the model as lmpress serves it."""
    from pipelines.tasks import TasksConfig, evaluate_tasks, score_metrics, stderr_key

    config = TasksConfig(tasks=tasks, limit=limit, num_fewshot=num_fewshot, batch_size=batch_size, include_path=str(include_path or ""))
    scores = evaluate_tasks(model, out, config)
    table = Table("task", "metric", "value", "stderr", "examples", title=f"{model} on {scores['device']} (lm-eval {scores['lm_eval']['version']})")
    for task, entry in scores["tasks"].items():
        for metric in score_metrics(entry):
            stderr = entry.get(stderr_key(metric))
            table.add_row(task, metric, f"{entry[metric]:.4f}", f"{stderr:.4f}" if isinstance(stderr, (int, float)) else "", str(entry["examples"]))
    out_console.print(table)


def clip_search_option(method: str):
    """--clip-search, as quantize, prune and levels take it (None: the stage's default)."""
    return typer.Option(
        None, "--clip-search", show_default=f"true for {method}",
        help=f"{method}: clip each group's range by the ratio that loses the least output error (AWQ's search) as its grid is fitted.",
    )


def hessian_shrinkage_option(method: str):
    """--hessian-shrinkage, as quantize, prune and levels take it."""
    return typer.Option(
        0.25, "--hessian-shrinkage",
        help=f"{method}: shrink the input correlations the error feedback leans on toward 0 by this fraction, keeping each input's "
        "variance (0: as published, 1: no error feedback; 0.25 lowered held-out KL on every text measured, most on text unlike the calibration's).",
    )


def optional_switch(value: "Switch | None") -> bool | None:
    return None if value is None else bool(value)


@app.command()
def quantize(
    out: Path = typer.Option(..., "--out", "-o", help="Directory for the quantized model; replaced only when complete."),
    model: str = typer.Option("smollm2-135m", help=MODEL_HELP),
    calibration: Optional[Path] = typer.Option(None, help="Calibration artifact from `lmpress calibrate` (needed by gptq, awq, squeezellm)."),
    method: str = typer.Option("gptq", help="rtn (round to nearest, the baseline), gptq (Hessian-based error compensation), awq (activation-aware scales and clipping), squeezellm (per-row k-means codebooks, 2-4 bits, no groups), squeezellm-gptq (the same codebooks, indices chosen by GPTQ's error feedback), or bitsandbytes' nf4 / int8 (their own fixed formats)."),
    bits: Optional[int] = typer.Option(None, show_default="4; int8: 8", help="Bits per weight: 2, 3, 4 or 8 (codebooks: 2-4; nf4 and int8 fix their own)."),
    group_size: Optional[int] = typer.Option(
        None, "--group-size", show_default="64; int8 and codebooks: -1",
        help="Input columns sharing one scale: 32, 64, 128, or -1 for per-channel (nf4 fixes 64; int8 and the per-row codebooks, -1).",
    ),
    symmetric: Switch = typer.Option(Switch.true, help="Symmetric grid (zero point 0); rtn, gptq and awq can be asymmetric."),
    act_order: Optional[Switch] = typer.Option(
        None, "--act-order", show_default="true for gptq and squeezellm-gptq",
        help="GPTQ's error feedback (gptq, squeezellm-gptq): quantize columns by decreasing Hessian diagonal.",
    ),
    damp: float = typer.Option(0.01, help="GPTQ: dampening added to the Hessian diagonal, as a fraction of its mean."),
    hessian_shrinkage: float = hessian_shrinkage_option("GPTQ (gptq, squeezellm-gptq)"),
    clip_search: Optional[Switch] = clip_search_option("gptq"),
    sequential: Switch = typer.Option(
        Switch.true,
        help="Calibrated methods: re-collect each layer's statistics on the already-quantized model (slower, better) instead of using the stored ones.",
    ),
    true_sequential: Optional[Switch] = typer.Option(
        None, "--true-sequential", show_default="on with --sequential true for gptq and squeezellm",
        help="Quantize a layer's linears group by group (q/k/v, o, gate/up, down), each from inputs that went through the groups before it, quantized (AutoGPTQ's and GPTQModel's default; each linear still runs once per layer).",
    ),
    forward_dtype: str = typer.Option(
        "auto", "--forward-dtype",
        help="Sequential mode: dtype the layers run in while statistics are collected: auto (bfloat16 on CPUs with AVX512-BF16 or AMX, where it is faster; float32 elsewhere, where bf16 is emulated and several times slower), float32 or bfloat16. Weights stay as loaded.",
    ),
    skip: str = typer.Option("", help="Comma-separated regexes of linear names to keep dense, e.g. 'layers\\.0\\.,down_proj'."),
    overrides: str = typer.Option("", help="YAML file mapping linear-name regexes to {bits, group_size, symmetric} (per-layer plan)."),
    batch_size: int = typer.Option(
        2, "--batch-size", help="Calibration windows per forward pass of the sequential mode (more: a higher memory peak; 4 and 8 measured no faster).",
    ),
):
    """Quantize the decoder's linears: a compressed-tensors (pack-quantized) model that stock transformers loads, or lmpress-packed for codebooks."""
    from pipelines.stages import QuantizeConfig, quantize as run

    config = QuantizeConfig(
        method=method, bits=bits, group_size=group_size, symmetric=bool(symmetric), act_order=optional_switch(act_order), damp=damp,
        hessian_shrinkage=hessian_shrinkage, clip_search=optional_switch(clip_search), sequential=bool(sequential), true_sequential=optional_switch(true_sequential), forward_dtype=forward_dtype,
        skip=skip, overrides=overrides, batch_size=batch_size,
    )
    path = run(model, calibration, out, config)
    out_console.print(f"quantized model written to {path}", markup=False, highlight=False)


@app.command()
def prune(
    out: Path = typer.Option(..., "--out", "-o", help="Directory for the pruned model; replaced only when complete."),
    model: str = typer.Option("smollm2-135m", help=MODEL_HELP),
    calibration: Optional[Path] = typer.Option(None, help="Calibration artifact from `lmpress calibrate` (needed by wanda, sparsegpt and --refine)."),
    method: str = typer.Option("wanda", help="magnitude (|W|, the baseline), wanda (|W| x input norm) or sparsegpt (Hessian-based reconstruction of the kept weights)."),
    sparsity: Optional[float] = typer.Option(None, help="Unstructured: share of each linear's weights set to zero, in [0, 1), e.g. 0.5."),
    pattern: Optional[str] = typer.Option(None, help="N:M: keep N of every M consecutive inputs, e.g. 2:4 (served compressed) or 4:8. Default 2:4."),
    refine: bool = typer.Option(False, "--refine", help="Refine the masks without training: swap pruned and kept weights while that lowers the layer's reconstruction error (50 rounds)."),
    refine_cycles: int = typer.Option(0, "--refine-cycles", help="Swap rounds per linear (implies --refine; 0 with no --refine: off)."),
    bits: int = typer.Option(0, help="sparsegpt: also quantize the kept weights (2, 3, 4 or 8 bits); 0 keeps them in floating point."),
    group_size: int = typer.Option(64, "--group-size", help="With --bits: input columns sharing one scale (32, 64, 128 or -1)."),
    symmetric: Switch = typer.Option(Switch.true, help="With --bits: symmetric grid (zero point 0)."),
    act_order: Switch = typer.Option(Switch.true, "--act-order", help="sparsegpt: GPTQ's column order for linears a plan leaves dense (pattern 0) but quantizes."),
    clip_search: Optional[Switch] = clip_search_option("sparsegpt"),
    damp: float = typer.Option(0.01, help="sparsegpt: dampening added to the Hessian diagonal, as a fraction of its mean."),
    hessian_shrinkage: float = hessian_shrinkage_option("sparsegpt"),
    sequential: Switch = typer.Option(
        Switch.true, help="Re-collect each layer's statistics on the already-pruned model (slower, better) instead of using the stored ones.",
    ),
    forward_dtype: str = typer.Option("auto", "--forward-dtype", help="Sequential mode: dtype of the layer passes: auto (as quantize's), float32 or bfloat16."),
    skip: str = typer.Option("", help="Comma-separated regexes of linear names to keep dense, e.g. 'down_proj'."),
    overrides: str = typer.Option("", help="YAML file mapping linear-name regexes to a pattern (\"4:8\"), a sparsity (0.6) or {pattern, bits, group_size}: the per-layer plan."),
    batch_size: int = SEQUENTIAL_BATCH_SIZE,
):
    """Prune the decoder's linears: a dense-with-zeros model any loader opens, plus the compressed 2:4 form lmpress serves."""
    from pipelines.stages import PruneConfig, prune as run

    if sparsity is not None and pattern is not None:
        raise LmpressError("pass either --sparsity (unstructured, e.g. 0.5) or --pattern (N:M, e.g. 2:4), not both")
    config = PruneConfig(
        method=method, pattern=pattern if pattern is not None else str(sparsity) if sparsity is not None else "2:4", 
        refine_cycles=refine_cycles or (50 if refine else 0), bits=bits, group_size=group_size, symmetric=bool(symmetric),
        act_order=bool(act_order), clip_search=optional_switch(clip_search), damp=damp, hessian_shrinkage=hessian_shrinkage,
        sequential=bool(sequential), forward_dtype=forward_dtype,
        skip=skip, overrides=overrides, batch_size=batch_size,
    )
    path = run(model, calibration, out, config)
    out_console.print(f"pruned model written to {path}", markup=False, highlight=False)


@app.command("prune-structured")
def prune_structured(
    out: Path = typer.Option(..., "--out", "-o", help="Directory for the smaller model; replaced only when complete."),
    model: str = typer.Option("smollm2-135m", help=MODEL_HELP),
    calibration: Optional[Path] = typer.Option(None, help="Calibration artifact from `lmpress calibrate` (scores, bias compensation, recovery)."),
    target_params: float = typer.Option(0.8, "--target-params", help="Share of the parameters to keep, e.g. 0.75."),
    scorer: str = typer.Option("flap", help="flap (input variance x squared weight column), wanda-sp (|W| x input norm) or magnitude (weight norms, the baseline)."),
    bias_compensation: Switch = typer.Option(Switch.true, "--bias-compensation", help="Fold the pruned units' mean output into biases (Llama configs)."),
    keep_heads: int = typer.Option(0, "--keep-heads", help="Query heads to keep per layer, a whole number of KV groups (0: chosen with the MLP width)."),
    allocation: str = typer.Option("uniform", help="uniform (the same widths in every layer: a plain checkpoint) or global (per-layer widths, opened by lmpress's loader)."),
    recovery_steps: int = RECOVERY_STEPS,
    recovery_lr: float = RECOVERY_LR,
    batch_size: int = RECOVERY_BATCH_SIZE,
):
    """Remove MLP channels and attention head groups (the same in every layer): a smaller model stock transformers opens."""
    from pipelines.stages import StructuredConfig, prune_structured as run

    config = StructuredConfig(
        target_params=target_params, scorer=scorer, bias_compensation=bool(bias_compensation), keep_heads=keep_heads, allocation=allocation,
        recovery_steps=recovery_steps, recovery_lr=recovery_lr, batch_size=batch_size,
    )
    path = run(model, calibration, out, config)
    out_console.print(f"smaller model written to {path}", markup=False, highlight=False)


@app.command("drop-layers")
def drop_layers(
    out: Path = typer.Option(..., "--out", "-o", help="Directory for the shallower model; replaced only when complete."),
    model: str = typer.Option("smollm2-135m", help=MODEL_HELP),
    calibration: Optional[Path] = typer.Option(None, help="Calibration artifact from `lmpress calibrate` (block influence, recovery)."),
    n: int = typer.Option(4, "--n", help="Decoder layers to drop."),
    scorer: str = typer.Option("influence", help="influence (layers that change their input least) or last (the last layers, the baseline)."),
    layers: str = typer.Option("", help="Comma-separated indices of the layers to drop, e.g. a search's dropped_blocks (overrides --n and --scorer)."),
    recovery_steps: int = RECOVERY_STEPS,
    recovery_lr: float = RECOVERY_LR,
    batch_size: int = RECOVERY_BATCH_SIZE,
):
    """Drop whole decoder layers: a shallower model stock transformers opens."""
    from pipelines.stages import DropLayersConfig, drop_layers as run

    config = DropLayersConfig(n=n, scorer=scorer, layers=layers, recovery_steps=recovery_steps, recovery_lr=recovery_lr, batch_size=batch_size)
    path = run(model, calibration, out, config)
    out_console.print(f"shallower model written to {path}", markup=False, highlight=False)


@app.command()
def levels(
    out: Path = typer.Option(..., "--out", "-o", help="Directory for the level database; replaced only when complete."),
    model: str = typer.Option("smollm2-135m", help=MODEL_HELP),
    calibration: Optional[Path] = typer.Option(None, help="Calibration artifact from `lmpress calibrate` (GPTQ's Hessians, Wanda's scores)."),
    bits: str = typer.Option("2,3,4,8", help="Bit-widths to quantize every linear to (comma-separated; '' for none)."),
    group_size: str = typer.Option("64", help="Group sizes (input columns sharing one scale), each with every bit-width, e.g. 64,128 (-1: per channel)."),
    method: str = typer.Option("gptq", help="gptq or rtn, from the calibration's stored statistics."),
    act_order: Optional[Switch] = typer.Option(None, "--act-order", show_default="true for gptq", help="GPTQ: quantize columns by decreasing Hessian diagonal."),
    clip_search: Optional[Switch] = clip_search_option("gptq"),
    hessian_shrinkage: float = hessian_shrinkage_option("gptq and the 2:4 levels' sparsegpt"),
    sparse24: Switch = typer.Option(Switch.false, "--sparse24", help="Each bits level also 2:4 sparse with its kept weights quantized (SparseGPT), for 2:4 on/off."),
    sparsity: str = typer.Option("", help="Unstructured sparsity levels (Wanda), e.g. 0.4,0.5,0.6,0.7,0.8 ('' for none)."),
    drop: Switch = typer.Option(Switch.false, "--drop", help="Let the search drop whole decoder blocks too."),
):
    """Compress every linear once at every level: the database `lmpress search` picks from."""
    from pipelines.levels import LevelsConfig, level_database

    config = LevelsConfig(bits=bits, group_size=group_size, method=method, act_order=optional_switch(act_order), clip_search=optional_switch(clip_search),
                          hessian_shrinkage=hessian_shrinkage, sparse24=bool(sparse24), sparsity=sparsity, drop=bool(drop))
    path = level_database(model, calibration, out, config)
    out_console.print(f"level database written to {path}", markup=False, highlight=False)


@app.command()
def latency(
    out: Path = typer.Option(..., "--out", "-o", help="The latency table (JSON) to write."),
    levels: Path = typer.Option(..., "--levels", help="Level database from `lmpress levels`: its levels are timed."),
    model: str = typer.Option("smollm2-135m", help=MODEL_HELP),
    batch: int = typer.Option(1, help="Sequences decoded together."),
    context: int = typer.Option(256, help="Tokens already in the KV cache."),
    repeats: int = typer.Option(30, help="Timed calls per measurement (the median is kept)."),
    device: str = typer.Option("auto", help="auto (a CUDA GPU if there is one), cpu or cuda."),
    random_weights: bool = typer.Option(False, "--random-weights", help="Time the architecture from the model folder's config.json alone, with random weights (speed does not depend on them): for a machine without the weights; the table is stamped with the database's base."),
    cuda_graphs: bool = typer.Option(True, "--cuda-graphs/--no-cuda-graphs", help="On a GPU, time each call as a CUDA graph's replay, as `lmpress generate` decodes; off: eager calls, as `generate --no-cuda-graphs`."),
    dtype: str = DTYPE_OPTION,
):
    """Measure a decode step's parts on this device (each linear shape at each level, as lmpress serves it): the model `search --budget-latency` counts in."""
    from pipelines.latency import LatencyConfig, measure_latency

    config = LatencyConfig(batch=batch, context=context, repeats=repeats, device=device, random_weights=random_weights, cuda_graphs=cuda_graphs, dtype=dtype)
    path = measure_latency(model, levels, out, config)
    table = json.loads(path.read_text())
    check = table["check"]
    out_console.print(
        f"latency table written to {path}: decode step {table['step_s'] * 1e3:.2f} ms on {table['device']} "
        f"({table['outside_s'] * 1e3:.2f} ms outside the blocks, {table['block_rest_s'] * 1e3:.3f} ms per block besides its linears); "
        f"check, {check['blocks_kept']} blocks at {check['level']}: predicted {check['predicted_s'] * 1e3:.2f} ms, measured {check['measured_s'] * 1e3:.2f} ms",
        markup=False, highlight=False,
    )


@app.command()
def search(
    out: Path = typer.Option(..., "--out", "-o", help="Directory for the plan and report; replaced only when complete."),
    levels: Path = typer.Option(..., "--levels", help="Level database from `lmpress levels`."),
    calibration: Path = typer.Option(..., help="Calibration artifact: the fitness is the KL to the base on its windows."),
    model: str = typer.Option("smollm2-135m", help=MODEL_HELP),
    budget_bits: float = typer.Option(0.0, "--budget-bits", help="Average stored bits per weight over the decoder linears: codes, fp16 scales and 2:4 masks (3-bit codes at group size 64: 3.25)."),
    target_sparsity: float = typer.Option(0.0, "--target-sparsity", help="Average sparsity over the decoder linears."),
    budget_latency: float = typer.Option(0.0, "--budget-latency", help="Decode step time as a fraction of the base's (e.g. 0.8), by the --latency table."),
    latency: Optional[Path] = typer.Option(None, "--latency", help="Latency table from `lmpress latency`: the model --budget-latency counts in; with another budget, the predicted step is reported."),
    drop: Switch = typer.Option(Switch.false, "--drop", help="Also choose whole blocks to drop (their weights cost nothing)."),
    sparse24: Switch = typer.Option(Switch.false, "--sparse24", help="With --budget-bits: also choose 2:4 sparsity on/off per linear (a database built with --sparse24 true)."),
    generations: int = typer.Option(50, help="Generations of (1 + offspring) evolution."),
    offspring: int = typer.Option(16, help="Children per generation."),
    selection: str = typer.Option("1:4,4:1", help="Rounds of selection, windows:survivors: all children on few windows, the best on more."),
    seq_len: int = typer.Option(256, help="Tokens per fitness window."),
    batch_size: int = typer.Option(4, help="Windows per forward pass."),
    seed: int = typer.Option(0, help="Seed of the mutations: same seed, same plan."),
    start: str = typer.Option("uniform", help="The first parent: uniform (every linear at one level) or sensitivity (the greedy allocation on each unit's own KL, one evaluation per unit and level)."),
    validation_windows: int = typer.Option(8, "--validation-windows", help="Whole calibration windows, none of the fitness's, on which the searched plan must beat its start, or the start is written; 0: no check."),
):
    """Evolutionary search (EvoPress) for per-layer levels within a budget; writes plan.yaml for quantize/prune --overrides."""
    from pipelines.levels import SearchConfig, search as run

    config = SearchConfig(budget_bits=budget_bits, target_sparsity=target_sparsity, budget_latency=budget_latency, latency=str(latency or ""),
                          drop=bool(drop), sparse24=bool(sparse24), generations=generations,
                          offspring=offspring, selection=selection, seq_len=seq_len, batch_size=batch_size, seed=seed, start=start,
                          validation_windows=validation_windows)
    path = run(model, levels, calibration, out, config)
    report = json.loads((path / "search.json").read_text())
    fitness = report["fitness"]
    out_console.print(
        f"plan written to {path / 'plan.yaml'}: calibration KL {fitness['start']:.4f} ({report['start']} start) -> {fitness['searched']:.4f} "
        f"after {report['evaluations']} evaluations in {report['search_s']} s", markup=False, highlight=False,
    )
    if "validation" in report:
        check = report["validation"]
        line = (f"on {check['windows']} held-aside calibration windows of {check['seq_len']} tokens: KL {check['start']:.4f} (start) -> "
                f"{check['searched']:.4f} (searched)")
        if check["kept"] == "searched":
            out_console.print(line, markup=False, highlight=False)
        else:  # the search fitted its few fitness tokens, not the text
            sys.stderr.write(f"warning: {line}; wrote the start's plan (more fitness tokens: --selection, --seq-len)\n")
    if "latency" in report:
        step = report["latency"]
        out_console.print(f"predicted decode step on {step['device']}: {step['searched_step_ms']:.2f} ms (base {step['base_step_ms']:.2f} ms)", markup=False, highlight=False)


@app.command("kv-merge")
def kv_merge(
    out: Path = typer.Option(..., "--out", "-o", help="Directory for the merged model; replaced only when complete."),
    model: str = typer.Option("smollm2-135m", help=MODEL_HELP),
    calibration: Optional[Path] = typer.Option(None, help="Calibration artifact from `lmpress calibrate` (grouping, the aligned fit, healing)."),
    kv_heads: int = typer.Option(..., "--kv-heads", help="KV heads per layer after merging: a divisor of the current count (1: multi-query attention)."),
    method: str = typer.Option("aligned", help="aligned (shared heads fitted on calibration data, corrections folded into q_proj/o_proj) or mean (average the heads, the baseline)."),
    samples: int = typer.Option(64, help="Calibration windows the merge reads."),
    damp: float = typer.Option(0.01, help="Ridge of the o_proj least-squares refit, relative to its mean diagonal."),
    heal_steps: int = typer.Option(0, "--heal-steps", help="Distill from the parent for this many batches of calibration tokens (0: off)."),
    heal_lr: float = typer.Option(1e-4, "--heal-lr", help="Learning rate of the healing distillation."),
    batch_size: int = typer.Option(4, "--batch-size", help="Calibration windows per forward pass and per healing step."),
):
    """Merge KV heads (MHA -> GQA -> MQA): a smaller KV cache, a plain config stock transformers opens."""
    from pipelines.stages import KVMergeConfig, kv_merge as run

    config = KVMergeConfig(kv_heads=kv_heads, method=method, samples=samples, damp=damp, heal_steps=heal_steps, heal_lr=heal_lr, batch_size=batch_size)
    path = run(model, calibration, out, config)
    out_console.print(f"merged model written to {path}", markup=False, highlight=False)


@app.command()
def draft(
    out: Path = typer.Option(..., "--out", "-o", help="Directory for the draft model; replaced only when complete (progress is kept beside it, so an interrupted run resumes)."),
    target: str = typer.Option(..., "--target", help="The model the draft will serve: the base, or a compressed artifact (the draft is distilled against it as it is)."),
    calibration: Optional[Path] = typer.Option(None, help="Calibration artifact from `lmpress calibrate`: its windows' beginnings are the prompts the target continues."),
    layers: int = typer.Option(0, "--layers", help="Target decoder layers the draft keeps (required unless --draft)."),
    draft_model: str = typer.Option("", "--draft", help="Instead of --layers: a draft to distill, e.g. a structured-pruned copy of the target or any small model with its tokenizer."),
    selection: str = typer.Option("influence", help="Which layers: influence (those that change the target's hidden states most, measured on its outputs) or even (evenly spaced)."),
    vocab_trim: int = typer.Option(0, "--vocab-trim", help="Keep this many LM-head rows, the tokens the target emits most (VOCABTRIM); 0: the whole vocabulary."),
    real_windows: int = typer.Option(0, "--real-windows", help="Also distill on this many calibration windows of real text, cut to the generated sequences' length (0: the target's continuations only)."),
    steps: int = typer.Option(200, help="Distillation steps (0: the undistilled draft)."),
    lr: float = typer.Option(1e-3, help="Distillation learning rate (AdamW)."),
    cosine_decay: Switch = typer.Option(Switch.false, "--cosine-decay", help="Let the learning rate fall to 0 along a half cosine."),
    batch_size: int = typer.Option(4, "--batch-size", help="Sequences per distillation step."),
    loss: str = typer.Option("kl", help="kl (forward KL to the target's next-token distribution) or tvd (total variation distance)."),
    prompts: int = typer.Option(64, help="Calibration windows whose beginnings the target continues."),
    prompt_len: int = typer.Option(128, "--prompt-len", help="Tokens of each prompt (real text the draft learns to continue from)."),
    new_tokens: int = typer.Option(128, "--new-tokens", help="Tokens the target generates per prompt (greedy)."),
    checkpoint_every: int = typer.Option(25, "--checkpoint-every", help="Steps between resumable checkpoints."),
):
    """Build a draft for speculative decoding from the target and distill it on the target's own outputs."""
    from pipelines.stages import DraftConfig, draft as run

    config = DraftConfig(
        layers=layers, draft=draft_model, selection=selection, vocab_trim=vocab_trim, prompts=prompts, prompt_len=prompt_len,
        new_tokens=new_tokens, real_windows=real_windows, steps=steps, lr=lr, cosine_decay=bool(cosine_decay), batch_size=batch_size,
        loss=loss, checkpoint_every=checkpoint_every,
    )
    path = run(target, calibration, out, config)
    out_console.print(f"draft written to {path}", markup=False, highlight=False)


ALLOW_OTHER_TARGET = typer.Option(False, "--allow-other-target", help="Pair a draft with a target other than the one it was distilled against (a warning instead of an error).")


@app.command("evaluate-draft")
def evaluate_draft(
    draft_model: str = typer.Argument(..., metavar="DRAFT", help="A draft from `lmpress draft`, or any model with the target's tokenizer."),
    target: str = typer.Option(..., "--target", help="The model the draft serves."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Write the metrics as JSON here (a DVC metrics file)."),
    corpora: str = typer.Option("austen-heldout,pydoc-heldout", help="Held-out corpora the prompts come from, comma-separated."),
    prompts: int = typer.Option(8, help="Prompts, shared out over the corpora (their first windows)."),
    prompt_len: int = typer.Option(128, "--prompt-len", help="Tokens per prompt."),
    new_tokens: int = typer.Option(64, "--new-tokens", help="Tokens generated per prompt."),
    lookahead: str = typer.Option("4,8", help="Draft tokens per target forward, comma-separated; each is measured."),
    allow_other_target: bool = ALLOW_OTHER_TARGET,
):
    """Speculative vs plain greedy decoding on held-out prompts: tokens per target forward, acceptance, speedup, identical output."""
    from pipelines.stages import SpeculationConfig, evaluate_draft as run

    config = SpeculationConfig(corpora=corpora, prompts=prompts, prompt_len=prompt_len, new_tokens=new_tokens, lookahead=lookahead)
    metrics = run(draft_model, target, out, config, allow_other_target)
    table = Table("lookahead", "tokens / target forward", "acceptance", "plain s", "speculative s", "speedup", "identical",
                  title=f"{metrics['draft']} ({metrics['draft_layers']} layers, {metrics['draft_vocabulary']} tokens) for {metrics['target']}")
    for k, entry in metrics["lookahead"].items():
        table.add_row(k, *(str(entry[key]) for key in ("tokens_per_target_forward", "acceptance_rate", "plain_s", "speculative_s", "speedup", "identical_output")))
    out_console.print(table)


@app.command()
def validate(
    artifact: Path = typer.Argument(..., help="A quantized (pack-quantized) artifact."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Where to write the report (default: ARTIFACT/validation.json)."),
):
    """Check each kernel against its torch reference on the artifact's own tensors (batch 1, 16, 64); on a GPU, also its speed vs dense fp16."""
    from pipelines.serving import worst_error, validation_failures
    from pipelines.serving import validate as run

    report = run(artifact, out)
    table = Table("linear", "kernel", "max rel error", "speedup vs fp16 (1/16/64)", title=f"{report['device']} (gpu_validated={report['gpu_validated']})")
    for name, entry in report["layers"].items():
        speed = "/".join(f"{v:.2f}" for v in entry.get("speedup_vs_fp16", {}).values()) or "needs a GPU"
        worst = worst_error(entry.get("max_rel_error", {0: 0}).values())
        table.add_row(name, str(entry.get("kernel")), "NaN/inf" if worst is None else f"{worst:.2e}", speed)
    out_console.print(table)
    failures = validation_failures(report)
    if failures:  # the report is written either way: it says what failed
        sys.stderr.write(f"error: kernel validation failed: {failures[0]}{f' (and {len(failures) - 1} more)' if len(failures) > 1 else ''}; the report says which\n")
        raise typer.Exit(1)


@app.command()
def publish(
    artifact: Path = typer.Argument(..., help="A model artifact an lmpress stage made."),
    repo_id: str = typer.Option(..., "--repo-id", help="The hub repository, ORG/NAME (created if missing)."),
    revision: str = typer.Option("main", help="The branch to commit to (created from main if missing)."),
    private: bool = typer.Option(False, "--private", help="Create the repository private."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Write the exact upload folder (--out) and print its files and card; upload nothing."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Where the upload folder is written (default with --dry-run: ARTIFACT-hub beside it; otherwise a temporary folder)."),
    metrics: str = typer.Option("", help="Comma-separated metrics files or folders (`lmpress evaluate --out`, `evaluate-draft --out`); those measured on this artifact or its base fill the card."),
    receipt: Optional[Path] = typer.Option(None, help="Write what was (or would be) published here as JSON: files with sha256, commit, url."),
    force: bool = typer.Option(False, "--force", help="Publish an artifact without lineage or with a failed kernel validation."),
    timeout: float = typer.Option(60.0, help="Seconds to wait for each answer from the hub."),
):
    """Publish an artifact to the model hub (HF_ENDPOINT, default huggingface.co) with a model card generated from its lineage, metrics and kernel validation; one commit."""
    from pipelines.publish import PublishConfig, card_preview
    from pipelines.publish import publish as run

    if dry_run and out is None:
        out = artifact.parent / f"{artifact.name}-hub"
    config = PublishConfig(repo_id=repo_id, revision=revision, private=private, dry_run=dry_run, metrics=metrics, force=force, timeout=timeout)
    result = run(artifact, config, out, receipt)
    if dry_run:
        typer.echo(card_preview(result))  # plain echo: the card exactly as written, unwrapped
        typer.echo(f"dry run: nothing uploaded; the folder above is {out}")
    else:
        size = sum(entry["bytes"] for entry in result["files"].values())
        done = f"published {len(result['files'])} files ({size / 1e6:.1f} MB) to" if result["new_commit"] else "nothing new to commit: already on"
        out_console.print(f"{done} {result['url']} (revision {revision}) at commit {result['commit']}", markup=False, highlight=False)


@app.command()
def generate(
    artifact: str = typer.Argument(..., help=MODEL_HELP),
    prompt: str = typer.Argument(..., help="Text to continue."),
    max_new_tokens: int = typer.Option(40, "--max-new-tokens", help="Tokens to generate (greedy)."),
    draft_model: Optional[str] = typer.Option(None, "--draft", help="A draft for speculative decoding (the same output, fewer target forwards)."),
    lookahead: Optional[int] = typer.Option(None, help="With --draft: tokens the draft proposes per target forward [default: 4]."),
    allow_other_target: bool = ALLOW_OTHER_TARGET,
    cuda_graphs: bool = typer.Option(True, "--cuda-graphs/--no-cuda-graphs", help="On a GPU, run each decoding step as a CUDA graph's replay (no Python per token); off: eagerly."),
    dtype: str = DTYPE_OPTION,
):
    """Continue a prompt greedily with the model, served with its packed kernels where it has them."""
    from pipelines.serving import generate as run

    out_console.print(run(artifact, prompt, max_new_tokens, draft_model, lookahead, allow_other_target, cuda_graphs, dtype), markup=False, highlight=False)


@app.command()
def info(path: str = typer.Argument(..., help="An lmpress artifact (model or calibration) or any model spec.")):
    """Print an artifact's lineage chain and its metrics."""
    from pipelines.artifact import read_json, read_lineage
    from pipelines.errors import require
    from pipelines.models import resolve_model

    folder = Path(path) if any(Path(path, marker).is_file() for marker in ("manifest.json", "lineage.json")) else resolve_model(path)
    lineage = read_lineage(folder)
    if lineage is None:
        manifest = read_json(folder / "manifest.json", "re-run the stage that made it") if (folder / "manifest.json").is_file() else None
        kind = manifest.get("format") if isinstance(manifest, dict) else None
        what = f"format {kind}, no lineage of its own" if isinstance(kind, str) else "a model without lmpress lineage (a base model)"
        out_console.print(f"{folder}: {what}", markup=False, highlight=False)
        return
    out_console.print(f"lineage {lineage['hash'][:16]}  ({folder})", markup=False, highlight=False)
    table = Table("#", "stage", "settings", "wall s", "peak MB")
    for number, record in enumerate(lineage["chain"]):
        settings = record.get("params") or {k: record[k] for k in ("model", "weights_sha256") if k in record}
        run = record.get("run") if isinstance(record.get("run"), dict) else {}
        peak = run.get("peak_rss_bytes")
        table.add_row(
            str(number), record["stage"], json.dumps(settings, sort_keys=True)[:100],
            str(run.get("wall_time_s", "")), str(round(peak / 2**20)) if isinstance(peak, (int, float)) else "",
        )
    out_console.print(table)
    metrics_file = folder / "metrics.json"
    if metrics_file.is_file():
        metrics = read_json(metrics_file, "re-run the stage that made this artifact")
        require(isinstance(metrics, dict), f"{metrics_file} is not a JSON object of metrics; re-run the stage that made this artifact")
        out_console.print(metrics_table(metrics))


def metrics_table(metrics: dict) -> Table:
    table = Table("metric", "value", title=f"metrics: {metrics.get('model', '')}")
    for key, value in metrics.items():
        if isinstance(value, dict):
            for sub, subvalue in value.items():
                table.add_row(f"{key} {sub}", str(subvalue))
        elif key != "model":
            table.add_row(key, str(value))
    return table


def _stop_on_sigterm(signum, frame) -> None:
    """`kill`, a job scheduler's timeout or a container stop: unwind as Ctrl-C does, so the
    stage's temporary folder is removed on the way out instead of left beside the output."""
    raise KeyboardInterrupt


def _usage_error_line(error: typer.TyperException) -> str:
    """typer's own refusal as one line in the stages' style: its message, then where help is."""
    message = " ".join(error.format_message().split())
    message += "" if message.endswith((".", "?", "!")) else "."
    context = getattr(error, "ctx", None)
    return f"{message} See '{context.command_path} --help'." if context is not None else message


def main() -> None:
    """Entry point: user errors and interrupts become one line on stderr, never a traceback."""
    interrupted = 130  # typer turns Ctrl-C into this exit code
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        code = app(standalone_mode=False, prog_name="lmpress")  # also when run as `python -m pipelines.cli`
    except LmpressError as error:
        sys.stderr.write(f"error: {error}\n")
        sys.exit(2)
    except typer.TyperException as error:  # a bad, missing or unknown option or command
        sys.stderr.write(f"error: {_usage_error_line(error)}\n")
        sys.exit(error.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        code = interrupted
    except Exception as error:  # the disk refusing a write deep in a stage (a full disk mid-save) is no bug
        from pipelines.artifact import write_refusal

        reason = write_refusal(error)
        if reason is None:
            raise
        where = f" ({error.filename})" if getattr(error, "filename", None) else ""
        sys.stderr.write(f"error: the filesystem refused a write{where}: {reason}; free space or write elsewhere, then run the command again\n")
        sys.exit(2)
    if code == interrupted:
        command = sys.argv[1:2]
        resumes = "; the progress so far is kept: run the command again to resume" if command in (["draft"], ["search"]) else "; run the command again to restart"
        sys.stderr.write(f"interrupted: no partial artifact was left{resumes}\n" if command != ["generate"] else "interrupted\n")  # generate writes nothing
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
