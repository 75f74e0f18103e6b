"""Artifact I/O: atomic directory writes and the lineage manifest.

Every stage writes into a hidden temporary sibling and renames it into place only when it is
complete, so an interrupted stage never leaves a half artifact and never destroys a good one.

The lineage manifest (`lineage.json`) is a chain of stage records, base model first; each
stage appends its record to its parent's chain, so the whole history reads from the last
artifact alone. A record's `run` part (wall time, peak memory, date) varies between runs and
is left out of the manifest hash, which identifies the artifact's content and recipe.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import platform
import re
import resource
import shutil
import sys
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Callable, Iterator, TypeVar

from pipelines.errors import LmpressError, reason, require

LINEAGE_FILE = "lineage.json"
LINEAGE_FORMAT = "lmpress-lineage/1"
_PACKAGES = ("calibrate", "compressors", "pipelines")


def write_json(path: Path, data) -> None:
    """Stable JSON (sorted keys, so equal content gives equal bytes), written to a temporary
    sibling and renamed into place, so a reader never sees half a file."""
    path = Path(path).expanduser()
    require_output_kind(path, directory=False)
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)


def require_output_path(path: Path, directory: bool, inputs: tuple = (), kind: str | None = None) -> None:
    """Fail before any work when `path` cannot become a stage's output (a directory, or a
    file): it lies in lmpress's model cache, writing it would replace one of the local
    `inputs` (a model folder or calibration artifact the run reads), a folder holding one or a
    part of one, a report (a file) would land inside an artifact or model folder, an earlier
    output of another `kind` than this one (see `output_kind`: a mistyped --out would destroy
    it), or `require_output_kind` refuses it."""
    path = Path(path).expanduser()
    target = path.resolve()
    from pipelines.models import model_cache

    cache = model_cache().resolve()
    require(target != cache and cache not in target.parents, f"output path {path} lies in lmpress's model cache ({cache}); write the result elsewhere")
    for given in inputs:
        if not given or not Path(given).expanduser().exists():
            continue  # unset ("" or None); hub ids and built-in names resolve to lmpress's model cache, refused above
        source = Path(given).expanduser().resolve()
        require(
            target != source and target not in source.parents and source not in target.parents,
            f"output path {path} would replace the input {given} or a part of it; write the result to another folder",
        )
    earlier = output_kind(path) if kind and path.is_dir() else None
    require(
        earlier in (None, kind),
        f"output path {path} holds an earlier {earlier} output, which this {kind} run would replace; "
        "pass a new folder, or remove that one first",
    )
    if not directory:  # a report written into an artifact or model would replace one of its files (its metrics, lineage, manifest)
        holder = artifact_holding(target)
        require(holder is None, f"output path {path} lies inside {holder}, an artifact or model folder whose files it could replace; write the report outside it")
    require_output_kind(path, directory)


def output_kind(folder: Path) -> str | None:
    """What an lmpress output folder holds: the stage of its lineage's last record ("quantize",
    "calibrate", ...), or a manifest's format less its version (a KL reference cache is
    "lmpress-reference"); None for anything else."""
    for name, kind_of in ((LINEAGE_FILE, lambda data: data["chain"][-1]["stage"]), ("manifest.json", lambda data: data["format"].split("/")[0])):
        try:
            return str(kind_of(json.loads((Path(folder) / name).read_text())))
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            continue  # missing or not lmpress's: the next marker, or no kind
    return None


def artifact_holding(path: Path) -> Path | None:
    """The nearest folder above `path` that is an lmpress output (it holds lineage.json or
    manifest.json) or a model (config.json beside .safetensors weights), or None."""
    for folder in Path(path).parents:
        if any((folder / marker).is_file() for marker in OUTPUT_MARKERS) or ((folder / "config.json").is_file() and any(folder.glob("*.safetensors"))):
            return folder
    return None


def require_output_kind(path: Path, directory: bool) -> None:
    """`path` can be written as a directory (or a file): it does not exist as the other kind, no
    folder above it is a file, it is not the current folder or one above it (which cannot be
    renamed into place), and what it would replace is an lmpress output: an existing folder is
    empty or holds lineage.json or manifest.json, an existing file is a .json report."""
    path = Path(path).expanduser()
    target, here = path.resolve(), Path.cwd().resolve()
    require(target != here and target not in here.parents, f"output path '{path}' is the current folder or one above it; pass a new path")
    if directory:
        require(not path.is_file(), f"output path {path} is a file; pass a directory path or remove the file")
        require(
            not path.is_dir() or _replaceable(path),
            f"output path {path} is a folder of other files than an lmpress output, which would be lost; "
            "pass a new folder path (or an earlier output of lmpress to replace)",
        )
    else:
        require(not path.is_dir(), f"output path {path} is a directory; pass a file path such as {path / 'report.json'}")
        require(
            not path.exists() or path.suffix == ".json",
            f"output path {path} is a file that is not a JSON report, which would be lost; pass a new path such as report.json",
        )
    blocker = next((folder for folder in path.parents if folder.exists() and not folder.is_dir()), None)
    require(blocker is None, f"output path {path} lies under {blocker}, which is a file; pass a path inside a folder")


OUTPUT_MARKERS = (LINEAGE_FILE, "manifest.json")  # every folder lmpress writes holds one of them


def _replaceable(folder: Path) -> bool:
    """An existing output folder may be replaced when it is empty or an lmpress output."""
    return not any(folder.iterdir()) or any((folder / marker).is_file() for marker in OUTPUT_MARKERS)


def read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError as error:
        raise LmpressError(f"{path} is missing; {what}") from error
    except json.JSONDecodeError as error:
        raise LmpressError(f"{path} is not valid JSON ({error.msg}); {what}") from error


def read_safetensors(path: Path, what: str) -> dict:
    """Every tensor of a safetensors file lmpress wrote; a missing, truncated or corrupt one is
    a one-line error ending in `what` (how to make it again)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except FileNotFoundError as error:
        raise LmpressError(f"{path} is missing; {what}") from error
    except SafetensorError as error:
        raise LmpressError(f"{path} is truncated or corrupt ({str(error).splitlines()[0][:120]}); {what}") from error


def require_keys(data: dict, keys: tuple[str, ...], path: Path, what: str) -> None:
    """A manifest holds every key its readers use, or a one-line error ending in `what`."""
    missing = [key for key in keys if key not in data]
    require(not missing, f"{path} lacks {', '.join(missing)}; {what}")


# --------------------------------------------------------------------------- atomic writes


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _clean_leftovers(out: Path) -> None:
    """Remove temporaries of runs that died (SIGKILL, power loss); restore a good output that
    was moved aside when the swap was cut between its two renames. Only names this module
    makes (`.NAME.partial-PID`, `.NAME.old-PID`) are touched, never a user's own siblings."""
    made_here = re.compile(rf"\.{re.escape(out.name)}\.(partial|old)-(\d+)")
    for leftover in out.parent.iterdir():
        match = made_here.fullmatch(leftover.name)
        if match is None or _pid_alive(int(match[2])):
            continue
        if match[1] == "old" and not out.exists():
            os.rename(leftover, out)
        else:
            shutil.rmtree(leftover, ignore_errors=True)


def write_refusal(error: BaseException) -> str | None:
    """Why the filesystem refused a write (a full disk, a quota, a read-only mount, a file-size
    limit), when that is what `error` is, else None. safetensors' writer reports an OS error
    only in its message."""
    from safetensors import SafetensorError

    code = error.errno if isinstance(error, OSError) else None
    if isinstance(error, SafetensorError):
        found = re.search(r"os error (\d+)", str(error))
        code = int(found[1]) if found else None
    return os.strerror(code) if code in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG) else None


@contextmanager
def writing(out: Path) -> Iterator[None]:
    """A filesystem refusal (no permission, read-only or full disk, a busy folder) while writing
    `out` becomes one line that says so, not a traceback."""
    try:
        yield
    except OSError as error:
        raise LmpressError(f"cannot write {out}: {error.strerror or error}; pass a path in a folder you can write to") from error


@contextmanager
def atomic_directory(out: Path) -> Iterator[Path]:
    """Yield a temporary directory that becomes `out` only if the block completes. Folders made
    above `out` for it are removed again when it does not."""
    out = Path(out).expanduser()
    require_output_kind(out, directory=True)
    made = [folder for folder in (out.parent, *out.parent.parents) if not folder.exists()]
    pid = os.getpid()
    tmp = out.parent / f".{out.name}.partial-{pid}"
    try:
        with writing(out):
            out.parent.mkdir(parents=True, exist_ok=True)
            _clean_leftovers(out)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        yield tmp
        with writing(out):
            _swap_in(tmp, out, out.parent / f".{out.name}.old-{pid}")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for folder in made:  # innermost first; stops at one that is not empty
            try:
                folder.rmdir()
            except OSError:
                break
        raise


def _swap_in(tmp: Path, out: Path, old: Path) -> None:
    """Rename `tmp` to `out`, moving a good `out` aside first and back should the second rename fail."""
    if not out.exists():
        os.rename(tmp, out)
        return
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except OSError:
        os.rename(old, out)
        raise
    shutil.rmtree(old)


# --------------------------------------------------------------------------- lineage


def file_sha256(path: Path) -> str:
    """sha256 of a file, read in blocks (weights files run to gigabytes)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def code_version() -> str:
    """sha256 of lmpress's own source files: identifies the code with or without git."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent
    for package in _PACKAGES:
        for file in sorted((root / package).rglob("*.py")):
            digest.update(str(file.relative_to(root)).encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()[:16]


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in ("lmpress", "torch", "transformers", "safetensors", "tokenizers"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def _without_run(record: dict) -> dict:
    return {key: value for key, value in record.items() if key != "run"}


def chain_hash(chain: list[dict]) -> str:
    canonical = json.dumps([_without_run(record) for record in chain], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def base_record(spec: str, folder: Path, config) -> dict:
    """The first link of every chain: which base model, by its weights' hash."""
    from pipelines.models import BUILTIN_MODELS, weights_hash

    license_file = folder / "LICENSE.json"
    builtin = BUILTIN_MODELS.get(spec)
    return {
        "stage": "base",
        "model": spec,
        "model_type": config.model_type,
        "weights_sha256": weights_hash(folder),
        "license": builtin.license if builtin else (json.loads(license_file.read_text())["license"] if license_file.is_file() else "unknown"),
    }


def read_lineage(folder: Path) -> dict | None:
    path = Path(folder) / LINEAGE_FILE
    if not path.is_file():
        return None
    lineage = read_json(path, "re-run the stage that made this artifact")
    require(
        isinstance(lineage, dict) and lineage.get("format") == LINEAGE_FORMAT and isinstance(lineage.get("hash"), str)
        and isinstance(lineage.get("chain"), list) and bool(lineage["chain"])
        and all(isinstance(record, dict) and isinstance(record.get("stage"), str) for record in lineage["chain"]),
        f"{path} is not an lmpress lineage manifest (a format, a hash and a chain of stage records); re-run the stage that made this artifact",
    )
    return lineage


def model_chain(spec: str, folder: Path, config) -> list[dict]:
    """The chain of a model: its own lineage if lmpress made it, else a fresh base record."""
    lineage = read_lineage(folder)
    return lineage["chain"] if lineage else [base_record(spec, folder, config)]


def model_identity(spec: str, folder: Path, chain: list[dict]) -> dict:
    """What pins a model for a pairing (a draft and its target): its lineage hash (content and
    recipe) and the hash of its weight files as they are now."""
    from pipelines.models import weights_hash

    return {"model": spec, "lineage_hash": chain_hash(chain), "weights_sha256": weights_hash(folder)}


def peak_rss_bytes() -> int:
    """This process's peak resident memory: VmHWM where /proc has it, since getrusage's
    ru_maxrss also counts the parent's memory at fork (Linux carries it across exec)."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class StageRun:
    """Times a stage and records its peak resident memory, for the record's `run` part."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        """Record the time since the previous lap (or the start) as `phase`."""
        now = time.perf_counter()
        self.phases[phase], self.last = round(now - self.last, 3), now

    def info(self) -> dict:
        import torch

        return {
            **({"phases_s": self.phases} if self.phases else {}),
            "wall_time_s": round(time.perf_counter() - self.start, 3),
            "peak_rss_bytes": peak_rss_bytes(),
            "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "host": platform.node(),
            "torch_threads": torch.get_num_threads(),  # the bytes of a CPU run depend on it (reduction order)
        }


def write_lineage(folder: Path, parent_chain: list[dict], record: dict, run: StageRun) -> dict:
    """Append this stage's record to its parent's chain and write `lineage.json`."""
    record = {
        **record,
        "parent_hash": chain_hash(parent_chain),
        "versions": package_versions(),
        "code_version": code_version(),
        "run": run.info(),
    }
    chain = [*parent_chain, record]
    lineage = {"format": LINEAGE_FORMAT, "hash": chain_hash(chain), "chain": chain}
    write_json(Path(folder) / LINEAGE_FILE, lineage)
    return lineage


Saved = TypeVar("Saved")


class ResumeFolder:
    """Where a long stage keeps its progress between runs: `.<out>.resume/` beside the output.
    It belongs to one set of inputs (`key`: a hash of everything that decides the result);
    progress made for other inputs is discarded. The stage removes it once the output is in
    place."""

    def __init__(self, out: Path, key: str):
        self.path = Path(out).parent / f".{Path(out).name}.resume"
        key_file = self.path / "key"
        if not key_file.is_file() or key_file.read_text() != key:
            shutil.rmtree(self.path, ignore_errors=True)
            self.path.mkdir(parents=True)
            key_file.write_text(key)

    def file(self, name: str) -> Path:
        return self.path / name

    def read(self, name: str, reader: Callable[[Path], Saved]) -> Saved | None:
        """`reader(file)` of the saved progress `name`, or None when there is none. Progress
        that does not read is discarded with a one-line warning and that part starts over:
        it is written by renaming a finished file into place, but not synced, so a machine
        that goes down can leave it truncated or zero-filled."""
        from safetensors import SafetensorError

        path = self.file(name)
        if not path.is_file():
            return None
        try:
            return reader(path)
        except (SafetensorError, OSError, ValueError, KeyError, TypeError) as error:  # JSON errors are ValueErrors
            sys.stderr.write(f"warning: saved progress {path} is damaged ({reason(error, 120)}); starting that part over\n")
            path.unlink()
            return None

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def inputs_key(*parts) -> str:
    """sha256 of JSON-serializable inputs, with lmpress's code version: a resume key."""
    canonical = json.dumps([code_version(), *parts], sort_keys=True, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()
