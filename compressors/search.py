"""Per-unit compression levels under a budget: evolutionary search (EvoPress), and the two
allocations it is measured against (uniform, and a score-based greedy one).

A *unit* is what gets one level: a linear (bit-width or sparsity) or a whole decoder block
(kept or dropped). Each unit has its levels ordered from least to most compressed, and each
level a cost per weight (stored bits, density, or seconds from a latency model); a *genome*
gives every unit a level index. The budget bounds the genome's total cost, `sum(unit size *
level cost)`, dropped blocks' linears costing nothing.

The search is (1 + lambda) evolution (Sieberling et al., EvoPress, 2024): each generation
makes `offspring` children of the parent by level-switch mutation (one unit one level less
compressed, then others one level more compressed until the budget holds again, so every
child stays on budget), scores them in rounds of selection (all children on a few
calibration windows, the best on more: most children are bad and cheap to reject), and the
best child replaces the parent when it beats it on the final round's windows. Fitness is
the KL divergence of the candidate from the base model on calibration tokens, lower better.
All randomness comes from one seeded generator whose state is part of the checkpoint, so a
search resumed from any generation ends in the same plan.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

from pipelines.errors import LmpressError, require


@dataclass(frozen=True)
class Unit:
    name: str  # a linear's full name, or a decoder block's prefix
    size: int  # weights it holds (a block: the weights of its linears)
    levels: tuple[str, ...]  # level names, least compressed first
    costs: tuple[float, ...]  # cost per weight of each level (non-increasing)
    block: int  # the decoder block it lies in (a block unit: its own index)
    is_block: bool = False  # a block unit: levels ("keep", "drop")


def genome_cost(units: list[Unit], genome: list[int]) -> float:
    """Total cost; a linear in a dropped block costs nothing (a block unit's own cost is what
    the block costs besides its linears: nothing in bits, its attention and norms in time)."""
    dropped = {u.block for u, level in zip(units, genome) if u.is_block and u.levels[level] == "drop"}
    return sum(u.size * u.costs[level] for u, level in zip(units, genome) if u.is_block or u.block not in dropped)


def cheapest_genome(units: list[Unit]) -> list[int]:
    """Every unit at its cheapest level (the most compressed of equally cheap ones); costs need
    not fall with compression (a latency model: a 3-bit kernel may be slower than a 4-bit one)."""
    return [max(range(len(u.levels)), key=lambda level, u=u: (-u.costs[level], level)) for u in units]


def within(cost: float, budget: float) -> bool:
    """cost <= budget, up to float rounding (a sum of products against a product of sums)."""
    return cost <= budget * (1 + 1e-9)


def check_budget(units: list[Unit], budget: float, what: str, describe: Callable[[float], str], fix: str) -> None:
    """Some genome must meet the budget (the cheapest one), and not every one: where every unit
    at its least compressed level fits, that is the answer and there is nothing to search.
    `describe(cost)` words a cost."""
    lowest = genome_cost(units, cheapest_genome(units))
    require(within(lowest, budget), f"no assignment of the database's levels meets the budget {what}: the cheapest one costs {describe(lowest)}; {fix}")
    least_compressed = genome_cost(units, [0] * len(units))
    require(
        not within(least_compressed, budget),
        f"the budget {what} leaves nothing to search: every unit at its least compressed level costs {describe(least_compressed)}, "
        "within it; lower the budget below that",
    )


def spread_order(count: int) -> list[int]:
    """0 .. count-1 in bit-reversed order (0, 8, 4, 12, 2, ... for 16): every prefix is spread
    evenly over the range, so the first k picks are about count/k apart."""
    bits = max(count - 1, 0).bit_length()
    return sorted(range(count), key=lambda i: int(format(i, f"0{bits}b")[::-1] or "0", 2))


def uniform_genome(units: list[Unit], budget: float) -> list[int]:
    """The least compressed single level that every linear can take within the budget (blocks
    kept), the standard allocation. Where the budget falls between two levels, the cheaper one
    goes to linears spread evenly over depth (`spread_order`) until the budget holds: given to
    the first linears in order instead, 2 bits on the first half of SmolLM2's layers broke the
    model (KL 8 at the start of a 2+4-bit search)."""
    linears = [i for i, u in enumerate(units) if not u.is_block]
    depth = max(len(units[i].levels) for i in linears)
    genome = [0] * len(units)
    for level in range(depth):
        genome = [min(level, len(u.levels) - 1) if not u.is_block else 0 for u in units]
        if within(genome_cost(units, genome), budget):
            return genome
        step = [min(level + 1, len(u.levels) - 1) if not u.is_block else 0 for u in units]
        for k in spread_order(len(linears)):  # move linears to the next level one by one until it fits
            genome[linears[k]] = step[linears[k]]
            if within(genome_cost(units, genome), budget):
                return genome
    # only where costs do not fall with compression, or only dropping blocks meets the budget
    raise LmpressError("no single level for every linear (blocks kept) meets the budget; start from --start sensitivity")


def _next_steps(unit: Unit, level: int) -> list[int]:
    """The levels one step cheaper than `level`: those at the next lower cost, wherever they
    lie in the order (under a latency model a more compressed level may cost more). Levels of
    equal cost (4-bit 2:4 and 3-bit dense both store 3.25 bits at group 64) are alternatives,
    not steps, so a step never saves nothing."""
    if unit.is_block:  # keep -> drop: what it saves is what its linears cost (see greedy_genome)
        return [level + 1] if level + 1 < len(unit.levels) else []
    lower = [j for j in range(len(unit.levels)) if unit.costs[j] < unit.costs[level]]
    return [j for j in lower if unit.costs[j] == max(unit.costs[k] for k in lower)]


def greedy_genome(units: list[Unit], budget: float, error: Callable[[int, int], float]) -> list[int]:
    """Score-based allocation: from the least compressed genome, repeatedly take the step to
    a next cheaper level with the smallest error increase per unit of cost saved,
    `error(unit, level)` being a unit's own error at a level (e.g. the model's error with only
    that unit compressed), until the budget holds."""
    genome = [0] * len(units)
    cost = genome_cost(units, genome)
    while not within(cost, budget):
        dropped = {u.block for u, level in zip(units, genome) if u.is_block and level == 1}
        best, best_ratio, best_saving = None, float("inf"), 0.0
        for i, u in enumerate(units):
            if u.block in dropped:
                continue
            for step in _next_steps(u, genome[i]):
                if u.is_block:  # dropping saves what its linears cost now, and its own cost
                    saving = u.size * (u.costs[genome[i]] - u.costs[step])
                    saving += sum(v.size * v.costs[genome[j]] for j, v in enumerate(units) if not v.is_block and v.block == u.block)
                else:
                    saving = u.size * (u.costs[genome[i]] - u.costs[step])
                if saving <= 0:
                    continue
                ratio = (error(i, step) - error(i, genome[i])) / saving
                if ratio < best_ratio:
                    best, best_ratio, best_saving = (i, step), ratio, saving
        require(best is not None, "the score-based allocation cannot meet the budget")
        genome[best[0]] = best[1]
        cost -= best_saving
    return genome


def mutate(units: list[Unit], genome: list[int], budget: float, rng: random.Random) -> list[int]:
    """Level switch: one unit one level less compressed, then random others one level more
    compressed until the cost is within the budget again."""
    child = list(genome)
    raisable = [i for i, level in enumerate(child) if level > 0]
    if not raisable:
        return child
    up = rng.choice(raisable)
    child[up] -= 1
    while not within(genome_cost(units, child), budget):
        lowerable = [i for i, level in enumerate(child) if i != up and level + 1 < len(units[i].levels)]
        if not lowerable:
            return list(genome)
        child[rng.choice(lowerable)] += 1
    return child


@dataclass
class SearchState:
    """Everything a resumed search needs: the parent, its fitness on the final round's
    windows, the generator's state, and the history for the fitness curve (generation 0:
    the uniform start)."""

    generation: int
    parent: list[int]
    parent_fitness: float
    rng_state: tuple
    history: list[dict] = field(default_factory=list)
    evaluations: int = 0
    start: list[int] = field(default_factory=list)  # the first parent (what the search is checked against)


def parse_selection(text: str) -> list[tuple[int, int]]:
    """"windows:survivors,..." e.g. "1:4,4:1": all children on 1 window, the best 4 on 4
    windows, the best 1 of those goes on to compete with the parent."""
    try:
        steps = [tuple(int(v) for v in part.split(":")) for part in text.split(",") if part.strip()]
        ok = bool(steps) and all(len(s) == 2 and s[0] > 0 and s[1] > 0 for s in steps)
    except ValueError:
        ok = False
    require(ok, f"selection must be windows:survivors steps such as 1:4,4:1 (got '{text}')")
    require(steps[-1][1] == 1, f"the last selection step keeps one survivor (got '{text}')")
    require(all(a[0] <= b[0] and a[1] >= b[1] for a, b in zip(steps, steps[1:])), f"selection steps must use more windows and keep fewer survivors as they go (got '{text}')")
    return steps


def evolve(
    units: list[Unit],
    budget: float,
    fitness: Callable[[list[int], int], float],
    generations: int,
    offspring: int,
    selection: list[tuple[int, int]],
    state: SearchState,
    on_generation: Callable[[SearchState], None] | None = None,
) -> SearchState:
    """Run the (1 + lambda) search from `state` to `generations`. `fitness(genome, windows)`
    is the KL to the base on the first `windows` calibration windows."""
    rng = random.Random()
    rng.setstate(state.rng_state)
    while state.generation < generations:
        children = []
        for _ in range(offspring):
            child = mutate(units, state.parent, budget, rng)
            if child != state.parent and child not in children:
                children.append(child)
        survivors = children
        for windows, keep in selection:
            scored = [(fitness(child, windows), child) for child in survivors]
            state.evaluations += len(scored)
            scored.sort(key=lambda pair: pair[0])
            survivors = [child for _, child in scored[:keep]]
            best_fitness = scored[0][0] if scored else float("inf")
        if survivors and best_fitness < state.parent_fitness:
            state.parent, state.parent_fitness = survivors[0], best_fitness
        state.generation += 1
        state.rng_state = rng.getstate()
        state.history.append({"generation": state.generation, "fitness": state.parent_fitness, "evaluations": state.evaluations})
        if on_generation is not None:
            on_generation(state)
    assert within(genome_cost(units, state.parent), budget)
    return state


def sensitivity_genome(units: list[Unit], budget: float, fitness: Callable[[list[int], int], float], windows: int) -> tuple[list[int], int]:
    """The score-based allocation on layer-wise sensitivity: each unit's error at each level is
    the fitness with only that unit there (the others at their least compressed level), then
    `greedy_genome`. Returns the genome and the evaluations it took."""
    table = {}
    for i, unit in enumerate(units):
        for level in range(len(unit.levels)):
            genome = [0] * len(units)
            genome[i] = level
            table[i, level] = fitness(genome, windows)
    evaluations = 1 + sum(len(u.levels) - 1 for u in units)  # the all-least-compressed genome once, then each move
    return greedy_genome(units, budget, lambda i, level: table[i, level]), evaluations


STARTS = ("uniform", "sensitivity")


def start_state(units: list[Unit], budget: float, fitness: Callable[[list[int], int], float], selection, seed: int,
                start: str = "uniform") -> SearchState:
    """The first parent: the uniform allocation (EvoPress), or the sensitivity allocation,
    which the search then improves on."""
    evaluations = 1
    if start == "sensitivity":
        parent, evaluations = sensitivity_genome(units, budget, fitness, selection[0][0])
        evaluations += 1
    else:
        parent = uniform_genome(units, budget)
    score = fitness(parent, selection[-1][0])
    return SearchState(0, parent, score, random.Random(seed).getstate(), [{"generation": 0, "fitness": score, "evaluations": evaluations}], evaluations,
                       list(parent))
