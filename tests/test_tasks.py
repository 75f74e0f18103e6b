"""lm-eval through lmpress (pipelines/tasks.py): the held-out last-word tasks are the text they
claim, lm-eval's scores are those of a direct forward of the model as lmpress serves it (the
real model, and a packed artifact through its PackedLinears), a task of one's own runs from
--include-path, and bad requests are refused before the model loads."""

import json
import math
import re

import pytest
import torch

from conftest import REAL_MODEL, leftovers, refuse_in_process

LIMIT = 10


def direct_scores(model, tokenizer, examples: list[dict]) -> tuple[float, float]:
    """(acc, perplexity) of the targets after their contexts, by one forward each: the
    continuation is the tokens the joined text has beyond the context's own."""
    log_likelihoods, greedy = [], []
    with torch.no_grad():
        for example in examples:
            context = tokenizer(example["context"], add_special_tokens=False)["input_ids"]
            whole = tokenizer(f"{example['context']} {example['target']}", add_special_tokens=False)["input_ids"]
            assert whole[: len(context)] == context
            logits = model(torch.tensor([whole[:-1]])).logits[0, len(context) - 1:].float().log_softmax(-1)
            target = torch.tensor(whole[len(context):])
            log_likelihoods.append(logits.gather(1, target[:, None]).sum().item())
            greedy.append(bool((logits.argmax(-1) == target).all()))
    return sum(greedy) / len(greedy), math.exp(-sum(log_likelihoods) / len(log_likelihoods))


def test_lastword_examples_are_sentence_ends_of_the_held_out_text():
    from calibrate.corpora import load_corpus_part
    from pipelines.tasks import ABBREVIATIONS, CONTEXT_WORDS, LOCAL_TASKS, MIN_CONTEXT_WORDS, lastword_examples

    assert set(LOCAL_TASKS) == {"austen-lastword", "pydoc-lastword", "reuters-lastword"}
    for corpus in LOCAL_TASKS.values():
        examples = lastword_examples(corpus)
        assert len(examples) > 300 and examples == lastword_examples(corpus)
        texts = {document.id: " ".join(document.text.split()) for document in load_corpus_part(corpus)}
        for example in examples[::7]:
            text = texts[example["document"]]
            assert re.search(re.escape(f"{example['context']} {example['target']}") + r"[.!?]", text), example
            assert MIN_CONTEXT_WORDS <= len(example["context"].split()) <= CONTEXT_WORDS
            assert example["target"].lstrip("\"'([_").lower() not in ABBREVIATIONS
        assert len({example["target"] for example in examples}) > len(examples) / 5  # words, not one recurring token


def test_scores_are_a_direct_forward_of_the_real_model(tmp_path):
    """lm-eval's acc and perplexity on the first examples of two corpora, against the same
    computed here: the delimiter, the tokenization split and the metric are as they claim."""
    from pipelines.serving import load_for_serving
    from pipelines.tasks import LOCAL_TASKS, TasksConfig, evaluate_tasks, lastword_examples

    out = tmp_path / "tasks.json"
    scores = evaluate_tasks(REAL_MODEL, out, TasksConfig(tasks="austen-lastword,reuters-lastword", limit=LIMIT, batch_size=4))
    assert json.loads(out.read_text()) == scores and scores["device"] == "cpu"
    loaded = load_for_serving(REAL_MODEL)
    for task in ("austen-lastword", "reuters-lastword"):
        acc, perplexity = direct_scores(loaded.model, loaded.tokenizer, lastword_examples(LOCAL_TASKS[task])[:LIMIT])
        entry = scores["tasks"][task]
        assert entry["examples"] == LIMIT and entry["acc"] == pytest.approx(acc) and 0 < acc < 1
        assert entry["perplexity"] == pytest.approx(perplexity, rel=1e-4)
        assert entry["higher_is_better"] == {"acc": True, "perplexity": False} and entry["acc_stderr"] > 0


def test_a_packed_artifact_is_scored_as_served_and_its_own_task_from_include_path(tmp_path, tiny_folder):
    """A 4-bit artifact through its PackedLinears, on lmpress's task and on a multiple-choice
    task of one's own (YAML and JSON lines in a folder): its acc is the choice of highest
    log-likelihood, computed here."""
    from pipelines.serving import load_for_serving
    from pipelines.stages import QuantizeConfig, quantize
    from pipelines.tasks import LOCAL_TASKS, TasksConfig, evaluate_tasks, lastword_examples

    artifact = quantize(str(tiny_folder), None, tmp_path / "q", QuantizeConfig(method="rtn", group_size=32))
    loaded = load_for_serving(str(artifact))
    assert any(type(module).__name__ == "PackedLinear" for module in loaded.model.modules())
    questions = [{"question": f"{a} plus {b} is", "choices": [str(a + b + offset) for offset in (0, 1, 2)], "answer": i % 3}
                 for i, (a, b) in enumerate([(2, 3), (10, 7), (4, 4), (9, 1), (6, 5), (3, 8)])]
    tasks = tmp_path / "my_tasks"
    tasks.mkdir()
    (tasks / "sums.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    (tasks / "sums.yaml").write_text(
        "task: my_sums\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {tasks / 'sums.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: question\ndoc_to_choice: choices\ndoc_to_target: answer\nmetric_list:\n  - metric: acc\n"
    )
    config = TasksConfig(tasks="pydoc-lastword,my_sums", limit=LIMIT, batch_size=4, include_path=str(tasks))
    scores = evaluate_tasks(str(artifact), None, config)["tasks"]

    acc, perplexity = direct_scores(loaded.model, loaded.tokenizer, lastword_examples(LOCAL_TASKS["pydoc-lastword"])[:LIMIT])
    assert scores["pydoc-lastword"]["acc"] == pytest.approx(acc) and scores["pydoc-lastword"]["perplexity"] == pytest.approx(perplexity, rel=1e-4)
    chosen = []
    for question in questions:
        per_choice = [direct_scores(loaded.model, loaded.tokenizer, [{"context": question["question"], "target": choice}])[1] for choice in question["choices"]]
        chosen.append(min(range(3), key=per_choice.__getitem__) == question["answer"])  # lowest perplexity of a one-example set: highest likelihood
    assert scores["my_sums"]["examples"] == len(questions) and scores["my_sums"]["acc"] == pytest.approx(sum(chosen) / len(chosen))


def test_bad_requests_are_refused_before_the_model_loads(tmp_path, tiny_folder):
    """An unknown task, a bad setting, a task whose data is not there, and a held-out task the
    model's calibration saw: one line naming the fix, a non-zero exit, no scores written."""
    from pipelines.stages import CalibrateConfig, QuantizeConfig, calibrate, quantize

    out = tmp_path / "scores.json"
    missing = tmp_path / "missing"
    missing.mkdir()
    (missing / "gone.yaml").write_text(
        f"task: gone\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp_path / 'nowhere.jsonl'}\n"
        "test_split: test\noutput_type: loglikelihood\ndoc_to_text: '{{a}}'\ndoc_to_target: '{{b}}'\n"
    )
    calibration = calibrate(str(tiny_folder), tmp_path / "cal", CalibrateConfig(corpus="austen-heldout", samples=2, seq_len=32, batch_size=2))
    saw_austen = quantize(str(tiny_folder), calibration, tmp_path / "q", QuantizeConfig(group_size=32))
    cases = [
        (("--tasks", "hellaswagg"), r"unknown task hellaswagg; lmpress's own are austen-lastword, .*`lm-eval ls tasks`"),
        (("--tasks", " , "), r"no task given; pass e\.g\. --tasks austen-lastword"),
        (("--limit", "-1"), r"--limit must be 0 \(every example\) or positive"),
        (("--include-path", tmp_path / "nothing"), r"--include-path .*nothing does not exist; pass a folder of lm-eval task YAML files"),
        (("--tasks", "gone", "--include-path", missing), r"the data of lm-eval task gone did not load \(.*\); lm-eval reads it from the Hugging Face hub"),
    ]
    for args, message in cases:
        result = refuse_in_process("lm-eval", tiny_folder, "--out", out, *args)
        assert result.returncode != 0 and re.search(message, result.stderr), (args, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    result = refuse_in_process("lm-eval", saw_austen, "--out", out, "--tasks", "pydoc-lastword,austen-lastword")
    assert result.returncode != 0 and "evaluation corpus 'austen-heldout' overlaps the calibration text (austen/prideprejudice)" in result.stderr
    assert not out.exists() and not leftovers(out)
