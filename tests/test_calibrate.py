import pytest
import torch
from safetensors.torch import save_file

from calibrate.corpora import Samples
from calibrate.runner import LayerRunner
from calibrate.stats import CalibrationData, LayerStatisticsCollector
from conftest import tiny_model
from pipelines.models import layer_linears


def _collect(model, input_ids, dtype=None):
    per_layer = []
    runner = LayerRunner(model, input_ids, batch_size=2, dtype=dtype)
    for index, layer in runner:
        with LayerStatisticsCollector(layer_linears(model, layer), model.config) as collector:
            runner.forward(layer)
        per_layer.append((collector.group, collector.tensors(), collector.tokens))
    return per_layer


def test_statistics_match_the_inputs_seen_in_a_full_forward():
    """Second moments and means equal those of the inputs each linear receives when the whole
    model runs at once; q/k/v and gate/up share one entry because they read one tensor."""
    model = tiny_model("qwen3")
    input_ids = torch.randint(0, 320, (5, 24), generator=torch.Generator().manual_seed(0))
    seen = {}
    hooks = [
        module.register_forward_hook(lambda m, args, out, name=name: seen.setdefault(name, []).append(args[0].reshape(-1, args[0].shape[-1])))
        for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)
    ]
    with torch.no_grad():
        model.base_model(input_ids=input_ids)
    for hook in hooks:
        hook.remove()

    per_layer = _collect(model, input_ids)
    for index, (group, tensors, tokens) in enumerate(per_layer):
        assert group == {
            "self_attn.q_proj": "self_attn.q_proj", "self_attn.k_proj": "self_attn.q_proj", "self_attn.v_proj": "self_attn.q_proj",
            "self_attn.o_proj": "self_attn.o_proj", "mlp.gate_proj": "mlp.gate_proj", "mlp.up_proj": "mlp.gate_proj",
            "mlp.down_proj": "mlp.down_proj",
        }
        assert tokens == 5 * 24
        for leader in set(group.values()):
            x = torch.cat(seen[f"model.layers.{index}.{leader}"])
            torch.testing.assert_close(tensors[f"{leader}.second_moment"], x.T @ x / x.shape[0], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(tensors[f"{leader}.mean"], x.mean(0), rtol=1e-4, atol=1e-5)
        k = torch.cat(seen[f"model.layers.{index}.self_attn.q_proj"]) @ model.model.layers[index].self_attn.k_proj.weight.T
        k = torch.nn.functional.normalize(k.view(-1, 2, 16), dim=-1)
        torch.testing.assert_close(tensors["kv.k_cosine"], torch.einsum("thd,tgd->hg", k, k) / k.shape[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_a_collecting_pass_stops_at_the_last_linear_with_the_same_statistics(family):
    """A pass that only collects (the sequential stages') stops each batch at down_proj's input:
    down_proj never runs in it, and the statistics are those of the whole layer's pass."""
    model = tiny_model(family)
    input_ids = torch.randint(0, 320, (5, 24), generator=torch.Generator().manual_seed(0))
    full = _collect(model, input_ids)
    runner = LayerRunner(model, input_ids, batch_size=2)
    ran = []
    for index, layer in runner:
        handle = layer.mlp.down_proj.register_forward_hook(lambda *_: ran.append(index))
        with LayerStatisticsCollector(layer_linears(model, layer), model.config) as collector:
            runner.forward(layer, propagate=False, until=layer.mlp.down_proj)
        handle.remove()  # before the runner propagates the batches through the whole layer
        assert collector.group == full[index][0] and collector.tokens == full[index][2]
        tensors = collector.tensors()
        assert tensors.keys() == full[index][1].keys()
        for name, tensor in tensors.items():
            assert torch.equal(tensor, full[index][1][name]), name
    assert ran == []


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_bfloat16_forward_keeps_the_weights_and_approximates_the_statistics(family):
    """Layers run in bf16 for speed: the model's fp32 weights come back untouched (not cast
    back and forth), hidden states are held in bf16, and the statistics stay within bf16's
    precision of the fp32 ones."""
    model = tiny_model(family)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    input_ids = torch.randint(0, 320, (4, 24), generator=torch.Generator().manual_seed(0))
    exact, fast = _collect(model, input_ids), _collect(model, input_ids, dtype=torch.bfloat16)
    assert all(p.dtype == torch.float32 and torch.equal(p, before[name]) for name, p in model.named_parameters())
    for (_, tensors, _), (_, approx, _) in zip(exact, fast):
        for key, value in tensors.items():
            assert approx[key].dtype == torch.float32
            assert (approx[key] - value).norm() <= 0.05 * value.norm(), key


def test_calibration_data_derives_norms_and_variance(tmp_path):
    model = tiny_model("llama")
    input_ids = torch.randint(0, 320, (4, 16))
    group, tensors, tokens = _collect(model, input_ids)[0]
    (tmp_path / "stats").mkdir()
    save_file(tensors, tmp_path / "stats" / "layer_000.safetensors")
    import json

    (tmp_path / "manifest.json").write_text(json.dumps({
        "format": "lmpress-calibration/1", "groups": group, "tokens": tokens,
        "seed": 0, "seq_len": 16, "corpus": "test", "data_sha256": "", "sample_ids": [], "documents": [],
    }))
    stats = CalibrationData(tmp_path).layer(0)
    x = []
    hook = model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, a, o: x.append(a[0].reshape(-1, 96)))
    with torch.no_grad():
        model.base_model(input_ids=input_ids)
    hook.remove()
    x = x[0]
    down = stats["mlp.down_proj"]
    torch.testing.assert_close(down.channel_norm, x.norm(dim=0), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(down.channel_variance, x.var(dim=0, unbiased=False), rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(down.xtx, x.T @ x, rtol=1e-4, atol=1e-4)
    assert stats["self_attn.k_proj"] is not stats["self_attn.q_proj"]
    torch.testing.assert_close(stats["self_attn.k_proj"].second_moment, stats["self_attn.q_proj"].second_moment)


def test_samples_hash_is_of_the_tokens():
    a = Samples(torch.arange(8).view(2, 4), ["x:0", "x:4"], ["x"])
    b = Samples(torch.arange(8).view(2, 4), ["y:0", "y:4"], ["y"])
    assert a.data_hash() == b.data_hash()
    assert a.data_hash() != Samples(torch.arange(1, 9).view(2, 4), [], []).data_hash()
