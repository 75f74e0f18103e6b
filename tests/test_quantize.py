import json

import pytest
import torch
from safetensors.torch import load_file

from compressors.gptq import gptq_quantize, gptq_quantize_together
from compressors.grid import GridSpec, round_to_nearest
from compressors.packed_int import unpack_int32
from conftest import leftovers, refuse_in_process, run_cli
from pipelines.errors import LmpressError


def _problem(seed=0, rows=48, columns=128):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1024, columns, generator=g) @ torch.randn(columns, columns, generator=g) * 0.1
    return torch.randn(rows, columns, generator=g) * 0.05, x.T @ x / x.shape[0]


@pytest.mark.parametrize("spec", [GridSpec(2, 32), GridSpec(3, 64), GridSpec(4, 64), GridSpec(4, -1), GridSpec(8, 128), GridSpec(3, 32, False)])
def test_codes_scales_and_dequantization(spec):
    w, _ = _problem()
    q = round_to_nearest(w, spec)
    assert q.codes.dtype == torch.int8 and spec.qmin <= q.codes.min() and q.codes.max() <= spec.qmax
    assert torch.equal(q.scale, q.scale.half().float())  # stored as fp16 without loss
    groups = 1 if spec.group_size == -1 else 128 // spec.group_size
    assert q.scale.shape == (48, groups)
    error = (q.dequantized() - w).abs().max()
    assert error <= q.scale.max() * (1 if spec.symmetric else 0.51)  # within a step of the grid


@pytest.mark.parametrize("spec", [GridSpec(8, 64), GridSpec(4, 64), GridSpec(4, 64, False)])
def test_groups_of_small_weights_keep_their_grid_and_zero_groups_a_positive_scale(spec):
    """A group whose scale lies below fp16's smallest normal (6.1e-5) is stored as a subnormal,
    not raised to it (which at 8 bits and max |w| = 3e-3 used 44 of the 256 codes); an all-zero
    group gets a finite positive scale and codes of zero."""
    w = torch.randn(4, 128, generator=torch.Generator().manual_seed(0)) * 1e-4
    w[3] = 0.0
    q = round_to_nearest(w, spec)
    assert torch.equal(q.scale, q.scale.half().float()) and bool((q.scale > 0).all())
    assert float(q.scale[:3].max()) < torch.finfo(torch.float16).tiny
    step = (w[:3].abs().amax() / ((spec.qmax - spec.qmin) / 2)).item()
    assert (q.dequantized()[:3] - w[:3]).abs().max() <= step * (1 if spec.symmetric else 2)  # the old floor: up to 10x step at 8 bits
    assert torch.equal(q.dequantized()[3], w[3])


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("spec", [GridSpec(3, 32), GridSpec(4, 64), GridSpec(4, -1), GridSpec(3, 64, False)])
def test_gptq_halves_the_hessian_weighted_error_of_rtn(spec, act_order):
    w, h = _problem()
    loss = lambda q: torch.trace((w - q.dequantized()) @ h @ (w - q.dequantized()).T).item()  # noqa: E731
    assert loss(gptq_quantize(w, h, spec, act_order=act_order)) < 0.6 * loss(round_to_nearest(w, spec))


@pytest.mark.parametrize("act_order", [True, False])
@pytest.mark.parametrize("seed", range(3))
def test_clip_search_lowers_gptqs_hessian_weighted_error(seed, act_order):
    """Groups fitted with AWQ's clip search (static groups up front; without act order each as
    the sweep reaches it), then GPTQ's sweep: less output error than min-max groups, most
    where the grid is coarsest."""
    w, h = _problem(seed)
    loss = lambda q: torch.trace((w - q.dequantized()) @ h @ (w - q.dequantized()).T).item()  # noqa: E731
    for bits, most in ((2, 0.8), (3, 0.95)):
        spec = GridSpec(bits, 64)
        assert loss(gptq_quantize(w, h, spec, act_order=act_order, clip_search=True)) < most * loss(gptq_quantize(w, h, spec, act_order=act_order))


def test_hessian_shrinkage_scales_the_correlations_and_keeps_the_variances():
    from compressors.gptq import inverse_hessian_factor

    _, h = _problem()
    target = 0.75 * h + 0.25 * torch.diag(h.diagonal())
    assert torch.allclose(inverse_hessian_factor(h, 0.01, 0.25), inverse_hessian_factor(target, 0.01), rtol=1e-4, atol=1e-5)
    assert torch.equal(inverse_hessian_factor(h, 0.01, 0.0), inverse_hessian_factor(h, 0.01))
    w, diagonal = _problem()[0], torch.diag(h.diagonal())  # uncorrelated inputs: nothing to shrink
    assert torch.equal(gptq_quantize(w, diagonal, GridSpec(4, 64), shrinkage=0.5).codes, gptq_quantize(w, diagonal, GridSpec(4, 64)).codes)


@pytest.mark.parametrize("seed", range(3))
def test_hessian_shrinkage_errs_less_on_inputs_whose_correlations_changed(seed):
    """Calibration and test inputs with the same variances but other correlations between their
    features (text of another domain): GPTQ as published moves each rounding error onto the
    columns correlated with it in the calibration data, a fit that does not carry over.
    Shrinkage 0.25 gives up a few percent of the calibration objective GPTQ minimizes and errs
    over 10% less on the test inputs (13-20% in these draws)."""
    g = torch.Generator().manual_seed(seed)
    columns = 128
    variances = torch.rand(columns, generator=g) * 2 + 0.2

    def second_moment():
        mix = torch.eye(columns) + 0.5 * torch.randn(columns, columns, generator=g) / columns**0.5
        x = torch.randn(4096, columns, generator=g) @ mix
        x = x / x.std(dim=0) * variances
        return x.T @ x / x.shape[0]

    calibration, test = second_moment(), second_moment()
    w = torch.randn(48, columns, generator=g) * 0.05
    loss = lambda q, h: torch.trace((w - q.dequantized()) @ h @ (w - q.dequantized()).T).item()  # noqa: E731
    for bits in (3, 4):
        published, shrunk = (gptq_quantize(w, calibration, GridSpec(bits, 64), act_order=True, shrinkage=s) for s in (0.0, 0.25))
        assert loss(shrunk, test) < 0.9 * loss(published, test)
        assert loss(published, calibration) < loss(shrunk, calibration) < 1.1 * loss(published, calibration)


@pytest.mark.parametrize("spec,act_order,clip_search", [
    (GridSpec(3, 32), True, True), (GridSpec(4, 64), False, False), (GridSpec(4, -1), False, False), (GridSpec(3, 64, False), True, False),
])
def test_linears_sharing_a_hessian_quantize_together_exactly_as_alone(spec, act_order, clip_search):
    """q/k/v (or gate/up) stacked into one sweep: the codes, scales and zeros of each, bit for
    bit, that its own sweep gives (GPTQ treats each row on its own given the Hessian)."""
    (q, h), (k, _), (v, _) = _problem(0, 48), _problem(1, 16), _problem(2, 16)
    for alone, together in zip([gptq_quantize(w, h, spec, 0.01, act_order, clip_search=clip_search) for w in (q, k, v)],
                               gptq_quantize_together([q, k, v], h, spec, 0.01, act_order, clip_search)):
        assert together.codes.shape == alone.codes.shape
        for a, b in ((alone.codes, together.codes), (alone.scale, together.scale), (alone.zero, together.zero)):
            assert torch.equal(a, b)


def test_gptq_keeps_dead_inputs_at_zero_and_is_deterministic():
    w, h = _problem()
    h[5, :] = h[:, 5] = 0
    a, b = gptq_quantize(w, h, GridSpec(4, 64)), gptq_quantize(w, h, GridSpec(4, 64))
    assert torch.equal(a.codes, b.codes) and (a.codes[:, 5] == 0).all()


def test_spilled_weights_read_back_unchanged(tmp_path):
    """Every packed kind (symmetric, asymmetric, codebook, 2:4) survives the quantize stage's
    spill of its finished layers to disk: same tensors, same shape fields, None stays None."""
    from compressors.kernels import _self_check_weights
    from compressors.packed_int import read_spilled, spill_to_disk

    weights = {f"model.layers.0.mlp.linear{i}": w.clone() for i, w in enumerate(_self_check_weights(torch.device("cpu")))}  # no shared memory, as a stage makes them
    spill_to_disk(weights, tmp_path / "0.safetensors")
    back = read_spilled(tmp_path / "0.safetensors")
    assert list(back) == list(weights)
    for name, weight in weights.items():
        for field in ("packed", "scale", "zero", "codebook", "bitmask"):
            a, b = getattr(weight, field), getattr(back[name], field)
            assert (a is None and b is None) or torch.equal(a, b), (name, field)
        assert (back[name].bits, back[name].columns, back[name].kind) == (weight.bits, weight.columns, weight.kind)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("columns", [64, 96, 100])
def test_unpack_reads_compressed_tensors_packing(bits, columns):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    codes = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (7, columns), dtype=torch.int8)
    assert torch.equal(unpack_int32(pack_to_int32(codes, bits), bits, columns), codes)


def test_forward_dtype_auto_is_bfloat16_only_where_the_cpu_multiplies_it_natively(monkeypatch):
    """An AVX2-only CPU emulates bf16 (7.5x slower than float32 on a Zen 3), so `auto` takes
    bfloat16 only with AVX512-BF16 or AMX; the config keeps the dtype that ran, for the lineage."""
    from pipelines.stages import PruneConfig, QuantizeConfig, resolve_forward_dtype

    for avx512_bf16, amx, expected in [(True, False, "bfloat16"), (False, True, "bfloat16"), (False, False, "float32")]:
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda value=avx512_bf16: value)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda value=amx: value)
        assert resolve_forward_dtype("auto") == expected
        for config in (QuantizeConfig(method="rtn"), PruneConfig()):
            config.validate()
            assert config.forward_dtype == expected
        assert resolve_forward_dtype("float32") == "float32" and resolve_forward_dtype("bfloat16") == "bfloat16"


def test_bad_grid_settings():
    with pytest.raises(LmpressError, match="bits must be one of 2, 3, 4, 8"):
        GridSpec(5, 64)
    with pytest.raises(LmpressError, match="group size must be one of"):
        GridSpec(4, 48)
    with pytest.raises(LmpressError, match="group size 128 does not divide the input width 576 of x; use a group size that divides it \\(32, 64\\)"):
        GridSpec(4, 128).check_width(576, "x")
    with pytest.raises(LmpressError, match="does not divide the input width 1273 of x; none of 32, 64, 128 does: use -1 \\(per-channel\\)$"):
        GridSpec(4, 32).check_width(1273, "x")  # a structured-pruned width


def test_rtn_artifact_loads_in_stock_transformers_and_round_trips(tmp_path, tiny_folder):
    """The packed artifact opens with plain AutoModelForCausalLM (compressed-tensors' own
    decompression) and gives the logits of the in-memory quantized model; the packed codes
    are exactly the codes RTN chose."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "q"
    result = run_cli("quantize", "--model", tiny_folder, "--method", "rtn", "--bits", "3", "--group-size", "32", "--out", out)
    assert result.returncode == 0, result.stderr
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "pack-quantized"

    reference = AutoModelForCausalLM.from_pretrained(tiny_folder).eval()
    spec, codes = GridSpec(3, 32), {}
    for name, module in reference.named_modules():
        if name.startswith("model.layers.") and isinstance(module, torch.nn.Linear):
            q = round_to_nearest(module.weight.data, spec)
            module.weight.data, codes[name] = q.dequantized(), q.codes
    stock = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 49152, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(stock(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)

    tensors = load_file(out / "model.safetensors")
    for name, expected in codes.items():
        assert torch.equal(unpack_int32(tensors[f"{name}.weight_packed"], 3, expected.shape[1]), expected), name
    lineage = json.loads((out / "lineage.json").read_text())
    assert [r["stage"] for r in lineage["chain"]] == ["base", "quantize"]
    assert not (out / ".layers").exists()  # the finished layers' spill is gone once the artifact is written


def test_asymmetric_grid_is_compressed_tensors_with_packed_zero_points(tmp_path, tiny_folder):
    """An asymmetric grid is written as llm-compressor's W4A16_ASYM is: pack-quantized with
    int32 zero points packed down the columns. lmpress's loader and its serving loader give the
    in-memory RTN model's logits; stock transformers opens it dequantized (its compressed load
    rejects packed zero points), with the weights rounded to the scales' fp16."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    from pipelines.models import load_model
    from pipelines.serving import load_for_serving

    out = tmp_path / "asym"
    result = run_cli("quantize", "--model", tiny_folder, "--method", "rtn", "--bits", "4", "--group-size", "32", "--symmetric", "false", "--out", out)
    assert result.returncode == 0, result.stderr
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "pack-quantized"
    assert [group["weights"]["symmetric"] for group in config["config_groups"].values()] == [False]
    reference = AutoModelForCausalLM.from_pretrained(tiny_folder).eval()
    tensors, spec = load_file(out / "model.safetensors"), GridSpec(4, 32, symmetric=False)
    for name, module in reference.named_modules():
        if name.startswith("model.layers.") and isinstance(module, torch.nn.Linear):
            q = round_to_nearest(module.weight.data, spec)
            module.weight.data = q.dequantized()
            assert tensors[f"{name}.weight_zero_point"].shape == (-(-q.zero.shape[0] * 4 // 32), q.zero.shape[1])
    ids = torch.randint(0, 49152, (2, 12))
    with torch.no_grad():
        expected = reference(ids).logits
        for model in (load_model(str(out)).model, load_for_serving(str(out)).model):
            torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=1e-5)
        stock = AutoModelForCausalLM.from_pretrained(out, quantization_config=CompressedTensorsConfig(dequantize=True)).eval()(ids).logits
    assert (stock - expected).abs().max() <= 2e-3 * expected.abs().max()
    report = json.loads((out / "validation.json").read_text())
    assert report["max_rel_error"] < 1e-5 and {e["decode"] for e in report["layers"].values()} == {"asymmetric, group 32 stored values"}

    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] = True
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(LmpressError, match=r"model\.layers\.0\.\w+\.\w+ stores zero points but its config group is symmetric; restore the artifact's own config.json"):
        load_for_serving(str(out))


def test_quantize_bad_input(tmp_path, tiny_folder):
    out = tmp_path / "q"

    def error(*args):
        result = refuse_in_process("quantize", "--model", tiny_folder, "--out", out, *args)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert not out.exists() and leftovers(out) == []
        return result.stderr.strip()

    assert "bits must be one of 2, 3, 4, 8 (got 5)" in error("--method", "rtn", "--bits", "5")
    assert "group size 64 does not divide the input width 96 of model.layers.0.mlp.down_proj" in error("--method", "rtn", "--group-size", "64")
    assert "unknown method 'awq2'" in error("--method", "awq2")
    assert "forward dtype must be auto, float32 or bfloat16 (got 'float16')" in error("--forward-dtype", "float16")
    assert "hessian shrinkage must be in [0, 1] (got 1.5); 0.25 is the default, 0 the published GPTQ and SparseGPT" \
        in error("--hessian-shrinkage", "1.5")
    assert "--clip-search clips the grids GPTQ and SparseGPT fit: use it with --method gptq" in error("--method", "rtn", "--clip-search", "true")
    assert "needs --calibration" in error("--method", "gptq")
    assert "--true-sequential takes --sequential true and a method that quantizes each linear" in error("--method", "awq", "--true-sequential", "true")
    assert "nf4 on the CPU needs input widths that are multiples of 64" in error("--method", "nf4")  # down_proj is 96 wide
    # a setting the method would ignore is refused, not recorded in the lineage as if it had run
    assert "int8 quantizes to bitsandbytes' LLM.int8, 8 bits with an absmax scale per output row: leave out --bits (or pass --bits 8; got 4)" \
        in error("--method", "int8", "--bits", "4")
    assert "nf4 quantizes to bitsandbytes' NF4, 4 bits in blocks of 64 with absmax scales: leave out --group-size (or pass --group-size 64; got 32)" \
        in error("--method", "nf4", "--group-size", "32")
    assert "leave out --symmetric (or pass --symmetric true; got false)" in error("--method", "int8", "--symmetric", "false")
    assert "--act-order orders GPTQ's columns: use it with --method gptq or squeezellm-gptq, or pass --act-order false" \
        in error("--method", "awq", "--act-order", "true")
    plan = tmp_path / "plan.yaml"
    plan.write_text("layers.0.self_attn.q_proj: {bits: 5}\n")  # matches nothing whole: names start with model.
    assert "override 'layers.0.self_attn.q_proj' matches no linear of this model" in error("--method", "rtn", "--group-size", "32", "--overrides", plan)
    plan.write_text("model.layers.0.mlp.down_proj: [1, 2\n")
    assert f"{plan} is not valid YAML (line 2)" in error("--method", "rtn", "--group-size", "32", "--overrides", plan)
    assert "--skip '(' is not a valid regular expression" in error("--method", "rtn", "--group-size", "32", "--skip", "(")
    assert "--skip 'lm_hed' matches no linear of this model" in error("--method", "rtn", "--group-size", "32", "--skip", "lm_head,down_proj,lm_hed")
    for setting, message in [("bits: 4.0", "bits must be one of 2, 3, 4, 8 (got 4.0)"), ("group_size: 32.0", "(got 32.0)"),
                             ('symmetric: "false"', "symmetric must be true or false (got 'false')")]:
        plan.write_text(f"model.layers.0.mlp.down_proj: {{{setting}}}\n")
        assert message in error("--method", "rtn", "--group-size", "32", "--overrides", plan)
    plan.write_text("model.layers.0.mlp.down_proj: {bits: 3}\nmodel.layers.0.mlp.down_proj: {bits: 8}\n")
    assert "'model.layers.0.mlp.down_proj' is given twice" in error("--method", "rtn", "--group-size", "32", "--overrides", plan)
    plan.write_bytes(bytes(range(256)))
    assert "is not a text file" in error("--method", "rtn", "--group-size", "32", "--overrides", plan)
    assert f"overrides {tmp_path} is a folder, not a file" in error("--method", "rtn", "--group-size", "32", "--overrides", tmp_path)


def test_a_quantized_model_is_refused_by_every_stage(tmp_path, tiny_folder):
    """Quantizing comes last: a quantized model is not quantized again, and a stage that would
    shrink it (drop layers, merge KV heads, prune) refuses it in one line. drop-layers used to
    write the decompressed layers dense under the parent's quantization config, which no loader
    opened (compressed-tensors' KeyError: 'weight_packed' at the next load)."""
    first = run_cli("quantize", "--model", tiny_folder, "--method", "rtn", "--group-size", "32", "--out", tmp_path / "q")
    assert first.returncode == 0, first.stderr
    for command, *options in [("quantize", "--method", "rtn", "--group-size", "32"), ("drop-layers", "--n", "1", "--scorer", "last"),
                              ("kv-merge", "--kv-heads", "1", "--method", "mean"), ("prune", "--method", "magnitude", "--sparsity", "0.5")]:
        again = refuse_in_process(command, "--model", tmp_path / "q", *options, "--out", tmp_path / "qq")
        assert again.returncode == 2 and "Traceback" not in again.stderr and "is quantized already" in again.stderr, (command, again.stderr)
        assert len(again.stderr.strip().splitlines()) == 1 and not (tmp_path / "qq").exists(), command


def test_quantize_refuses_outputs_that_would_lose_an_input(tmp_path, tiny_folder):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_folder, model)
    before = {path.name: path.read_bytes() for path in model.iterdir()}
    blocker = tmp_path / "notes.txt"
    blocker.write_text("precious")
    for out, message in [
        (model, "would replace the input"), (tmp_path, "would replace the input"), (blocker / "q", "which is a file"),
        (model / "sub", "would replace the input"), (blocker.parent / "mine", "is a folder of other files than an lmpress output"),
    ]:
        if out.name == "mine":
            out.mkdir()
            (out / "notes.txt").write_text("precious")
        result = refuse_in_process("quantize", "--model", model, "--method", "rtn", "--group-size", "32", "--out", out)
        assert result.returncode == 2 and "Traceback" not in result.stderr and message in result.stderr, result.stderr
    assert {path.name: path.read_bytes() for path in model.iterdir()} == before and blocker.read_text() == "precious"
    assert (tmp_path / "mine" / "notes.txt").read_text() == "precious"


def test_calibration_from_another_model_is_refused(tmp_path, tiny_folder):
    from pipelines.stages import CalibrateConfig, calibrate

    calibration = tmp_path / "cal"
    calibrate("smollm2-135m", calibration, CalibrateConfig(samples=2, seq_len=16))
    out = tmp_path / "q"
    result = refuse_in_process("quantize", "--model", tiny_folder, "--calibration", calibration, "--group-size", "32", "--out", out)
    assert result.returncode == 2 and "was made for another base model" in result.stderr
    assert not out.exists()


def test_per_layer_overrides_and_skips_reach_the_artifact(tmp_path, tiny_folder):
    """A plan (as the search stage will hand in) gives mixed grids in one compressed-tensors
    config; skipped linears stay dense; the plan is recorded in the lineage."""
    from transformers import AutoModelForCausalLM

    plan = tmp_path / "plan.yaml"
    plan.write_text("'model\\.layers\\.0\\..*': {bits: 8}\n'.*down_proj': {bits: 2, group_size: 32}\n")
    out = tmp_path / "q"
    result = run_cli(
        "quantize", "--model", tiny_folder, "--method", "rtn", "--group-size", "32", "--overrides", plan,
        "--skip", "layers\\.3\\.mlp", "--out", out,
    )
    assert result.returncode == 0, result.stderr
    groups = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]
    bits_of = {target: group["weights"]["num_bits"] for group in groups.values() for target in group["targets"]}
    assert bits_of["model.layers.0.mlp.down_proj"] == 8  # first matching pattern wins
    assert bits_of["model.layers.1.mlp.down_proj"] == 2 and bits_of["model.layers.1.self_attn.q_proj"] == 4
    assert not any(name.startswith("model.layers.3.mlp") for name in bits_of)
    tensors = load_file(out / "model.safetensors")
    assert "model.layers.3.mlp.up_proj.weight" in tensors and "model.layers.3.mlp.up_proj.weight_packed" not in tensors
    AutoModelForCausalLM.from_pretrained(out)  # stock transformers opens the mixed artifact
    record = json.loads((out / "lineage.json").read_text())["chain"][-1]
    assert record["overrides"] == {"model\\.layers\\.0\\..*": {"bits": 8}, ".*down_proj": {"bits": 2, "group_size": 32}}


def test_settings_a_method_never_reads_leave_its_lineage_alone(tmp_path, tiny_folder):
    """RTN reads no statistics and runs no GPTQ feedback: given --damp, --hessian-shrinkage,
    --sequential, --forward-dtype or --batch-size, it writes the same artifact under the same lineage hash,
    and the record says those settings did not apply."""
    from pipelines.stages import QuantizeConfig, quantize

    plain = quantize(str(tiny_folder), None, tmp_path / "plain", QuantizeConfig(method="rtn", group_size=32))
    given = quantize(str(tiny_folder), None, tmp_path / "given", QuantizeConfig(
        method="rtn", group_size=32, damp=0.3, hessian_shrinkage=0.5, sequential=True, forward_dtype="float32", batch_size=7,
    ))
    lineages = [json.loads((folder / "lineage.json").read_text()) for folder in (plain, given)]
    assert lineages[0]["hash"] == lineages[1]["hash"]
    params = lineages[1]["chain"][-1]["params"]
    assert all(params[key] is None for key in ("damp", "hessian_shrinkage", "sequential", "true_sequential", "forward_dtype", "batch_size")), params
    assert (plain / "model.safetensors").read_bytes() == (given / "model.safetensors").read_bytes()


@pytest.mark.parametrize("method", ["nf4", "int8"])
def test_bitsandbytes_baselines_reload(tmp_path, tiny_folder, method, caplog):
    from transformers import AutoModelForCausalLM

    from pipelines.models import load_model

    out = tmp_path / method
    # (down_proj is 96 wide here: bitsandbytes' CPU NF4 forward needs multiples of its block of 64)
    result = run_cli("quantize", "--model", tiny_folder, "--method", method, "--skip", "layers\\.0\\.,down_proj", "--out", out)
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "bitsandbytes"
    params = json.loads((out / "lineage.json").read_text())["chain"][-1]["params"]  # the format's own settings, not the CLI's defaults
    assert (params["bits"], params["group_size"], params["act_order"]) == ((4, 64) if method == "nf4" else (8, -1)) + (False,)
    from pipelines.evaluation import logical_parameters

    model = load_model(str(out)).model
    assert logical_parameters(model) == logical_parameters(load_model(str(tiny_folder)).model)
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear  # skipped
    assert type(model.model.layers[1].self_attn.q_proj).__name__ in ("Linear4bit", "Linear8bitLt")
    with torch.no_grad(), caplog.at_level("WARNING"):
        model(torch.randint(0, 49152, (1, 8)))
        model(torch.randint(0, 49152, (1, 8)))
    # int8 warns on each matmul that fp32 inputs are cast to fp16: said once per process at most
    assert sum("MatMul8bitLt" in record.getMessage() for record in caplog.records) <= 1
    AutoModelForCausalLM.from_pretrained(out)


def save_with_compressed_tensors(model, quantized: dict, groups: list[tuple[list[str], GridSpec]], out) -> None:
    """Write `model` with its `quantized` linears as compressed-tensors' own compressor does,
    under config groups of (targets, grid) in this order."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, apply_quantization_config

    from compressors.packed_int import FORMAT, _weight_args

    config = QuantizationConfig(
        config_groups={f"group_{i}": QuantizationScheme(targets=targets, weights=_weight_args(spec)) for i, (targets, spec) in enumerate(groups)},
        ignore=[name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear) and name not in quantized],
    )
    modules = dict(model.named_modules())
    for name, q in quantized.items():
        modules[name].weight.data = q.dequantized()
    apply_quantization_config(model, config)
    for name, q in quantized.items():
        modules[name].weight_scale = torch.nn.Parameter(q.scale.half(), requires_grad=False)
        if not q.spec.symmetric:
            modules[name].weight_zero_point = torch.nn.Parameter(q.zero.to(torch.int8), requires_grad=False)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=FORMAT)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)


def test_pack_quantized_writer_matches_compressed_tensors_own_compressor(tmp_path, tiny_folder):
    """lmpress writes the packed tensors from the codes, without reading the (released)
    weights; the result is what compressed-tensors' own compressor writes from the dequantized
    weights: the same tensors and the same config, with mixed grids, per channel, asymmetric
    (packed zero points, as llm-compressor's W4A16_ASYM) and a linear left dense."""
    from compressors.lmpress_format import packed_weight
    from compressors.packed_int import save_pack_quantized
    from pipelines.models import load_model, release_weights

    grids = {
        "model.layers.0.mlp.down_proj": GridSpec(8, -1), "model.layers.1.self_attn.q_proj": GridSpec(2, 32),
        "model.layers.2.mlp.gate_proj": GridSpec(4, 32, symmetric=False), "model.layers.2.self_attn.o_proj": GridSpec(3, -1, symmetric=False),
    }
    outputs = {}
    for writer in ("lmpress", "compressed-tensors"):
        model = load_model(str(tiny_folder)).model
        modules = dict(model.named_modules())
        quantized = {}
        for name, module in modules.items():
            if name.startswith("model.layers.") and isinstance(module, torch.nn.Linear) and not name.endswith("layers.3.mlp.up_proj"):
                quantized[name] = round_to_nearest(module.weight.data, grids.get(name, GridSpec(4, 32)))
        plan = {name: q.spec for name, q in quantized.items()}
        out = outputs[writer] = tmp_path / writer
        if writer == "lmpress":
            release_weights(modules[name] for name in quantized)
            save_pack_quantized(model, {name: packed_weight(q) for name, q in quantized.items()}, plan, out)
            continue
        by_spec = {}
        for name, spec in plan.items():
            by_spec.setdefault(spec, []).append(name)
        groups = sorted(by_spec.items(), key=lambda item: item[1][0])
        save_with_compressed_tensors(model, quantized, [(names, spec) for spec, names in groups], out)
    ours, theirs = (load_file(outputs[w] / "model.safetensors") for w in ("lmpress", "compressed-tensors"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[key], theirs[key]) for key in ours)
    assert "model.layers.3.mlp.up_proj.weight" in ours and ours["model.layers.2.mlp.gate_proj.weight_zero_point"].dtype == torch.int32
    assert json.loads((outputs["lmpress"] / "config.json").read_text()) == json.loads((outputs["compressed-tensors"] / "config.json").read_text())


def test_compressed_tensors_checkpoints_serve_with_compressed_tensors_target_matching(tmp_path, tiny_folder):
    """A pack-quantized checkpoint another tool wrote, its config groups targeting by `re:`
    prefix and by class (compressed-tensors matches an exact name first, then a regex from the
    name's start, then a class): lmpress's kernels serve each linear at the bits stock
    transformers reads it at, and a config that gives a linear other bits than its packed
    width is one line."""
    import shutil

    from transformers import AutoModelForCausalLM

    from pipelines.models import load_model
    from pipelines.serving import load_for_serving, packed_weights

    model = load_model(str(tiny_folder)).model
    first, wide = r"re:model\.layers\.0\.", GridSpec(8, 32)
    quantized = {
        name: round_to_nearest(module.weight.data, wide if name.startswith("model.layers.0.") else GridSpec(4, 32))
        for name, module in model.named_modules() if name.startswith("model.layers.") and isinstance(module, torch.nn.Linear)
    }
    out = tmp_path / "other-tool"
    shutil.copytree(tiny_folder, out)
    save_with_compressed_tensors(model, quantized, [([first], wide), (["Linear"], GridSpec(4, 32))], out)
    assert {name: w.bits for name, w in packed_weights(out).items()} == {name: q.spec.bits for name, q in quantized.items()}
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        stock = AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
        served = load_for_serving(str(out)).model(ids).logits
    assert (served - stock).abs().max() <= 1e-4 * stock.abs().max()

    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["targets"] = [r"re:model\.layers\.1\."]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(LmpressError, match=r"model\.layers\.0\.mlp\.down_proj\.weight_packed holds 24 words a row, not the 12 of 96 4-bit codes"):
        packed_weights(out)


def _resident_file_mb() -> float:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssFile")) / 1024


def test_mapped_weights_keep_their_values_and_give_their_memory_back(tmp_path, real_model_folder):
    """`map_weights` points each layer tensor at a map of its own: the values are the
    checkpoint's, and once a stage releases a layer's weights their pages leave the process
    (with transformers' one map per file they would stay resident until the end)."""
    from transformers import LlamaConfig

    from conftest import save_tiny
    from pipelines.models import load_model, map_weights, release_weights

    config = LlamaConfig(hidden_size=512, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8)
    folder = save_tiny(tmp_path / "mid", config, real_model_folder)  # 4 x 12.6 MB of linears, fp32
    loaded, reference = load_model(str(folder)), load_model(str(folder)).model.state_dict()
    map_weights(loaded)
    linears = [m for layer in loaded.model.model.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    before = _resident_file_mb()
    for module in linears:
        module.weight.sum()  # read: every page resident
    read = _resident_file_mb()
    assert all(torch.equal(value, reference[key]) for key, value in loaded.model.state_dict().items())
    after_compare = _resident_file_mb()
    release_weights(linears)
    assert read - before > 40 and _resident_file_mb() < after_compare - 40
    assert all(m.weight.device.type == "meta" and m.weight.shape == (m.out_features, m.in_features) for m in linears)


def _walk(folder, true_sequential: bool, halve: bool) -> list[tuple[int, dict]]:
    """walk_layers over the tiny model with a stand-in compressor that halves the weights of the
    linears it is handed (a change to what later linears read); returns (layer, {linear: E[x x^T]})
    per call of the compressor."""
    from types import SimpleNamespace

    from pipelines.models import load_model
    from pipelines.stages import walk_layers

    loaded = load_model(str(folder))
    calib = SimpleNamespace(input_ids=torch.randint(0, 320, (4, 24), generator=torch.Generator().manual_seed(0)))
    config = SimpleNamespace(sequential=True, batch_size=2, forward_dtype="float32")
    calls = []

    def process(index, layer, statistics):
        calls.append((index, {name: s.second_moment for name, s in statistics.items()}))
        for name in statistics if halve else ():
            layer.get_submodule(name).weight.data.mul_(0.5)

    walk_layers(loaded, calib, config, process, lambda: None, true_sequential=true_sequential)
    return calls


def test_true_sequential_collects_each_group_on_the_groups_before_it_compressed(tiny_folder):
    """GPTQ's true-sequential mode: per layer the compressor is handed q/k/v, then o, then
    gate/up, then down, each group's statistics taken after the groups before it were changed.
    With nothing changed they are the whole-layer walk's statistics, bit for bit; with a change, every
    group but a layer's first (which reads the layer's input) sees different inputs."""
    groups = [("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",), ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",)]
    whole_layer, grouped = _walk(tiny_folder, False, False), _walk(tiny_folder, True, False)
    assert [index for index, _ in whole_layer] == [0, 1, 2, 3] and [tuple(stats) for _, stats in grouped] == groups * 4
    for index, stats in grouped:
        for name, moment in stats.items():
            assert torch.equal(moment, whole_layer[index][1][name]), (index, name)
    whole_layer, grouped = _walk(tiny_folder, False, True), _walk(tiny_folder, True, True)
    for index, stats in grouped:
        for name, moment in stats.items():
            first = name in groups[0]  # reads the layer's input, which the whole layer before changed in both modes
            assert torch.equal(moment, whole_layer[index][1][name]) == first, (index, name)


def test_true_sequential_quantizes_every_linear(tmp_path, real_model_folder):
    """Through the stage: every linear is packed once (a layer's groups spill separately) and
    the result differs from the whole-layer walk's quantization only by the inputs each group saw.
    True-sequential is the default where it applies."""
    from transformers import AutoModelForCausalLM

    from conftest import save_tiny, tiny_config
    from pipelines.serving import packed_weights
    from pipelines.stages import QuantizeConfig, quantize

    folder = save_tiny(tmp_path / "tiny", tiny_config("llama"), real_model_folder, tmp_path / "calib")
    whole_layer = packed_weights(quantize(str(folder), tmp_path / "calib", tmp_path / "q", QuantizeConfig(group_size=32, true_sequential=False)))
    grouped = packed_weights(quantize(str(folder), tmp_path / "calib", tmp_path / "qt", QuantizeConfig(group_size=32)))
    groups = json.loads((tmp_path / "qt" / "config.json").read_text())["quantization_config"]["config_groups"]
    assert {group["weights"]["actorder"] for group in groups.values()} == {"weight"}  # GPTQ's default act order, static groups
    AutoModelForCausalLM.from_pretrained(tmp_path / "qt")  # which stock transformers loads as it is
    assert grouped.keys() == whole_layer.keys() and len(grouped) == 4 * 7
    same = {name for name in grouped if torch.equal(grouped[name].packed, whole_layer[name].packed)}
    assert {"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"} <= same
    assert "model.layers.0.self_attn.o_proj" not in same and len(same) < len(grouped)
