"""Evolutionary search against uniform and score-based allocation, at equal budget, on
held-out text.

    .venv/bin/python benchmarks/search_quality.py --levels artifacts/levels
        [--experiments bits:3.25,sparsity:0.6,bits:3.25:drop,bits:3.25:24,latency:0.9:drop] [--latency FILE]
        [--generations 100] [--offspring 16]

Per experiment (kind:budget[:drop][:24]; bits budgets in stored bits per weight, codes plus
scales, 2:4 masks; `24`: 2:4 on/off per linear too, from a database built with --sparse24;
latency budgets a fraction of the base's decode step by the `--latency` table from `lmpress
latency`, over the database's bits levels) these plans, each within the budget:
- uniform: every linear at the same level (compressors/search.py:uniform_genome), where one
  meets the budget;
- with a latency budget and --drop, the standard depth pruning (ShortGPT): the blocks of lowest
  block influence dropped, as few as meet the budget, every linear at the least compressed level;
- sensitivity: the score-based heuristic. Each unit's sensitivity is the calibration KL with
  only that unit moved to each level (the rest at the least compressed level), and the
  greedy allocation takes the cheapest error per unit of cost saved
  (compressors/search.py:greedy_genome);
- evolutionary: `lmpress search` as a user runs it, in its own process, timed, from the
  uniform allocation (EvoPress) and/or from the sensitivity allocation (`--start`).

Every plan is assembled from the level database in memory and scored on held-out Austen and
pydoc text (never calibration text) against the base's cached reference (artifacts/reference):
KL to the base, perplexity and top-1 agreement, as `lmpress evaluate` computes them. The test
suite checks that `lmpress quantize --overrides plan.yaml` builds exactly these weights.
Results: benchmarks/results/search_quality.{json,md}.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("LMPRESS_QUIET", "1")


from benchmarks._report import quality_arguments, reference_corpora, scratch_directory  # noqa: E402
from compressors.search import genome_cost, sensitivity_genome, uniform_genome  # noqa: E402
from pipelines.errors import LmpressError  # noqa: E402
from pipelines.evaluation import LMHead  # noqa: E402
from pipelines.latency import LatencyTable  # noqa: E402
from pipelines.levels import Candidates, KLFitness, LevelDatabase, read_plan  # noqa: E402
from pipelines.models import load_model  # noqa: E402
from pipelines.stages import rebuild_reference, reference_metrics  # noqa: E402


METRICS = {"kl": "kl_to_base", "perplexity": "perplexity", "top1": "top1_agreement"}  # column -> reference_metrics key


def held_out(candidates: Candidates, genome: list[int], reference: Path, batch_size: int = 4) -> dict:
    candidates.apply(genome)
    head = LMHead.load(reference / "lm_head.safetensors", rebuild_reference(reference))
    return {corpus: reference_metrics(candidates.model, reference, corpus, head, batch_size) for corpus in reference_corpora(reference)}


def least_influential_dropped(units: list, budget: float, influence: list[float], top_level: str) -> list[int]:
    """Depth pruning's standard (ShortGPT): drop the blocks of lowest block influence, as few
    as meet the budget, every linear at `top_level` (the database's least compressed)."""
    genome = [0 if u.is_block else u.levels.index(top_level) for u in units]
    for block in sorted(range(len(influence)), key=lambda i: influence[i]):
        if genome_cost(units, genome) <= budget * (1 + 1e-9):
            break
        genome[next(i for i, u in enumerate(units) if u.is_block and u.block == block)] = 1
    return genome


def main() -> None:
    parser = quality_arguments(None, "search_quality", levels=True)
    parser.add_argument("--experiments", default="bits:3.25,sparsity:0.6,bits:3.25:drop")
    parser.add_argument("--generations", type=int, default=100)
    parser.add_argument("--offspring", type=int, default=16)
    parser.add_argument("--selection", default="1:4,4:1")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--starts", default="uniform", help="first parents of the evolutionary runs: uniform and/or sensitivity")
    parser.add_argument("--latency", type=Path, help="latency table (`lmpress latency`) for latency experiments")
    args = parser.parse_args()

    from calibrate.stats import CalibrationData

    loaded = load_model(args.model)
    loaded.model.eval()
    database = LevelDatabase(args.levels)
    calib = CalibrationData(args.calibration)
    work = scratch_directory()
    rows = []
    for experiment in args.experiments.split(","):
        kind, value, *flags = experiment.split(":")
        drop, sparse24 = "drop" in flags, "24" in flags
        units = database.units("bits" if kind == "latency" else kind, drop, sparse24)
        weights = sum(u.size for u in units if not u.is_block)
        if kind == "latency":
            table = LatencyTable(args.latency)
            units, base_step = table.costed(units, database), table.base_step(database)
            budget = float(value) * base_step - table.fixed_seconds(units)
            cost = lambda genome: (table.fixed_seconds(units) + genome_cost(units, genome)) / base_step  # noqa: E731
        else:
            budget = (float(value) if kind == "bits" else 1 - float(value)) * weights
            cost = lambda genome: genome_cost(units, genome) / weights  # noqa: E731
        candidates = Candidates(loaded, database, units)
        fitness = KLFitness(candidates, calib.spread_samples(4)[:, : args.seq_len], 4)

        start = time.perf_counter()
        greedy, greedy_evaluations = sensitivity_genome(units, budget, fitness, 1)
        plans = {}
        try:
            plans["uniform"] = (uniform_genome(units, budget), 0, 0.0)
        except LmpressError:  # no single level meets a latency budget that only dropping blocks can meet
            pass
        if kind == "latency" and drop:
            plans["block influence (ShortGPT)"] = (least_influential_dropped(units, budget, calib.block_influence(), database.config.quantized_levels[0]), 0, 0.0)
        if sparse24:  # uniform picks 2:4 + 4-bit at 3.25 bits; the standard is every linear dense at one bit-width
            dense = database.units(kind, drop)
            plans["uniform"] = ([u.levels.index(d.levels[level]) for u, d, level in zip(units, dense, uniform_genome(dense, budget))], 0, 0.0)
            plans["uniform 2:4"] = (uniform_genome(units, budget), 0, 0.0)
        plans["sensitivity"] = (greedy, greedy_evaluations, time.perf_counter() - start)
        budget_flag = {"bits": ["--budget-bits", value], "sparsity": ["--target-sparsity", value],
                       "latency": ["--budget-latency", value, "--latency", str(args.latency)]}[kind]
        reports = {}
        for first in filter(None, args.starts.split(",")):  # --starts "": the baselines only
            out = work / f"{experiment.replace(':', '_')}_{first}"
            command = [sys.executable, "-m", "pipelines.cli", "search", "--model", args.model, "--levels", str(args.levels), "--calibration",
                       str(args.calibration), *budget_flag, "--generations", str(args.generations), "--offspring", str(args.offspring),
                       "--selection", args.selection, "--seq-len", str(args.seq_len), "--start", first, "--out", str(out),
                       "--drop", "true" if drop else "false", "--sparse24", "true" if sparse24 else "false"]
            start = time.perf_counter()
            subprocess.run(command, check=True, cwd=ROOT)
            reports[first] = json.loads((out / "search.json").read_text())
            plans[f"evolutionary ({first} start)"] = (
                read_plan(units, out, database.manifest["layer_prefix"]), reports[first]["evaluations"], time.perf_counter() - start,
            )
        for method, (genome, evaluations, wall) in plans.items():
            metrics = held_out(candidates, genome, args.reference)
            row = {
                "experiment": experiment, "method": method, "cost": round(cost(genome), 4),
                "dropped_blocks": sum(1 for u, level in zip(units, genome) if u.is_block and u.levels[level] == "drop"),
                "calibration_kl": round(fitness(genome, 4), 4), "evaluations": evaluations, "wall_s": round(wall, 1),
                **{f"{corpus}.{key}": entry[name] for corpus, entry in metrics.items() for key, name in METRICS.items()},
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
        rows[-1]["search"] = {first: {k: r[k] for k in ("units", "levels", "generations", "evaluations", "search_s", "fitness")} for first, r in reports.items()}
        candidates.restore()

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"settings": vars(args) | {"levels": str(args.levels), "calibration": str(args.calibration),
                                                                                  "reference": str(args.reference), "out": str(args.out)},
                                                         "levels": database.manifest["params"], "rows": rows}, indent=2, default=str) + "\n")
    columns = ["cost", "dropped_blocks", "calibration_kl", *[f"{c}.{k}" for c in reference_corpora(args.reference) for k in ("kl", "perplexity", "top1")],
               "evaluations", "wall_s"]
    lines = ["| experiment | method | " + " | ".join(columns) + " |", "|" + "---|" * (len(columns) + 2)]
    lines += [f"| {r['experiment']} | {r['method']} | " + " | ".join(str(r[c]) for c in columns) + " |" for r in rows]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
