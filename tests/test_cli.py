"""The CLI as a user runs it: bad input gets one line naming the fix, a non-zero exit, no
traceback and no partial artifact; interrupts leave nothing half-written; reruns complete."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import REAL_MODEL, leftovers, refuse_in_process, run_cli

SMALL = ["--samples", "4", "--seq-len", "32", "--batch-size", "2"]


def assert_user_error(result, pattern: str, out: Path | None = None):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
    assert pattern in lines[0], lines[0]
    if out is not None:
        assert not out.exists() and leftovers(out) == []


@pytest.mark.parametrize("args, message", [
    (["draft", "--out", "x"], "Missing option '--target'. See 'lmpress draft --help'."),
    (["quantize", "--out"], "Option '--out' requires an argument."),
    (["quantize", "--out", "x", "--bits", "four"], "Invalid value for '--bits'"),
    (["quantize", "--out", "x", "--act-order", "maybe"], "Invalid value for '--act-order'"),
    (["quantise", "--out", "x"], "No such command 'quantise'. Did you mean 'quantize'? See 'lmpress --help'."),
])
def test_usage_mistakes_print_one_error_line(tmp_path, args, message):
    """Options typer itself refuses (missing, unparsable, unknown) get one line with exit 2,
    like the stages' own checks: never a traceback or a usage block, nothing written."""
    assert_user_error(run_cli(*args, cwd=tmp_path), message)
    assert list(tmp_path.iterdir()) == []


def test_model_path_that_does_not_exist(tmp_path):
    # one stage refusal as a user meets it, in a fresh interpreter; the others run in this
    # process (refuse_in_process), through the same entry point, without 5-10 s of imports each
    out = tmp_path / "cal"
    assert_user_error(run_cli("calibrate", "--model", tmp_path / "nope", "--out", out, *SMALL), "does not exist; pass an existing folder", out)


def test_folder_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    out = tmp_path / "cal"
    assert_user_error(refuse_in_process("calibrate", "--model", tmp_path / "empty", "--out", out, *SMALL), "has no config.json", out)


def test_unsupported_architecture(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1).save_pretrained(tmp_path / "gpt2")
    out = tmp_path / "cal"
    assert_user_error(
        refuse_in_process("calibrate", "--model", tmp_path / "gpt2", "--out", out, *SMALL),
        "model type 'gpt2' is not supported; lmpress supports llama, mistral, qwen2, qwen3, gemma2, gemma3_text", out,
    )


def test_truncated_safetensors(tmp_path, tiny_folder):
    weights = tiny_folder / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    out = tmp_path / "cal"
    assert_user_error(refuse_in_process("calibrate", "--model", tiny_folder, "--out", out, *SMALL), "is truncated", out)


def test_model_without_tokenizer(tmp_path, tiny_folder):
    # the tokenizer is loaded on first use, often at a stage's end: its absence must stop the stage first
    from pipelines.models import TOKENIZER_FILES

    for name in TOKENIZER_FILES:
        (tiny_folder / name).unlink(missing_ok=True)
    out = tmp_path / "q"
    assert_user_error(refuse_in_process("quantize", "--model", tiny_folder, "--method", "rtn", "--out", out), "has no tokenizer", out)


def test_corpus_shorter_than_samples_times_length(tmp_path):
    (tmp_path / "short.txt").write_text("Too short to calibrate on.")
    out = tmp_path / "cal"
    result = refuse_in_process("calibrate", "--corpus", tmp_path / "short.txt", "--out", out, "--samples", "8", "--seq-len", "512")
    assert_user_error(result, "fewer than the 8 needed; pass a smaller --samples or --seq-len, or more text", out)


def test_unknown_corpus_name(tmp_path):
    out = tmp_path / "cal"
    assert_user_error(refuse_in_process("calibrate", "--corpus", "wikitext", "--out", out, *SMALL), "unknown corpus 'wikitext'", out)


def test_non_positive_sample_count(tmp_path):
    out = tmp_path / "cal"
    assert_user_error(refuse_in_process("calibrate", "--out", out, "--samples", "0"), "samples must be positive (got 0)", out)


def test_output_path_that_is_a_file(tmp_path):
    out = tmp_path / "taken"
    out.write_text("precious")
    assert_user_error(refuse_in_process("calibrate", "--out", out, *SMALL), "is a file")
    assert out.read_text() == "precious"


def test_help_explains_every_option():
    result = run_cli("calibrate", "--help")
    assert result.returncode == 0
    for option in ("--out", "--model", "--corpus", "--samples", "--seq-len", "--batch-size", "--seed"):
        assert option in result.stdout


def test_calibration_is_byte_identical_for_the_same_seed(tmp_path):
    """Same model, text and seed: identical samples and statistics, byte for byte; and
    `lmpress info` reads the lineage back."""
    runs = []
    for name in ("a", "b"):
        result = run_cli("calibrate", "--model", REAL_MODEL, "--out", tmp_path / name, "--samples", "4", "--seq-len", "64", "--seed", "7")
        assert result.returncode == 0, result.stderr
        runs.append(tmp_path / name)
    files = sorted(p.relative_to(runs[0]) for p in runs[0].rglob("*.safetensors"))
    assert len(files) == 31  # samples + 30 layers
    for file in files:
        assert (runs[0] / file).read_bytes() == (runs[1] / file).read_bytes(), file
    a, b = (json.loads((run / "lineage.json").read_text()) for run in runs)
    assert a["hash"] == b["hash"]
    manifest = json.loads((runs[0] / "manifest.json").read_text())
    assert manifest["tokens"] == 4 * 64 and len(manifest["sample_ids"]) == 4
    assert load_file(runs[0] / "samples.safetensors")["input_ids"].shape == (4, 64)
    info = run_cli("info", runs[0])
    assert info.returncode == 0 and "calibrate" in info.stdout and a["hash"][:16] in info.stdout


def _start_calibration(out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "pipelines.cli", "calibrate", "--model", REAL_MODEL, "--out", str(out),
         "--samples", "32", "--seq-len", "256", "--batch-size", "4"],  # long enough to be caught mid-way on a loaded machine
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "LMPRESS_QUIET": "1"},
        # a child inherits an ignored SIGINT (as some test runners leave it), and then Ctrl-C
        # would be ignored by design; the test is about the default, a user's terminal
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _wait_for_layers(out: Path, layers: int, timeout: float = 300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if any(len(list((p / "stats").glob("*.safetensors"))) >= layers for p in leftovers(out)):
            return
        time.sleep(0.2)
    raise AssertionError("calibration made no progress")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["SIGINT", "SIGTERM", "SIGKILL"])
def test_interrupted_calibration_leaves_no_artifact_and_reruns(tmp_path, sig):
    out = tmp_path / "cal"
    process = _start_calibration(out)
    _wait_for_layers(out, 2)
    process.send_signal(sig)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode != 0
    assert not out.exists()
    if sig != signal.SIGKILL:  # SIGTERM (kill, a scheduler's timeout) unwinds as Ctrl-C does
        assert process.returncode == 130 and "Traceback" not in stderr and "interrupted" in stderr
        assert leftovers(out) == []
        return  # nothing is left, so a rerun is a first run
    # SIGKILL cannot be caught: its half-written folder is left, and the rerun must not trip on it
    rerun = run_cli("calibrate", "--model", REAL_MODEL, "--out", out, "--samples", "4", "--seq-len", "64")
    assert rerun.returncode == 0, rerun.stderr
    assert len(list((out / "stats").glob("*.safetensors"))) == 30 and leftovers(out) == []


def test_evaluate_generate_and_validate_refuse_bad_paths_and_values(tmp_path):
    model_copy = tmp_path / "not-a-reference"  # a folder that is not a reference cache is never replaced by one
    model_copy.mkdir()
    (model_copy / "config.json").write_text("{}")
    assert_user_error(refuse_in_process("evaluate", REAL_MODEL, "--reference", model_copy), "is a folder of other files than an lmpress output")
    assert (model_copy / "config.json").read_text() == "{}"
    (model_copy / "manifest.json").write_text('{"format": "lmpress-calibration/1"}')
    assert_user_error(refuse_in_process("evaluate", REAL_MODEL, "--reference", model_copy), "is not an lmpress reference cache")
    assert_user_error(refuse_in_process("generate", REAL_MODEL, " "), "the prompt is empty")
    assert_user_error(refuse_in_process("generate", REAL_MODEL, "Hi", "--max-new-tokens", "0"), "--max-new-tokens must be positive (got 0)")
    assert_user_error(refuse_in_process("generate", REAL_MODEL, "Hi", "--lookahead", "8"), "--lookahead sets how many tokens a draft proposes; pass --draft MODEL")
    assert_user_error(refuse_in_process("generate", REAL_MODEL, "Hi", "--dtype", "int4"), "--dtype must be auto, float32, bfloat16 or float16 (got 'int4')")
    assert_user_error(refuse_in_process("evaluate", REAL_MODEL, "--reference", tmp_path / "ref", "--windows", "2", "--seq-len", "100000"),
                      "1 windows of 100000, fewer than the 2 needed; pass a smaller --windows or --seq-len, or more text")
    assert_user_error(refuse_in_process("validate", REAL_MODEL, "--out", tmp_path), f"output path {tmp_path} is a directory")
    assert_user_error(refuse_in_process("validate", model_copy.parent / "nope"), "is not a folder; pass a quantized or pruned artifact")
    (tmp_path / "stats").mkdir()  # e.g. a calibration artifact: no model in it
    assert_user_error(refuse_in_process("validate", tmp_path / "stats"), "stats has no config.json, so holds no model; pass a quantized or pruned artifact")
    assert_user_error(refuse_in_process("generate", REAL_MODEL, "Hi", "--max-new-tokens", "100000"),
                      "the prompt's 1 tokens and --max-new-tokens 100000 exceed the model's context of 8192 tokens; pass --max-new-tokens 8191 or less")
    assert list(tmp_path.glob(".*partial*")) == []


def test_an_output_of_another_kind_is_never_replaced(tmp_path, real_model_folder):
    """A mistyped --out that names an earlier output of another stage (a calibration, a draft)
    is refused before any work, and the output is left as it was; one of the same kind is
    replaced, as re-running a stage does."""
    from pipelines.stages import QuantizeConfig, quantize
    from conftest import save_tiny, tiny_config

    model, calibration = tmp_path / "tiny", tmp_path / "cal"
    save_tiny(model, tiny_config("llama"), real_model_folder, calibration)
    quantized = quantize(str(model), calibration, tmp_path / "q", QuantizeConfig(method="rtn", bits=4, group_size=32))
    before = {p.name: p.read_bytes() for p in (*calibration.iterdir(), *quantized.iterdir()) if p.is_file()}
    assert_user_error(refuse_in_process("quantize", "--model", model, "--method", "rtn", "--group-size", "32", "--out", calibration),
                      f"output path {calibration} holds an earlier calibrate output, which this quantize run would replace")
    assert_user_error(refuse_in_process("calibrate", "--model", model, "--out", quantized, *SMALL), "holds an earlier quantize output, which this calibrate run")
    assert_user_error(refuse_in_process("drop-layers", "--model", model, "--layers", "1", "--out", quantized), "holds an earlier quantize output, which this drop-layers run")
    assert_user_error(refuse_in_process("publish", quantized, "--repo-id", "me/tiny", "--dry-run", "--out", calibration),
                      "holds an earlier calibrate output, which this quantize run would replace")
    assert {p.name: p.read_bytes() for p in (*calibration.iterdir(), *quantized.iterdir()) if p.is_file()} == before
    again = run_cli("quantize", "--model", model, "--method", "rtn", "--bits", "8", "--group-size", "32", "--out", quantized)
    assert again.returncode == 0, again.stderr
    assert json.loads((quantized / "lineage.json").read_text())["chain"][-1]["params"]["bits"] == 8


def test_generate_refuses_a_request_beyond_the_context_before_loading_the_weights(monkeypatch):
    """The prompt and --max-new-tokens are checked from the config and tokenizer alone: the
    error comes at once, not after a load (a packed artifact's decompression bars)."""
    from pipelines import serving

    def load_for_serving(*args, **kwargs):
        raise AssertionError("the weights were loaded before the request was checked")

    monkeypatch.setattr(serving, "load_for_serving", load_for_serving)
    assert_user_error(refuse_in_process("generate", REAL_MODEL, "Hi", "--max-new-tokens", "8192"),
                      "the prompt's 1 tokens and --max-new-tokens 8192 exceed the model's context of 8192 tokens; pass --max-new-tokens 8191 or less")


def test_damaged_model_files_are_one_line_and_reports_never_overwrite_them(tmp_path):
    """Weights that are a Git LFS pointer, an HTML page or cut short, and a config.json that is
    not an object, fail before loading; `validate --out` never overwrites the artifact's files."""
    from pipelines.models import resolve_model

    base = resolve_model(REAL_MODEL)
    model = tmp_path / "model"
    model.mkdir()
    for file in base.iterdir():
        (model / file.name).symlink_to(file)
    weights = model / "model.safetensors"
    weights.unlink()
    for content, message in [
        (b"version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 1\n", "is a Git LFS pointer, not the weights"),
        (b"<!DOCTYPE html><html>Not found</html>", "is corrupt"),
        ((base / "model.safetensors").open("rb").read(1 << 20), "is truncated"),
    ]:
        weights.write_bytes(content)
        for command in (["generate", model, "Hi"], ["validate", model, "--out", tmp_path / "v.json"]):
            assert_user_error(refuse_in_process(*command), message)
    weights.unlink()
    weights.symlink_to(base / "model.safetensors")
    (model / "config.json").unlink()
    (model / "config.json").write_text("[]")
    assert_user_error(refuse_in_process("validate", model, "--out", tmp_path / "v.json"), "config.json is not a JSON object")
    weights.unlink()
    weights.write_bytes(b"keep")
    other = tmp_path / "notes.txt"
    other.write_bytes(b"keep")
    assert_user_error(refuse_in_process("validate", model, "--out", other), "is a file that is not a JSON report")
    for inside in (weights, model / "lineage.json"):
        assert_user_error(refuse_in_process("validate", model, "--out", inside), "an artifact or model folder whose files it could replace")
    assert weights.read_bytes() == b"keep" and other.read_bytes() == b"keep" and not (model / "lineage.json").exists()


def test_reports_never_land_in_an_artifact_and_damaged_inputs_are_one_line(tmp_path, real_model_folder):
    """A report path (evaluate / latency --out, publish --receipt) inside an artifact would
    replace one of its files: refused before any work. Damaged calibration statistics, a
    tokenizer file that does not parse or does not load, a config.json with a wrong value, an
    override that an earlier one shadows or a skip leaves out, truncated weights handed to
    publish and a damaged metrics.json are each one line naming the fix, and leave what they
    read as it was."""
    import shutil

    from conftest import save_tiny, tiny_config

    tiny = save_tiny(tmp_path / "tiny", tiny_config("llama"), real_model_folder, calibration=tmp_path / "cal")
    quantized = tmp_path / "q"
    assert refuse_in_process("quantize", "--model", tiny, "--method", "rtn", "--group-size", "32", "--out", quantized).returncode == 0
    before = {file: file.read_bytes() for file in (quantized / "config.json", quantized / "lineage.json", tmp_path / "cal" / "manifest.json")}
    for command in (
        ["evaluate", quantized, "--reference", tmp_path / "ref", "--out", quantized / "config.json"],
        ["latency", "--model", tiny, "--levels", tmp_path / "cal", "--out", tmp_path / "cal" / "manifest.json"],
        ["publish", quantized, "--repo-id", "me/tiny", "--dry-run", "--force", "--out", tmp_path / "pub", "--receipt", quantized / "lineage.json"],
    ):
        assert_user_error(refuse_in_process(*command), "an artifact or model folder whose files it could replace")
    assert {file: file.read_bytes() for file in before} == before and not (tmp_path / "ref").exists() and not (tmp_path / "pub").exists()

    out = tmp_path / "q2"
    damaged = tmp_path / "cal2"
    shutil.copytree(tmp_path / "cal", damaged)
    stats = damaged / "stats" / "layer_001.safetensors"
    os.truncate(stats, stats.stat().st_size // 2)
    gptq = ["quantize", "--model", tiny, "--method", "gptq", "--group-size", "32", "--calibration", damaged, "--out", out]
    assert_user_error(refuse_in_process(*gptq, "--sequential", "false"), "layer_001.safetensors is truncated or corrupt", out)
    manifest = json.loads((damaged / "manifest.json").read_text())
    del manifest["tokens"]
    (damaged / "manifest.json").write_text(json.dumps(manifest))
    assert_user_error(refuse_in_process(*gptq), "manifest.json lacks tokens; re-run `lmpress calibrate`", out)

    plan = tmp_path / "plan.yaml"
    plan.write_text(".*:\n  bits: 3\n.*down_proj:\n  bits: 8\n")
    rtn = ["quantize", "--model", tiny, "--method", "rtn", "--group-size", "32", "--out", out]
    assert_user_error(refuse_in_process(*rtn, "--overrides", plan), "override '.*down_proj' never applies")
    plan.write_text(".*down_proj:\n  bits: 8\n")
    assert_user_error(refuse_in_process(*rtn, "--overrides", plan, "--skip", "mlp"), "override '.*down_proj' never applies: --skip leaves", out)
    tokenizer = (tiny / "tokenizer.json").read_text()
    (tiny / "tokenizer.json").write_text(tokenizer[:1000])
    assert_user_error(refuse_in_process(*rtn), f"the tokenizer in {tiny} does not load (", out)
    (tiny / "tokenizer.json").write_text(json.dumps({**json.loads(tokenizer), "model": {"type": "BPE"}}))  # JSON, but no vocabulary
    assert_user_error(refuse_in_process(*rtn), "does not load (Missing vocab/merges", out)
    config = json.loads((tiny / "config.json").read_text())
    (tiny / "config.json").write_text(json.dumps({**config, "num_hidden_layers": "thirty"}))
    assert_user_error(refuse_in_process(*rtn), "config.json cannot be read as a transformers config", out)

    weights = quantized / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    assert_user_error(refuse_in_process("publish", quantized, "--repo-id", "me/tiny", "--dry-run", "--force", "--out", tmp_path / "pub"), "is truncated")
    assert not (tmp_path / "pub").exists()
    (quantized / "metrics.json").write_text("{")
    assert_user_error(refuse_in_process("info", quantized), "metrics.json is not valid JSON")


def test_a_write_the_filesystem_refuses_mid_stage_is_one_line_and_leaves_nothing(tmp_path, tiny_folder):
    """A file-size limit (RLIMIT_FSIZE, as a full disk: the OS refuses the write) hit while
    safetensors saves the weights, which reports the OS error only in its message: one line,
    exit 2, no partial output."""
    import resource

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    out = tmp_path / "q"
    result = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "quantize", "--model", tiny_folder, "--method", "rtn", "--group-size", "32", "--out", out],
        capture_output=True, text=True, timeout=600, env={**os.environ, "LMPRESS_QUIET": "1"}, preexec_fn=limit_file_size,
    )
    assert (tiny_folder / "model.safetensors").stat().st_size > 1 << 20  # the save is what hits the limit
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    # the stage's own progress lines come first: the error is the one line after them
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: the filesystem refused a write: {os.strerror(27)}; free space")
    assert not out.exists() and leftovers(out) == []


def test_evaluate_base_then_rescore_against_the_cached_reference(tmp_path):
    """The first run builds the reference from the base (one pass); the second scores the base
    against it for real: KL 0, full agreement, same perplexity. Perplexity on held-out Austen is
    in the range the base model is known for (a broken conversion gives thousands)."""
    args = ["evaluate", REAL_MODEL, "--reference", tmp_path / "ref", "--windows", "2", "--seq-len", "128"]
    first = run_cli(*args, "--out", tmp_path / "m1.json")
    assert first.returncode == 0, first.stderr
    second = run_cli(*args, "--out", tmp_path / "m2.json")
    assert second.returncode == 0, second.stderr
    m1, m2 = (json.loads((tmp_path / f"m{i}.json").read_text()) for i in (1, 2))
    for corpus in ("austen-heldout", "pydoc-heldout", "reuters-heldout"):  # the default corpora: both calibration domains and newswire
        assert m2[corpus]["kl_to_base"] < 1e-5 and m2[corpus]["top1_agreement"] == 1.0
        assert abs(m1[corpus]["perplexity"] - m2[corpus]["perplexity"]) < 1e-3
    assert 10 < m1["austen-heldout"]["perplexity"] < 40 and 10 < m1["reuters-heldout"]["perplexity"] < 80
    assert m1["parameters"] == 134_515_008 and m1["bits_per_weight"] == 32.0
    mismatch = refuse_in_process(*args[:-2], "--seq-len", "64")
    assert_user_error(mismatch, "was built with windows=2, seq_len=128")


def test_evaluate_a_model_made_elsewhere_against_the_base_reference(tmp_path):
    """A model without lmpress lineage (another tool's output) is scored against the base
    reference once the user names its base; without --base it is refused."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipelines.models import resolve_model

    base = resolve_model(REAL_MODEL)
    model = AutoModelForCausalLM.from_pretrained(base)
    with torch.no_grad():
        model.model.layers[3].mlp.down_proj.weight.mul_(0.5)  # "another tool" changed it
    model.save_pretrained(tmp_path / "other")
    AutoTokenizer.from_pretrained(base).save_pretrained(tmp_path / "other")
    args = ["--reference", tmp_path / "ref", "--windows", "1", "--seq-len", "64", "--corpora", "austen-heldout"]
    assert run_cli("evaluate", REAL_MODEL, *args).returncode == 0
    assert_user_error(refuse_in_process("evaluate", REAL_MODEL, *args[:-2]),  # the default corpora, against a reference of one
                      f"reference {tmp_path / 'ref'} holds no pydoc-heldout, reuters-heldout; pass --corpora austen-heldout (what it holds) "
                      "or another --reference path")
    refused = refuse_in_process("evaluate", tmp_path / "other", *args)
    assert_user_error(refused, "was built from another base model")
    scored = run_cli("evaluate", tmp_path / "other", *args, "--base", REAL_MODEL, "--out", tmp_path / "m.json")
    assert scored.returncode == 0, scored.stderr
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["austen-heldout"]["kl_to_base"] > 1e-4 and metrics["austen-heldout"]["top1_agreement"] < 1.0
