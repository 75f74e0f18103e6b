"""The level database and the search over it: two stages, `levels` and `search`.

`levels` compresses every decoder linear once at every level of the chosen kinds, from the
calibration artifact's stored statistics, and stores the results compactly (int8 codes with
fp16 scales; packed keep masks):

    manifest.json                  base model, calibration, settings, units and levels
    bits<b>g<g>.safetensors        GPTQ (or RTN) at b bits, group size g:
                                   <linear>.codes int8 [out, in], <linear>.scale fp16 [out, groups]
    bits<b>g<g>s24.safetensors     (--sparse24) SparseGPT 2:4 with the kept weights on that grid
                                   (clip-searched with --clip-search, as `prune --bits` fits them):
                                   the same, plus <linear>.keep uint8 [out, ceil(in / 8)]
    sparsity<s>.safetensors        Wanda at sparsity s: <linear>.keep (packed, see pack_bitmask)

Blocks may also be dropped (`drop`), which needs no tensors. A quantized level's cost is what
its linear stores per weight, in bits: codes, fp16 scales and, for 2:4, the kept half's codes
plus a 1-bit mask (compressors/lmpress_format.py), so bit-widths, group sizes, 2:4 on/off and
dropped blocks trade against each other in one currency, the `bits_per_weight` that
`lmpress evaluate` reports. `search` looks for the per-unit levels that best keep the base
model's distribution within a budget (compressors/search.py) and writes the plan as a YAML
file that `lmpress quantize --overrides` (or, with 2:4 or sparsity levels, `lmpress prune
--overrides`) takes as it is, so the searched model is made by the same stage functions (and
is then the same weights the search scored: the stages compute them with the same functions
from the same statistics).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from calibrate.stats import spread_indices
from compressors.search import STARTS, SearchState, Unit, check_budget, evolve, genome_cost, parse_selection, start_state
from compressors.structured import LayerSubset
from pipelines.artifact import ResumeFolder, atomic_directory, file_sha256, inputs_key, read_json, read_safetensors, require_keys, write_json, write_lineage
from pipelines.errors import require, require_input
from pipelines.evaluation import LMHead, score_windows
from pipelines.latency import LatencyTable
from pipelines.models import architecture_of, decoder_layers, layer_linears
from pipelines.progress import progress_bar
from pipelines.stages import (
    HESSIAN_SHRINKAGE, begin_stage, calibration_record, check_hessian_regularization, needed_by, number_list, planned_linears, require_positive,
    resolve_clip_search, resolve_where_it_applies,
)

LEVELS_FORMAT = "lmpress-levels"
LEVELS_VERSION = 3  # 2: group sizes and 2:4 levels, costs in stored bits; 3: 2:4 levels clip-searched too
LEVELS_METHODS = ("gptq", "rtn")
PLAN_FILE = "plan.yaml"
SEARCH_REPORT = "search.json"
HISTORY_FILE = "history.csv"


_QUANTIZED_LEVEL = re.compile(r"bits(\d+)g(-?\d+)(s24)?")


def quantized_level(bits: int, group_size: int, sparse24: bool = False) -> str:
    return f"bits{bits}g{group_size}" + ("s24" if sparse24 else "")


def parse_quantized_level(level: str) -> tuple[int, int, bool]:
    bits, group_size, sparse24 = _QUANTIZED_LEVEL.fullmatch(level).groups()
    return int(bits), int(group_size), sparse24 is not None


def stored_bits(level: str, in_features: int) -> float:
    """Bits a linear stores per weight at a quantized level: the codes, one fp16 scale per
    group (symmetric grids: no zero points) and, for 2:4, codes for the kept half plus the
    1-bit keep mask, as compressed-tensors and lmpress-packed store them."""
    bits, group_size, sparse24 = parse_quantized_level(level)
    scales = 16 / (group_size if group_size > 0 else in_features)
    return (bits / 2 + 1 if sparse24 else bits) + scales


@dataclass
class LevelsConfig:
    bits: str = "2,3,4,8"  # quantization levels; "" for none
    group_size: str = "64"  # group sizes, each combined with every bit-width (-1: per channel)
    method: str = "gptq"  # gptq | rtn, symmetric grids, from the stored statistics
    act_order: bool | None = None  # GPTQ's column order (None: on for gptq; rtn has no column order, so true is refused)
    clip_search: bool | None = None  # gptq: grids clipped as quantize's are, 2:4 levels' as prune's (None: on where it applies)
    damp: float = 0.01
    hessian_shrinkage: float = HESSIAN_SHRINKAGE  # gptq and the 2:4 levels' SparseGPT, as quantize's and prune's
    sparse24: bool = False  # each bits level also as 2:4 sparse + quantized (SparseGPT, jointly)
    sparsity: str = ""  # unstructured sparsity levels (Wanda), e.g. "0.4,0.5,0.6,0.7,0.8"; "" for none
    drop: bool = False  # blocks may be dropped whole

    @property
    def bit_levels(self) -> list[int]:
        return sorted(set(number_list(self.bits, int, "--bits")), reverse=True)

    @property
    def group_sizes(self) -> list[int]:
        return sorted(set(number_list(str(self.group_size), int, "--group-size")))

    @property
    def quantized_levels(self) -> list[str]:
        return [quantized_level(b, g, s24) for b in self.bit_levels for g in self.group_sizes for s24 in (False, True)[: 1 + self.sparse24]]

    @property
    def sparsity_levels(self) -> list[float]:
        return sorted(set(number_list(self.sparsity, float, "--sparsity")))

    @property
    def level_names(self) -> list[str]:
        """Every level the database stores, by the name of its tensors file."""
        return self.quantized_levels + [f"sparsity{s:g}" for s in self.sparsity_levels]

    def validate(self) -> None:
        from compressors.grid import GridSpec
        from compressors.sparsity import parse_pattern

        require(self.method in LEVELS_METHODS, f"unknown method '{self.method}'; the level database takes {' or '.join(LEVELS_METHODS)}")
        self.act_order = resolve_where_it_applies(self.act_order, self.method == "gptq",
                                                  "--act-order orders GPTQ's columns: use it with --method gptq, or pass --act-order false")
        self.clip_search = resolve_clip_search(self.clip_search, self.method == "gptq", "--method gptq")
        for bits in self.bit_levels:
            for group_size in self.group_sizes:
                GridSpec(bits, group_size)
        require(not self.sparse24 or bool(self.bit_levels), "--sparse24 makes 2:4 variants of the bits levels; give some --bits too")
        for sparsity in self.sparsity_levels:
            require(0 < parse_pattern(sparsity).sparsity < 1, f"sparsity levels must lie in (0, 1) (got {sparsity})")
        require(bool(self.bit_levels or self.sparsity_levels), "give the database some levels: --bits 2,3,4,8 and/or --sparsity 0.4,0.5,0.6")
        check_hessian_regularization(self.damp, self.hessian_shrinkage)


def level_database(model: str, calibration: Path | None, out: Path, config: LevelsConfig) -> Path:
    """Compress every decoder linear at every level once; see the module docstring."""
    from compressors.gptq import gptq_quantize
    from compressors.grid import GridSpec, round_to_nearest
    from compressors.packed_int import pack_bitmask
    from compressors.sparsegpt import sparsegpt_prune
    from compressors.sparsity import keep_mask, parse_pattern, wanda_score

    config.validate()
    needs_statistics = needed_by("levels", {
        "--method gptq": config.method == "gptq", "--sparse24 true": config.sparse24, f"--sparsity {config.sparsity}": bool(config.sparsity_levels),
    })
    run, loaded, chain, calib = begin_stage("levels", model, calibration, out, needs_statistics)
    linears = list(planned_linears(loaded.model, "", {}, None))
    for name, module, _ in linears:
        for level in config.quantized_levels:
            bits, group_size, sparse24 = parse_quantized_level(level)
            GridSpec(bits, group_size).check_width(module.in_features, name)
            if sparse24:
                parse_pattern("2:4").check_width(module.in_features, name)
    prefix = architecture_of(loaded.config).layers
    tensors = {level: {} for level in config.level_names}
    with atomic_directory(out) as tmp, progress_bar("levels", loaded.config.num_hidden_layers) as advance:
        for index, layer in enumerate(decoder_layers(loaded.model)):
            stats = calib.layer(index) if needs_statistics else {}
            for local, module in layer_linears(loaded.model, layer).items():
                name, weight = f"{prefix}.{index}.{local}", module.weight.data
                for level in config.quantized_levels:
                    # the functions (and settings) quantize and prune call, so a plan assembles to these weights
                    bits, group_size, sparse24 = parse_quantized_level(level)
                    grid, entry = GridSpec(bits, group_size), {}
                    if sparse24:
                        pruned = sparsegpt_prune(weight, stats[local].second_moment, parse_pattern("2:4"), config.damp, grid=grid,
                                                 clip_search=config.clip_search, shrinkage=config.hessian_shrinkage)
                        q, entry[f"{name}.keep"] = pruned.quantized, pack_bitmask(pruned.keep)
                    elif config.method == "gptq":
                        q = gptq_quantize(weight, stats[local].second_moment, grid, config.damp, config.act_order, clip_search=config.clip_search,
                                          shrinkage=config.hessian_shrinkage)
                    else:
                        q = round_to_nearest(weight, grid)
                    tensors[level] |= entry | {f"{name}.codes": q.codes.contiguous(), f"{name}.scale": q.scale.half().contiguous()}
                for sparsity in config.sparsity_levels:
                    keep = keep_mask(wanda_score(weight, stats[local].second_moment), parse_pattern(sparsity))
                    tensors[f"sparsity{sparsity:g}"][f"{name}.keep"] = pack_bitmask(keep)
            advance()
        for level, level_tensors in tensors.items():
            save_file(level_tensors, tmp / f"{level}.safetensors")
        units = [
            {"name": name, "size": module.weight.numel(), "in_features": module.in_features, "block": int(name.split(".")[len(prefix.split("."))])}
            for name, module, _ in linears
        ]
        write_json(tmp / "manifest.json", {
            "format": LEVELS_FORMAT, "version": LEVELS_VERSION, "base": chain[0], "params": asdict(config), "units": units,
            "layers": loaded.config.num_hidden_layers, "layer_prefix": prefix, **calibration_record(calib),
        })
        write_lineage(tmp, chain, {"stage": "levels", "params": asdict(config), **calibration_record(calib)}, run)
    return Path(out)


class LevelDatabase:
    """Read side of a level database."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        require_input(self.folder, True, "level database", "build it with `lmpress levels`")
        self.manifest = read_json(self.folder / "manifest.json", "rebuild it with `lmpress levels`")
        require(isinstance(self.manifest, dict), f"{self.folder / 'manifest.json'} is not a JSON object; rebuild it with `lmpress levels`")
        # databases from before clip search: min-max; from before the Hessian shrinkage: none
        params = {"clip_search": False, "hessian_shrinkage": 0.0, **self.manifest.get("params", {})}
        version = self.manifest.get("version")
        readable = version == LEVELS_VERSION or (version == 2 and not (params.get("sparse24") and params["clip_search"]))  # 2's 2:4 levels: min-max
        require(
            self.manifest.get("format") == LEVELS_FORMAT and readable,
            f"{self.folder} is not an lmpress level database of version {LEVELS_VERSION}; rebuild it with `lmpress levels`",
        )
        require_keys(self.manifest, ("base", "units", "layers", "layer_prefix"), self.folder / "manifest.json", "rebuild it with `lmpress levels`")
        self.config = LevelsConfig(**params)
        self._cache: dict[str, dict[str, torch.Tensor]] = {}

    def check_model(self, chain: list[dict]) -> None:
        require(
            self.manifest["base"]["weights_sha256"] == chain[0]["weights_sha256"] and len(chain) == 1,
            f"level database {self.folder} was built for {self.manifest['base']['model']}, not this model; "
            "rebuild it with `lmpress levels --model` for the model you search",
        )

    def units(self, kind: str, drop: bool, sparse24: bool = False) -> list[Unit]:
        """Linear units with the levels of `kind` (bits: cost = stored bits per weight, with 2:4
        levels if `sparse24`; sparsity: cost = density), least compressed first, plus a
        keep/drop unit per block with `drop`."""
        require(not drop or self.config.drop, f"level database {self.folder} was built without block dropping; rebuild it with --drop true")
        require(not sparse24 or self.config.sparse24, f"level database {self.folder} has no 2:4 levels; rebuild it with --sparse24 true")
        units = []
        for u in self.manifest["units"]:
            if kind == "bits":
                levels = [(level, stored_bits(level, u["in_features"])) for level in self.config.quantized_levels if sparse24 or not level.endswith("s24")]
            else:
                levels = [(f"sparsity{s:g}", 1 - s) for s in self.config.sparsity_levels]
            require(bool(levels), f"level database {self.folder} has no {kind} levels; rebuild it with `lmpress levels --{kind} ...`")
            levels.sort(key=lambda pair: -pair[1])  # stable: equal costs keep the database's order
            units.append(Unit(u["name"], u["size"], tuple(name for name, _ in levels), tuple(cost for _, cost in levels), u["block"]))
        if drop:
            prefix = self.manifest["layer_prefix"]
            for block in range(self.manifest["layers"]):
                size = sum(u.size for u in units if u.block == block)
                units.append(Unit(f"{prefix}.{block}", size, ("keep", "drop"), (0.0, 0.0), block, is_block=True))
        return units

    def weight(self, level: str, name: str, base: torch.Tensor) -> torch.Tensor:
        """A linear's weight at a level, in fp32: dequantized codes, or the base weight masked."""
        from compressors.grid import GridSpec, QuantizedLinear
        from compressors.packed_int import unpack_bitmask

        if level not in self._cache:
            self._cache[level] = read_safetensors(self.folder / f"{level}.safetensors", "rebuild it with `lmpress levels`")
        tensors = self._cache[level]
        columns = tensors[f"{name}.codes"].shape[1] if level.startswith("bits") else base.shape[1]
        keep = unpack_bitmask(tensors[f"{name}.keep"], columns) if f"{name}.keep" in tensors else None
        if level.startswith("bits"):
            bits, group_size, _ = parse_quantized_level(level)
            scale = tensors[f"{name}.scale"].float()
            weight = QuantizedLinear(tensors[f"{name}.codes"], scale, torch.zeros_like(scale), GridSpec(bits, group_size)).dequantized()
            return weight if keep is None else weight * keep
        return base.float() * keep


class Candidates:
    """The base model with each unit switchable among its levels, for scoring genomes."""

    def __init__(self, loaded, database: LevelDatabase, units: list[Unit]):
        self.model, self.database, self.units = loaded.model, database, units
        modules = dict(loaded.model.named_modules())
        self.linears = {u.name: modules[u.name] for u in units if not u.is_block}
        self.base = {name: module.weight.data.clone() for name, module in self.linears.items()}
        self.levels: dict[tuple[str, str], torch.Tensor] = {}  # (linear, level) -> weight, made once
        self.applied: dict[str, str] = {}
        self.layers = LayerSubset(loaded.model)

    def apply(self, genome: list[int]) -> None:
        dropped = set()
        for unit, level in zip(self.units, genome):
            name = unit.levels[level]
            if unit.is_block:
                if name == "drop":
                    dropped.add(unit.block)
                continue
            if self.applied.get(unit.name) != name:
                key = (unit.name, name)
                if key not in self.levels:
                    self.levels[key] = self.database.weight(name, unit.name, self.base[unit.name]).to(self.base[unit.name].dtype)
                self.linears[unit.name].weight.data.copy_(self.levels[key])
                self.applied[unit.name] = name
        # dropped blocks are left out, the kept ones renumbered with their attention kinds, as drop-layers leaves them
        self.layers.keep([index for index in range(len(self.layers.layers)) if index not in dropped])

    def restore(self) -> None:
        for name, module in self.linears.items():
            module.weight.data.copy_(self.base[name])
        self.applied.clear()
        self.layers.restore()


class KLFitness:
    """KL(base || candidate) per token on the first windows of a fixed set of calibration
    windows; the base's side is its final hidden states, computed once (see evaluation.py)."""

    def __init__(self, candidates: Candidates, windows: torch.Tensor, batch_size: int):
        self.candidates, self.windows, self.batch_size = candidates, windows, batch_size
        self.head = LMHead.of(candidates.model)
        self.base_hidden = score_windows(candidates.model, windows, None, batch_size).hidden
        self.cache: dict[tuple, float] = {}

    def __call__(self, genome: list[int], windows: int) -> float:
        key = (tuple(genome), windows)
        if key not in self.cache:
            self.candidates.apply(genome)
            scores = score_windows(self.candidates.model, self.windows[:windows], (self.head, self.base_hidden[:windows]), self.batch_size)
            self.cache[key] = scores.kl_sum / scores.tokens
        return self.cache[key]


@dataclass
class SearchConfig:
    budget_bits: float = 0.0  # average stored bits per weight over the decoder linears (codes, scales, 2:4 masks)
    target_sparsity: float = 0.0  # average sparsity over the decoder linears (sparsity levels)
    budget_latency: float = 0.0  # decode step time as a fraction of the base's, by the latency table
    latency: str = ""  # latency table from `lmpress latency`: the budget_latency model; with another budget, reported
    drop: bool = False  # also choose blocks to drop (a dropped block's weights cost nothing)
    sparse24: bool = False  # bits: also choose 2:4 sparsity on/off per linear (the database's 2:4 levels)
    generations: int = 50
    offspring: int = 16
    selection: str = "1:4,4:1"  # windows:survivors per round
    seq_len: int = 256  # tokens per fitness window (the start of each calibration window)
    batch_size: int = 4
    seed: int = 0
    start: str = "uniform"  # uniform | sensitivity: the first parent
    # whole calibration windows, none of the fitness's, on which the searched plan must beat its
    # start, or the start is written: a few hundred fitness tokens are easily overfitted
    validation_windows: int = 8

    @property
    def budget(self) -> str:
        return "bits" if self.budget_bits else "sparsity" if self.target_sparsity else "latency"

    def kind(self, database: "LevelDatabase") -> str:
        """The levels the genome takes: bits or sparsity (under a latency budget: bits where
        the database has them)."""
        if self.budget == "latency":
            return "bits" if database.config.bit_levels else "sparsity"
        return self.budget

    def validate(self) -> None:
        require(
            sum(map(bool, (self.budget_bits, self.target_sparsity, self.budget_latency))) == 1,
            "give exactly one budget: --budget-bits (average bits per weight), --target-sparsity (average sparsity) "
            "or --budget-latency (fraction of the base's decode step)",
        )
        require(
            self.budget_bits >= 0 and 0 <= self.target_sparsity < 1 and 0 <= self.budget_latency <= 1,
            "the budget must be positive bits, a sparsity in (0, 1) or a latency fraction in (0, 1]",
        )
        require(not self.budget_latency or bool(self.latency), "--budget-latency needs --latency, a table from `lmpress latency`")
        require(not self.sparse24 or self.budget != "sparsity", "--sparse24 chooses 2:4 on/off among bits levels; for unstructured sparsity use --target-sparsity alone")
        require_positive(generations=self.generations, offspring=self.offspring, seq_len=self.seq_len, batch_size=self.batch_size)
        parse_selection(self.selection)
        require(self.start in STARTS, f"--start must be one of {', '.join(STARTS)} (got '{self.start}')")
        require(self.validation_windows >= 0, f"--validation-windows must be 0 (no check) or more (got {self.validation_windows})")


def _budgeted_units(config: SearchConfig, database: LevelDatabase, chain: list[dict]) -> tuple[list[Unit], float, LatencyTable | None]:
    """The units with their costs in the budget's currency (stored bits or density per weight,
    or seconds per weight from the latency table), the budget in it, and the table if given."""
    units = database.units(config.kind(database), config.drop, config.sparse24)
    latency = LatencyTable(Path(config.latency)) if config.latency else None
    if latency is not None:
        latency.check(chain, database)
    if config.budget == "latency":
        units, base_step = latency.costed(units, database), latency.base_step(database)
        fixed = latency.fixed_seconds(units)
        budget = config.budget_latency * base_step - fixed
        check_budget(units, budget, f"of {config.budget_latency} of the base's decode step",
                     lambda cost: f"{(cost + fixed) / base_step:.4g} of it on {latency.device}",
                     "raise the budget" + ("" if config.drop else ", or let the search drop blocks (--drop true)"))
        return units, budget, latency
    weights = sum(u.size for u in units if not u.is_block)
    budget = (config.budget_bits if config.budget == "bits" else 1 - config.target_sparsity) * weights
    check_budget(units, budget, f"{config.budget_bits} bits" if config.budget == "bits" else f"sparsity {config.target_sparsity}",
                 lambda cost: f"{cost / weights:.4g} per weight", "raise the budget or build the database with more compressed levels")
    return units, budget, latency


def read_search_state(path: Path) -> SearchState:
    saved = json.loads(path.read_text())
    version, internal, gauss = saved.pop("rng_state")
    return SearchState(**saved, rng_state=(version, tuple(internal), gauss))


def search(model: str, levels: Path, calibration: Path, out: Path, config: SearchConfig) -> Path:
    """Evolutionary search for per-unit levels within the budget; writes the plan (YAML the
    quantize or prune stage takes as --overrides), the report and the fitness curve. An
    interrupted search resumes from its last generation."""
    config.validate()
    database = LevelDatabase(levels)
    run, loaded, chain, calib = begin_stage("search", model, calibration, out, "search", (levels, config.latency))
    database.check_model(chain)
    units, budget, latency = _budgeted_units(config, database, chain)
    linear_weights = sum(u.size for u in units if not u.is_block)
    selection = parse_selection(config.selection)
    stored = calib.input_ids
    fitness_windows = spread_indices(selection[-1][0], stored.shape[0])
    require(len(fitness_windows) >= selection[-1][0], f"the calibration artifact holds {stored.shape[0]} windows; the selection needs {selection[-1][0]}")
    held_aside = spread_indices(config.validation_windows, stored.shape[0], skip=fitness_windows)
    require(len(held_aside) or not config.validation_windows,
            f"the calibration artifact's {stored.shape[0]} windows all feed the fitness; pass --validation-windows 0 or calibrate more samples")
    loaded.model.eval()
    candidates = Candidates(loaded, database, units)
    fitness = KLFitness(candidates, stored[fitness_windows][:, : config.seq_len], config.batch_size)
    validation = KLFitness(candidates, stored[held_aside], config.batch_size) if held_aside else None
    resume = ResumeFolder(out, inputs_key(database.manifest, calib.manifest["data_sha256"], asdict(config), chain[0]["weights_sha256"],
                                          latency.table if latency else None))
    state_file = resume.file("state.json")
    state = resume.read(state_file.name, read_search_state)
    if state is None:
        state = start_state(units, budget, fitness, selection, config.seed, config.start)
    start_fitness = state.history[0]["fitness"]
    start = time.perf_counter()

    def checkpoint(state: SearchState) -> None:
        temporary = state_file.with_suffix(".tmp")
        temporary.write_text(json.dumps(asdict(state)))
        temporary.replace(state_file)
        advance()

    with progress_bar(f"search ({config.budget})", config.generations) as advance:
        advance(state.generation)
        state = evolve(units, budget, fitness, config.generations, config.offspring, selection, state, on_generation=checkpoint)
    plan, check = state.parent, {}
    if validation is not None:
        check = {"windows": len(held_aside), "seq_len": stored.shape[1],
                 "start": validation(state.start, len(held_aside)), "searched": validation(state.parent, len(held_aside))}
        check["kept"] = "searched" if check["searched"] <= check["start"] else "start"
        plan = state.parent if check["kept"] == "searched" else state.start
    candidates.restore()
    report = {
        "kind": config.kind(database), "budget": config.budget, "drop": config.drop, "start": config.start,
        **({"budget_per_weight": budget / linear_weights, "cost_per_weight": genome_cost(units, plan) / linear_weights}
           if config.budget != "latency" else {}),  # seconds per weight mean nothing; see "latency"
        "units": len(units),
        "levels": sorted({level for u in units for level in u.levels}), "generations": state.generation,
        "evaluations": state.evaluations, "search_s": round(time.perf_counter() - start, 1),
        "fitness": {"start": start_fitness, "searched": state.parent_fitness, "windows": selection[-1][0], "seq_len": config.seq_len},
        **({"validation": check} if check else {}),  # KL on the held-aside windows; "kept": the plan written
        "dropped_blocks": [u.block for u, level in zip(units, plan) if u.is_block and u.levels[level] == "drop"],
        "assemble": assembly_command(units, plan, database.config),
    }
    if latency is not None:  # the decode step the table predicts
        base_step = latency.base_step(database)
        report["latency"] = {"device": latency.device, "base_step_ms": 1e3 * base_step, "searched_step_ms": 1e3 * latency.step(units, plan, database)}
        if config.budget == "latency":
            report["latency"]["budget_step_ms"] = 1e3 * config.budget_latency * base_step
    with atomic_directory(out) as tmp:
        (tmp / PLAN_FILE).write_text(plan_yaml(units, plan, database.manifest["layer_prefix"]))
        write_json(tmp / SEARCH_REPORT, report)
        lines = ["generation,fitness,evaluations"] + [f"{h['generation']},{h['fitness']:.6f},{h['evaluations']}" for h in state.history]
        (tmp / HISTORY_FILE).write_text("\n".join(lines) + "\n")
        timing = {"latency_table": {"device": latency.device, "sha256": file_sha256(latency.path)}} if latency else {}
        write_lineage(tmp, chain, {"stage": "search", "params": asdict(config), "levels": database.manifest["params"], **timing, **calibration_record(calib)}, run)
    resume.remove()
    return Path(out)


def _served_names(units: list[Unit], genome: list[int], prefix: str) -> dict[str, str]:
    """Each kept linear's name in the model the plan is applied to: with dropped blocks,
    layers are renumbered as `lmpress drop-layers` renumbers them."""
    dropped = {u.block for u, level in zip(units, genome) if u.is_block and u.levels[level] == "drop"}
    kept = sorted({u.block for u in units if not u.is_block} - dropped)
    names = {}
    for unit in units:
        if not unit.is_block and unit.block not in dropped:
            local = unit.name[len(f"{prefix}.{unit.block}.") :]
            names[unit.name] = f"{prefix}.{kept.index(unit.block)}.{local}"
    return names


def _plan_entry(level: str, prune: bool):
    """A level as the setting an --overrides plan gives one linear: {bits, group_size} for
    quantize; for prune a sparsity, or {pattern: 2:4 | 0, bits, group_size} (2:4 levels and
    the dense ones beside them)."""
    if not level.startswith("bits"):
        return float(level[len("sparsity"):])
    bits, group_size, sparse24 = parse_quantized_level(level)
    grid = {"bits": bits, "group_size": group_size}
    return {"pattern": "2:4" if sparse24 else 0, **grid} if prune else grid


def _is_prune_plan(units: list[Unit]) -> bool:
    return any(not level.startswith("bits") or level.endswith("s24") for u in units if not u.is_block for level in u.levels)


def plan_yaml(units: list[Unit], genome: list[int], prefix: str) -> str:
    """The plan as --overrides for quantize ({linear regex: {bits, group_size}}) or prune
    ({linear regex: sparsity}, or {pattern: 2:4 | 0, bits, group_size} with 2:4 levels). With
    dropped blocks (search.json's dropped_blocks) it is the plan of the model they leave,
    layers renumbered: `lmpress drop-layers --layers ...` first."""
    import yaml

    names = _served_names(units, genome, prefix)
    prune = _is_prune_plan(units)
    plan = {}
    for unit, level in zip(units, genome):
        if unit.name in names:
            plan[re.escape(names[unit.name])] = _plan_entry(unit.levels[level], prune)
    return yaml.safe_dump(plan, sort_keys=False)


def assembly_command(units: list[Unit], genome: list[int], levels: LevelsConfig) -> str:
    """The stage commands that build the searched model from the plan (search.json's hint)."""
    dropped = [str(u.block) for u, level in zip(units, genome) if u.is_block and u.levels[level] == "drop"]
    first = f"lmpress drop-layers --layers {','.join(dropped)} --out DROPPED, then on DROPPED: " if dropped else ""
    gptq = (f"--act-order {str(levels.act_order).lower()} --clip-search {str(bool(levels.clip_search)).lower()} "  # as the database's levels
            f"--hessian-shrinkage {levels.hessian_shrinkage:g}")
    if not _is_prune_plan(units):
        method = f"--method {levels.method}" + (f" {gptq}" if levels.method == "gptq" else "")  # rtn takes neither option
        return first + f"lmpress quantize {method} --sequential false --overrides plan.yaml"
    if any(u.levels[0].startswith("bits") for u in units if not u.is_block):
        return first + f"lmpress prune --method sparsegpt --bits 4 {gptq} --sequential false --overrides plan.yaml"
    return first + "lmpress prune --method wanda --sequential false --overrides plan.yaml"


def read_plan(units: list[Unit], folder: Path, prefix: str) -> list[int]:
    """The genome a search wrote (plan.yaml, and the dropped blocks in search.json)."""
    import yaml

    dropped = set(read_json(Path(folder) / SEARCH_REPORT, "re-run `lmpress search`")["dropped_blocks"])
    genome = [unit.levels.index("drop" if unit.block in dropped else "keep") if unit.is_block else 0 for unit in units]
    names = _served_names(units, genome, prefix)
    plan = {re.sub(r"\\(.)", r"\1", regex): setting for regex, setting in yaml.safe_load((Path(folder) / PLAN_FILE).read_text()).items()}
    for i, unit in enumerate(units):
        if unit.is_block:
            continue
        if unit.name not in names:
            genome[i] = len(unit.levels) - 1  # in a dropped block: costs nothing either way
            continue
        setting = plan[names[unit.name]]
        if isinstance(setting, dict):
            level = quantized_level(setting["bits"], setting["group_size"], str(setting.get("pattern", 0)) == "2:4")
        else:
            level = f"sparsity{setting:g}"
        genome[i] = unit.levels.index(level)
    return genome
