"""Structured pruning and layer dropping: smaller plain checkpoints that stock transformers
opens with the logits of lmpress's own pruned model; bias compensation on real activations;
recovery; bad input."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from compressors.structured import prune_heads, prune_mlp
from conftest import dequantized_in_place, leftovers, refuse_in_process
from pipelines.errors import LmpressError
from pipelines.stages import DropLayersConfig, QuantizeConfig, StructuredConfig, drop_layers, prune_structured, quantize


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory, real_model_folder):
    """A tiny Llama (real tokenizer) and its calibration artifact."""
    from conftest import save_tiny, tiny_config

    root = tmp_path_factory.mktemp("structured")
    return save_tiny(root / "tiny", tiny_config("llama"), real_model_folder, root / "calib"), root / "calib"


def logits(model, seed=0):
    ids = torch.randint(0, 49152, (2, 12), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("scorer,compensate", [("flap", True), ("wanda-sp", False), ("magnitude", False)])
def test_width_pruning_gives_a_smaller_stock_checkpoint_with_lmpress_logits(tmp_path, tiny_setup, scorer, compensate):
    from calibrate.stats import CalibrationData

    folder, calibration = tiny_setup
    out = prune_structured(str(folder), calibration, tmp_path / "s", StructuredConfig(target_params=0.99, scorer=scorer, bias_compensation=compensate))
    report = json.loads((out / "structure.json").read_text())
    stock = AutoModelForCausalLM.from_pretrained(out).eval()  # stock transformers, no lmpress code
    assert sum(p.numel() for p in stock.parameters()) == report["params_after"] <= 0.99 * report["params_before"]
    assert stock.config.intermediate_size == 96 - report["mlp_channels_dropped"][0]
    assert stock.config.num_key_value_heads == 2 - report["head_groups_dropped"][0] >= 1
    assert stock.config.num_attention_heads == 2 * stock.config.num_key_value_heads  # GQA ratio kept

    # lmpress's own pruned model: the parent with the recorded units removed in memory
    parent = AutoModelForCausalLM.from_pretrained(folder).eval()
    data = CalibrationData(calibration)
    for index, layer in enumerate(parent.model.layers):
        kept, stats = report["kept"][str(index)], data.layer(index)
        mean = lambda name: stats[name].mean if compensate else None  # noqa: E731
        prune_mlp(layer.mlp, torch.tensor(kept["mlp_channels"]), mean("mlp.down_proj"), compensate)
        prune_heads(layer.self_attn, torch.tensor(kept["kv_heads"]), parent.config, mean("self_attn.o_proj"), compensate)
    torch.testing.assert_close(logits(stock), logits(parent), rtol=1e-5, atol=1e-5)
    assert (stock.model.layers[0].mlp.down_proj.bias is not None) == compensate


def test_global_allocation_gives_per_layer_widths_that_lmpress_loads(tmp_path, tiny_setup):
    from compressors.kernels import PackedLinear
    from pipelines.models import LAYER_WIDTHS, load_model
    from pipelines.serving import load_for_serving
    from pipelines.stages import QuantizeConfig, quantize

    folder, calibration = tiny_setup
    out = prune_structured(str(folder), calibration, tmp_path / "g", StructuredConfig(target_params=0.99, allocation="global"))
    report = json.loads((out / "structure.json").read_text())
    widths = json.loads((out / "config.json").read_text())[LAYER_WIDTHS]
    assert len({w["intermediate_size"] for w in widths}) > 1  # the layers differ
    assert [w["intermediate_size"] for w in widths] == [96 - d for d in report["mlp_channels_dropped"]]
    loaded = load_model(str(out)).model
    assert sum(p.numel() for p in loaded.parameters()) == report["params_after"] <= 0.99 * report["params_before"]
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):  # stock transformers cannot build per-layer widths, and says so
        AutoModelForCausalLM.from_pretrained(out)
    parent = AutoModelForCausalLM.from_pretrained(folder).eval()
    from calibrate.stats import CalibrationData

    data = CalibrationData(calibration)
    for index, layer in enumerate(parent.model.layers):
        kept, stats = report["kept"][str(index)], data.layer(index)
        prune_mlp(layer.mlp, torch.tensor(kept["mlp_channels"]), stats["mlp.down_proj"].mean, True)
        prune_heads(layer.self_attn, torch.tensor(kept["kv_heads"]), parent.config, stats["self_attn.o_proj"].mean, True)
    torch.testing.assert_close(logits(loaded), logits(parent), rtol=1e-5, atol=1e-5)

    # quantized (compressed-tensors keeps the widths in config.json), it loads for evaluation and
    # for serving alike: PackedLinears on its codes (transformers cannot build the widths)
    quantized = quantize(str(out), None, tmp_path / "q", QuantizeConfig(method="rtn", bits=4, group_size=-1))
    expected = logits(dequantized_in_place(load_model(str(out)).model, quantized))
    for model in (load_model(str(quantized)).model, load_for_serving(str(quantized)).model):
        assert isinstance(model.model.layers[0].mlp.down_proj, PackedLinear)
        torch.testing.assert_close(logits(model), expected, rtol=1e-5, atol=1e-5)


def test_block_influence_is_what_each_layer_does_to_its_input(tiny_setup):
    """The calibration stage's block influence equals 1 - cos(h_i, h_i+1) from a full forward."""
    from calibrate.stats import CalibrationData

    folder, calibration = tiny_setup
    data = CalibrationData(calibration)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        hidden = model(data.input_ids, output_hidden_states=True).hidden_states
    for index, influence in enumerate(data.block_influence()[:-1]):  # the last hidden state is after the final norm
        cos = torch.nn.functional.cosine_similarity(hidden[index], hidden[index + 1], dim=-1).mean().item()
        assert influence == pytest.approx(1 - cos, abs=1e-5)


@pytest.mark.parametrize("scorer", ["influence", "last"])
def test_dropping_layers_gives_a_shallower_stock_checkpoint(tmp_path, tiny_setup, scorer):
    folder, calibration = tiny_setup
    out = drop_layers(str(folder), calibration, tmp_path / "d", DropLayersConfig(n=2, scorer=scorer))
    report = json.loads((out / "structure.json").read_text())
    if scorer == "last":
        assert report["dropped_layers"] == [2, 3]
    else:  # the two layers that turn their input least
        influence = report["block_influence"]
        assert sorted(report["dropped_layers"]) == sorted(sorted(range(4), key=influence.__getitem__)[:2])
    stock = AutoModelForCausalLM.from_pretrained(out).eval()
    assert stock.config.num_hidden_layers == 2
    parent = AutoModelForCausalLM.from_pretrained(folder).eval()
    parent.model.layers = torch.nn.ModuleList([l for i, l in enumerate(parent.model.layers) if i not in report["dropped_layers"]])
    for index, layer in enumerate(parent.model.layers):
        layer.self_attn.layer_idx = index
    parent.config.num_hidden_layers = 2
    torch.testing.assert_close(logits(stock), logits(parent), rtol=1e-5, atol=1e-5)


def test_recovery_distillation_lowers_the_kl_to_the_parent(tmp_path, tiny_setup):
    """KL(parent || pruned) over the calibration windows, without and with recovery (per-step
    losses are on different, shuffled batches, so first vs last step would be noise)."""
    from calibrate.stats import CalibrationData

    folder, calibration = tiny_setup
    ids = CalibrationData(calibration).input_ids
    parent = AutoModelForCausalLM.from_pretrained(folder).eval()

    def kl_to_parent(model) -> float:
        with torch.no_grad():
            p, q = parent(ids).logits.log_softmax(-1), model(ids).logits.log_softmax(-1)
        return torch.nn.functional.kl_div(q.flatten(0, 1), p.flatten(0, 1), log_target=True, reduction="batchmean").item()

    kl = {}
    for steps in (0, 24):
        config = StructuredConfig(target_params=0.99, recovery_steps=steps, recovery_lr=2e-3, batch_size=2)
        kl[steps] = kl_to_parent(AutoModelForCausalLM.from_pretrained(prune_structured(str(folder), calibration, tmp_path / f"r{steps}", config)).eval())
    assert kl[24] < 0.7 * kl[0], kl


def test_bias_compensation_reduces_the_output_error_on_real_activations(real_model_folder):
    """On SmolLM2-135M and real calibration text: removing 30% of an MLP's channels by FLAP's
    score, folding their mean contribution into down_proj's bias lowers E||y - y'||^2."""
    from transformers import AutoTokenizer

    from calibrate.corpora import sample_windows
    from compressors.structured import mlp_channel_scores
    from calibrate.stats import LinearStatistics

    tokenizer = AutoTokenizer.from_pretrained(real_model_folder)
    model = AutoModelForCausalLM.from_pretrained(real_model_folder, dtype=torch.float32).eval()
    samples = sample_windows("austen-calib+pydoc-calib", tokenizer, 8, 128, seed=0)
    captured = {}
    for index in (3, 15, 27):
        mlp = model.model.layers[index].mlp
        mlp.down_proj.register_forward_hook(lambda m, args, out, i=index: captured.setdefault(i, []).append(args[0].reshape(-1, args[0].shape[-1])))
    with torch.no_grad():
        model(samples.input_ids)
    for index, chunks in captured.items():
        x = torch.cat(chunks)
        stats = LinearStatistics(x.T @ x / len(x), x.mean(0), x.abs().mean(0), len(x))
        mlp = model.model.layers[index].mlp
        keep = mlp_channel_scores(mlp, stats, "flap").argsort(descending=True)[: int(0.7 * x.shape[1])].sort().values
        y = mlp.down_proj(x)
        errors = {}
        for compensate in (False, True):
            down = torch.nn.Module()
            down.gate_proj, down.up_proj, down.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
            prune_mlp(down, keep, stats.mean if compensate else None, compensate)
            with torch.no_grad():
                errors[compensate] = ((down.down_proj(x[:, keep]) - y) ** 2).sum(dim=1).mean().item()
        print(f"layer {index}: E||y - y'||^2 {errors[False]:.2f} without, {errors[True]:.2f} with bias compensation")
        assert errors[True] < 0.99 * errors[False], (index, errors)


def test_structured_bad_input_fails_cleanly(tmp_path, tiny_setup):
    folder, calibration = tiny_setup
    out = tmp_path / "s"
    cases = [
        (prune_structured, StructuredConfig(target_params=0.5), "would remove every MLP channel or every head group"),
        (prune_structured, StructuredConfig(target_params=0.99, keep_heads=3), "3 query heads would break grouped-query attention"),
        (prune_structured, StructuredConfig(target_params=1.0), "target params must be in (0, 1)"),
        (drop_layers, DropLayersConfig(n=4), "would drop every layer of the 4"),
        (drop_layers, DropLayersConfig(n=0), "--n must be at least 1"),
        (drop_layers, DropLayersConfig(layers="1,7"), "names layer 7, but the model has layers 0-3"),
        (drop_layers, DropLayersConfig(layers="0,1,2,3"), "--layers 0,1,2,3 would drop every layer of the 4"),
        (drop_layers, DropLayersConfig(layers="one"), "--layers takes comma-separated numbers"),
    ]
    for stage, config, message in cases:
        with pytest.raises(LmpressError, match=message.replace("(", r"\(").replace(")", r"\)")):
            stage(str(folder), calibration, out, config)
        assert not out.exists() and not leftovers(out)
    # without calibration, the error names the options that need it
    for stage, config, message in [
        (drop_layers, DropLayersConfig(scorer="last", recovery_steps=2), "drop-layers --recovery-steps 2 needs --calibration"),
        (drop_layers, DropLayersConfig(), "drop-layers --scorer influence needs --calibration"),
        (prune_structured, StructuredConfig(target_params=0.9, scorer="magnitude", bias_compensation=True), "prune-structured --bias-compensation true needs"),
    ]:
        with pytest.raises(LmpressError, match=message):
            stage(str(folder), None, out, config)
        assert not out.exists() and not leftovers(out)
    # the calibration's stored statistics are the base's: a narrower model needs its own
    narrower = prune_structured(str(folder), calibration, tmp_path / "narrow", StructuredConfig(target_params=0.99, bias_compensation=False))
    with pytest.raises(LmpressError, match="stored statistics are the base model's, where mlp.down_proj reads 96 features"):
        quantize(str(narrower), calibration, out, QuantizeConfig(method="gptq", group_size=-1, sequential=False))
    assert not out.exists() and not leftovers(out)
    result = refuse_in_process("drop-layers", "--model", folder, "--n", "9", "--out", out, "--calibration", calibration)
    assert result.returncode == 2 and "would drop every layer" in result.stderr and "Traceback" not in result.stderr
    assert not out.exists() and not leftovers(out)


def test_structured_pruning_is_byte_identical_when_repeated(tmp_path, tiny_setup):
    folder, calibration = tiny_setup
    config = StructuredConfig(target_params=0.99, recovery_steps=2)
    first, second = (prune_structured(str(folder), calibration, tmp_path / name, config) for name in ("a", "b"))
    for file in ("model.safetensors", "config.json", "structure.json"):
        assert (first / file).read_bytes() == (second / file).read_bytes(), file
