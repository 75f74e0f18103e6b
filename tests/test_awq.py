import pytest
import torch

from calibrate.runner import LayerRunner
from calibrate.stats import LayerStatisticsCollector
from compressors.awq import awq_layer, search_scales
from compressors.grid import GridSpec, round_to_nearest
from conftest import tiny_config
from pipelines.models import architecture_of, layer_linears


def _model(family, kv_heads=2):
    from transformers import AutoModelForCausalLM

    config = tiny_config(family)
    config.num_key_value_heads = kv_heads
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    for name, p in model.named_parameters():  # random norms, so folding into them is tested
        if "norm" in name:
            p.data = 0.5 + torch.rand_like(p)
    return model


@pytest.mark.parametrize("family,kv_heads", [("llama", 2), ("llama", 4), ("gemma2", 2)])
def test_scales_fold_without_changing_the_float_model(family, kv_heads):
    """Before rounding, AWQ only moves scales between ops: logits are unchanged. With as many
    KV heads as query heads, o_proj is scaled through v_proj too."""
    model = _model(family, kv_heads)
    ids = torch.randint(0, 320, (3, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
    arch = architecture_of(model.config)
    o_before = model.model.layers[0].self_attn.o_proj.weight.clone()
    runner = LayerRunner(model, ids, batch_size=3)
    for index, layer in runner:
        with LayerStatisticsCollector(layer_linears(model, layer), model.config) as collector:
            runner.forward(layer, propagate=False)
        awq_layer(layer, arch, model.config, collector.statistics(), {name: GridSpec(3, 32) for name in arch.linears})
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=1e-4, atol=1e-4)
    assert torch.equal(model.model.layers[0].self_attn.o_proj.weight, o_before) == (kv_heads != 4)


def test_awq_beats_rtn_on_the_layer_output_at_3_bits():
    """On the calibration inputs, the layer quantized by AWQ (scales folded, clipped grids)
    reproduces the float layer's output better than the same layer rounded to nearest."""
    import copy

    model = _model("llama")
    ids = torch.randint(0, 320, (4, 32), generator=torch.Generator().manual_seed(1))
    arch = architecture_of(model.config)
    spec = GridSpec(3, 32)
    runner = LayerRunner(model, ids, batch_size=4)
    for index, layer in runner:
        with LayerStatisticsCollector(layer_linears(model, layer), model.config) as collector:
            runner.forward(layer, propagate=False)
        inputs, (args, kwargs) = runner.hidden[0], runner.calls[index][0]
        with torch.no_grad():
            exact = layer(inputs, *args, **kwargs)
        rtn = copy.deepcopy(layer)
        for name in arch.linears:
            rtn.get_submodule(name).weight.data = round_to_nearest(rtn.get_submodule(name).weight.data, spec).dequantized()
        for name, q in awq_layer(layer, arch, model.config, collector.statistics(), {n: spec for n in arch.linears}).items():
            layer.get_submodule(name).weight.data = q.dequantized()
        with torch.no_grad():
            rtn_error = (rtn(inputs, *args, **kwargs) - exact).pow(2).mean()
            awq_error = (layer(inputs, *args, **kwargs) - exact).pow(2).mean()
        assert awq_error < 0.8 * rtn_error, (index, awq_error, rtn_error)


def test_scale_search_scores_each_linear_on_its_own_grid():
    """A plan may give linears that share an input different grids (q at 8 bits, k/v at 2): each
    is scored on its own. An 8-bit member adds almost nothing, so the pair's scales are the
    2-bit member's alone; scoring both on the first member's grid (as before) gives others."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(512, 64, generator=g) * (torch.rand(64, generator=g) * 4 + 0.1)
    sigma, abs_mean = x.T @ x / 512, x.abs().mean(dim=0)
    fine, coarse = (torch.randn(32, 64, generator=g), GridSpec(8, 32)), (torch.randn(32, 64, generator=g), GridSpec(2, 32))
    alone = search_scales([coarse], sigma, abs_mean)
    assert torch.equal(search_scales([fine, coarse], sigma, abs_mean), alone)
    assert not torch.equal(search_scales([fine, (coarse[0], fine[1])], sigma, abs_mean), alone)
