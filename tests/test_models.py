import json

import pytest
import torch

from calibrate.runner import LayerRunner
from conftest import FAMILIES, tiny_config, tiny_model
from pipelines.errors import LmpressError
from pipelines.models import ARCHITECTURES, architecture_of, decoder_layers, kv_cache_bytes_per_token, layer_linears, resolve_model


@pytest.mark.parametrize("family", FAMILIES)
def test_architecture_finds_layers_and_projections(family):
    model = tiny_model(family)
    layers = decoder_layers(model)
    assert len(layers) == model.config.num_hidden_layers
    linears = layer_linears(model, layers[0])
    assert set(linears) == set(architecture_of(model.config).linears)
    assert linears["self_attn.k_proj"].out_features == 2 * 16
    assert linears["mlp.down_proj"].in_features == 96


@pytest.mark.parametrize("family", FAMILIES)
def test_runner_reproduces_the_models_own_hidden_states(family):
    """Layer by layer, with each layer's own mask and rotary tables (sliding windows shorter than
    the sequence), the runner's outputs equal the full model's hidden states."""
    model = tiny_model(family)
    input_ids = torch.randint(0, 320, (5, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model.base_model(input_ids=input_ids, output_hidden_states=True).hidden_states
    runner = LayerRunner(model, input_ids, batch_size=2)
    last = len(runner) - 1
    for index, layer in runner:
        runner.forward(layer)
        got = torch.cat(runner.hidden)
        if index == last:  # the model's last entry is after the final norm
            got = model.base_model.norm(got)
        torch.testing.assert_close(got, expected[index + 1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_runner_attends_in_causal_chunks_as_sdpa_does(family):
    """With sdpa, the runner's layer passes attend through causal_sdpa_in_chunks (on 100 tokens:
    chunks of 64 and 36 queries, grouped KV heads), and their outputs equal the full model's;
    Mistral's sliding-window mask goes to transformers' own sdpa. Afterwards the model is as it was."""
    from calibrate.runner import CHUNKED_ATTENTION

    model = tiny_model(family)
    model.config._attn_implementation = "sdpa"
    input_ids = torch.randint(0, 320, (3, 100), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model.base_model(input_ids=input_ids, output_hidden_states=True).hidden_states
    runner = LayerRunner(model, input_ids, batch_size=2)
    last = len(runner) - 1
    for index, layer in runner:
        assert model.config._attn_implementation == CHUNKED_ATTENTION
        runner.forward(layer)
        got = torch.cat(runner.hidden)
        if index == last:  # the model's last entry is after the final norm
            got = model.base_model.norm(got)
        torch.testing.assert_close(got, expected[index + 1], rtol=1e-5, atol=1e-5)
    assert model.config._attn_implementation == "sdpa"


def test_causal_chunks_equal_sdpa_and_leave_the_rest_to_it(monkeypatch):
    """150 causal tokens, grouped KV heads: three SDPA calls (64, 64 and 22 queries) whose joined
    output equals one sdpa call's; given a mask, transformers' sdpa runs it in one call."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from calibrate.runner import causal_sdpa_in_chunks

    sdpa, queries = torch.nn.functional.scaled_dot_product_attention, []
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", lambda q, *a, **k: queries.append(q.shape[2]) or sdpa(q, *a, **k))
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, heads, 150, 16, generator=generator) for heads in (6, 2, 2))
    module = SimpleNamespace(is_causal=True, num_key_value_groups=3)
    expected, _ = sdpa_attention_forward(module, query, key, value, None, scaling=0.25)
    queries.clear()
    got, _ = causal_sdpa_in_chunks(module, query, key, value, None, scaling=0.25)
    assert queries == [64, 64, 22]
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    mask = torch.ones(150, 150, dtype=torch.bool).tril()[None, None]
    queries.clear()
    masked, _ = causal_sdpa_in_chunks(module, query, key, value, mask, scaling=0.25)
    assert queries == [150]
    torch.testing.assert_close(masked, expected, rtol=1e-6, atol=1e-6)


def test_runner_propagates_the_changed_layer():
    """A stage that changes a layer's weights feeds the next layer the changed outputs."""
    model = tiny_model("llama")
    input_ids = torch.randint(0, 320, (3, 16))
    runner = LayerRunner(model, input_ids, batch_size=3)
    for index, layer in runner:
        if index == 0:
            runner.forward(layer, propagate=False)
            layer.mlp.down_proj.weight.data.zero_()  # this layer now adds nothing from its MLP
    with torch.no_grad():
        expected = model.base_model(input_ids=input_ids).last_hidden_state
    torch.testing.assert_close(model.base_model.norm(torch.cat(runner.hidden)), expected, rtol=1e-5, atol=1e-5)


def _true_sequential_walk(family: str, stepped: bool, dtype: torch.dtype | None, hidden_in_file: bool | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Every layer in true-sequential order, each group of linears halved once its input moments
    are taken: `stepped` by `forward_true_sequential` (each linear run once), else the plain way (the layer re-run
    up to each group, then once more to propagate). Returns the moments and the final hidden states."""
    from calibrate.stats import LayerStatisticsCollector

    model = tiny_model(family)
    arch = architecture_of(model.config)
    runner = LayerRunner(model, torch.randint(0, 320, (5, 24), generator=torch.Generator().manual_seed(1)), batch_size=2, dtype=dtype,
                         hidden_in_file=hidden_in_file)
    moments = []

    def halve(layer, statistics):
        moments.append(next(iter(statistics.values())).second_moment)
        for name in statistics:
            layer.get_submodule(name).weight.data.mul_(0.5)

    for _, layer in runner:
        if stepped:
            runner.forward_true_sequential(layer, arch, lambda statistics: halve(layer, statistics))
            continue
        for group in arch.input_groups:
            with LayerStatisticsCollector({name: layer.get_submodule(name) for name in group}, model.config) as collector:
                runner.forward(layer, propagate=False, until=layer.get_submodule(group[-1]))
            halve(layer, collector.statistics())
    return moments, torch.cat(runner.hidden)


@pytest.mark.parametrize("family,dtype", [(family, None) for family in FAMILIES] + [("llama", torch.bfloat16)])
def test_true_sequential_stepped_walk_equals_rerunning_the_layer_per_group(family, dtype):
    """The stepped walk goes through each family's layer along its pre-norm structure (Gemma's
    output norms included) and keeps o's and down's inputs in a file (bf16 ones too): the
    moments each group sees and the outputs it propagates are the plain walk's, bit for bit."""
    moments, hidden = _true_sequential_walk(family, True, dtype)
    expected_moments, expected_hidden = _true_sequential_walk(family, False, dtype)
    assert len(moments) == 4 * 4
    for got, expected in zip(moments, expected_moments):
        assert torch.equal(got, expected)
    assert torch.equal(hidden, expected_hidden)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_hidden_states_in_a_file_or_in_memory_walk_alike(dtype):
    """On the CPU the runner keeps the hidden states in a scratch file, one batch read at a time
    (the last batch shorter); kept in memory, as on a GPU, the walk is the same bit for bit."""
    from calibrate.runner import _BatchFile, _BatchList

    runner = LayerRunner(tiny_model("llama"), torch.randint(0, 320, (5, 24)), batch_size=2, dtype=dtype)
    assert isinstance(runner._hidden, _BatchFile) and [h.shape[0] for h in runner.hidden] == [2, 2, 1]
    assert {h.dtype for h in runner.hidden} == {dtype or torch.float32}
    for stepped in (True, False):  # the stepped walk's in-place updates, and whole-layer passes
        (moments, hidden), (in_memory, hidden_in_memory) = (_true_sequential_walk("llama", stepped, dtype, in_file) for in_file in (True, False))
        assert all(torch.equal(a, b) for a, b in zip(moments, in_memory)) and torch.equal(hidden, hidden_in_memory)
    stored = _BatchFile(None)
    stored.append(torch.zeros(2, 3))
    stored.write(0, torch.ones(2, 3, dtype=torch.float64))  # in place, in the batch's own dtype
    assert torch.equal(stored.read(0, torch.device("cpu")), torch.ones(2, 3))
    in_memory = _BatchList()
    in_memory.append(torch.zeros(2, 3))
    for store in (stored, in_memory):
        with pytest.raises(ValueError, match=r"batch 0 holds \(2, 3\), not \(1, 3\)"):
            store.write(0, torch.zeros(1, 3))  # copy_ would broadcast it


def test_unsupported_architecture_names_the_supported_ones():
    from transformers import GPT2Config

    with pytest.raises(LmpressError, match="'gpt2' is not supported; lmpress supports llama, mistral"):
        architecture_of(GPT2Config())
    assert set(FAMILIES) == set(ARCHITECTURES)


def test_kv_cache_bytes_per_token():
    config = tiny_config("llama")
    assert kv_cache_bytes_per_token(config) == 2 * 4 * 2 * 16 * 2


def test_hub_id_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(LmpressError, match="offline"):
        resolve_model("someorg/somemodel")


def test_real_model_is_converted_once_as_plain_safetensors(real_model_folder):
    config = json.loads((real_model_folder / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["num_hidden_layers"] == 30 and config["num_key_value_heads"] == 3
    assert [p.suffix for p in real_model_folder.glob("model*")] == [".safetensors"]
    assert resolve_model("smollm2-135m") == real_model_folder
