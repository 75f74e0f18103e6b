"""Quality and size of a model against its base.

Perplexity on non-overlapping windows of held-out text; KL divergence KL(base || model) of the
next-token distributions and top-1 agreement on the same tokens, over the full vocabulary.

The base's distributions are cached as a *reference* without storing them: a distribution
over this vocabulary costs 100 MB per 512-token window, and a top-k cut leaves several percent
of the mass unseen. Instead the reference keeps the base's final hidden states (hidden size
floats per token) and its LM head once; the base logits are recomputed from them exactly, at
the cost of one LM-head matmul per window.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from pipelines.errors import require
from pipelines.models import architecture_of, decoder_layers, kv_cache_bytes_per_token, safetensors_layout


def softcapped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Final logits as Gemma 2/3 squash them (cap * tanh(logits / cap)); others as they are."""
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


@dataclass
class LMHead:
    """The base's final projection, applied to cached hidden states."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    softcap: float | None = None  # Gemma 2/3's final-logit cap (`softcapped`)

    @classmethod
    def of(cls, model) -> "LMHead":
        head = model.get_output_embeddings()
        return cls(head.weight.detach(), head.bias, getattr(model.config, "final_logit_softcapping", None))

    def rows(self, token_ids: torch.Tensor | None) -> "LMHead":
        """The head restricted to the vocabulary `token_ids` (None: all of it)."""
        if token_ids is None:
            return self
        return LMHead(self.weight[token_ids], None if self.bias is None else self.bias[token_ids], self.softcap)

    def to(self, device) -> "LMHead":
        return LMHead(self.weight.to(device), None if self.bias is None else self.bias.to(device), self.softcap)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return softcapped(torch.nn.functional.linear(hidden, self.weight, self.bias), self.softcap)

    def save(self, path: Path) -> None:
        tensors = {"weight": self.weight.contiguous()}
        if self.bias is not None:
            tensors["bias"] = self.bias.detach().contiguous()
        save_file(tensors, path, metadata={"softcap": str(self.softcap or "")})

    @classmethod
    def load(cls, path: Path, what: str) -> "LMHead":
        """The head saved at `path`; `what` ends the error for a damaged file (how to make it again)."""
        from safetensors import safe_open

        from pipelines.artifact import read_safetensors

        tensors = read_safetensors(path, what)  # first: a damaged file is a clear error, not safe_open's
        with safe_open(path, framework="pt") as handle:
            softcap = handle.metadata().get("softcap") or None
        return cls(tensors["weight"], tensors.get("bias"), float(softcap) if softcap else None)


@dataclass
class WindowScores:
    nll_sum: float
    tokens: int
    hidden: torch.Tensor  # [windows, seq_len - 1, hidden]: final hidden states, to serve as a reference
    kl_sum: float | None = None
    top1_agree: int | None = None

    @property
    def perplexity(self) -> float:
        return float(torch.tensor(self.nll_sum / self.tokens).exp())


LOGIT_CHUNK = 1 << 24  # logits held at once (64 MB in fp32): the tokens of a batch are scored this many at a time


@torch.no_grad()
def score_windows(
    model,
    windows: torch.Tensor,
    reference: tuple[LMHead, torch.Tensor] | None = None,
    batch_size: int = 4,
    on_batch=None,
) -> WindowScores:
    """One pass over the windows: NLL of each next token and the final hidden states; given a
    reference (the base's LM head and hidden states), KL(base || model) and top-1 agreement.

    The decoder runs a batch at a time and the LM head a chunk of its tokens at a time: a batch
    of 4 x 512 tokens has 400 MB of fp32 logits over this vocabulary, and its log-softmax, the
    base's and the KL terms as many again, where a chunk's stay in the cache; allocating and
    faulting in those buffers took as long as the forward itself."""
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    softcap = getattr(model.config, "final_logit_softcapping", None)
    chunk = max(1, LOGIT_CHUNK // head.out_features)
    nll_sum, kl_sum, agree, hidden = 0.0, 0.0, 0, []
    for start in range(0, windows.shape[0], batch_size):
        batch = windows[start : start + batch_size]
        states = decoder(input_ids=batch).last_hidden_state[:, :-1]
        hidden.append(states.float())
        states = states.flatten(0, 1)  # one copy a batch (the slice is not contiguous), not one a chunk
        base_states = reference[1][start : start + batch_size].flatten(0, 1) if reference is not None else None
        targets = batch[:, 1:].flatten()
        for first in range(0, targets.shape[0], chunk):
            rows = slice(first, first + chunk)
            logprobs = torch.log_softmax(softcapped(head(states[rows]), softcap).float(), dim=-1)
            nll_sum -= logprobs.gather(-1, targets[rows, None]).sum().item()
            if reference is not None:
                base_logprobs = torch.log_softmax(reference[0].logits(base_states[rows]).float(), dim=-1)
                kl_sum += torch.nn.functional.kl_div(logprobs, base_logprobs, log_target=True, reduction="sum").item()
                agree += (logprobs.argmax(-1) == base_logprobs.argmax(-1)).sum().item()
        if on_batch is not None:
            on_batch(batch.shape[0])
    return WindowScores(
        nll_sum, windows.shape[0] * (windows.shape[1] - 1), torch.cat(hidden),
        kl_sum if reference is not None else None, agree if reference is not None else None,
    )


def size_metrics(model, folder: Path) -> dict:
    """Parameters, bytes on disk, bits per decoder-linear weight and KV-cache bytes per token.

    Bits per weight counts every stored tensor under a decoder linear's name (weights, packed
    weights, scales, zero points, indices) against the linear's logical in x out weights, so it
    holds for dense, quantized and sparse formats alike."""
    layout = safetensors_layout(folder)
    arch = architecture_of(model.config)
    linear_bytes, linear_weights = 0, 0
    for index, layer in enumerate(decoder_layers(model)):
        for name in arch.linears:
            prefix = f"{arch.layers}.{index}.{name}."
            linear_bytes += sum(size for key, (_, _, size) in layout.items() if key.startswith(prefix))
            module = layer.get_submodule(name)
            linear_weights += module.in_features * module.out_features
    require(linear_weights > 0 and linear_bytes > 0, f"no decoder linear weights found in {folder}'s safetensors")
    return {
        "parameters": logical_parameters(model),
        "weights_bytes": sum(file.stat().st_size for file in folder.glob("*.safetensors")),
        "bits_per_weight": round(8 * linear_bytes / linear_weights, 4),
        "kv_cache_bytes_per_token_fp16": kv_cache_bytes_per_token(model.config),
    }


def logical_parameters(model) -> int:
    """Weights and biases as the architecture defines them, whatever their storage: a linear
    counts in x out even when packed (bitsandbytes keeps 4-bit weights as uint8 pairs), scales
    and zero points count nothing, and a tied weight counts once."""
    seen, total = set(), 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(getattr(module, "in_features", None), int) and (isinstance(weight, torch.Tensor) or hasattr(module, "weight_packed")):
            key = id(weight) if isinstance(weight, torch.Tensor) else id(module)
            if key not in seen:
                seen.add(key)
                total += module.in_features * module.out_features
        else:
            for name, parameter in module.named_parameters(recurse=False):
                if name == "weight" and id(parameter) not in seen:
                    seen.add(id(parameter))
                    total += parameter.numel()
        bias = getattr(module, "bias", None)
        if isinstance(bias, torch.Tensor):
            total += bias.numel()
    return total
