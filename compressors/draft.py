"""Draft models for speculative decoding, built from the target and distilled against it.

The pieces, in the order the draft stage (pipelines/stages.py:draft) uses them:
- `generate_continuations`: FastDraft-style data, the target's own greedy continuations of
  calibration prompts (what the draft must predict when it serves).
- `teacher_pass`: the target's final hidden states on those sequences (cached: the teacher's
  distributions are recomputed from them by one LM-head matmul, as the evaluation reference
  does) and each layer's block influence measured on the target itself.
- `choose_layers`: which target layers a layer-subset draft keeps.
- `emitted_vocabulary`: VOCABTRIM, the LM-head rows a draft keeps (the tokens the target
  emits most); `trim_lm_head` cuts a draft's head to them at load time. A proposal is an index
  into the kept rows and maps back to the target's token id, so verification stays exact.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from compressors.structured import BlockInfluence
from pipelines.models import decoder_layers

SELECTIONS = ("influence", "even")


@torch.no_grad()
def generate_continuations(
    target: nn.Module, prompts: torch.Tensor, new_tokens: int, batch_size: int, on_batch: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """The target's greedy continuation of each prompt ([n, p] -> [n, p + new_tokens]).
    End-of-text is suppressed so every sequence has the same length (no padding)."""
    sequences = []
    for batch in prompts.split(batch_size):
        sequences.append(
            target.generate(
                input_ids=batch, attention_mask=torch.ones_like(batch), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                do_sample=False, pad_token_id=0,
            )
        )
        if on_batch is not None:
            on_batch(batch.shape[0])
    return torch.cat(sequences)


@torch.no_grad()
def teacher_pass(target: nn.Module, sequences: torch.Tensor, batch_size: int) -> tuple[torch.Tensor, list[float]]:
    """The target's final (normed) hidden states [n, T, hidden] on `sequences`, and per decoder
    layer its block influence (1 - mean cos(input, output)) on the same tokens."""
    influences = [BlockInfluence() for _ in decoder_layers(target)]
    handles = [layer.register_forward_hook(i.hook, with_kwargs=True) for layer, i in zip(decoder_layers(target), influences)]
    try:
        hidden = [target.base_model(input_ids=batch, use_cache=False).last_hidden_state.float() for batch in sequences.split(batch_size)]
    finally:
        for handle in handles:
            handle.remove()
    return torch.cat(hidden), [influence.value for influence in influences]


def choose_layers(layers: int, keep: int, influence: list[float] | None) -> list[int]:
    """The `keep` layers (ascending) a layer-subset draft takes: the most influential ones
    (those that turn the residual stream most), or, without scores, evenly spaced from the
    first layer to the last."""
    if influence is not None:
        ranked = sorted(range(layers), key=lambda i: (-influence[i], i))
        return sorted(ranked[:keep])
    return sorted({round(i * (layers - 1) / max(keep - 1, 1)) for i in range(keep)}) if keep > 1 else [0]


def emitted_vocabulary(generated: torch.Tensor, context: torch.Tensor, vocab_size: int, keep: int) -> torch.Tensor:
    """VOCABTRIM's kept token ids (ascending): the `keep` tokens the target emitted most often
    in `generated`; ties, and the rest when it emitted fewer distinct tokens, by their count in
    `context` (the prompts' text), then by id."""
    emitted = torch.bincount(generated.flatten(), minlength=vocab_size)[:vocab_size]
    seen = torch.bincount(context.flatten(), minlength=vocab_size)[:vocab_size]
    score = emitted * (int(seen.max()) + 1) + seen
    ranked = torch.argsort(score, descending=True, stable=True)  # stable: equal scores keep id order
    return ranked[:keep].sort().values


def trim_lm_head(model: nn.Module, token_ids: torch.Tensor) -> None:
    """Replace the model's LM head by one holding only the rows `token_ids` (untied from the
    input embeddings, which keep the whole vocabulary): its logits index into `token_ids`."""
    head = model.get_output_embeddings()
    trimmed = nn.Linear(head.in_features, token_ids.numel(), bias=head.bias is not None, dtype=head.weight.dtype)
    with torch.no_grad():
        trimmed.weight.copy_(head.weight[token_ids])
        if head.bias is not None:
            trimmed.bias.copy_(head.bias[token_ids])
    model.config.tie_word_embeddings = False
    model.set_output_embeddings(trimmed)


def tokenizer_difference(a, b) -> str | None:
    """Why two tokenizers would not map the same text to the same ids (None: they do)."""
    vocab_a, vocab_b = a.get_vocab(), b.get_vocab()
    if vocab_a == vocab_b:
        return None
    differing = len(set(vocab_a.items()) ^ set(vocab_b.items()))
    return f"vocabularies of {len(vocab_a)} and {len(vocab_b)} tokens, {differing} token/id pairs not in both"
