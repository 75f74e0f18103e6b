import json
import os
from pathlib import Path

import pytest
import torch

from conftest import leftovers
from pipelines.artifact import atomic_directory, chain_hash, read_lineage, write_lineage, StageRun
from pipelines.errors import LmpressError


def test_failed_write_leaves_nothing_and_keeps_the_old_output(tmp_path):
    out = tmp_path / "out"
    with atomic_directory(out) as tmp:
        (tmp / "lineage.json").write_text("v1")  # an lmpress output: a later run may replace it
    with pytest.raises(RuntimeError):
        with atomic_directory(out) as tmp:
            (tmp / "lineage.json").write_text("half")
            raise RuntimeError("stage failed midway")
    assert (out / "lineage.json").read_text() == "v1"
    assert leftovers(out) == []
    with atomic_directory(out) as tmp:
        (tmp / "new").write_text("v2")
    assert sorted(p.name for p in out.iterdir()) == ["new"] and leftovers(out) == []


def test_leftovers_of_a_killed_run_are_cleaned(tmp_path):
    out = tmp_path / "out"
    dead = tmp_path / ".out.partial-999999999"  # no such pid
    dead.mkdir()
    (tmp_path / f".out.partial-{os.getpid()}").mkdir()  # "ours": reused
    with atomic_directory(out) as tmp:
        (tmp / "x").write_text("1")
    assert leftovers(out) == [] and (out / "x").exists()


def test_old_output_moved_aside_by_a_killed_swap_is_restored(tmp_path):
    out = tmp_path / "out"
    aside = tmp_path / ".out.old-999999999"
    aside.mkdir()
    (aside / "x").write_text("good")
    with pytest.raises(RuntimeError):
        with atomic_directory(out):
            raise RuntimeError
    assert (out / "x").read_text() == "good"


def test_output_path_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("keep me")
    with pytest.raises(LmpressError, match="is a file"):
        with atomic_directory(tmp_path / "f"):
            pass
    assert (tmp_path / "f").read_text() == "keep me"


def test_lineage_chains_and_its_hash_ignores_run_details(tmp_path):
    base = [{"stage": "base", "model": "m", "weights_sha256": "abc"}]
    first = write_lineage(tmp_path, base, {"stage": "calibrate", "params": {"samples": 4}}, StageRun())
    assert read_lineage(tmp_path) == first
    assert [r["stage"] for r in first["chain"]] == ["base", "calibrate"]
    assert first["chain"][1]["parent_hash"] == chain_hash(base)
    assert first["chain"][1]["run"]["torch_threads"] == torch.get_num_threads()  # a CPU run's bytes depend on it
    again = write_lineage(tmp_path, base, {"stage": "calibrate", "params": {"samples": 4}}, StageRun())
    assert again["hash"] == first["hash"]
    other = write_lineage(tmp_path, base, {"stage": "calibrate", "params": {"samples": 5}}, StageRun())
    assert other["hash"] != first["hash"]


def test_a_folder_of_other_files_is_never_replaced(tmp_path):
    """Only an empty folder or an lmpress output (lineage.json or manifest.json) is replaced;
    a folder of the user's own files is refused before any work and left as it was."""
    out = tmp_path / "mine"
    (out / "src").mkdir(parents=True)
    (out / "notes.txt").write_text("precious")
    with pytest.raises(LmpressError, match="is a folder of other files than an lmpress output"):
        with atomic_directory(out):
            pass
    assert (out / "notes.txt").read_text() == "precious" and (out / "src").is_dir() and leftovers(out) == []
    (out / "notes.txt").unlink(), (out / "src").rmdir()
    for marker in ("", "lineage.json", "manifest.json"):  # empty, then an earlier output of either kind
        if marker:
            (out / marker).write_text("{}")
        with atomic_directory(out) as tmp:
            (tmp / "new").write_text("x")
        assert [p.name for p in out.iterdir()] == ["new"]


def test_only_this_modules_temporaries_are_cleaned(tmp_path):
    """A sibling that merely looks like a temporary (a user's dated backup) is not removed."""
    backup = tmp_path / ".out.backup-20241126"
    backup.mkdir()
    (backup / "x").write_text("keep")
    with atomic_directory(tmp_path / "out") as tmp:
        (tmp / "y").write_text("1")
    assert (backup / "x").read_text() == "keep"


def test_the_current_folder_and_the_model_cache_are_refused(tmp_path, monkeypatch):
    from pipelines.artifact import require_output_path

    monkeypatch.chdir(tmp_path)
    for out in (".", "", ".."):
        with pytest.raises(LmpressError, match="is the current folder or one above it"):
            require_output_path(Path(out), directory=True)
    monkeypatch.setenv("LMPRESS_CACHE", str(tmp_path / "cache"))
    with pytest.raises(LmpressError, match="lies in lmpress's model cache"):
        require_output_path(tmp_path / "cache" / "models" / "smollm2-135m", directory=True)
    model = tmp_path / "model"
    (model / "stats").mkdir(parents=True)
    with pytest.raises(LmpressError, match="would replace the input .* or a part of it"):
        require_output_path(model / "stats", directory=True, inputs=(model,))


def test_a_failed_run_removes_the_folders_it_made_and_a_refused_rename_is_one_line(tmp_path, monkeypatch):
    out = tmp_path / "a" / "b" / "out"
    with pytest.raises(RuntimeError):
        with atomic_directory(out):
            raise RuntimeError
    assert list(tmp_path.iterdir()) == []
    good = tmp_path / "good"
    with atomic_directory(good) as tmp:
        (tmp / "lineage.json").write_text("v1")

    def refuse(source, target):  # the new output may not go in; the good one may move back
        if ".partial-" in Path(source).name:
            raise PermissionError(1, "Operation not permitted")
        os.replace(source, target)

    monkeypatch.setattr("pipelines.artifact.os.rename", refuse)
    with pytest.raises(LmpressError, match=f"cannot write {good}: Operation not permitted"):
        with atomic_directory(good) as tmp:
            (tmp / "lineage.json").write_text("v2")
    assert (good / "lineage.json").read_text() == "v1" and leftovers(good) == []


def test_a_report_never_overwrites_a_file_that_is_not_json(tmp_path):
    from pipelines.artifact import write_json

    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"weights")
    with pytest.raises(LmpressError, match="is a file that is not a JSON report"):
        write_json(weights, {"a": 1})
    assert weights.read_bytes() == b"weights"
    write_json(tmp_path / "report.json", {"a": 1})
    write_json(tmp_path / "report.json", {"a": 2})  # an earlier report is replaced
    assert json.loads((tmp_path / "report.json").read_text()) == {"a": 2}


def test_a_damaged_lineage_is_one_line(tmp_path):
    for text in ("[]", '{"format": "lmpress-lineage/1"}', '{"format": "lmpress-lineage/1", "chain": []}'):
        (tmp_path / "lineage.json").write_text(text)
        with pytest.raises(LmpressError, match="is not an lmpress lineage manifest"):
            read_lineage(tmp_path)
