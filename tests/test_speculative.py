"""Greedy speculative decoding gives exactly the target's greedy output and counts what the draft
contributed: a draft that is the target is always accepted, an unrelated one never helps, and a
draft with a remapped (trimmed) vocabulary is verified in the target's ids."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from compressors.speculative import speculative_greedy
from conftest import tiny_config


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


def test_decoding_stops_after_an_end_of_text_token_as_generate_does(target_and_prompt):
    target, prompt, greedy = target_and_prompt
    eos = int(greedy[0, prompt.shape[1] + 10])  # a token the target emits 11th
    stopped = target.generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=eos, pad_token_id=0)
    for draft in (target, tiny(1)):
        result = speculative_greedy(target, draft, prompt, 30, 4, eos_token_id=eos)
        assert torch.equal(result.tokens, stopped) and result.new_tokens == stopped.shape[1] - prompt.shape[1] <= 11
