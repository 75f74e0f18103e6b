"""Greedy speculative decoding gives exactly the target's greedy output and counts what the draft
contributed: a draft that is the target is always accepted, an unrelated one never helps, and a
draft with a remapped (trimmed) vocabulary is verified in the target's ids."""

import math
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from compressors.speculative import speculative_greedy
from conftest import FAMILIES, tiny_config, tiny_model


def tiny(seed: int):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config("llama")).eval()


@pytest.fixture(scope="module")
def target_and_prompt():
    target = tiny(0)
    prompt = torch.randint(0, 320, (1, 7), generator=torch.Generator().manual_seed(0))
    greedy = target.generate(prompt, max_new_tokens=30, min_new_tokens=30, do_sample=False)
    return target, prompt, greedy


@pytest.mark.parametrize("lookahead", [1, 4, 8])
def test_output_is_the_targets_greedy_output_whatever_the_draft(target_and_prompt, lookahead):
    target, prompt, greedy = target_and_prompt
    unrelated = speculative_greedy(target, tiny(1), prompt, 30, lookahead)
    assert torch.equal(unrelated.tokens, greedy)
    assert unrelated.target_forwards + unrelated.accepted == 30 == unrelated.new_tokens

    itself = speculative_greedy(target, target, prompt, 30, lookahead)
    assert torch.equal(itself.tokens, greedy)
    assert itself.acceptance_rate == 1.0
    # the prompt's pass gives one token, each verification lookahead + 1 (the last one fewer)
    assert itself.target_forwards == 1 + math.ceil(29 / (lookahead + 1))
    assert itself.tokens_per_target_forward == 30 / itself.target_forwards


def test_a_remapped_draft_vocabulary_is_verified_in_target_ids(target_and_prompt):
    """A draft whose LM head lists the vocabulary in another order (as a trimmed head does) with
    the map back to target ids proposes exactly what the target would."""
    target, prompt, greedy = target_and_prompt
    draft = tiny(0)
    order = torch.randperm(320, generator=torch.Generator().manual_seed(1))
    draft.lm_head.weight.data = draft.lm_head.weight.data[order].clone()
    result = speculative_greedy(target, draft, prompt, 30, 4, draft_to_target=order)
    assert torch.equal(result.tokens, greedy) and result.acceptance_rate == 1.0
    unmapped = speculative_greedy(target, draft, prompt, 30, 4)
    assert torch.equal(unmapped.tokens, greedy) and unmapped.acceptance_rate < 0.5


@pytest.mark.parametrize("position", [6, 7, 8, 9])  # each the first new token of its id, reached in an accepted run
def test_decoding_stops_after_an_end_of_text_token_as_generate_does(target_and_prompt, position):
    """The output ends as generate's does, whatever the draft, and no draft token past the end is
    offered or counted: every accepted draft token and every target forward's token is kept,
    but the last forward's when the end cut it."""
    target, prompt, greedy = target_and_prompt
    eos = int(greedy[0, prompt.shape[1] + position])
    # the prompt holds token 0: without a mask generate would take it for padding
    stopped = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=30, do_sample=False, eos_token_id=eos, pad_token_id=0)
    assert stopped.shape[1] - prompt.shape[1] == position + 1
    for draft in (target, tiny(1)):
        result = speculative_greedy(target, draft, prompt, 30, 4, eos_token_id=eos)
        assert torch.equal(result.tokens, stopped)
        assert result.accepted + result.target_forwards - 1 <= result.new_tokens <= result.accepted + result.target_forwards
    assert result.acceptance_rate < 1.0 and speculative_greedy(target, target, prompt, 30, 4, eos_token_id=eos).acceptance_rate == 1.0


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_greedy_decoding_on_a_static_cache_is_generates_output(family):
    """`lmpress generate` without a draft (pipelines.serving.greedy_decode): a static KV cache and
    a fixed-shape step (what a CUDA graph captures on a GPU; here run eagerly) give exactly
    transformers' greedy output in every family, sliding-window layers (8 positions, shorter
    than the 37 tokens) included; they stop after an end-of-text token as it does, and take one
    token. Queries and keys are scaled up so attention is sharp: at init it is near uniform, and a
    position off by one went unnoticed."""
    from pipelines.serving import greedy_decode

    target = tiny_model(family)
    for name, parameter in target.named_parameters():
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            parameter.data *= 8
    prompt = torch.randint(0, 320, (1, 7), generator=torch.Generator().manual_seed(0))
    whole = torch.ones_like(prompt)  # else generate takes the prompt's token 0, the pad id, for padding
    greedy = target.generate(prompt, attention_mask=whole, max_new_tokens=30, min_new_tokens=30, do_sample=False, pad_token_id=0)
    tokens, graphed = greedy_decode(target, prompt, 30)
    assert torch.equal(tokens, greedy) and not graphed
    eos = int(greedy[0, prompt.shape[1] + 10])
    stopped = target.generate(prompt, attention_mask=whole, max_new_tokens=30, do_sample=False, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(greedy_decode(target, prompt, 30, [eos, 10**6])[0], stopped)
    assert torch.equal(greedy_decode(target, prompt, 1)[0], greedy[:, : prompt.shape[1] + 1])


def test_greedy_decoding_says_when_the_logits_overflow_and_names_a_wider_dtype():
    """Argmax of an inf or nan row still picks a token, so an fp16 overflow (a model trained in
    bf16 with activations past 65504, as Gemma's are) would decode as gibberish; it is one error
    naming --dtype instead. The same model in fp32 decodes."""
    from pipelines.errors import LmpressError
    from pipelines.serving import greedy_decode

    model = tiny_model("llama")
    model.model.norm.weight.data.fill_(1e6)  # the last hidden state past fp16's range
    prompt = torch.randint(0, 320, (1, 5), generator=torch.Generator().manual_seed(0))
    assert greedy_decode(model, prompt, 4)[0].shape == (1, 9)
    with pytest.raises(LmpressError, match=r"overflowed float16 .*--dtype bfloat16 or --dtype float32"):
        greedy_decode(model.half(), prompt, 4)


def test_decoding_benchmark_runs_here(tmp_path, tiny_folder):
    """benchmarks/decode_graphs.py (CUDA graphs against eager decoding; its timing is a GPU's):
    on the CPU it decodes the dense and the packed model with generate and eagerly, and each
    pair gives the same tokens, so a GPU call spends its minutes on timing, not on a broken script."""
    import json
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "decode_graphs.py")
    result = subprocess.run([sys.executable, script, "--model", str(tiny_folder), "--level", "bits4g32", "--prompt-tokens", "5",
                             "--new-tokens", "4", "--rounds", "1", "--out", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads((tmp_path / "decode_graphs.json").read_text())["rows"]
    assert [(r["model"], r["decoding"]) for r in rows] == [(m, d) for m in ("dense", "packed bits4g32") for d in ("generate", "eager")]
    assert all(r["same_tokens_as_eager"] and not r["graphed"] for r in rows)
