"""The uniform allocation where the budget falls between two levels: the cheaper level given
to the first linears in order (lmpress before 037686f) against spread evenly over depth
(compressors/search.py:uniform_genome now), on held-out text.

    .venv/bin/python benchmarks/uniform_between_levels.py [--levels artifacts/levels]
        [--cases 2+4:3.25,all:2.75,all:3.75]

A case is LEVELS:BUDGET: the database's bits levels with those bit-widths (`all`: every one),
and a budget in stored bits per weight (3-bit codes with g64 scales are 3.25). Each plan is
the search's uniform start at that budget, assembled from the level database in memory and
scored as benchmarks/search_quality.py scores plans: KL to the base, perplexity and top-1 on
held-out Austen and pydoc text against `--reference`, and the search's own fitness (KL on 4
calibration windows of 256 tokens). Results: benchmarks/results/uniform_between_levels.{json,md}.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("LMPRESS_QUIET", "1")

from benchmarks._report import quality_arguments, reference_corpora  # noqa: E402
from benchmarks.search_quality import held_out  # noqa: E402
from benchmarks.search_scaling import searched_units  # noqa: E402
from compressors import search  # noqa: E402
from compressors.search import genome_cost, uniform_genome  # noqa: E402
from pipelines.levels import Candidates, KLFitness, LevelDatabase, parse_quantized_level  # noqa: E402
from pipelines.models import load_model  # noqa: E402


def first_in_order(units, budget):
    """The allocation before 037686f: the cheaper level to the first linears in order."""
    spread = search.spread_order
    search.spread_order = lambda count: list(range(count))
    try:
        return uniform_genome(units, budget)
    finally:
        search.spread_order = spread


def main() -> None:
    parser = quality_arguments(None, "uniform_between_levels", levels=True)
    parser.add_argument("--cases", default="2+4:3.25,all:2.75,all:3.75")
    args = parser.parse_args()

    from calibrate.stats import CalibrationData

    loaded = load_model(args.model)
    loaded.model.eval()
    database = LevelDatabase(args.levels)
    windows = CalibrationData(args.calibration).spread_samples(4)[:, :256]
    rows = []
    for case in args.cases.split(","):
        levels, value = case.split(":")
        every = sorted({parse_quantized_level(level)[0] for unit in database.units("bits", drop=False) for level in unit.levels})
        bits = every if levels == "all" else [int(b) for b in levels.split("+")]
        units = searched_units(database, database.manifest["layers"], bits)
        weights = sum(u.size for u in units)
        budget = float(value) * weights
        candidates = Candidates(loaded, database, units)
        fitness = KLFitness(candidates, windows, 4)
        for name, allocate in (("first in order", first_in_order), ("spread over depth", uniform_genome)):
            genome = allocate(units, budget)
            blocks = sorted({units[i].block for i in range(len(units)) if genome[i] == max(genome)})
            row = {"case": case, "allocation": name, "bits_per_weight": round(genome_cost(units, genome) / weights, 4),
                   "cheaper_level": units[0].levels[max(genome)], "blocks_holding_it": f"{blocks[0]}-{blocks[-1]} ({len(blocks)})",
                   "calibration_kl": round(fitness(genome, 4), 4), **held_out(candidates, genome, args.reference)}
            rows.append(row)
            print(json.dumps(row), flush=True)
        candidates.restore()  # the next case's Candidates takes the model's weights as its base

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    corpora = reference_corpora(args.reference)
    header = "| levels:budget | allocation | bits/weight | cheaper level | blocks holding it | calibration KL | " + " | ".join(
        f"{c} {m}" for c in corpora for m in ("KL", "ppl", "top-1")) + " |"
    lines = [header, "|" + "---|" * header.count(" | ") + "---|"]
    for r in rows:
        cells = [r["case"], r["allocation"], r["bits_per_weight"], r["cheaper_level"], r["blocks_holding_it"], r["calibration_kl"]]
        cells += [f"{r[c][k]:.4g}" for c in corpora for k in ("kl_to_base", "perplexity", "top1_agreement")]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    title = ["# The uniform allocation between two levels: first in order against spread over depth", "",
             f"`benchmarks/uniform_between_levels.py --levels {args.levels} --reference {args.reference} --cases {args.cases}`; "
             "KL to the base on held-out text, and on 4 calibration windows of 256 tokens (the search's fitness).", ""]
    args.out.with_suffix(".md").write_text("\n".join(title + lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
