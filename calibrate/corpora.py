"""Text sources, token windows and seeded sampling.

Named corpora come in disjoint calibration / held-out pairs, and one out-of-domain held-out
corpus with no calibration part (`reuters-heldout`: newswire, a domain the default
calibration mix never sees); every document carries an id (`austen/emma`, `pydoc/assert`,
`reuters/10`, `file:<sha>/<line>`) so a stage can prove that evaluation text was never
calibration text. A corpus spec joins parts with `+`
(`austen-calib+pydoc-calib`); calibration draws an equal share of samples from each part, so
one large part does not crowd out the other domain.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import zlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from pipelines.errors import LmpressError, require
from pipelines.models import cache_root

AUSTEN_NOVELS = ("emma", "mansfieldpark", "northangerabbey", "persuasion", "prideprejudice", "sensesensibility")
AUSTEN_HELDOUT = ("prideprejudice",)
PYDOC_HELDOUT_EVERY = 5  # every 5th topic (in sorted order) is held out
SHARED_RUN_WORDS = 24  # a calibration paragraph sharing a run of this many words with held-out text is dropped

_AUSTEN_DATA = Path("usr/lib/R/site-library/janeaustenr/data")
_REUTERS_DATA = Path("usr/lib/R/site-library/tm/texts")
REUTERS_TOPICS = ("acq", "crude")  # the two Reuters-21578 samples R's tm package ships: 50 + 20 articles


@dataclass(frozen=True)
class Document:
    id: str
    text: str


# --------------------------------------------------------------------------- sources


def _debian_data_dir(unpacked: str, data: Path, probe: str, what: str, package: str) -> Path:
    """A Debian package's data folder: unpacked by scripts/setup.sh into the cache, or installed."""
    for root in (cache_root() / unpacked, Path("/")):
        if (root / data / probe).exists():
            return root / data
    raise LmpressError(
        f"{what} not installed; run scripts/setup.sh (it unpacks Debian's {package} into {cache_root() / unpacked})"
    )


def _austen_data_dir() -> Path:
    return _debian_data_dir("janeaustenr", _AUSTEN_DATA, "Rdata.rdb", "the Austen novels are", "r-cran-janeaustenr")


def _reuters_data_dir() -> Path:
    return _debian_data_dir("tm", _REUTERS_DATA, "crude", "the Reuters newswire articles are", "r-cran-tm")


@lru_cache(maxsize=1)
def austen_novels() -> dict[str, str]:
    """The six novels, parsed once per installed package and then read from a JSON copy in the
    cache: parsing the R database takes 5 s, paid by every stage that reads calibration or
    held-out text (a dozen in the default pipeline). The copy is named by a hash of the
    package's files, so a different package version is parsed afresh."""
    data = _austen_data_dir()
    digest = hashlib.sha256((data / "Rdata.rdx").read_bytes() + (data / "Rdata.rdb").read_bytes()).hexdigest()[:16]
    copy = cache_root() / "janeaustenr" / f"novels-{digest}.json"
    if copy.is_file():
        return json.loads(copy.read_text())
    novels = _parse_austen_database(data)
    try:
        from pipelines.artifact import write_json

        write_json(copy, novels)  # atomic: a concurrent stage reads the whole copy or parses again
    except (OSError, LmpressError):  # a read-only cache: parse every time
        pass
    return novels


def _parse_austen_database(data: Path) -> dict[str, str]:
    """The R package's lazy-load database, parsed without R: the index is gzip'd R
    serialization; each object in the .rdb is a 4-byte length (skipped) then a zlib stream."""
    import warnings

    import rdata

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rdata warns that the raw stream has no file-type magic
        index = rdata.conversion.convert(rdata.parser.parse_data(gzip.decompress((data / "Rdata.rdx").read_bytes())))
        blob = (data / "Rdata.rdb").read_bytes()
        novels = {}
        for name, (offset, length) in index["variables"].items():
            record = blob[int(offset) : int(offset) + int(length)]
            lines = rdata.conversion.convert(rdata.parser.parse_data(zlib.decompress(record[4:])))
            novels[str(name)] = "\n".join(str(line) for line in lines)
    return novels


def _austen(held_out: bool) -> list[Document]:
    novels = austen_novels()
    names = AUSTEN_HELDOUT if held_out else [n for n in AUSTEN_NOVELS if n not in AUSTEN_HELDOUT]
    return [Document(f"austen/{name}", novels[name]) for name in names]


def _pydoc(held_out: bool) -> list[Document]:
    """Python's documentation topics, every 5th held out. Topics repeat each other (`specialnames`
    holds all of `customization` and `attribute-access`, `if` all of `else`), so distinct ids
    are not distinct text: the calibration topics lose every paragraph that shares a run of
    SHARED_RUN_WORDS words with the held-out ones (about 9% of their words)."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    held = [name for i, name in enumerate(names) if i % PYDOC_HELDOUT_EVERY == 0]
    if held_out:
        return [Document(f"pydoc/{name}", topics[name]) for name in held]
    held_text = " ".join(" ".join(topics[name].split()) for name in held)
    held_runs = set(_runs(held_text))

    def shared(paragraph: str) -> bool:  # word for word in the held-out text, or a long run of it
        return " ".join(paragraph.split()) in held_text or any(run in held_runs for run in _runs(paragraph))

    documents = []
    for name in (name for name in names if name not in held):
        kept = [paragraph for paragraph in topics[name].split("\n\n") if not shared(paragraph)]
        if kept:
            documents.append(Document(f"pydoc/{name}", "\n\n".join(kept)))
    return documents


def _reuters() -> list[Document]:
    """Reuters-21578 newswire from 1987 (corporate acquisitions and crude oil; 70 articles, about
    12k words), each its title and body: out-of-domain text for the default calibration mix of
    novels and Python documentation, the check that a method's gain is not fitted to its
    calibration domains. Too small to split, so it has no calibration part."""
    from xml.etree import ElementTree

    documents = []
    for topic in REUTERS_TOPICS:
        for path in sorted((_reuters_data_dir() / topic).glob("*.xml")):
            article = ElementTree.parse(path).getroot()
            text = article.find("TEXT")
            documents.append(Document(f"reuters/{article.get('NEWID')}", f"{text.findtext('TITLE', '')}\n{text.findtext('BODY', '')}"))
    return documents


def _runs(text: str):
    """Every run of SHARED_RUN_WORDS consecutive words (split on whitespace: line breaks and
    spacing do not hide a copy)."""
    words = text.split()
    return (tuple(words[i : i + SHARED_RUN_WORDS]) for i in range(len(words) - SHARED_RUN_WORDS + 1))


def shared_text(documents: list[Document], others: list[Document]) -> set[tuple[str, str]]:
    """(id in `documents`, id in `others`) of every pair of documents that share a run of
    SHARED_RUN_WORDS words. The runs of `documents` are held in memory and those of `others`
    streamed past them, so `documents` should be the smaller side."""
    owner: dict[tuple[str, ...], str] = {}
    for document in documents:
        for run in _runs(document.text):
            owner.setdefault(run, document.id)
    return {(owner[run], other.id) for other in others for run in _runs(other.text) if run in owner}


NAMED_CORPORA = {
    "austen-calib": lambda: _austen(held_out=False),
    "austen-heldout": lambda: _austen(held_out=True),
    "pydoc-calib": lambda: _pydoc(held_out=False),
    "pydoc-heldout": lambda: _pydoc(held_out=True),
    "reuters-heldout": _reuters,
}


def _file_documents(path: Path) -> list[Document]:
    require(path.is_file(), f"corpus file {path} does not exist; pass an existing .txt or .jsonl file")
    raw = path.read_bytes()
    tag = f"file:{hashlib.sha256(raw).hexdigest()[:16]}"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise LmpressError(f"corpus file {path} is not UTF-8 text; convert it to UTF-8") from error
    if path.suffix == ".txt":
        return [Document(tag, text)]
    documents = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            document = json.loads(line)["text"]
            require(isinstance(document, str), "")
        except (json.JSONDecodeError, KeyError, TypeError, LmpressError) as error:
            raise LmpressError(
                f'line {number} of {path} is not a JSON object with a string "text" field; fix or remove it'
            ) from error
        documents.append(Document(f"{tag}/{number}", document))
    return documents


def load_corpus_part(part: str) -> list[Document]:
    """Documents of one named corpus or one user file."""
    if part in NAMED_CORPORA:
        return NAMED_CORPORA[part]()
    path = Path(part).expanduser()
    if path.suffix in (".txt", ".jsonl"):
        return _file_documents(path)
    raise LmpressError(
        f"unknown corpus '{part}'; use one of {', '.join(NAMED_CORPORA)} or a path to a .txt or .jsonl file"
    )


def corpus_parts(spec: str) -> list[str]:
    parts = [part.strip() for part in spec.split("+") if part.strip()]
    require(bool(parts), "empty corpus spec; name a corpus such as austen-calib+pydoc-calib")
    return parts


# --------------------------------------------------------------------------- tokens


@dataclass
class TokenizedPart:
    name: str
    documents: list[str]  # document ids
    tokens: torch.Tensor  # 1-D int64


def tokenize_part(part: str, tokenizer) -> TokenizedPart:
    """The part's documents joined by blank lines, tokenized once without special tokens (the
    windows are slices of running text, not separate prompts)."""
    documents = load_corpus_part(part)
    text = "\n\n".join(document.text for document in documents)
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    return TokenizedPart(part, [d.id for d in documents], torch.tensor(ids, dtype=torch.int64))


def _windows_available(part: TokenizedPart, length: int, needed: int, options: tuple[str, str]) -> int:
    """`options`: the command's options for the window count and length, which the error names."""
    available = part.tokens.numel() // length
    require(
        available >= needed,
        f"corpus '{part.name}' has {part.tokens.numel()} tokens, {available} windows of {length}, fewer than the "
        f"{needed} needed; pass a smaller {options[0]} or {options[1]}, or more text",
    )
    return available


@dataclass
class Samples:
    """Token windows and where each came from (`part:token_offset`)."""

    input_ids: torch.Tensor  # [n, length] int64
    sample_ids: list[str]
    documents: list[str]

    def data_hash(self) -> str:
        return hashlib.sha256(self.input_ids.contiguous().numpy().tobytes()).hexdigest()


def sample_windows(spec: str, tokenizer, samples: int, length: int, seed: int) -> Samples:
    """`samples` disjoint windows of `length` tokens, drawn with `seed`, an equal share from
    each part of the spec."""
    require(samples > 0, f"samples must be positive (got {samples}); pass e.g. --samples 128")
    require(length > 1, f"sequence length must be at least 2 (got {length}); pass e.g. --seq-len 512")
    parts = [tokenize_part(part, tokenizer) for part in corpus_parts(spec)]
    shares = [samples // len(parts) + (i < samples % len(parts)) for i in range(len(parts))]
    generator = torch.Generator().manual_seed(seed)
    windows, ids = [], []
    for part, share in zip(parts, shares):
        available = _windows_available(part, length, share, ("--samples", "--seq-len"))
        chosen = torch.randperm(available, generator=generator)[:share].sort().values
        for index in chosen.tolist():
            windows.append(part.tokens[index * length : (index + 1) * length])
            ids.append(f"{part.name}:{index * length}")
    documents = [doc for part in parts for doc in part.documents]
    return Samples(torch.stack(windows), ids, documents)


def leading_windows(part: TokenizedPart, windows: int, length: int, options: tuple[str, str] = ("--windows", "--seq-len")) -> torch.Tensor:
    """The first `windows` consecutive windows of a held-out part: a fixed evaluation slice."""
    require(windows > 0, f"windows must be positive (got {windows})")
    _windows_available(part, length, windows, options)
    return part.tokens[: windows * length].view(windows, length).clone()


def check_disjoint(calibration_documents: list[str], evaluation_documents: list[str], corpus: str) -> None:
    overlap = sorted(set(calibration_documents) & set(evaluation_documents))
    require(
        not overlap,
        f"evaluation corpus '{corpus}' overlaps the calibration text ({', '.join(overlap[:3])}); evaluate on held-out "
        "text such as austen-heldout or pydoc-heldout",
    )


# Ids prove the named parts disjoint, but a user's file carries only its own hash: the two
# checks below compare text wherever a user file meets a named part, on either side.


def held_out_text_in(spec: str) -> list[str]:
    """The named held-out documents whose text a user file of calibration `spec` repeats
    (recorded with the calibration, so evaluating on them is refused as for a shared id)."""
    files = [document for part in corpus_parts(spec) if part not in NAMED_CORPORA for document in load_corpus_part(part)]
    if not files:
        return []
    held_out = [document for part in NAMED_CORPORA if part.endswith("-heldout") for document in NAMED_CORPORA[part]()]
    return sorted({held_id for held_id, _ in shared_text(held_out, files)})


def check_text_disjoint(calibration_specs: list[str], calibration_documents: list[str], corpus: str) -> None:
    """A user file evaluated on repeats none of the named calibration documents' text."""
    named = sorted({part for spec in calibration_specs for part in corpus_parts(spec) if part in NAMED_CORPORA})
    if corpus in NAMED_CORPORA or not named:  # named held-out and calibration parts are disjoint by construction
        return
    used = set(calibration_documents)
    calibration = [document for part in named for document in NAMED_CORPORA[part]() if document.id in used]
    shared = sorted({calibration_id for _, calibration_id in shared_text(load_corpus_part(corpus), calibration)})
    require(
        not shared,
        f"evaluation corpus '{corpus}' repeats calibration text ({', '.join(shared[:3])}); evaluate on text the calibration "
        "did not see, such as austen-heldout or pydoc-heldout",
    )
