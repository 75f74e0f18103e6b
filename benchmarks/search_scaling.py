"""How the evolutionary search scales with the number of layers searched and the number of
levels per unit, on the CPU.

    .venv/bin/python benchmarks/search_scaling.py --levels artifacts/levels
        [--blocks 10,20,30] [--level-sets 2+4,2+3+4+8] [--generations 30]

For every (searched blocks, level set) pair: the linears of the first `blocks` decoder blocks
are searched at an average of `--budget` stored bits per weight using only the levels in the
set (the other blocks stay uncompressed), with the same evolution `lmpress search` runs
(compressors/search.py:evolve, uniform start, the shipped pipeline's offspring and selection).
Reported per run: units, candidate evaluations, wall time, seconds per evaluation, calibration
KL at the start and at the end, and the generation by which half and 90% of the final
improvement had been reached (how convergence stretches with the search space).
Results: benchmarks/results/search_scaling.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("LMPRESS_QUIET", "1")

from compressors.search import Unit, evolve, parse_selection, start_state  # noqa: E402
from pipelines.levels import Candidates, KLFitness, LevelDatabase, parse_quantized_level  # noqa: E402
from pipelines.models import load_model  # noqa: E402


def searched_units(database: LevelDatabase, blocks: int, bits: list[int]) -> list[Unit]:
    """The database's bits units of the first `blocks` blocks, restricted to `bits` levels."""
    units = []
    for unit in database.units("bits", drop=False):
        if unit.block >= blocks:
            continue
        keep = [i for i, level in enumerate(unit.levels) if parse_quantized_level(level)[0] in bits]
        units.append(Unit(unit.name, unit.size, tuple(unit.levels[i] for i in keep), tuple(unit.costs[i] for i in keep), unit.block))
    return units


def generation_reaching(history: list[dict], share: float) -> int:
    """The first generation whose fitness has made `share` of the run's whole improvement."""
    start, end = history[0]["fitness"], history[-1]["fitness"]
    target = start - share * (start - end)
    return next(h["generation"] for h in history if h["fitness"] <= target + 1e-12)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--levels", type=Path, default=Path("artifacts/levels"))
    parser.add_argument("--calibration", type=Path, default=Path("artifacts/calibration"))
    parser.add_argument("--blocks", default="10,20,30")
    parser.add_argument("--level-sets", default="2+4,2+3+4+8")
    parser.add_argument("--budget", type=float, default=3.25)  # 3-bit codes + fp16 scales per 64
    parser.add_argument("--generations", type=int, default=30)
    parser.add_argument("--offspring", type=int, default=8)
    parser.add_argument("--selection", default="1:2,2:1")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "search_scaling")
    args = parser.parse_args()

    from calibrate.stats import CalibrationData

    loaded = load_model(args.model)
    loaded.model.eval()
    database = LevelDatabase(args.levels)
    selection = parse_selection(args.selection)
    windows = CalibrationData(args.calibration).spread_samples(selection[-1][0])[:, : args.seq_len]
    rows = []
    for level_set in args.level_sets.split(","):
        bits = [int(b) for b in level_set.split("+")]
        for blocks in (int(b) for b in args.blocks.split(",")):
            units = searched_units(database, blocks, bits)
            budget = args.budget * sum(u.size for u in units)
            candidates = Candidates(loaded, database, units)
            fitness = KLFitness(candidates, windows, 4)
            start = time.perf_counter()
            state = start_state(units, budget, fitness, selection, args.seed)
            state = evolve(units, budget, fitness, args.generations, args.offspring, selection, state)
            wall = time.perf_counter() - start
            candidates.restore()
            row = {
                "blocks": blocks, "levels": level_set, "units": len(units), "generations": state.generation,
                "evaluations": state.evaluations, "wall_s": round(wall, 1), "s_per_evaluation": round(wall / state.evaluations, 3),
                "kl_start": round(state.history[0]["fitness"], 4), "kl_end": round(state.parent_fitness, 4),
                "improvement": round(1 - state.parent_fitness / state.history[0]["fitness"], 3),
                "generation_50pct": generation_reaching(state.history, 0.5), "generation_90pct": generation_reaching(state.history, 0.9),
                "history": [round(h["fitness"], 5) for h in state.history],
            }
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "history"}), flush=True)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    settings = {key: str(value) for key, value in vars(args).items()}
    args.out.with_suffix(".json").write_text(json.dumps({"settings": settings, "rows": rows}, indent=2) + "\n")
    columns = ["units", "evaluations", "wall_s", "s_per_evaluation", "kl_start", "kl_end", "improvement", "generation_50pct", "generation_90pct"]
    lines = ["| blocks searched | levels (bits) | " + " | ".join(columns) + " |", "|" + "---|" * (len(columns) + 2)]
    lines += [f"| {r['blocks']} | {r['levels']} | " + " | ".join(str(r[c]) for c in columns) + " |" for r in rows]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
