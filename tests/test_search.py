"""Evolutionary search over per-unit levels: the algorithm on a synthetic fitness, and the
levels/search stages on a tiny model, with the plan consumed by quantize --overrides."""

import random
from pathlib import Path

import pytest
import torch
import yaml

from compressors.search import SearchState, Unit, check_budget, evolve, genome_cost, greedy_genome, mutate, start_state, uniform_genome
from conftest import leftovers, refuse_in_process, run_cli
from pipelines.errors import LmpressError
from pipelines.levels import LevelsConfig, level_database
from pipelines.stages import DropLayersConfig, drop_layers


def toy_units(count=12, seed=0):
    g = random.Random(seed)
    return [Unit(f"u{i}", g.choice([100, 300]), ("bits8", "bits4", "bits3", "bits2"), (8.0, 4.0, 3.0, 2.0), i // 3) for i in range(count)]


def toy_fitness(units, sensitivity):
    """A separable stand-in for KL: each unit's error grows as its bits drop, by its own sensitivity."""
    penalty = {0: 0.0, 1: 1.0, 2: 3.0, 3: 10.0}
    return lambda genome, windows: sum(s * penalty[level] for s, level in zip(sensitivity, genome))


def test_allocations_and_mutations_stay_within_budget():
    units = toy_units()
    total = sum(u.size for u in units)
    for bits in (2.0, 2.5, 3.0, 3.7, 8.0):
        budget = bits * total
        genome = uniform_genome(units, budget)
        assert genome_cost(units, genome) <= budget
        rng = random.Random(0)
        for _ in range(200):
            genome = mutate(units, genome, budget, rng)
            assert genome_cost(units, genome) <= budget
    assert uniform_genome(units, 3.0 * total) == [2] * len(units)  # exactly the 3-bit level
    # between two levels the cheaper one is spread over depth, not given to the first units
    even = [Unit(f"u{i}", 100, ("bits4", "bits2"), (4.0, 2.0), i // 7) for i in range(210)]
    cheaper = [i for i, level in enumerate(uniform_genome(even, 3.0 * 100 * 210)) if level == 1]
    assert len(cheaper) == 105 and sum(i < 105 for i in cheaper) in range(50, 56)
    assert all(sum(i // 7 == block for i in cheaper) in (3, 4) for block in range(30))  # every block: 3 or 4 of 7
    with pytest.raises(LmpressError, match="no assignment.*cheapest one costs 2 per weight; raise it"):
        check_budget(units, 1.9 * total, "1.9 bits", lambda cost: f"{cost / total:g} per weight", "raise it")
    with pytest.raises(LmpressError, match="leaves nothing to search: every unit at its least compressed level costs 8 per weight"):
        check_budget(units, 8.0 * total, "8 bits", lambda cost: f"{cost / total:g} per weight", "raise it")
    check_budget(units, 7.9 * total, "7.9 bits", lambda cost: f"{cost / total:g} per weight", "raise it")


def test_latency_costs_need_not_fall_with_compression():
    """A latency model prices levels by kernel time, which need not fall as bits do (a 3-bit
    kernel slower than the 4-bit one), and a block costs its attention and norms besides its
    linears: the cheapest genome, the budget check, the score-based allocation and the
    mutations all work on such costs, and only dropping blocks meets a budget below every
    level's time."""
    from compressors.search import cheapest_genome

    levels, seconds = ("bits8", "bits4", "bits3", "bits2"), (2.0, 1.0, 3.0, 0.9)  # per weight: bits3 the slowest
    linears = [Unit(f"b{b}.l{i}", 10, levels, seconds, b) for b in range(3) for i in range(2)]
    blocks = [Unit(f"b{b}", 20, ("keep", "drop"), (0.5, 0.0), b, is_block=True) for b in range(3)]
    units = linears + blocks
    assert cheapest_genome(units) == [3] * 6 + [1] * 3
    assert cheapest_genome(linears) == [3] * 6 and genome_cost(linears, cheapest_genome(linears)) == pytest.approx(6 * 9.0)
    everything = genome_cost(units, [0] * 9)
    assert everything == pytest.approx(6 * 20 + 3 * 10)  # linears at bits8, plus each kept block's rest
    penalty = {0: 0.0, 1: 1.0, 2: 0.5, 3: 5.0}
    error = lambda i, level: 100.0 if units[i].is_block and level == 1 else (0.0 if units[i].is_block else penalty[level])  # noqa: E731
    budget = 0.6 * everything  # needs bits4 nearly everywhere; bits3 is never a saving over bits4
    greedy = greedy_genome(units, budget, error)
    assert genome_cost(units, greedy) <= budget and 2 not in greedy[:6] and greedy[6:] == [0, 0, 0]
    rng = random.Random(0)
    genome = greedy
    for _ in range(200):
        genome = mutate(units, genome, budget, rng)
        assert genome_cost(units, genome) <= budget * (1 + 1e-9)
    below_every_level = 0.9 * genome_cost(units, cheapest_genome(linears) + [0, 0, 0])
    dropping = greedy_genome(units, below_every_level, error)
    assert genome_cost(units, dropping) <= below_every_level and 1 in dropping[6:]
    with pytest.raises(LmpressError, match="no single level for every linear"):
        uniform_genome(units, below_every_level)
    # the cheapest level may lie earlier in the order than a cheaper-than-now one: greedy reaches it
    zigzag = [Unit(f"u{i}", 10, levels, (1.0, 0.5, 0.7, 0.6), i) for i in range(4)]
    greedy = greedy_genome(zigzag, 0.55 * 40, lambda i, level: float(level))  # it used to stop at bits2 (0.6) and fail
    assert genome_cost(zigzag, greedy) <= 0.55 * 40 * (1 + 1e-9) and cheapest_genome(zigzag) == [1] * 4


@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma3_text", "qwen3"])
def test_decode_step_timing_runs_on_every_family(family):
    """The latency table times decode steps with sliding-window layers too, with all blocks or
    none or every other one, and a context past the sliding window. Each timed step decodes
    what a forward over the whole sequence predicts, again after each prefill (the state every
    timed step, or CUDA graph replay, starts from)."""
    import contextlib

    from conftest import tiny_model
    from pipelines.latency import LatencyConfig, _blocks_kept, decode_step, decode_step_seconds

    model = tiny_model(family)
    config = LatencyConfig(batch=2, context=12, repeats=2)  # the sliding windows are 8
    cpu = torch.device("cpu")
    ids = torch.randint(0, model.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))  # as decode_step draws them
    for kept in (None, [], [0, 2]):
        with _blocks_kept(model, kept) if kept is not None else contextlib.nullcontext(), torch.no_grad():
            assert decode_step_seconds(model, config, cpu) > 0
            expected = model(input_ids=ids).logits[:, -1:]
            prefill, step = decode_step(model, config, cpu)
            for _ in range(2):
                prefill()
                torch.testing.assert_close(step(), expected, rtol=1e-4, atol=1e-4)


def test_graphed_timing_captures_from_the_state_each_replay_starts_from(monkeypatch):
    """On a GPU the latency table captures `call` once and replays it after each `before()`, so
    the capture must record `call` from that state too (a sliding-window layer picks its code
    path by a Python int that `call` advances). No GPU here: capture_graph and replay_seconds are
    stood in for by ones that run the warm-ups as capture_graph does, note the state when they
    capture, and replay after each before()."""
    from compressors import kernels
    from pipelines.latency import median_seconds

    state, seen = {"steps": 0}, {}

    def capture(call, warm_up=None):
        for _ in range(2):
            (warm_up or call)()
        seen["at_capture"] = state["steps"]
        return call

    def replay(graph, replays, before=None):
        for _ in range(replays):
            before()
            seen.setdefault("at_replay", set()).add(state["steps"])
            graph()
        return 1.0

    monkeypatch.setattr(kernels, "capture_graph", capture)
    monkeypatch.setattr(kernels, "replay_seconds", replay)
    step, reset = lambda: state.update(steps=state["steps"] + 1), lambda: state.update(steps=0)
    assert median_seconds(step, torch.device("cpu"), 3, before=reset, graphed=True) == 1.0
    assert seen == {"at_capture": 0, "at_replay": {0}}


def test_evolution_beats_uniform_and_is_reproducible_and_resumable():
    units = toy_units()
    sensitivity = [random.Random(i).random() ** 3 * 10 for i in range(len(units))]
    fitness = toy_fitness(units, sensitivity)
    budget = 3.0 * sum(u.size for u in units)
    selection = [(1, 4), (4, 1)]

    def run(generations, state=None):
        state = state or start_state(units, budget, fitness, selection, seed=7)
        return evolve(units, budget, fitness, generations, 8, selection, state)

    final = run(60)
    assert final.parent_fitness < fitness(uniform_genome(units, budget), 4) * 0.8
    assert [h["fitness"] for h in final.history] == sorted((h["fitness"] for h in final.history), reverse=True)
    assert run(60).parent == final.parent  # same seed, same plan
    halfway = run(25)
    resumed = run(60, SearchState(**{**halfway.__dict__, "history": list(halfway.history)}))
    assert resumed.parent == final.parent and resumed.evaluations == final.evaluations
    # the score-based allocation, from the true per-unit errors, also beats uniform on a separable fitness
    penalty = {0: 0.0, 1: 1.0, 2: 3.0, 3: 10.0}
    greedy = greedy_genome(units, budget, lambda i, level: sensitivity[i] * penalty[level])
    assert genome_cost(units, greedy) <= budget and fitness(greedy, 4) < fitness(uniform_genome(units, budget), 4)


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory, real_model_folder):
    from conftest import save_tiny, tiny_config

    root = tmp_path_factory.mktemp("search")
    model = save_tiny(root / "tiny", tiny_config("llama"), real_model_folder, root / "calib")
    # set-up through the stage function, not a fresh CLI interpreter (the CLI runs `levels` in test_dvc)
    levels = level_database(str(model), root / "calib", root / "levels", LevelsConfig(bits="2,4,8", group_size="32", sparse24=True, sparsity="0.3,0.6", drop=True))
    return model, root / "calib", levels


def search_args(setup, out, *extra):
    model, calibration, levels = setup
    return ("search", "--model", model, "--levels", levels, "--calibration", calibration, "--generations", "4", "--offspring", "4",
            "--selection", "1:2,2:1", "--seq-len", "16", "--out", out, *extra)


def test_search_plan_feeds_quantize_and_is_reproducible(tmp_path, tiny_setup):
    import json

    from pipelines.levels import LevelDatabase

    model, calibration, levels = tiny_setup
    first, second = tmp_path / "a", tmp_path / "b"
    for out in (first, second):
        result = run_cli(*search_args(tiny_setup, out, "--budget-bits", "3.5"))
        assert result.returncode == 0, result.stderr
    assert (first / "plan.yaml").read_bytes() == (second / "plan.yaml").read_bytes()
    report = json.loads((first / "search.json").read_text())
    assert report["cost_per_weight"] <= 3.5 and report["fitness"]["searched"] <= report["fitness"]["start"]
    assert report["evaluations"] > 4 and len((first / "history.csv").read_text().splitlines()) == 1 + 5  # generations 0 (uniform) to 4
    check = report["validation"]  # the searched plan against its start on whole held-aside windows
    assert check["windows"] >= 1 and check["kept"] == ("searched" if check["searched"] <= check["start"] else "start")
    plan = yaml.safe_load((first / "plan.yaml").read_text())
    assert {setting["bits"] for setting in plan.values()} <= {2, 4, 8} and len(plan) == 4 * 7
    assert not leftovers(first)

    # quantize with the plan, as the report's hint says, gives exactly the weights the search scored
    assert "lmpress quantize --method gptq --act-order true --clip-search true --hessian-shrinkage 0.25 --sequential false" in report["assemble"]
    quantized = tmp_path / "q"
    result = run_cli("quantize", "--model", model, "--calibration", calibration, "--method", "gptq", "--sequential", "false",
                     "--group-size", "32", "--overrides", first / "plan.yaml", "--out", quantized)
    assert result.returncode == 0, result.stderr
    from pipelines.models import load_model

    served, database = dict(load_model(str(quantized)).model.named_modules()), LevelDatabase(levels)
    for name, setting in list(plan.items())[:6]:
        name = name.replace("\\", "")
        expected = database.weight(f"bits{setting['bits']}g32", name, None)
        assert torch.equal(served[name].weight.float(), expected)


def test_search_sparsity_with_drop_and_resume(tmp_path, tiny_setup, monkeypatch, capsys):
    import json

    import pipelines.levels as levels_module

    whole = tmp_path / "whole"
    assert run_cli(*search_args(tiny_setup, whole, "--target-sparsity", "0.5", "--drop", "true")).returncode == 0
    report = json.loads((whole / "search.json").read_text())
    assert report["cost_per_weight"] <= 0.5 + 1e-9 and report["units"] == 4 * 7 + 4
    units = levels_module.LevelDatabase(tiny_setup[2]).units("sparsity", drop=True)
    genome = levels_module.read_plan(units, whole, "model.layers")  # the plan files give back the searched genome
    assert levels_module.plan_yaml(units, genome, "model.layers") == (whole / "plan.yaml").read_text()
    assert genome_cost(units, genome) / sum(u.size for u in units if not u.is_block) == pytest.approx(report["cost_per_weight"])

    # without dropping, prune --overrides builds exactly the masks the search scored
    plain = tmp_path / "plain"
    assert run_cli(*search_args(tiny_setup, plain, "--target-sparsity", "0.5")).returncode == 0
    pruned = tmp_path / "pruned"
    result = run_cli("prune", "--model", tiny_setup[0], "--calibration", tiny_setup[1], "--method", "wanda", "--sequential", "false",
                     "--overrides", plain / "plan.yaml", "--out", pruned)
    assert result.returncode == 0, result.stderr
    from pipelines.models import load_model

    served, database = dict(load_model(str(pruned)).model.named_modules()), levels_module.LevelDatabase(tiny_setup[2])
    base = dict(load_model(str(tiny_setup[0])).model.named_modules())
    for name, sparsity in list(yaml.safe_load((plain / "plan.yaml").read_text()).items())[:6]:
        name = name.replace("\\", "")
        assert torch.equal(served[name].weight.float(), database.weight(f"sparsity{sparsity:g}", name, base[name].weight.data))

    # interrupted after two generations, then run again: it resumes and ends in the same plan
    original = levels_module.evolve

    def interrupted(*args, on_generation, **kwargs):
        def stop_after_two(state):
            on_generation(state)
            if state.generation == 2:
                raise KeyboardInterrupt
        return original(*args, on_generation=stop_after_two, **kwargs)

    monkeypatch.setattr(levels_module, "evolve", interrupted)
    model, calibration, levels = tiny_setup
    config = levels_module.SearchConfig(target_sparsity=0.5, drop=True, generations=4, offspring=4, selection="1:2,2:1", seq_len=16)
    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        levels_module.search(str(model), levels, calibration, out, config)
    assert not out.exists() and (tmp_path / ".resumed.resume" / "state.json").is_file()
    monkeypatch.setattr(levels_module, "evolve", original)
    levels_module.search(str(model), levels, calibration, out, config)
    assert (out / "plan.yaml").read_bytes() == (whole / "plan.yaml").read_bytes()
    assert json.loads((out / "search.json").read_text())["evaluations"] == report["evaluations"]
    assert not leftovers(out)

    # saved progress a crash left cut short (renamed into place, never synced) is discarded
    # with a warning: the search starts over and ends in the same plan
    out = tmp_path / "damaged"
    monkeypatch.setattr(levels_module, "evolve", interrupted)
    with pytest.raises(KeyboardInterrupt):
        levels_module.search(str(model), levels, calibration, out, config)
    monkeypatch.setattr(levels_module, "evolve", original)
    state = tmp_path / ".damaged.resume" / "state.json"
    state.write_text(state.read_text()[:100])
    capsys.readouterr()
    levels_module.search(str(model), levels, calibration, out, config)
    assert f"warning: saved progress {state} is damaged" in capsys.readouterr().err
    assert (out / "plan.yaml").read_bytes() == (whole / "plan.yaml").read_bytes()


def test_a_plan_worse_than_its_start_on_held_aside_windows_is_not_written(tmp_path, tiny_setup, monkeypatch):
    """A child replaces its parent when it wins on the fitness windows, a few hundred tokens that
    a search can fit (on SmolLM2 the pipeline's plan from the uniform start beat it there and lost
    on held-out text). Here evolution is made to end on the cheapest plan, every linear at 2 bits:
    within the budget, and worse than the uniform start on the held-aside windows, so the start
    is written, with a warning; --validation-windows 0 writes what the search found."""
    import json

    import pipelines.levels as levels_module
    from compressors.search import cheapest_genome

    original = levels_module.evolve

    def ends_on_the_cheapest(units, *args, **kwargs):
        state = original(units, *args, **kwargs)
        state.parent = cheapest_genome(units)
        return state

    monkeypatch.setattr(levels_module, "evolve", ends_on_the_cheapest)
    units = levels_module.LevelDatabase(tiny_setup[2]).units("bits", drop=False)
    uniform = uniform_genome(units, 3.5 * sum(u.size for u in units if not u.is_block))
    guarded, unguarded = tmp_path / "guarded", tmp_path / "unguarded"
    result = refuse_in_process(*search_args(tiny_setup, guarded, "--budget-bits", "3.5"))
    assert result.returncode == 0, result.stderr
    report = json.loads((guarded / "search.json").read_text())
    check = report["validation"]
    assert check["kept"] == "start" and check["searched"] > check["start"] and check["seq_len"] > 16  # whole windows, not the fitness's 16 tokens
    assert f"warning: on {check['windows']} held-aside calibration windows" in result.stderr and "wrote the start's plan" in result.stderr
    assert levels_module.read_plan(units, guarded, "model.layers") == uniform
    assert report["cost_per_weight"] == pytest.approx(genome_cost(units, uniform) / sum(u.size for u in units if not u.is_block))

    result = refuse_in_process(*search_args(tiny_setup, unguarded, "--budget-bits", "3.5", "--validation-windows", "0"))
    assert result.returncode == 0 and "held-aside" not in result.stdout + result.stderr
    assert "validation" not in json.loads((unguarded / "search.json").read_text())
    assert levels_module.read_plan(units, unguarded, "model.layers") == cheapest_genome(units)


def test_levels_settings_that_do_not_apply_are_refused():
    """--act-order and --clip-search are GPTQ's: on by default for it, refused for RTN, which
    would silently ignore them."""
    config = LevelsConfig(method="gptq")
    config.validate()
    assert config.act_order and config.clip_search
    config = LevelsConfig(method="rtn")
    config.validate()
    assert not config.act_order and not config.clip_search
    with pytest.raises(LmpressError, match="--act-order orders GPTQ's columns: use it with --method gptq"):
        LevelsConfig(method="rtn", act_order=True).validate()
    with pytest.raises(LmpressError, match="--clip-search clips the grids GPTQ and SparseGPT fit"):
        LevelsConfig(method="rtn", clip_search=True).validate()


def test_version_2_databases_are_read_unless_their_2_4_levels_changed(tmp_path, tiny_setup):
    """Version 3 clip-searches the 2:4 levels too; a version 2 database whose dense levels were
    clipped has min-max 2:4 ones that a plan could no longer assemble, so it is refused."""
    import json
    import shutil

    from pipelines.levels import LevelDatabase

    old = tmp_path / "old"
    shutil.copytree(tiny_setup[2], old)
    manifest = json.loads((old / "manifest.json").read_text())
    assert manifest["params"]["sparse24"] and manifest["params"]["clip_search"]
    (old / "manifest.json").write_text(json.dumps({**manifest, "version": 2}))
    with pytest.raises(LmpressError, match="is not an lmpress level database of version 3; rebuild it with `lmpress levels`"):
        LevelDatabase(old)
    (old / "manifest.json").write_text(json.dumps({**manifest, "version": 2, "params": {**manifest["params"], "sparse24": False}}))
    assert LevelDatabase(old).config.clip_search


def test_search_bad_input_fails_cleanly(tmp_path, tiny_setup, real_model_folder):
    from conftest import save_tiny, tiny_config

    model, calibration, levels = tiny_setup
    out = tmp_path / "plan"
    result = refuse_in_process(*search_args(tiny_setup, out, "--budget-bits", "1.5"))
    assert result.returncode != 0 and "no assignment" in result.stderr and "Traceback" not in result.stderr
    result = refuse_in_process(*search_args(tiny_setup, out, "--budget-bits", "9"))  # above the 8-bit level's 8.5: every linear fits at 8 bits
    assert result.returncode == 2 and "leaves nothing to search: every unit at its least compressed level costs 8.5 per weight" in result.stderr
    result = refuse_in_process(*search_args(tiny_setup, out, "--budget-bits", "3", "--target-sparsity", "0.5"))
    assert result.returncode != 0 and "exactly one budget" in result.stderr
    result = refuse_in_process(*search_args(tiny_setup, out, "--budget-bits", "3", "--validation-windows", "-1"))
    assert result.returncode == 2 and "--validation-windows must be 0 (no check) or more (got -1)" in result.stderr
    result = refuse_in_process(*search_args(tiny_setup, out, "--budget-bits", "3", "--selection", "1:4,1000:1"))
    assert result.returncode == 2 and "the selection needs 1000" in result.stderr
    config = tiny_config("llama")
    config.num_hidden_layers = 2  # another model: its own weights
    other = save_tiny(tmp_path / "other", config, real_model_folder, tmp_path / "other-calib")
    result = refuse_in_process("search", "--model", other, "--levels", levels, "--calibration", tmp_path / "other-calib", "--budget-bits", "3", "--out", out)
    assert result.returncode != 0 and "was built for" in result.stderr and "Traceback" not in result.stderr
    assert not out.exists() and not leftovers(out)

    # an output that would replace the level database the search reads (it did: exit 0, database gone),
    # or a folder inside it
    before = sorted(p.name for p in Path(levels).iterdir())
    for target in (levels, Path(levels) / "plan"):
        result = refuse_in_process("search", "--model", model, "--levels", levels, "--calibration", calibration, "--budget-bits", "3", "--out", target)
        assert result.returncode == 2 and f"would replace the input {levels}" in result.stderr, result.stderr
    assert sorted(p.name for p in Path(levels).iterdir()) == before
    # a level database or latency table of the wrong shape: one line, not a KeyError
    import json
    import shutil

    for name, manifest in (("list", [1, 2]), ("no-units", {k: v for k, v in json.loads((Path(levels) / "manifest.json").read_text()).items() if k != "units"})):
        damaged = tmp_path / f"levels-{name}"
        shutil.copytree(levels, damaged, ignore=shutil.ignore_patterns("*.safetensors"))
        (damaged / "manifest.json").write_text(json.dumps(manifest))
        result = refuse_in_process("search", "--model", model, "--levels", damaged, "--calibration", calibration, "--budget-bits", "3", "--out", out)
        assert result.returncode == 2 and "rebuild it with `lmpress levels`" in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    table = tmp_path / "latency.json"
    table.write_text(json.dumps({"format": "lmpress-latency", "version": 1}))
    result = refuse_in_process(*search_args(tiny_setup, out, "--budget-latency", "0.8", "--latency", table))
    assert result.returncode == 2 and f"{table} lacks base" in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not out.exists() and not leftovers(out)


def test_joint_plan_with_dropped_blocks_assembles_through_the_stages(tmp_path, tiny_setup):
    """A plan that drops a block: drop-layers --layers, then quantize --overrides on the
    shallower model (renumbered names, statistics of the base's layers) gives the database's
    weights for every kept linear."""
    import json

    import pipelines.levels as levels_module
    from pipelines.models import load_model

    model, calibration, levels = tiny_setup
    database = levels_module.LevelDatabase(levels)
    units = database.units("bits", drop=True)
    genome = [int(unit.block == 1) if unit.is_block else 1 for unit in units]  # every linear at 4 bits, block 1 dropped
    genome[-5 - 4] = 0  # one linear of the last block at 8 bits
    plan = tmp_path / "plan"
    plan.mkdir()
    (plan / "plan.yaml").write_text(levels_module.plan_yaml(units, genome, "model.layers"))
    (plan / "search.json").write_text(json.dumps({"dropped_blocks": [1]}))
    assert levels_module.read_plan(units, plan, "model.layers")[:14] == genome[:7] + [len(units[7].levels) - 1] * 7

    shallow, quantized = tmp_path / "shallow", tmp_path / "quantized"
    drop_layers(str(model), None, shallow, DropLayersConfig(layers="1"))
    result = run_cli("quantize", "--model", shallow, "--calibration", calibration, "--method", "gptq", "--sequential", "false",
                     "--group-size", "32", "--overrides", plan / "plan.yaml", "--out", quantized)
    assert result.returncode == 0, result.stderr
    served = dict(load_model(str(quantized)).model.named_modules())
    for unit, level in zip(units, genome):
        if unit.is_block or unit.block == 1:
            continue
        block = unit.block if unit.block < 1 else unit.block - 1
        name = unit.name.replace(f"layers.{unit.block}.", f"layers.{block}.")
        assert torch.equal(served[name].weight.float(), database.weight(unit.levels[level], unit.name, None)), unit.name


def test_joint_bits_and_24_plan_assembles_through_prune(tmp_path, tiny_setup):
    """Bits, group size and 2:4 on/off in one genome, priced in stored bits: the search keeps
    the budget, and `prune --method sparsegpt --overrides` builds the database's weights for
    2:4 linears (SparseGPT with the grid) and dense ones (GPTQ) alike, served compressed."""
    import json

    import pipelines.levels as levels_module
    from pipelines.models import load_model

    model, calibration, levels = tiny_setup
    searched = tmp_path / "searched"
    result = run_cli(*search_args(tiny_setup, searched, "--budget-bits", "3.0", "--sparse24", "true"))
    assert result.returncode == 0, result.stderr
    shown = refuse_in_process("info", searched)  # a search's folder has a lineage but no config.json (info refused it as no model)
    assert shown.returncode == 0 and "lineage" in shown.stdout and "search" in shown.stdout, shown.stderr
    report = json.loads((searched / "search.json").read_text())
    assert report["cost_per_weight"] <= 3.0 and "lmpress prune --method sparsegpt" in report["assemble"]
    assert {"bits4g32s24", "bits2g32"} <= set(report["levels"])

    database = levels_module.LevelDatabase(levels)
    units = database.units("bits", drop=False, sparse24=True)
    assert units[0].levels[:3] == ("bits8g32", "bits8g32s24", "bits4g32") and units[0].costs[:3] == (8.5, 5.5, 4.5)
    genome = [u.levels.index("bits4g32s24" if i % 2 else "bits4g32") for i, u in enumerate(units)]  # 2:4 on every other linear
    plan = tmp_path / "plan.yaml"
    plan.write_text(levels_module.plan_yaml(units, genome, "model.layers"))
    pruned = tmp_path / "pruned"
    result = run_cli("prune", "--model", model, "--calibration", calibration, "--method", "sparsegpt", "--bits", "4", "--group-size", "32",
                     "--sequential", "false", "--overrides", plan, "--out", pruned)
    assert result.returncode == 0, result.stderr
    served = dict(load_model(str(pruned)).model.named_modules())
    for unit, level in list(zip(units, genome))[:4]:
        assert torch.equal(served[unit.name].weight.float(), database.weight(unit.levels[level], unit.name, None)), unit.name
    modules = json.loads((pruned / "compressed" / "config.json").read_text())["quantization_config"]["modules"]
    assert [modules[u.name]["sparse24"] for u in units[:4]] == [False, True, False, True]


def test_greedy_steps_over_levels_of_equal_cost():
    """4-bit 2:4 and 3-bit dense both store 3.25 bits: the score-based allocation must be able
    to reach the dense 3-bit level (and below) from either, not stop at the first of a tie."""
    levels, costs = ("b4", "b4s24", "b3", "b3s24", "b2"), (4.25, 3.25, 3.25, 2.75, 2.25)
    units = [Unit(f"u{i}", 100, levels, costs, i) for i in range(4)]
    error = {"b4": 0.0, "b4s24": 5.0, "b3": 1.0, "b3s24": 6.0, "b2": 4.0}
    genome = greedy_genome(units, 3.25 * 400, lambda i, level: error[levels[level]])
    assert [levels[level] for level in genome] == ["b3"] * 4
    genome = greedy_genome(units, 2.75 * 400, lambda i, level: error[levels[level]])
    assert sorted(levels[level] for level in genome) == ["b2", "b2", "b3", "b3"]


def test_latency_table_and_a_search_under_a_latency_budget(tmp_path, tiny_setup):
    """`lmpress latency` times every linear shape at every level as lmpress serves it here (the
    CPU: in bf16 torch's int4 kernel for plain 4-bit levels and a cached dense copy for the rest,
    one measurement a path; in fp32 a dense copy for every level, so every level costs the same)
    and a decode step's other parts; `search --budget-latency` keeps the predicted step within
    the budget, which here only dropping blocks can buy; bad input fails in one line."""
    import json

    from pipelines.levels import parse_quantized_level

    model, calibration, levels = tiny_setup
    table_file = tmp_path / "latency.json"
    result = run_cli("latency", "--model", model, "--levels", levels, "--context", "32", "--repeats", "5", "--dtype", "bfloat16", "--out", table_file)
    assert result.returncode == 0, result.stderr
    table = json.loads(table_file.read_text())
    assert table["device"] == "cpu" and table["dtype"] == "bfloat16" and set(table["linears"]) == {"64x64", "32x64", "96x64", "64x96"}
    int4 = {level for level in table["levels"] if level.startswith("bits") and parse_quantized_level(level)[::2] == (4, False)}  # 4-bit, not 2:4
    assert int4 and len(int4) < len([level for level in table["levels"] if level.startswith("bits")])
    for shape, times in table["linears"].items():
        paths = table["paths"][shape]
        assert set(times) == set(paths) == {"dense", *table["levels"]}
        assert all(len({times[level] for level in paths if paths[level] == path}) == 1 for path in set(paths.values()))  # one measurement a path
        assert {times[f"sparsity{s}"] for s in (0.3, 0.6)} == {times["dense"]}
        assert {paths[level] for level in int4} == {"torch's CPU int4 kernel (groups of 32)"}
        assert set(paths.values()) == {"dense", "PackedLinear's dense copy", "torch's CPU int4 kernel (groups of 32)"}
    assert table["step_s"] > table["outside_s"] > 0 and table["block_rest_s"] >= 0 and table["check"]["blocks_kept"] == 2
    # a machine with the architecture but not the weights (a GPU box): config.json alone, stamped with the database's base
    bare = tmp_path / "config-only"
    bare.mkdir()
    (bare / "config.json").write_text((model / "config.json").read_text())
    result = run_cli("latency", "--model", bare, "--levels", levels, "--context", "32", "--repeats", "2", "--random-weights", "--no-cuda-graphs",
                     "--dtype", "float32", "--out", tmp_path / "bare.json")
    assert result.returncode == 0, result.stderr
    bare_table = json.loads((tmp_path / "bare.json").read_text())
    assert bare_table["base"] == table["base"] and table["params"]["cuda_graphs"] and not bare_table["params"]["cuda_graphs"]  # how it was timed
    assert bare_table["dtype"] == "float32" and all(set(paths.values()) == {"dense", "PackedLinear's dense copy"} for paths in bare_table["paths"].values())

    searched = tmp_path / "searched"
    result = run_cli(*search_args(tiny_setup, searched, "--budget-latency", "0.95", "--latency", table_file, "--drop", "true", "--start", "sensitivity"))
    assert result.returncode == 0, result.stderr
    report = json.loads((searched / "search.json").read_text())
    assert report["budget"] == "latency" and report["kind"] == "bits" and report["dropped_blocks"]
    assert report["latency"]["searched_step_ms"] <= report["latency"]["budget_step_ms"] * (1 + 1e-9)
    assert "predicted decode step on cpu" in result.stdout

    for extra, message in [
        (("--budget-latency", "0.95", "--latency", table_file), "let the search drop blocks (--drop true)"),
        (("--budget-latency", "0.95"), "--budget-latency needs --latency"),
        (("--budget-latency", "0.95", "--latency", tmp_path / "none.json", "--drop", "true"), "does not exist; measure it with `lmpress latency`"),
        (("--budget-latency", "0.95", "--latency", bare, "--drop", "true"), "is a folder, not a file; measure it with `lmpress latency`"),
    ]:
        result = refuse_in_process(*search_args(tiny_setup, tmp_path / "refused", *extra))
        assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, result.stderr
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**table, "base": {**table["base"], "weights_sha256": "0" * 64, "model": "another"}}))
    result = refuse_in_process(*search_args(tiny_setup, tmp_path / "refused", "--budget-latency", "0.95", "--latency", other, "--drop", "true"))
    assert result.returncode == 2 and "was measured on another, not this model" in result.stderr
    result = refuse_in_process("latency", "--model", model, "--levels", table_file, "--out", tmp_path / "long.json")
    assert result.returncode == 2 and "is a file, not a folder; build it with `lmpress levels`" in result.stderr
    result = refuse_in_process("latency", "--model", model, "--levels", levels, "--context", "500", "--out", tmp_path / "long.json")
    assert result.returncode == 2 and "--context 500 leaves no room" in result.stderr
    result = refuse_in_process("latency", "--model", model, "--levels", levels, "--dtype", "int8", "--out", tmp_path / "long.json")
    assert result.returncode == 2 and "--dtype must be auto, float32, bfloat16 or float16 (got 'int8')" in result.stderr
    (bare / "config.json").write_text((bare / "config.json").read_text().replace('"hidden_size": 64', '"hidden_size": 128'))
    result = refuse_in_process("latency", "--model", bare, "--levels", levels, "--random-weights", "--out", tmp_path / "long.json")
    assert result.returncode == 2 and "is not the architecture level database" in result.stderr
    assert not (tmp_path / "refused").exists() and not (tmp_path / "long.json").exists()
