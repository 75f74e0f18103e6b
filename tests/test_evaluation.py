import torch

from conftest import tiny_model
from pipelines.evaluation import LMHead, score_windows, size_metrics


def _windows():
    return torch.randint(0, 320, (5, 20), generator=torch.Generator().manual_seed(0))


def test_perplexity_is_exp_of_mean_next_token_nll():
    model, windows = tiny_model("llama"), _windows()
    scores = score_windows(model, windows, batch_size=2)
    with torch.no_grad():
        logits = model(input_ids=windows).logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, 320), windows[:, 1:].reshape(-1))
    assert scores.tokens == 5 * 19
    assert abs(scores.perplexity - nll.exp().item()) < 1e-3 * nll.exp().item()


def test_kl_is_exact_full_vocabulary_kl_and_zero_against_itself():
    base, other, windows = tiny_model("gemma2", seed=0), tiny_model("gemma2", seed=1), _windows()
    head = LMHead.of(base)
    hidden = score_windows(base, windows).hidden
    with torch.no_grad():  # the cached hidden states give back the base's logits, softcap included
        torch.testing.assert_close(head.logits(hidden), base(input_ids=windows).logits[:, :-1], rtol=1e-5, atol=1e-5)
    itself = score_windows(base, windows, (head, hidden), batch_size=2)
    assert abs(itself.kl_sum) < 1e-6 and itself.top1_agree == itself.tokens

    scores = score_windows(other, windows, (head, hidden), batch_size=3)
    with torch.no_grad():
        p = torch.log_softmax(base(input_ids=windows).logits[:, :-1], -1)
        q = torch.log_softmax(other(input_ids=windows).logits[:, :-1], -1)
    expected = (p.exp() * (p - q)).sum(-1).mean().item()
    assert expected > 0.01
    assert abs(scores.kl_sum / scores.tokens - expected) < 1e-5
    assert scores.top1_agree == (p.argmax(-1) == q.argmax(-1)).sum().item()


def test_scores_are_the_same_with_the_lm_head_run_in_chunks_of_tokens(monkeypatch):
    """A batch's tokens go through the LM head a chunk at a time (7 tokens here: chunks that
    straddle windows, a short last one); sums and the hidden states are those of one pass."""
    from pipelines import evaluation

    base, other, windows = tiny_model("gemma2", seed=0), tiny_model("gemma2", seed=1), _windows()
    head, hidden = LMHead.of(base), score_windows(base, windows).hidden
    whole = score_windows(other, windows, (head, hidden), batch_size=2)
    monkeypatch.setattr(evaluation, "LOGIT_CHUNK", 7 * 320)
    chunked = score_windows(other, windows, (head, hidden), batch_size=2)
    assert chunked.top1_agree == whole.top1_agree and torch.equal(chunked.hidden, whole.hidden)
    assert abs(chunked.nll_sum - whole.nll_sum) < 1e-3 and abs(chunked.kl_sum - whole.kl_sum) < 1e-4


def test_lm_head_round_trips_through_safetensors(tmp_path):
    head = LMHead.of(tiny_model("gemma2"))
    head.save(tmp_path / "head.safetensors")
    loaded = LMHead.load(tmp_path / "head.safetensors", "save it again")
    assert loaded.softcap == 30.0 and torch.equal(loaded.weight, head.weight)


def test_size_metrics_count_stored_bytes_per_linear_weight(tmp_path):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path)
    metrics = size_metrics(model, tmp_path)
    assert metrics["bits_per_weight"] == 32.0
    assert metrics["parameters"] == sum(p.numel() for p in model.parameters())
    assert metrics["kv_cache_bytes_per_token_fp16"] == 2 * 4 * 2 * 16 * 2
    model.half().save_pretrained(tmp_path / "half")
    assert size_metrics(model, tmp_path / "half")["bits_per_weight"] == 16.0


def test_logical_parameters_ignore_storage_and_ties():
    from pipelines.evaluation import logical_parameters

    model = tiny_model("llama")
    assert logical_parameters(model) == sum(p.numel() for p in model.parameters())
    model.config.tie_word_embeddings = True
    model.tie_weights()
    assert logical_parameters(model) == sum(p.numel() for p in model.parameters())
