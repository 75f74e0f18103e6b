"""The latency model the search can budget: what one decode step costs on a device, split into
the parts a plan changes, each measured there once (`lmpress latency`).

A decode step (one new token per sequence, `context` tokens already in the KV cache) costs

    outside + sum over kept blocks of (block_rest + sum of its linears at their levels)

where `outside` is everything but the decoder blocks (embedding, final norm, LM head),
`block_rest` what a block costs besides its linears (attention over the cache, norms, rotary,
residuals), and each linear's time is that of one call at its level as lmpress serves it: the
level's packed kernel on a GPU; on the CPU, in bf16 (`generate`'s default where the CPU
multiplies bf16 natively), torch's int4 kernel for 4-bit levels and a cached dense copy for the
rest, in fp32 a dense copy for every level (so each costs the same, a little more than the plain
dense linear, and only dropping blocks buys time). The model is additive
by assumption; the table carries a check of it: a model with every other block dropped and
the rest at the database's most compressed packed level, predicted and measured.

latency.json:
    base                    the model it was measured on (as lineage records it)
    device, dtype, threads, batch, context, repeats
    step_s                  one decode step of the base model, measured
    outside_s, block_rest_s
    linears                 {"<out>x<in>": {"dense": s, "<level>": s, ...}}
    paths                   {"<out>x<in>": {"<level>": serving path}}: a kernel, "dense", or
                            "PackedLinear's dense copy" (a packed level without a kernel here)
    check                   {"predicted_s", "measured_s", "blocks_kept", "level"}
Times are medians of `repeats` timed calls after a warm-up, each as `lmpress generate` runs it:
on a GPU a CUDA graph's replay, timed by CUDA events (no Python, no launch overhead; with
`cuda_graphs` off, eager calls, wall clock after a synchronize, as `generate --no-cuda-graphs`);
on the CPU eager calls, wall clock. A decode step runs on transformers' StaticCache, as
`generate` decodes: its attention spans the whole cache of `context` + 1 positions. Linears are
timed round-robin over copies that overflow the device's last-level cache, so their weights
come from memory as they do in a model.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from compressors.search import Unit
from pipelines.artifact import read_json, require_keys, require_output_path, write_json
from pipelines.errors import LmpressError, require, require_input

LATENCY_FORMAT = "lmpress-latency"
LATENCY_VERSION = 1
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class LatencyConfig:
    batch: int = 1  # sequences decoded together
    context: int = 256  # tokens already in the KV cache
    repeats: int = 30  # timed calls per measurement (the median is kept)
    device: str = "auto"  # auto (cuda if there is one) | cpu | cuda
    random_weights: bool = False  # time the architecture from config.json alone (speed does not depend on values)
    cuda_graphs: bool = True  # on a GPU, time CUDA graph replays (as `lmpress generate` decodes); off: eager calls
    dtype: str = "auto"  # the activations' dtype, as `lmpress generate --dtype` resolves it (`serving_dtype`)

    def validate(self) -> None:
        from pipelines.stages import require_positive

        require_positive(batch=self.batch, context=self.context, repeats=self.repeats)
        require(self.device in DEVICES, f"--device must be one of {', '.join(DEVICES)} (got '{self.device}')")
        require(self.device != "cuda" or torch.cuda.is_available(), "--device cuda: no CUDA GPU is visible here; use --device cpu")
        self.torch_dtype(self.torch_device())

    def torch_device(self) -> torch.device:
        return torch.device("cuda" if self.device == "cuda" or (self.device == "auto" and torch.cuda.is_available()) else "cpu")

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        from pipelines.serving import serving_dtype

        return serving_dtype(self.dtype, device.type)

    def graphed(self, device: torch.device) -> bool:
        """Whether calls on `device` are timed as CUDA graph replays."""
        return self.cuda_graphs and device.type == "cuda"


# --------------------------------------------------------------------------- timing


def median_seconds(call: Callable[[], object], device: torch.device, repeats: int, before: Callable[[], object] | None = None,
                   graphed: bool = False) -> float:
    """Median seconds of `call()` after a warm-up; `before()` runs untimed ahead of each. With
    `graphed` (a GPU), of a replay of `call` captured as a CUDA graph; a capture that fails is a
    clear error (eager timing is one flag away)."""
    before = before or (lambda: None)

    def prepared():
        before()
        call()

    if graphed:
        from compressors.kernels import capture_graph, replay_seconds

        try:  # each warm-up ends with before(), so the capture records `call` from the state every replay starts from
            graph = capture_graph(call, warm_up=lambda: (prepared(), before()))
        except RuntimeError as error:
            message = f"CUDA graph capture failed ({str(error).splitlines()[0][:200]}); pass --no-cuda-graphs to time eager calls, as `generate` then decodes"
            raise LmpressError(message) from None
        return replay_seconds(graph, repeats, before)
    for _ in range(2):  # compile, autotune, fill caches and allocators
        prepared()
    times = []
    for _ in range(repeats):
        before()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _cache_bytes(device: torch.device) -> int:
    """The last-level cache a weight must overflow to be read from memory."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).L2_cache_size
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        text = (index / "size").read_text().strip() if (index / "size").is_file() else ""
        if text[:-1].isdigit():
            sizes.append(int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}.get(text[-1], 1))
    return max(sizes, default=32 << 20)


def linear_seconds(make: Callable[[], nn.Module], x: torch.Tensor, nbytes: int, repeats: int, graphed: bool = False) -> float:
    """Seconds of one call of the module `make()` builds, its weight read from memory: timed
    round-robin over enough copies to fill three times the last-level cache."""
    copies = [make() for _ in range(max(2, min(256, -(-3 * _cache_bytes(x.device) // max(nbytes, 1)))))]

    def call():
        for module in copies:
            module(x)

    return median_seconds(call, x.device, repeats, graphed=graphed) / len(copies)


@torch.no_grad()
def decode_step_seconds(model: nn.Module, config: LatencyConfig, device: torch.device) -> float:
    """One decode step at `batch` x 1 new token after `context` cached tokens, each timed from
    the same state (`decode_step`)."""
    prefill, step = decode_step(model, config, device)
    return median_seconds(step, device, config.repeats, before=prefill, graphed=config.graphed(device))


def decode_step(model: nn.Module, config: LatencyConfig, device: torch.device) -> tuple[Callable[[], object], Callable[[], torch.Tensor]]:
    """(prefill, step): `prefill()` resets a StaticCache of `context` + 1 positions in place
    and fills it with `context` tokens; `step()` decodes `batch` x 1 token after them (as
    `generate` does) and returns its logits. Why a reset and a prefill before each step, not a
    snapshot: a CUDA graph replays into the cache's own tensors, and a sliding-window layer also
    keeps its length as a Python int that only a reset and a prefill set right."""
    from transformers import StaticCache

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (config.batch, config.context + 1), generator=generator).to(device)
    cache = StaticCache(config=model.config, max_cache_len=config.context + 1)
    position = torch.full((config.batch, 1), config.context, device=device)

    def prefill():
        cache.reset()
        model(input_ids=ids[:, : config.context], past_key_values=cache, use_cache=True, logits_to_keep=1)

    def step() -> torch.Tensor:
        return model(input_ids=ids[:, config.context :], past_key_values=cache, use_cache=True, position_ids=position, logits_to_keep=1).logits

    return prefill, step


# --------------------------------------------------------------------------- serving modules


def level_kind(level: str) -> tuple[int, str, int]:
    """(bits, stored kind, group size) of a quantized level's weights, as
    `compressors.packed_int.random_packed_weight` takes them."""
    from pipelines.levels import parse_quantized_level

    bits, group_size, sparse24 = parse_quantized_level(level)
    return bits, "2:4 symmetric" if sparse24 else "symmetric", group_size


def serving_module(level: str, rows: int, columns: int, dtype: torch.dtype, device: torch.device) -> tuple[nn.Module, str, int]:
    """A linear of this shape as lmpress serves it at `level` (random weights: speed does not
    depend on them), the path it runs (a kernel, or a dense matmul), and the bytes a call reads."""
    from compressors.kernels import PackedLinear, serving_kernel
    from compressors.packed_int import cpu_int4_group, random_packed_weight

    dense_bytes = rows * columns * torch.finfo(dtype).bits // 8
    if level.startswith("bits"):
        bits, stored, group_size = level_kind(level)
        weight = random_packed_weight(bits, rows, columns, group_size, stored).to(device)
        kernel = serving_kernel(weight, device)
        module = PackedLinear(weight, None).to(device)
        if kernel is None and device.type == "cpu" and dtype == torch.bfloat16 and (group := cpu_int4_group(weight)):
            return module, f"torch's CPU int4 kernel (groups of {group})", weight.nbytes
        if kernel is None:  # every other level runs the same code on a dense copy (fp32 on the CPU but for bf16 x): one path, one measurement
            return module, "PackedLinear's dense copy", rows * columns * 4 if device.type == "cpu" and dtype != torch.bfloat16 else dense_bytes
        return module, f"{kernel.name} ({weight.kind}, {bits}-bit, group {group_size})", weight.nbytes
    # dense, and unstructured sparsity: no kernel skips scattered zeros, so it is served dense
    return nn.Linear(columns, rows, bias=False, device=device, dtype=dtype), "dense", dense_bytes


def _shape(rows: int, columns: int) -> str:
    return f"{rows}x{columns}"


def _unit_shapes(units: list[dict]) -> dict[str, tuple[int, int]]:
    """Each linear of a level database's manifest: (out, in)."""
    return {u["name"]: (u["size"] // u["in_features"], u["in_features"]) for u in units}


def _linear_table(shapes: list[tuple[int, int]], levels: list[str], config: LatencyConfig, dtype, device) -> tuple[dict, dict]:
    """Seconds of each shape at "dense" and each level, one measurement per serving path."""
    times, paths = {}, {}
    for rows, columns in shapes:
        x = torch.randn(config.batch, columns, generator=torch.Generator().manual_seed(0)).to(device, dtype)
        by_path: dict[str, float] = {}
        key = _shape(rows, columns)
        times[key], paths[key] = {}, {}
        for level in ("dense", *levels):
            _, path, nbytes = serving_module(level, rows, columns, dtype, device)
            if path not in by_path:
                make = lambda level=level: serving_module(level, rows, columns, dtype, device)[0]  # noqa: E731
                by_path[path] = linear_seconds(make, x, nbytes, config.repeats, config.graphed(device))
            times[key][level], paths[key][level] = by_path[path], path
    return times, paths


# --------------------------------------------------------------------------- the stage


def measure_latency(model: str, levels: Path, out: Path, config: LatencyConfig) -> Path:
    """Measure the latency table for the model and the level database's levels; see above.
    With `random_weights`, only the model's config.json is read and the table is stamped with
    the database's base (for a machine that has the architecture but not the weights)."""
    from pipelines.levels import LevelDatabase

    config.validate()
    out = Path(out)
    require_output_path(out, directory=False)
    database = LevelDatabase(levels)
    network, base = _network(model, database, config.random_weights)
    longest = getattr(network.config, "max_position_embeddings", None)
    require(longest is None or config.context < longest, f"--context {config.context} leaves no room for a new token in the model's {longest} positions; lower it")
    device = config.torch_device()
    dtype = config.torch_dtype(device)
    network.to(device, dtype)
    table = {
        "format": LATENCY_FORMAT, "version": LATENCY_VERSION, "base": base, "params": asdict(config),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(), "levels": database.config.level_names, "blocks": database.manifest["layers"],
        **_time_decode_parts(network, database.manifest["units"], database.config.level_names, config, dtype, device),
    }
    write_json(out, table)
    return out


def _network(model: str, database, random_weights: bool) -> tuple[nn.Module, dict]:
    """The model to time and the base record the table carries."""
    from pipelines.models import load_config, load_model, resolve_model
    from pipelines.stages import model_chain

    if not random_weights:
        loaded = load_model(model)
        chain = model_chain(model, loaded.folder, loaded.config)
        database.check_model(chain)
        return loaded.model, chain[0]
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    network = AutoModelForCausalLM.from_config(load_config(resolve_model(model))).eval()
    modules = dict(network.named_modules())
    for unit in database.manifest["units"]:
        module = modules.get(unit["name"])
        require(
            module is not None and module.weight.numel() == unit["size"] and module.in_features == unit["in_features"],
            f"{model} is not the architecture level database {database.folder} was built for ({unit['name']}); pass that model's config",
        )
    return network, database.manifest["base"]


@torch.no_grad()
def _time_decode_parts(network: nn.Module, units: list[dict], level_names: list[str], config: LatencyConfig, dtype, device) -> dict:
    """The table's times: the step, outside the blocks, each shape at each level, the blocks'
    rest, and the additivity check (every other block dropped, the kept ones' linears at the
    last, most compressed, level)."""
    blocks = len({u["block"] for u in units})
    shape_of = _unit_shapes(units)
    step = decode_step_seconds(network, config, device)
    with _blocks_kept(network, []):
        outside = decode_step_seconds(network, config, device)
    linears, paths = _linear_table(sorted(set(shape_of.values())), level_names, config, dtype, device)
    dense = sum(linears[_shape(*shape)]["dense"] for shape in shape_of.values())
    rest = max(0.0, (step - outside - dense) / blocks)

    packed = [name for name in level_names if name.startswith("bits")]
    level = packed[-1] if packed else level_names[-1]  # the most compressed packed level: it runs a kernel where there is one
    kept = list(range(0, blocks, 2))
    in_kept = [u["name"] for u in units if u["block"] in kept]
    predicted = outside + len(kept) * rest + sum(linears[_shape(*shape_of[name])][level] for name in in_kept)
    swapped = {name: serving_module(level, *shape_of[name], dtype, device)[0] for name in in_kept}
    with _linears_swapped(network, swapped), _blocks_kept(network, kept):
        measured = decode_step_seconds(network, config, device)
    return {
        "step_s": step, "outside_s": outside, "block_rest_s": rest, "linears": linears, "paths": paths,
        "check": {"level": level, "blocks_kept": len(kept), "predicted_s": predicted, "measured_s": measured},
    }


class _blocks_kept:
    """Within the block, the model runs only the decoder blocks `kept`, renumbered with their
    attention kinds (sliding or full) as `lmpress drop-layers` leaves them."""

    def __init__(self, model: nn.Module, kept: list[int]):
        from compressors.structured import LayerSubset

        self.subset, self.kept = LayerSubset(model), kept

    def __enter__(self):
        self.subset.keep(self.kept)

    def __exit__(self, *exc):
        self.subset.restore()


class _linears_swapped:
    """Within the block, the named linears are replaced by the given modules."""

    def __init__(self, model: nn.Module, modules: dict[str, nn.Module]):
        self.model, self.modules = model, modules
        self.originals = {name: model.get_submodule(name) for name in modules}

    def _set(self, modules: dict[str, nn.Module]) -> None:
        for name, module in modules.items():
            parent, child = name.rsplit(".", 1)
            setattr(self.model.get_submodule(parent), child, module)

    def __enter__(self):
        self._set(self.modules)

    def __exit__(self, *exc):
        self._set(self.originals)


# --------------------------------------------------------------------------- the search's side


class LatencyTable:
    """Read side: unit costs in seconds and predicted decode steps."""

    def __init__(self, path: Path):
        self.path = Path(path)
        require_input(self.path, False, "latency table", "measure it with `lmpress latency`")
        self.table = read_json(self.path, "measure it again with `lmpress latency`")
        require(
            isinstance(self.table, dict) and self.table.get("format") == LATENCY_FORMAT and self.table.get("version") == LATENCY_VERSION,
            f"{self.path} is not an lmpress latency table of version {LATENCY_VERSION}; measure it with `lmpress latency`",
        )
        require_keys(self.table, ("base", "levels", "device", "blocks", "linears", "outside_s", "block_rest_s"), self.path, "measure it again with `lmpress latency`")

    def check(self, chain: list[dict], database) -> None:
        """Measured on this base model, for every shape and level of the database."""
        require(
            self.table["base"]["weights_sha256"] == chain[0]["weights_sha256"],
            f"latency table {self.path} was measured on {self.table['base']['model']}, not this model; "
            "measure it with `lmpress latency --model` for the model you search",
        )
        missing = sorted(set(database.config.level_names) - set(self.table["levels"]))
        require(not missing, f"latency table {self.path} has no times for level(s) {', '.join(missing)}; measure it again with this --levels database")

    @property
    def device(self) -> str:
        return self.table["device"]

    def costed(self, units: list[Unit], database) -> list[Unit]:
        """The units with costs per weight in seconds: a linear's time at each level over its
        size; a block keeps (its rest) or drops (nothing)."""
        shape_of = {name: _shape(*shape) for name, shape in _unit_shapes(database.manifest["units"]).items()}
        costed = []
        for unit in units:
            if unit.is_block:
                costs = (self.table["block_rest_s"] / unit.size, 0.0)
            else:
                costs = tuple(self.table["linears"][shape_of[unit.name]][level] / unit.size for level in unit.levels)
            costed.append(Unit(unit.name, unit.size, unit.levels, costs, unit.block, unit.is_block))
        return costed

    def step(self, units: list[Unit], genome: list[int], database) -> float:
        """The decode step the table predicts for a genome of `units` (costed or not)."""
        from compressors.search import genome_cost

        costed = self.costed(units, database)
        return self.fixed_seconds(costed) + genome_cost(costed, genome)

    def fixed_seconds(self, units: list[Unit]) -> float:
        """What no genome of these units changes: outside the blocks, and the blocks' rest when
        blocks cannot be dropped."""
        blocks = 0 if any(u.is_block for u in units) else self.table["blocks"]
        return self.table["outside_s"] + blocks * self.table["block_rest_s"]

    def base_step(self, database) -> float:
        """The base model's step as the table predicts it (its measured step, up to a negative
        rest clipped to 0)."""
        shape_of = [_shape(*shape) for shape in _unit_shapes(database.manifest["units"]).values()]
        return self.table["outside_s"] + self.table["blocks"] * self.table["block_rest_s"] + sum(self.table["linears"][s]["dense"] for s in shape_of)
