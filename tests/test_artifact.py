import os

import pytest

from conftest import leftovers
from pipelines.artifact import atomic_directory, chain_hash, read_lineage, write_lineage, StageRun
from pipelines.errors import LmpressError


def test_failed_write_leaves_nothing_and_keeps_the_old_output(tmp_path):
    out = tmp_path / "out"
    with atomic_directory(out) as tmp:
        (tmp / "good").write_text("v1")
    with pytest.raises(RuntimeError):
        with atomic_directory(out) as tmp:
            (tmp / "good").write_text("half")
            raise RuntimeError("stage failed midway")
    assert (out / "good").read_text() == "v1"
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
    again = write_lineage(tmp_path, base, {"stage": "calibrate", "params": {"samples": 4}}, StageRun())
    assert again["hash"] == first["hash"]
    other = write_lineage(tmp_path, base, {"stage": "calibrate", "params": {"samples": 5}}, StageRun())
    assert other["hash"] != first["hash"]
