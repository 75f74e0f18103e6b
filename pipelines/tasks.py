"""Downstream-task accuracy through lm-eval (EleutherAI's harness), on the model as lmpress
serves it: `lmpress lm-eval MODEL --tasks ...`.

lm-eval does the scoring (its HFLM wrapper, request batching, metrics and their standard
errors); lmpress adds the model loader (packed, codebook, sparse and bitsandbytes artifacts
alike) and tasks of its own that run offline on the held-out text, checked to share nothing
with the calibration text of any stage that made the model:

    <corpus>-lastword  LAMBADA-style: a sentence's last word after (up to) the 64 words before
                       it, for each named held-out corpus (austen, pydoc, reuters); acc (the
                       greedy continuation is the word) and the word's perplexity

Any task lm-eval knows (`hellaswag`, `arc_easy`, ...) may be named too; those read their data
from the Hugging Face hub, or its local cache when offline, and --include-path adds a folder of
task YAML files of one's own."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

import torch

from calibrate.corpora import NAMED_CORPORA, load_corpus_part
from pipelines.artifact import chain_hash, model_chain, require_output_path, write_json
from pipelines.errors import LmpressError, reason, require, require_input

CONTEXT_WORDS = 64
MIN_CONTEXT_WORDS = 32
LASTWORD = "-lastword"
# A sentence's last word, with any opening quote or bracket (the target is the text as it
# stands, less the sentence's end and what closes after it).
SENTENCE_END = re.compile(r"^([\"'(\[_]{0,2}([A-Za-z]{2,}))[.!?][\"'_)\]]{0,3}$")
ABBREVIATIONS = {"mr", "mrs", "ms", "dr", "st", "jr", "sr", "co", "inc", "ltd", "vs", "etc", "no"}
LOCAL_TASKS = {part.removesuffix("-heldout") + LASTWORD: part for part in NAMED_CORPORA if part.endswith("-heldout")}


@dataclass
class TasksConfig:
    tasks: str = ",".join(LOCAL_TASKS)
    limit: int = 500  # examples per task, the first ones (0: all)
    num_fewshot: int = 0
    batch_size: int = 16
    include_path: str = ""  # a folder of lm-eval task YAML files

    @property
    def task_list(self) -> list[str]:
        return [name.strip() for name in self.tasks.split(",") if name.strip()]

    def validate(self) -> None:
        require(bool(self.task_list), f"no task given; pass e.g. --tasks {','.join(LOCAL_TASKS)}")
        require(self.limit >= 0, f"--limit must be 0 (every example) or positive (got {self.limit}); pass e.g. --limit 500")
        require(self.num_fewshot >= 0, f"--num-fewshot must be 0 or positive (got {self.num_fewshot})")
        require(self.batch_size > 0, f"--batch-size must be positive (got {self.batch_size}); pass e.g. --batch-size 16")
        if self.include_path:
            require_input(self.include_path, True, "--include-path", "pass a folder of lm-eval task YAML files")


def lastword_examples(corpus: str) -> list[dict]:
    """Each sentence-final word of the corpus that has `MIN_CONTEXT_WORDS` words before it in
    its document, with (up to) the `CONTEXT_WORDS` words before it as its context. Contexts
    overlap (a held-out corpus is a few thousand sentences; newswire articles are short), so
    the examples' standard error is somewhat optimistic; compare models on the same examples."""
    examples = []
    for document in load_corpus_part(corpus):
        words = document.text.split()
        for index in range(MIN_CONTEXT_WORDS, len(words)):
            end = SENTENCE_END.match(words[index])
            if end is not None and end.group(2).lower() not in ABBREVIATIONS:
                examples.append({"context": " ".join(words[max(0, index - CONTEXT_WORDS):index]), "target": end.group(1), "document": document.id})
    return examples


def lastword_task(name: str, examples: list[dict]) -> dict:
    """An lm-eval task config of `lastword_examples`, scored as lm-eval scores LAMBADA."""
    import datasets

    return {
        "task": name,
        "custom_dataset": lambda **_: {"test": datasets.Dataset.from_list(examples)},
        "test_split": "test",
        "output_type": "loglikelihood",
        "doc_to_text": "{{context}}",
        "doc_to_target": "{{' ' + target}}",
        "target_delimiter": "",  # the space is the target's, as the tokenizer sees a word
        "metric_list": [
            {"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
        ],
        "metadata": {"version": 1.0},
    }


def _task_specs(config: TasksConfig, chain: list[dict]):
    """(lm-eval task specs, their TaskManager): lmpress's tasks as configs (their text checked
    against the chain's calibration), the rest by name, checked to be lm-eval's."""
    from lm_eval.tasks import TaskManager

    from pipelines.stages import require_held_out

    own = [name for name in config.task_list if name in LOCAL_TASKS]
    others = [name for name in config.task_list if name not in LOCAL_TASKS]
    manager = TaskManager(include_path=config.include_path or None, include_defaults=False)
    if any(name not in manager.all_tasks for name in others):  # indexing lm-eval's thousands of task files takes seconds
        manager = TaskManager(include_path=config.include_path or None)
    unknown = [name for name in others if name not in manager.all_tasks]
    require(
        not unknown,
        f"unknown task {', '.join(unknown)}; lmpress's own are {', '.join(LOCAL_TASKS)}, lm-eval's are listed by `lm-eval ls tasks` "
        "(a task of your own: --include-path FOLDER of its YAML)",
    )
    specs = []
    for name in own:
        examples = lastword_examples(LOCAL_TASKS[name])
        require_held_out(LOCAL_TASKS[name], sorted({example["document"] for example in examples}), chain)
        specs.append(lastword_task(name, examples))
    if others:
        try:  # lm-eval reads a task's data as it builds it: a missing dataset fails here, before the model loads
            manager.load(others)
        except Exception as error:  # noqa: BLE001 (datasets and the hub raise many kinds for data that is not there)
            raise LmpressError(
                f"the data of lm-eval task {', '.join(others)} did not load ({reason(error)}); lm-eval reads it from the "
                "Hugging Face hub: run once with network access (or HF_DATASETS_CACHE pointing at a cache that has it)"
            ) from error
    return specs + others, manager


def _scores(results: dict) -> dict:
    """lm-eval's results, one entry per task: each metric (`acc`, and `acc_stderr` beside it),
    keyed `metric` or, where a filter made it, `metric (filter)`; examples scored; direction."""
    tasks = {}
    for task, values in results["results"].items():
        entry = {}
        for key, value in values.items():
            if "," not in key or not isinstance(value, (int, float)):
                continue
            metric, kind = key.split(",", 1)
            entry[metric if kind == "none" else f"{metric} ({kind})"] = value
        entry["examples"] = results.get("n-samples", {}).get(task, {}).get("effective")
        entry["higher_is_better"] = results.get("higher_is_better", {}).get(task, {})
        tasks[task] = entry
    return tasks


def score_metrics(entry: dict) -> list[str]:
    """A task entry's metrics (`_scores`), less their standard errors and the bookkeeping."""
    return [key for key, value in entry.items() if isinstance(value, (int, float)) and not isinstance(value, bool)
            and key != "examples" and "_stderr" not in key]


def stderr_key(metric: str) -> str:
    """The key of a metric's standard error in a task entry: `acc_stderr`, `exact_match_stderr (strict-match)`."""
    return metric.replace(" (", "_stderr (", 1) if " (" in metric else f"{metric}_stderr"


def evaluate_tasks(model: str, out: Path | None, config: TasksConfig) -> dict:
    """Score `model` on lm-eval tasks as lmpress serves it (its packed kernels on a GPU, the
    torch reference on a CPU); writes the scores to `out` (JSON) when given."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.utils import setup_logging

    from pipelines.models import load_config, resolve_model
    from pipelines.serving import load_for_serving

    config.validate()
    if out is not None:
        require_output_path(out, directory=False)
    folder = resolve_model(model)
    chain = model_chain(model, folder, load_config(folder))
    setup_logging("ERROR")  # lm-eval warns at length about a model passed as an object, which is how it is meant here
    specs, manager = _task_specs(config, chain)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    loaded = load_for_serving(model, device)
    harness = HFLM(pretrained=loaded.model, tokenizer=loaded.tokenizer, device=device, batch_size=config.batch_size)
    results = lm_eval.simple_evaluate(
        model=harness, tasks=specs, task_manager=manager, num_fewshot=config.num_fewshot, limit=config.limit or None,
        log_samples=False, bootstrap_iters=1000, verbosity="ERROR",
    )
    scores = {
        "model": model, "lineage_hash": chain_hash(chain), "device": device,
        "lm_eval": {"version": metadata.version("lm_eval"), **asdict(config)},
        "tasks": _scores(results),
    }
    if out is not None:
        write_json(Path(out), scores)
    return scores
