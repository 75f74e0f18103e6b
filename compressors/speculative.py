"""Greedy speculative decoding: a draft proposes `lookahead` tokens, the target checks them all in
one forward pass and keeps the longest prefix it agrees with plus its own next token, so the
output is the target's own greedy output, produced in fewer target forwards.

Written here rather than with transformers' assisted generation because the measurement is the
point: tokens per target forward and acceptance counted exactly, and (for a vocabulary-trimmed
draft) proposals mapped back to the target's token ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class SpeculativeResult:
    tokens: torch.Tensor  # [1, prompt + new]
    prompt_len: int
    target_forwards: int  # target passes, the prompt's included: each yields one target token
    proposed: int  # draft tokens offered to the target
    accepted: int  # draft tokens the target agreed with

    @property
    def new_tokens(self) -> int:
        """Tokens returned: accepted + target_forwards, less any decoded past an end-of-text."""
        return self.tokens.shape[1] - self.prompt_len

    @property
    def tokens_per_target_forward(self) -> float:
        return self.new_tokens / max(self.target_forwards, 1)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / max(self.proposed, 1)


def _trim_cache(cache, length: int) -> None:
    """Drop cached positions beyond `length` (transformers' crop takes the count to remove)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


@torch.no_grad()
def speculative_greedy(
    target: nn.Module, draft: nn.Module, input_ids: torch.Tensor, max_new_tokens: int, lookahead: int,
    draft_to_target: torch.Tensor | None = None, eos_token_id: int | list[int] | None = None,
) -> SpeculativeResult:
    """Greedy decoding of `target` from `input_ids` [1, n], `max_new_tokens` tokens or up to
    and including an `eos_token_id`, with `draft` proposing up to `lookahead` tokens per target
    forward. `draft_to_target` maps the draft's output ids to the target's (a trimmed
    vocabulary); None: the same vocabulary."""
    from transformers import DynamicCache

    assert input_ids.shape[0] == 1, "speculative decoding here is batch 1"
    target_cache, draft_cache = DynamicCache(), DynamicCache()
    prompt = input_ids.shape[1]
    # the prompt: the target's first token; the draft caches the prompt but its last position
    # logits_to_keep=1 wherever only the last position's logits are read: the LM head is a large
    # part of a small model's cost
    logits = target(input_ids=input_ids, past_key_values=target_cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    tokens = torch.cat([input_ids, logits.argmax(-1, keepdim=True)], dim=1)
    if prompt > 1:
        draft(input_ids=input_ids[:, :-1], past_key_values=draft_cache, use_cache=True, logits_to_keep=1)
    stops = stop_tokens(eos_token_id, input_ids.device)
    forwards, proposed, accepted = 1, 0, 0
    while tokens.shape[1] - prompt < max_new_tokens and not torch.isin(tokens[0, prompt:], stops).any():
        # draft: from its cache (everything but the newest tokens) propose k tokens
        k = min(lookahead, max_new_tokens - (tokens.shape[1] - prompt) - 1)
        proposal = tokens
        if k > 0:
            _trim_cache(draft_cache, tokens.shape[1] - 1)
            step_input = tokens[:, draft_cache.get_seq_length():]
            for _ in range(k):
                draft_logits = draft(input_ids=step_input, past_key_values=draft_cache, use_cache=True, logits_to_keep=1).logits[:, -1]
                choice = draft_logits.argmax(-1, keepdim=True)
                step_input = draft_to_target[choice] if draft_to_target is not None else choice
                proposal = torch.cat([proposal, step_input], dim=1)
                if torch.isin(step_input, stops).any():  # nothing past an end-of-text is kept: neither offered nor counted
                    break
        # target: verify the last accepted token and the k proposals in one pass
        _trim_cache(target_cache, tokens.shape[1] - 1)
        logits = target(input_ids=proposal[:, tokens.shape[1] - 1 :], past_key_values=target_cache, use_cache=True).logits[0]
        predicted = logits.argmax(-1)  # the target's choice after each position
        offered = proposal[0, tokens.shape[1] :]
        agree = int((offered == predicted[: offered.numel()]).long().cumprod(0).sum())
        tokens = torch.cat([proposal[:, : tokens.shape[1] + agree], predicted[agree].view(1, 1)], dim=1)
        forwards, proposed, accepted = forwards + 1, proposed + offered.numel(), accepted + agree
    return SpeculativeResult(until_stop(tokens, prompt, stops, max_new_tokens), prompt, forwards, proposed, accepted)


def stop_tokens(eos_token_id: int | list[int] | None, device: torch.device) -> torch.Tensor:
    """The end-of-text ids (a generation config's int, list or None) as a tensor."""
    return torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id or [], dtype=torch.long, device=device)


def until_stop(tokens: torch.Tensor, prompt: int, stops: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """tokens [1, n] cut after the first new end-of-text token, or after `max_new_tokens` new ones."""
    stopped = torch.isin(tokens[0, prompt:], stops).nonzero()
    return tokens[:, : prompt + (int(stopped[0]) + 1 if stopped.numel() else max_new_tokens)]
