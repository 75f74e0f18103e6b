"""Pruning: masks and their patterns, Wanda / SparseGPT against magnitude on the calibration
objective, refinement that never raises it, and the prune stage's two outputs."""

import json

import pytest
import torch

from compressors.grid import GridSpec
from compressors.sparsegpt import sparsegpt_prune
from compressors.sparsity import keep_mask, magnitude_score, parse_pattern, reconstruction_error, refine_mask, wanda_score
from conftest import leftovers, refuse_in_process, run_cli
from pipelines.errors import LmpressError


def layer_problem(rows=48, columns=128, seed=0):
    """A weight and the second moment of correlated inputs whose channels differ in scale (as
    LLM activations do: a few large channels), so input-aware pruning has something to use."""
    g = torch.Generator().manual_seed(seed)
    mixing = torch.randn(columns, columns, generator=g) / columns**0.5 + torch.eye(columns)
    x = torch.randn(4096, columns, generator=g) @ mixing * (torch.rand(columns, generator=g) * 3 + 0.1) ** 2
    return torch.randn(rows, columns, generator=g), x.T @ x / x.shape[0]


PATTERNS = ["0.5", "2:4", "4:8", "0.7"]


@pytest.mark.parametrize("text", PATTERNS)
def test_masks_hold_their_pattern(text):
    pattern = parse_pattern(text)
    weight, sigma = layer_problem()
    for keep in (keep_mask(magnitude_score(weight), pattern), sparsegpt_prune(weight, sigma, pattern).keep):
        if pattern.structured:
            assert (keep.reshape(48, -1, pattern.m).sum(dim=2) == pattern.n).all()
        else:
            assert abs((~keep).float().mean().item() - pattern.sparsity) < 0.01
    assert (keep_mask(magnitude_score(weight), pattern).sum(dim=1) == keep_mask(magnitude_score(weight), pattern).sum(dim=1)[0]).all()


@pytest.mark.parametrize("text", ["0.5", "2:4"])
def test_wanda_and_sparsegpt_beat_magnitude_and_refinement_never_hurts(text):
    pattern = parse_pattern(text)
    weight, sigma = layer_problem()
    objective = lambda pruned: reconstruction_error(weight, pruned, sigma).sum().item()  # noqa: E731
    magnitude = keep_mask(magnitude_score(weight), pattern)
    wanda = keep_mask(wanda_score(weight, sigma), pattern)
    sparsegpt = sparsegpt_prune(weight, sigma, pattern)
    assert objective(weight * wanda) < 0.8 * objective(weight * magnitude)
    assert objective(sparsegpt.weight) < objective(weight * wanda)
    for pruned, keep in ((weight * magnitude, magnitude), (weight * wanda, wanda), (sparsegpt.weight, sparsegpt.keep)):
        refined, refined_keep = refine_mask(weight, pruned, keep, sigma, pattern)
        assert objective(refined) <= objective(pruned) * (1 + 1e-6)
        assert torch.equal(refined_keep.sum(dim=1), keep.sum(dim=1))  # sparsity per row unchanged
        if pattern.structured:
            assert (refined_keep.reshape(48, -1, 4).sum(dim=2) == 2).all()
        assert (refined[~refined_keep] == 0).all()  # pruned weights are exact zeros
    refined, _ = refine_mask(weight, weight * magnitude, magnitude, sigma, pattern)
    assert objective(refined) < 0.9 * objective(weight * magnitude)  # it does find better masks


def test_sparsegpt_joint_quantization_and_fixed_mask():
    weight, sigma = layer_problem()
    grid = GridSpec(4, 32)
    joint = sparsegpt_prune(weight, sigma, parse_pattern("2:4"), grid=grid)
    assert (joint.weight[~joint.keep] == 0).all()
    torch.testing.assert_close(joint.weight, joint.quantized.dequantized() * joint.keep)
    assert joint.quantized.codes.min() >= -8 and joint.quantized.codes.max() <= 7
    fixed = sparsegpt_prune(weight, sigma, None, keep=joint.keep, grid=grid)  # GPTQ on an already-pruned weight
    assert torch.equal(fixed.keep, joint.keep) and (fixed.weight[~joint.keep] == 0).all()


@pytest.mark.parametrize("text", ["2:4", "0.5"])
def test_clip_search_lowers_sparsegpts_joint_error_and_keeps_the_mask(text):
    """Joint pruning + quantization with each group's grid clip-searched over the weights it
    keeps: less calibration objective than min-max grids at 2 and 3 bits, for a mask chosen
    in the sweep and for a fixed one, and the mask still holds its pattern."""
    pattern = parse_pattern(text)
    weight, sigma = layer_problem(seed=1)
    objective = lambda pruned: reconstruction_error(weight, pruned.weight, sigma).sum().item()  # noqa: E731
    for bits, most in ((2, 0.6), (3, 0.9)):
        grid = GridSpec(bits, 32)
        min_max = sparsegpt_prune(weight, sigma, pattern, grid=grid)
        clipped = sparsegpt_prune(weight, sigma, pattern, grid=grid, clip_search=True)
        assert objective(clipped) < most * objective(min_max)
        assert (clipped.weight[~clipped.keep] == 0).all()
        torch.testing.assert_close(clipped.weight, clipped.quantized.dequantized() * clipped.keep)
        if pattern.structured:
            assert (clipped.keep.reshape(48, -1, 4).sum(dim=2) == 2).all()
        fixed = sparsegpt_prune(weight, sigma, None, keep=min_max.keep, grid=grid, clip_search=True)
        assert torch.equal(fixed.keep, min_max.keep)
        assert objective(fixed) < most * objective(sparsegpt_prune(weight, sigma, None, keep=min_max.keep, grid=grid))


def test_clip_search_needs_groups_of_whole_n_m_chunks():
    weight, sigma = layer_problem(columns=96)
    with pytest.raises(LmpressError, match="the clip search fits each group's grid to its 3:6 mask: use a group size that is a multiple of 6"):
        sparsegpt_prune(weight, sigma, parse_pattern("3:6"), grid=GridSpec(4, 32), clip_search=True)
    assert sparsegpt_prune(weight, sigma, parse_pattern("3:6"), grid=GridSpec(4, -1), clip_search=True).quantized is not None


@pytest.mark.parametrize("text,message", [
    ("1.0", "sparsity must be in [0, 1)"), ("-0.1", "sparsity must be in [0, 1)"), ("4:4", "N must be at least 1 and below M"),
    ("5:4", "N must be at least 1 and below M"), ("2-4", "a ratio like 0.5 or a pattern like 2:4"), ("2:x", "must look like N:M"),
])
def test_bad_patterns_are_refused(text, message):
    with pytest.raises(LmpressError, match=message.replace("[", r"\[").replace(")", r"\)")):
        parse_pattern(text)


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory, real_model_folder):
    """A tiny Llama folder and its calibration artifact, shared by this module's stage tests."""
    from conftest import save_tiny, tiny_config

    root = tmp_path_factory.mktemp("prune")
    return save_tiny(root / "tiny", tiny_config("llama"), real_model_folder, root / "calib"), root / "calib"


@pytest.fixture
def tiny_folder(tiny_setup):
    return tiny_setup[0]


@pytest.fixture
def tiny_calibration(tiny_setup):
    return tiny_setup[1]


def test_prune_stage_writes_dense_and_compressed_forms(tmp_path, tiny_folder, tiny_calibration):
    """Wanda 2:4, layer-sequential, refined: the dense-with-zeros model opens in stock
    transformers with at most 2 nonzeros in every group of 4; the compressed 2:4 form, served
    from a dense copy, gives its logits to fp16 tolerance; refinement lowered the objective."""
    from transformers import AutoModelForCausalLM

    from compressors.kernels import PackedLinear
    from pipelines.publish import model_card, read_facts
    from pipelines.serving import load_for_serving

    out = tmp_path / "pruned"
    result = run_cli("prune", "--model", tiny_folder, "--calibration", tiny_calibration, "--method", "wanda", "--pattern", "2:4",
                     "--refine", "--skip", "layers\\.3\\.mlp\\.down_proj", "--out", out)
    assert result.returncode == 0, result.stderr
    dense = AutoModelForCausalLM.from_pretrained(out).eval()  # stock transformers, no lmpress code
    for name, module in dense.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in name:
            groups = (module.weight.reshape(module.weight.shape[0], -1, 4) != 0).sum(dim=2)
            assert (groups <= 2).all() or name == "model.layers.3.mlp.down_proj", name
    report = json.loads((out / "pruning.json").read_text())
    assert report["sparsity"] == 0.5 and report["refined_objective"] <= report["objective"]
    assert "model.layers.3.mlp.down_proj" not in report["linears"]

    served = load_for_serving(str(out / "compressed")).model
    assert isinstance(served.model.layers[0].self_attn.q_proj, PackedLinear)
    assert not isinstance(served.model.layers[3].mlp.down_proj, PackedLinear)
    ids = torch.randint(0, 49152, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = dense(ids).logits
        torch.testing.assert_close(served(ids).logits, expected, rtol=2e-3, atol=2e-3 * expected.abs().max().item())
    validation = json.loads((out / "compressed" / "validation.json").read_text())  # no kernel serves fp16 2:4: it says so
    assert validation["passed"] and validation["gpu_validated"] is False and validation["max_rel_error"] is None
    assert validation["checked"].startswith("no kernel") and validation["kernels"] == {}
    assert validation["layers"] and all(e["kernel"] is None and "2:4 fp16" in e["note"] for e in validation["layers"].values())
    assert json.loads((out / "lineage.json").read_text())["chain"][-1]["stage"] == "prune"
    card = model_card(read_facts(out / "compressed"), "tester/tiny-24")  # the card claims no kernel check that never ran
    kernels = card.split("## Kernels", 1)[1].split("\n## ", 1)[0]
    assert "no kernel serves" in kernels and "no speed claim" in kernels and "ran each kernel" not in kernels and "| kernel |" not in kernels
    dense = model_card(read_facts(out), "tester/tiny-24").split("## Kernels", 1)[1].split("\n## ", 1)[0]  # points to the packed form
    assert "`compressed/` holds" in dense and "no kernel serves" in dense and "No packed weights" not in dense


def test_prune_sparsegpt_with_int4_serves_the_quantized_24_form(tmp_path, tiny_folder, tiny_calibration):
    from pipelines.models import load_model
    from pipelines.serving import load_for_serving, packed_weights

    out = tmp_path / "pruned"
    result = run_cli("prune", "--model", tiny_folder, "--calibration", tiny_calibration, "--method", "sparsegpt", "--pattern", "2:4",
                     "--bits", "4", "--group-size", "32", "--sequential", "false", "--out", out)
    assert result.returncode == 0, result.stderr
    weights = packed_weights(out / "compressed")
    assert all(w.bitmask is not None and w.bits == 4 for w in weights.values())
    ids = torch.randint(0, 49152, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(load_for_serving(str(out / "compressed")).model(ids).logits, load_model(str(out)).model(ids).logits)
    validation = json.loads((out / "compressed" / "validation.json").read_text())  # the kernel serves 2:4 int4
    assert validation["passed"] and validation["max_rel_error"] < 1e-5
    assert validation["layers"] and all(e["kernel"] == "triton-packed-matmul" for e in validation["layers"].values())


def test_prune_bad_input_fails_cleanly(tmp_path, tiny_folder, tiny_calibration, real_model_folder):
    from pipelines.stages import PruneConfig, prune

    out = tmp_path / "pruned"
    cases = [
        (dict(pattern="1.0"), "sparsity must be in [0, 1)"),
        (dict(pattern="4:4"), "N must be at least 1 and below M"),
        (dict(pattern="3:7"), "needs input widths divisible by 7; model.layers.0.self_attn.q_proj is 64 wide"),
        (dict(method="sparsegpt", bits=4, refine_cycles=50), "prune with --refine, then quantize"),
        (dict(method="wanda", bits=4), "only sparsegpt quantizes while pruning"),
        (dict(method="wanda", clip_search=True), "--clip-search clips the grids GPTQ and SparseGPT fit: use it with --method sparsegpt"),
        (dict(method="obs"), "unknown pruning method 'obs'"),
    ]
    for settings, message in cases:
        with pytest.raises(LmpressError, match=message.replace("[", r"\[").replace(")", r"\)")):
            prune(str(tiny_folder), tiny_calibration, out, PruneConfig(**settings))
        assert not out.exists() and not leftovers(out)
    with pytest.raises(LmpressError, match="needs --calibration"):
        prune(str(tiny_folder), None, out, PruneConfig(method="wanda"))
    with pytest.raises(LmpressError, match="made for another base model"):
        prune(str(real_model_folder), tiny_calibration, out, PruneConfig(method="magnitude"))
    assert not out.exists() and not leftovers(out)
    # the command line: one line on stderr, exit 2, no traceback
    for extra, message in ((["--sparsity", "0.5", "--pattern", "2:4"], "not both"), (["--sparsity", "1.5"], "sparsity must be in [0, 1)")):
        result = refuse_in_process("prune", "--model", tiny_folder, "--calibration", tiny_calibration, "--out", out, *extra)
        assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert not out.exists() and not leftovers(out)


def test_quantizing_a_24_model_keeps_it_24(tmp_path, tiny_folder, tiny_calibration):
    """2:4 + int4 from the quantization stage: GPTQ on a 2:4 parent leaves the pruned weights
    at zero and the artifact stores only the kept half, served by the 2:4 kernel path."""
    from compressors.packed_int import dequantize_reference, unpack_bitmask
    from pipelines.serving import packed_weights
    from pipelines.stages import PruneConfig, QuantizeConfig, prune, quantize
    from safetensors.torch import load_file

    pruned = prune(str(tiny_folder), tiny_calibration, tmp_path / "pruned", PruneConfig(method="wanda", sequential=False))
    out = quantize(str(pruned), tiny_calibration, tmp_path / "q", QuantizeConfig(method="gptq", group_size=32, sequential=False))
    parent = load_file(pruned / "model.safetensors")
    weights = packed_weights(out)
    assert len(weights) == 4 * 7 and all(w.bitmask is not None and w.bits == 4 for w in weights.values())
    for name, weight in weights.items():
        kept = unpack_bitmask(weight.bitmask, weight.columns)
        assert torch.equal(kept, parent[f"{name}.weight"] != 0)  # the parent's mask, exactly
        assert (dequantize_reference(weight)[~kept] == 0).all()
    with pytest.raises(LmpressError, match="codebooks do not keep pruned weights at zero"):
        quantize(str(pruned), tiny_calibration, tmp_path / "sq", QuantizeConfig(method="squeezellm", sequential=False))


def test_per_layer_map_sets_each_linears_pattern(tmp_path, tiny_folder, tiny_calibration):
    from pipelines.stages import PruneConfig, prune

    plan = tmp_path / "plan.yaml"
    plan.write_text('".*mlp\\\\.down_proj": "4:8"\n".*layers\\\\.0\\\\.self_attn.*": 0.25\n')
    out = prune(str(tiny_folder), tiny_calibration, tmp_path / "p", PruneConfig(method="magnitude", overrides=str(plan), sequential=False))
    linears = json.loads((out / "pruning.json").read_text())["linears"]
    assert linears["model.layers.1.mlp.down_proj"]["pattern"] == "4:8"
    assert linears["model.layers.0.self_attn.q_proj"]["pattern"] == "0.25"
    assert linears["model.layers.0.self_attn.q_proj"]["zeros"] == 64 * 16  # a quarter of each 64-wide row
    assert linears["model.layers.1.self_attn.q_proj"]["pattern"] == "2:4"
    assert "objective" in linears["model.layers.1.self_attn.q_proj"]  # stored statistics at hand: magnitude reports it too


def test_pruning_is_byte_identical_when_repeated(tmp_path, tiny_folder, tiny_calibration):
    from pipelines.stages import PruneConfig, prune

    config = PruneConfig(method="sparsegpt", pattern="2:4", sequential=True)
    first, second = (prune(str(tiny_folder), tiny_calibration, tmp_path / name, config) for name in ("a", "b"))
    for file in ("model.safetensors", "pruning.json", "compressed/model.safetensors", "compressed/config.json"):
        assert (first / file).read_bytes() == (second / file).read_bytes(), file
