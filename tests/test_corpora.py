import json

import pytest
import torch

from calibrate.corpora import (
    NAMED_CORPORA, austen_novels, check_disjoint, corpus_parts, leading_windows, load_corpus_part, sample_windows, tokenize_part,
)
from calibrate import corpora
from pipelines.errors import LmpressError


def test_austen_novels_parse_from_the_debian_package():
    novels = corpora._parse_austen_database(corpora._austen_data_dir())
    assert sorted(novels) == sorted(["emma", "mansfieldpark", "northangerabbey", "persuasion", "prideprejudice", "sensesensibility"])
    assert novels["prideprejudice"].startswith("PRIDE AND PREJUDICE")
    assert "It is a truth universally acknowledged" in novels["prideprejudice"]
    assert sum(len(text.split()) for text in novels.values()) > 700_000


def test_austen_novels_are_parsed_once_then_read_from_the_cached_copy(tmp_path, monkeypatch):
    data = corpora._austen_data_dir()
    monkeypatch.setattr(corpora, "_austen_data_dir", lambda: data)
    monkeypatch.setattr(corpora, "cache_root", lambda: tmp_path)
    austen_novels.cache_clear()
    try:
        parsed = austen_novels()
        (copy,) = (tmp_path / "janeaustenr").glob("novels-*.json")
        assert json.loads(copy.read_text()) == parsed == corpora._parse_austen_database(data)
        monkeypatch.setattr(corpora, "_parse_austen_database", lambda _: pytest.fail("parsed again despite the copy"))
        austen_novels.cache_clear()
        assert austen_novels() == parsed
    finally:
        austen_novels.cache_clear()


@pytest.mark.parametrize("domain", ["austen", "pydoc"])
def test_calibration_and_heldout_parts_never_share_a_document(domain):
    calib = {d.id for d in NAMED_CORPORA[f"{domain}-calib"]()}
    heldout = {d.id for d in NAMED_CORPORA[f"{domain}-heldout"]()}
    assert calib and heldout and not calib & heldout
    with pytest.raises(LmpressError, match="overlaps the calibration text"):
        check_disjoint(sorted(calib), sorted(calib)[:1], f"{domain}-calib")


def test_reuters_newswire_is_out_of_domain_held_out_text(tmp_path, monkeypatch):
    """The 70 Reuters-21578 articles of Debian's r-cran-tm, title and body each, under ids of
    their own: no calibration corpus holds them or shares a run of words with them."""
    articles = load_corpus_part("reuters-heldout")
    assert len(articles) == len({a.id for a in articles}) == 70
    assert all(a.id.startswith("reuters/") for a in articles)
    first = next(a for a in articles if a.id == "reuters/10")
    assert first.text.startswith("COMPUTER TERMINAL SYSTEMS <CPML> COMPLETES SALE\nComputer Terminal Systems Inc said")
    assert 11_000 < sum(len(a.text.split()) for a in articles) < 13_000
    assert not [name for name in NAMED_CORPORA if name.startswith("reuters") and not name.endswith("-heldout")]
    assert not corpora.shared_text(articles, load_corpus_part("austen-calib") + load_corpus_part("pydoc-calib"))
    monkeypatch.setattr(corpora, "cache_root", lambda: tmp_path)  # as on a machine set-up never ran on
    with pytest.raises(LmpressError, match="Reuters newswire articles are not installed; run scripts/setup.sh .*r-cran-tm"):
        load_corpus_part("reuters-heldout")


def test_pydoc_calibration_text_shares_no_run_of_tokens_with_the_held_out_text(real_tokenizer):
    """pydoc's topics repeat each other (`specialnames` holds every paragraph of the held-out
    `attribute-access`): the calibration part drops what the held-out part says, and not one
    32-token run of held-out text remains in it, while it keeps over 90% of its words."""
    from pydoc_data.topics import topics

    run = 32
    calibration, held_out = (tokenize_part(part, real_tokenizer).tokens.tolist() for part in ("pydoc-calib", "pydoc-heldout"))
    calibration_runs = {tuple(calibration[i : i + run]) for i in range(len(calibration) - run + 1)}
    assert not any(tuple(held_out[i : i + run]) in calibration_runs for i in range(len(held_out) - run + 1))
    names = sorted(topics)
    whole = sum(len(topics[name].split()) for i, name in enumerate(names) if i % corpora.PYDOC_HELDOUT_EVERY)
    assert 0.9 * whole < sum(len(d.text.split()) for d in load_corpus_part("pydoc-calib")) < whole


def test_user_txt_and_jsonl_files(tmp_path):
    (tmp_path / "a.txt").write_text("plain text")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two", "x": 1}) + "\n")
    assert [d.text for d in load_corpus_part(str(tmp_path / "a.txt"))] == ["plain text"]
    docs = load_corpus_part(str(tmp_path / "b.jsonl"))
    assert [d.text for d in docs] == ["one", "two"] and docs[0].id != docs[1].id
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(LmpressError, match='line 2 of .* "text" field'):
        load_corpus_part(str(tmp_path / "bad.jsonl"))


def test_user_files_that_repeat_the_other_sides_text_are_caught_by_their_text(tmp_path, tiny_folder, real_tokenizer):
    """Ids prove the named parts disjoint, but a user's file carries only its own hash: a
    calibration file that copies a page of Pride and Prejudice, or an evaluation file that copies
    one of Emma, is found by a shared run of words, whatever its line breaks."""
    from pipelines.artifact import read_lineage
    from pipelines.stages import CalibrateConfig, calibrate, held_out_windows

    def page(corpus: str, document: str) -> str:
        text = next(d.text for d in load_corpus_part(corpus) if d.id == document)
        return "\n".join(text[len(text) // 2 :].split()[:300])  # re-wrapped: one word per line

    (tmp_path / "notes.txt").write_text("My own notes on novels.\n\n" + page("austen-heldout", "austen/prideprejudice"))
    (tmp_path / "quiz.txt").write_text("A quiz.\n\n" + page("austen-calib", "austen/emma"))
    (tmp_path / "fresh.txt").write_text(" ".join(f"line {i} of a text nobody calibrated on." for i in range(100)))
    calibration_spec = f"{tmp_path / 'notes.txt'}+austen-calib"
    assert corpora.held_out_text_in(calibration_spec) == ["austen/prideprejudice"]
    assert corpora.held_out_text_in(f"{tmp_path / 'fresh.txt'}+austen-calib") == []

    calibrate(str(tiny_folder), tmp_path / "cal", CalibrateConfig(corpus=calibration_spec, samples=2, seq_len=32, batch_size=2))
    chain = read_lineage(tmp_path / "cal")["chain"]
    with pytest.raises(LmpressError, match=r"evaluation corpus 'austen-heldout' overlaps the calibration text \(austen/prideprejudice\)"):
        held_out_windows("austen-heldout", real_tokenizer, chain, 1, 32)
    with pytest.raises(LmpressError, match=r"quiz.txt' repeats calibration text \(austen/emma\); evaluate on text the calibration did not see"):
        held_out_windows(str(tmp_path / "quiz.txt"), real_tokenizer, chain, 1, 32)
    for corpus in ("pydoc-heldout", str(tmp_path / "fresh.txt")):
        assert held_out_windows(corpus, real_tokenizer, chain, 1, 32)[0].shape == (1, 32)


def test_unknown_corpus_and_empty_spec():
    with pytest.raises(LmpressError, match="unknown corpus 'novels'; use one of austen-calib"):
        load_corpus_part("novels")
    with pytest.raises(LmpressError, match="empty corpus spec"):
        corpus_parts(" + ")


def test_sampling_is_seeded_disjoint_and_shares_parts(real_tokenizer, tmp_path):
    a = sample_windows("austen-calib+pydoc-calib", real_tokenizer, 9, 64, seed=3)
    b = sample_windows("austen-calib+pydoc-calib", real_tokenizer, 9, 64, seed=3)
    c = sample_windows("austen-calib+pydoc-calib", real_tokenizer, 9, 64, seed=4)
    assert torch.equal(a.input_ids, b.input_ids) and a.sample_ids == b.sample_ids
    assert a.sample_ids != c.sample_ids
    assert a.input_ids.shape == (9, 64)
    assert sum(i.startswith("austen-calib:") for i in a.sample_ids) == 5
    assert sum(i.startswith("pydoc-calib:") for i in a.sample_ids) == 4
    assert len(set(a.sample_ids)) == 9  # distinct windows; offsets are multiples of 64 so they never overlap
    assert all(int(i.rsplit(":", 1)[1]) % 64 == 0 for i in a.sample_ids)


def test_too_little_text_says_how_much_there_is(real_tokenizer, tmp_path):
    (tmp_path / "short.txt").write_text("A few words only.")
    with pytest.raises(LmpressError, match="fewer than the 4 needed; pass a smaller --samples or --seq-len"):
        sample_windows(str(tmp_path / "short.txt"), real_tokenizer, 4, 512, seed=0)


def test_leading_windows_are_a_fixed_slice(real_tokenizer):
    part = tokenize_part("austen-heldout", real_tokenizer)
    windows = leading_windows(part, 3, 128)
    assert torch.equal(windows.flatten(), part.tokens[: 3 * 128])
