"""The real DVC pipeline, with the shipped dvc.yaml and small params, in a scratch repo."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def dvc(*args, cwd):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "LMPRESS_QUIET": "1"}
    result = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_dvc_repro_runs_then_skips_and_shows_metrics(tmp_path):
    for name in ("dvc.yaml", ".dvcignore"):
        shutil.copy(ROOT / name, tmp_path / name)
    for package in ("calibrate", "compressors", "pipelines"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["calibrate"].update(samples=2, seq_len=32, batch_size=2)
    params["evaluate"].update(windows=1, seq_len=64)
    params["quantize"].update(batch_size=2, clip_search=False)  # the wiring: the clip search is 35% of this stage here
    params["prune"].update(method="magnitude", batch_size=2)  # the stage wiring, not SparseGPT's speed
    params["kv_merge"].update(samples=2, batch_size=2)
    params["draft"].update(layers=2, prompts=2, prompt_len=16, new_tokens=8, real_windows=2, steps=2, batch_size=2)
    params["speculation"].update(prompts=2, prompt_len=32, new_tokens=8, lookahead="2")
    params["levels"].update(bits="2,4", method="rtn", clip_search=False)  # clip search is GPTQ's
    params["search"].update(generations=2, offspring=2, selection="1:1", seq_len=32)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    dvc("init", "-q", cwd=tmp_path)
    shutil.copy(ROOT / ".dvc/config", tmp_path / ".dvc/config")  # the shipped cache settings (linked, not copied)

    dvc("repro", cwd=tmp_path)
    stats = tmp_path / "artifacts/calibration/stats/layer_029.safetensors"
    assert stats.stat().st_nlink >= 2  # linked to its cache entry, not a second copy
    assert (tmp_path / "artifacts/reference/lm_head.safetensors").is_file()
    assert (tmp_path / "artifacts/quantized/lineage.json").is_file()
    assert (tmp_path / "artifacts/pruned/compressed/validation.json").is_file()
    again = dvc("repro", cwd=tmp_path)
    for smaller in ("pruned-structured", "dropped", "kv-merged"):
        assert (tmp_path / f"artifacts/{smaller}/structure.json").is_file()
    stages = ("calibrate", "evaluate_base", "prune", "evaluate_pruned", "prune_structured", "evaluate_structured", "drop_layers", "evaluate_dropped")
    assert (tmp_path / "artifacts/draft/vocab_trim.safetensors").is_file()
    assert (tmp_path / "artifacts/search/history.csv").read_text().startswith("generation,fitness")
    card = (tmp_path / "artifacts/quantized-hub/README.md").read_text()  # publish: off by default, a dry run
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in card and "| perplexity, austen-heldout |" in card
    assert yaml.safe_load((tmp_path / "metrics/publish.json").read_text())["uploaded"] is False
    searched = ("levels", "search", "quantize_searched", "evaluate_searched")
    for stage in (*stages, "kv_merge", "evaluate_kv_merged", "quantize", "evaluate_quantized", "draft", "evaluate_draft", *searched, "publish"):
        assert f"Stage '{stage}' didn't change, skipping" in again
    shown = dvc("metrics", "show", cwd=tmp_path)
    assert "metrics/base.json" in shown and "metrics/quantized.json" in shown and "metrics/pruned.json" in shown and "metrics/kv-merged.json" in shown
    assert "lookahead.2.tokens_per_target_forward" in shown and "metrics/quantized-searched.json" in shown
    assert "austen-heldout.kl_to_base" in shown and "pydoc-heldout.perplexity" in shown
    assert "artifacts/search/search.json" in shown

    # the search's metrics and plot live under artifacts/ (not in git): DVC's cache keeps them
    for name in ("search.json", "history.csv"):
        (tmp_path / "artifacts/search" / name).unlink()
    dvc("checkout", cwd=tmp_path)
    assert (tmp_path / "artifacts/search/history.csv").read_text().startswith("generation,fitness")
    # the calibration stores the block influence compressors/structured.py computes
    with open(tmp_path / "compressors/structured.py", "a") as file:
        file.write("\n# changed\n")
    assert "compressors/structured.py" in dvc("status", "calibrate", cwd=tmp_path)
