"""KV-head merging: the merged layer is what stock attention computes from the checkpoint, an
exactly mergeable pair of heads merges exactly (RoPE-commuting key fold, value fold), the stage
writes plain GQA checkpoints (MHA 8 -> 4 -> 2), factor 1 changes nothing, bad input fails
cleanly, repeats are byte-identical; on the real model the aligned merge beats mean-pooling."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from compressors.kvmerge import AttentionHeads, AttentionInputStatistics, attention_outputs, balanced_groups, merge_heads
from conftest import leftovers, refuse_in_process, save_tiny, tiny_config
from pipelines.errors import LmpressError
from pipelines.stages import KVMergeConfig, kv_merge


def mha_config(family: str = "llama", heads: int = 8):
    config = tiny_config(family)
    config.num_attention_heads = config.num_key_value_heads = heads
    config._attn_implementation = "eager"
    return config


@pytest.fixture(scope="module")
def mha_setup(tmp_path_factory, real_model_folder):
    """A tiny multi-head-attention Llama (8 KV heads) and its calibration artifact."""
    root = tmp_path_factory.mktemp("kvmerge")
    return save_tiny(root / "mha", mha_config(), real_model_folder, root / "calib"), root / "calib"


def logits(model, seed=0):
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits


def attention_call(model, x):
    """Layer 0's attention inputs for hidden states x, as the model passes them (eager attention:
    an additive causal mask)."""
    positions = torch.arange(x.shape[1])[None]
    mask = torch.full((x.shape[1], x.shape[1]), float("-inf")).triu(1)[None, None]
    return {"hidden_states": x, "position_embeddings": model.model.rotary_emb(x, positions), "attention_mask": mask}


def merge_layer(attention, config, groups, method, inputs):
    """lmpress's merge of one attention module in place (closed form, no o_proj refit)."""
    heads = AttentionHeads.of(attention, config.num_attention_heads, config.num_key_value_heads, attention.head_dim)
    merged, order = merge_heads(heads, groups, method, heads.input_moment(AttentionInputStatistics(attention, [((), inputs)])))
    merged.write(attention, torch.float32)
    attention.num_key_value_groups = config.num_attention_heads // len(groups)
    return merged


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])  # qwen2: q/k/v biases; gemma2: logit soft-capping
@pytest.mark.parametrize("method,kv_heads", [("mean", 4), ("aligned", 4), ("aligned", 2), ("aligned", 1)])
def test_stock_attention_computes_what_lmpress_merged(family, method, kv_heads):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(mha_config(family)).eval()
    attention, x = model.model.layers[0].self_attn, torch.randn(2, 10, 64)
    inputs = attention_call(model, x)
    groups = balanced_groups(torch.randn(8, 8).clamp(-1, 1), kv_heads, 8)
    merged = merge_layer(attention, model.config, groups, method, inputs)
    assert attention.k_proj.out_features == attention.v_proj.out_features == kv_heads * 16
    assert attention.q_proj.out_features == attention.o_proj.in_features == 8 * 16
    with torch.no_grad():
        stock, _ = attention(**inputs)
        softcap = getattr(model.config, "attn_logit_softcapping", None)
        ours = attention_outputs(merged, x, *inputs["position_embeddings"], inputs["attention_mask"], attention.scaling, softcap).flatten(2) @ attention.o_proj.weight.T
    if attention.o_proj.bias is not None:
        ours = ours + attention.o_proj.bias
    torch.testing.assert_close(stock, ours, rtol=1e-4, atol=1e-5)


def test_heads_that_differ_by_a_rope_commuting_map_merge_exactly():
    """KV head 1's keys = head 0's scaled and rotated per rotary pair (a complex factor per
    pair, which commutes with RoPE), its values any linear map of head 0's: the aligned merge of
    the two loses nothing; mean-pooling does."""
    errors = {}
    for method in ("mean", "aligned"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(mha_config(heads=2)).eval()
        attention, x = model.model.layers[0].self_attn, torch.randn(2, 10, 64)
        with torch.no_grad():
            k, v = attention.k_proj.weight.view(2, 16, 64), attention.v_proj.weight.view(2, 16, 64)
            factor = torch.polar(0.5 + torch.rand(8), 6.28 * torch.rand(8))
            pairs = factor[:, None] * torch.complex(k[0, :8], k[0, 8:])
            k[1] = torch.cat([pairs.real, pairs.imag])
            v[1] = torch.randn(16, 16) @ v[0]
            inputs = attention_call(model, x)
            before, _ = attention(**inputs)
            merge_layer(attention, model.config, [[0, 1]], method, inputs)
            after, _ = attention(**inputs)
        errors[method] = ((after - before).norm() / before.norm()).item()
    assert errors["aligned"] < 1e-5 < 0.1 < errors["mean"], errors


def test_balanced_groups_are_equal_sized_and_put_similar_heads_together():
    similarity = torch.full((8, 8), -0.5)
    for group in ([0, 5], [1, 2], [3, 7], [4, 6]):
        for i in group:
            for j in group:
                similarity[i, j] = 1.0
    assert balanced_groups(similarity, 4, 8) == [[0, 5], [1, 2], [3, 7], [4, 6]]
    halves = balanced_groups(similarity, 2, 8)
    assert sorted(map(len, halves)) == [4, 4] and all(any(set(g) <= set(h) for h in halves) for g in ([0, 5], [1, 2], [3, 7], [4, 6]))


def lmpress_forward_logits(folder):
    """The checkpoint's logits with every attention computed by lmpress's own attention
    (`attention_outputs` on the heads read from the module) instead of transformers'."""
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    config = model.config

    def forward(attention):
        def run(hidden_states, position_embeddings, attention_mask=None, **_):
            heads = AttentionHeads.of(attention, config.num_attention_heads, config.num_key_value_heads, attention.head_dim)
            softcap = getattr(config, "attn_logit_softcapping", None)
            out = attention_outputs(heads, hidden_states, *position_embeddings, attention_mask, attention.scaling, softcap)
            return attention.o_proj(out.flatten(2).float()), None

        return run

    for layer in model.model.layers:
        layer.self_attn.forward = forward(layer.self_attn)
    return logits(model)


@pytest.mark.parametrize("method", ["mean", "aligned"])
def test_mha_merges_to_stock_gqa_checkpoints(tmp_path, mha_setup, method):
    folder, calibration = mha_setup
    parent, previous = folder, 8
    for kv_heads in (4, 2):  # MHA 8 -> GQA 4 -> GQA 2, each a stage on the previous output
        out = kv_merge(str(parent), calibration, tmp_path / f"kv{kv_heads}", KVMergeConfig(kv_heads=kv_heads, method=method, samples=8))
        report = json.loads((out / "structure.json").read_text())
        stock = AutoModelForCausalLM.from_pretrained(out).eval()  # stock transformers, its own attention
        assert stock.config.num_key_value_heads == kv_heads and stock.config.num_attention_heads == 8
        assert stock.model.layers[0].self_attn.k_proj.out_features == kv_heads * 16
        assert report["kv_cache_bytes_per_token_fp16"]["after"] * previous == report["kv_cache_bytes_per_token_fp16"]["before"] * kv_heads
        assert all(sorted(map(len, groups)) == [previous // kv_heads] * kv_heads for groups in report["groups"].values())
        torch.testing.assert_close(logits(stock), lmpress_forward_logits(out), rtol=1e-4, atol=1e-4)
        parent, previous = out, kv_heads


@pytest.mark.parametrize("family", ["mistral", "gemma2"])  # sliding-window masks; soft-capping
def test_other_families_merge_to_stock_checkpoints(tmp_path, family, real_model_folder):
    folder = save_tiny(tmp_path / family, mha_config(family), real_model_folder, tmp_path / "calib")
    out = kv_merge(str(folder), tmp_path / "calib", tmp_path / "kv", KVMergeConfig(kv_heads=2, samples=8))
    stock = AutoModelForCausalLM.from_pretrained(out).eval()
    assert stock.config.num_key_value_heads == 2
    torch.testing.assert_close(logits(stock), lmpress_forward_logits(out), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method", ["mean", "aligned"])
def test_merge_by_factor_one_keeps_the_logits(tmp_path, mha_setup, method, real_model_folder):
    """As many KV heads as the model has (a sweep's unmerged point) leaves the model as it is,
    without calibration, on a family whose k_norm the aligned fold cannot pass through too
    (the aligned method rescaled keys and refit o_proj anyway: Qwen3's logits moved by 0.02)."""
    folder, calibration = mha_setup
    qwen3 = save_tiny(tmp_path / "qwen3", tiny_config("qwen3"), real_model_folder)
    for model, kv_heads, calib in ((folder, 8, calibration), (qwen3, 2, None)):
        out = kv_merge(str(model), calib, tmp_path / f"same-{kv_heads}", KVMergeConfig(kv_heads=kv_heads, method=method, samples=8))
        assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(out)), logits(AutoModelForCausalLM.from_pretrained(model)))


def test_kv_merge_bad_input_fails_cleanly(tmp_path, mha_setup, real_model_folder):
    folder, calibration = mha_setup
    fused = tmp_path / "phi3"
    config = tiny_config("llama")
    from transformers import Phi3Config

    save_tiny(fused, Phi3Config(**{k: getattr(config, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")}), real_model_folder)
    out = tmp_path / "merged"
    cases = [
        (str(folder), KVMergeConfig(kv_heads=3), "does not divide the 8 query heads"),
        (str(folder), KVMergeConfig(kv_heads=16), "the model has 8 KV heads, and merging only reduces them; pass at most 8"),
        (str(fused), KVMergeConfig(kv_heads=1), "phi3 has no separate k_proj and v_proj"),
        (str(folder), KVMergeConfig(kv_heads=0), "--kv-heads must be at least 1"),
        (str(folder), KVMergeConfig(kv_heads=2, method="svd"), "unknown method 'svd'"),
    ]
    for model, config, message in cases:
        with pytest.raises(LmpressError, match=message):
            kv_merge(model, calibration, out, config)
        assert not out.exists() and not leftovers(out)
    with pytest.raises(LmpressError, match="needs --calibration"):
        kv_merge(str(folder), None, out, KVMergeConfig(kv_heads=2))
    out.mkdir()
    (out / "keep.txt").write_text("a good earlier output")
    result = refuse_in_process("kv-merge", "--model", folder, "--kv-heads", "5", "--out", out, "--calibration", calibration)
    assert result.returncode == 2 and "does not divide the 8 query heads" in result.stderr and "Traceback" not in result.stderr
    assert (out / "keep.txt").read_text() == "a good earlier output" and not leftovers(out)


def test_kv_merge_is_byte_identical_when_repeated(tmp_path, mha_setup):
    folder, calibration = mha_setup
    config = KVMergeConfig(kv_heads=2, samples=8, heal_steps=2)
    first, second = (kv_merge(str(folder), calibration, tmp_path / name, config) for name in ("a", "b"))
    for file in ("model.safetensors", "config.json", "structure.json"):
        assert (first / file).read_bytes() == (second / file).read_bytes(), file


def test_aligned_merge_beats_mean_pooling_on_the_real_model(tmp_path, real_model_folder):
    """SmolLM2-135M, 3 KV heads -> 1, on held-out text: the calibration-aware merge keeps far
    more of the model than mean-pooling (benchmarks/kvmerge_quality.py has the full numbers)."""
    from pipelines.stages import CalibrateConfig, EvaluateConfig, calibrate, evaluate

    calibration = calibrate(str(real_model_folder), tmp_path / "calib", CalibrateConfig(samples=8, seq_len=256, batch_size=4))
    evaluation = EvaluateConfig(corpora="austen-heldout", windows=2, seq_len=256)
    kl = {}
    for method in ("mean", "aligned"):
        out = kv_merge(str(real_model_folder), calibration, tmp_path / method, KVMergeConfig(kv_heads=1, method=method, samples=8))
        assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 1
        kl[method] = evaluate(str(out), tmp_path / "reference", None, evaluation)["austen-heldout"]["kl_to_base"]
    print(kl)
    assert kl["aligned"] < 0.5 * kl["mean"], kl
