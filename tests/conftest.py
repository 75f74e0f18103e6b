import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is defined
os.environ.setdefault("LMPRESS_QUIET", "1")
torch.set_num_threads(1)

REAL_MODEL = "smollm2-135m"


def tiny_config(family: str):
    """A random-init config of each supported family, small enough to build in milliseconds.
    Sliding windows are shorter than the test sequences, so per-layer masks matter."""
    import transformers as tf

    common = dict(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=False,
    )
    return {
        "llama": lambda: tf.LlamaConfig(**common),
        "mistral": lambda: tf.MistralConfig(**common, sliding_window=8),
        "qwen2": lambda: tf.Qwen2Config(**common),
        "qwen3": lambda: tf.Qwen3Config(**common, use_sliding_window=True, sliding_window=8, max_window_layers=2),
        "gemma2": lambda: tf.Gemma2Config(**common, sliding_window=8, final_logit_softcapping=30.0),
        "gemma3_text": lambda: tf.Gemma3TextConfig(**common, sliding_window=8, sliding_window_pattern=2),
    }[family]()


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text"]


def tiny_model(family: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(family)
    config._attn_implementation = "eager"
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="session")
def real_model_folder() -> Path:
    from pipelines.models import resolve_model

    return resolve_model(REAL_MODEL)


@pytest.fixture(scope="session")
def real_tokenizer(real_model_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_model_folder)


def save_tiny(folder: Path, config, tokenizer_folder: Path, calibration: Path | None = None) -> Path:
    """A random-init model of `config` saved as a HF folder with the real tokenizer (vocab sized
    to match); with `calibration`, also its calibration artifact (8 windows of 32 tokens)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config.vocab_size = 49152
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_folder).save_pretrained(folder)
    if calibration is not None:
        from pipelines.stages import CalibrateConfig, calibrate

        calibrate(str(folder), calibration, CalibrateConfig(samples=8, seq_len=32, batch_size=4))
    return folder


@pytest.fixture
def tiny_folder(tmp_path, real_model_folder) -> Path:
    """A tiny Llama saved as a HF folder with the real tokenizer."""
    return save_tiny(tmp_path / "tiny", tiny_config("llama"), real_model_folder)


def run_cli(*args, cwd=None, timeout=600, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipelines.cli", *map(str, args)],
        capture_output=True, text=True, cwd=cwd, timeout=timeout, env=env or {**os.environ, "LMPRESS_QUIET": "1"},
    )


def refuse_in_process(*args) -> subprocess.CompletedProcess:
    """`run_cli` for a command the CLI must refuse, run through the same entry point
    (`pipelines.cli.main`: the one-line error and exit code) in this process. A fresh
    interpreter imports torch and transformers for 5-10 s before a stage checks anything, and
    the bad-input tests run dozens of such commands; here that is paid once per worker. Any
    exception but the CLI's own exit fails the test, as a traceback would."""
    import contextlib
    import io
    import signal

    from pipelines import cli

    command = ["lmpress", *map(str, args)]
    stdout, stderr, argv, on_sigterm = io.StringIO(), io.StringIO(), sys.argv, signal.getsignal(signal.SIGTERM)
    sys.argv = command
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            cli.main()
        code = 0
    except SystemExit as exit:
        code = exit.code or 0
    finally:
        sys.argv = argv
        signal.signal(signal.SIGTERM, on_sigterm)  # main() installs its own
    return subprocess.CompletedProcess(command, code, stdout.getvalue(), stderr.getvalue())


def leftovers(out: Path) -> list[Path]:
    """Temporaries a stage left beside its output."""
    return sorted(out.parent.glob(f".{out.name}.*"))


def dequantized_in_place(model, folder: Path):
    """`model` (the one a packed artifact in `folder` was quantized from) with each of the
    artifact's packed weights, dequantized by the torch reference, in its linear's place: what
    loading the artifact must give, built without the loader."""
    from compressors.packed_int import dequantize_reference
    from pipelines.serving import packed_weights

    with torch.no_grad():
        for name, weight in packed_weights(folder).items():
            model.get_submodule(name).weight.copy_(dequantize_reference(weight))
    return model
