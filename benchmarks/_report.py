"""What the quality benchmarks share: flattening stage metrics and the markdown table."""

from __future__ import annotations

import json
from pathlib import Path

def quality_arguments(default_runs: str | None, out_name: str, levels: bool = False):
    """The options every quality benchmark takes: model, calibration, reference, out, and
    runs (unless None) or a level database (`levels`)."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--calibration", type=Path, default=Path("artifacts/calibration"))
    parser.add_argument("--reference", type=Path, default=Path("artifacts/reference"))
    if levels:
        parser.add_argument("--levels", type=Path, default=Path("artifacts/levels"))
    if default_runs is not None:
        parser.add_argument("--runs", default=default_runs)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / out_name)
    return parser


def evaluation_config(reference: Path):
    """The evaluation settings `reference` was built with (so a benchmark scores against the
    pipeline's reference whatever its corpora and window count), or the defaults where it is
    still to be built."""
    from pipelines.stages import EvaluateConfig

    manifest = Path(reference) / "manifest.json"
    if not manifest.is_file():
        return EvaluateConfig()
    built = json.loads(manifest.read_text())
    return EvaluateConfig(corpora=",".join(built["corpora"]), windows=built["windows"], seq_len=built["seq_len"])


def reference_corpora(reference: Path) -> list[str]:
    """The held-out corpora a benchmark reports: those of `reference`."""
    return evaluation_config(reference).corpus_list


def row_corpora(row: dict) -> list[str]:
    """The corpora a flattened metrics row holds, in its order."""
    return [key.removesuffix(".kl_to_base") for key in row if key.endswith(".kl_to_base")]


def spec_value(flags: list[str], prefix: str, default):
    """The number a run spec's flag carries (':shrink0.1' -> 0.1 for prefix 'shrink'), or `default`."""
    return next((float(flag[len(prefix):]) for flag in flags if flag.startswith(prefix)), default)


def scratch_directory() -> Path:
    """A temporary folder for a benchmark's models, removed when the benchmark exits (each
    model is hundreds of MB; a long run would otherwise fill the disk)."""
    import atexit
    import shutil
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="lmpress-bench-"))
    atexit.register(shutil.rmtree, work, True)
    return work


def flatten(metrics: dict) -> dict:
    flat = {}
    for key, value in metrics.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{sub}": subvalue for sub, subvalue in value.items()})
        else:
            flat[key] = value
    return flat


def write_quality_table(rows: list[dict], out: Path, first: str, extra: tuple[str, ...]) -> str:
    """rows -> out.json and out.md: run, `first` column, ppl / KL / top-1 per corpus, `extra`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=2) + "\n")
    corpora = row_corpora(rows[0])
    header = f"| run | {first} | " + " | ".join(f"{c} ppl | {c} KL | {c} top-1" for c in corpora) + " | " + " | ".join(extra) + " |"
    lines = [header, "|" + "---|" * (3 * len(corpora) + 2 + len(extra))]
    for row in rows:
        cells = [row["run"], str(row.get(first, ""))]
        for corpus in corpora:
            cells += [f"{row[f'{corpus}.perplexity']:.2f}", f"{row[f'{corpus}.kl_to_base']:.4f}", f"{row[f'{corpus}.top1_agreement']:.3f}"]
        cells += [str(row.get(column, "")) for column in extra]
        lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n"
    out.with_suffix(".md").write_text(table)
    return table


def run_stage(arguments: list[str], out: Path, report_file: str) -> tuple[dict, dict]:
    """Run one `lmpress` command in its own process (so its peak memory is its own) and return
    its report file and the `run` part of its lineage (wall time, peak RSS)."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-m", "pipelines.cli", *arguments, "--out", str(out)], check=True, cwd=Path(__file__).resolve().parent.parent)
    report = json.loads((out / report_file).read_text())
    return report, json.loads((out / "lineage.json").read_text())["chain"][-1]["run"]
