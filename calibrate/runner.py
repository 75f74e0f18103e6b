"""Walk a causal LM one decoder layer at a time over a fixed set of token samples.

    runner = LayerRunner(model, input_ids, batch_size=8)
    for index, layer in runner:
        ...                                   # hooks, runner.forward(layer, propagate=False),
        ...                                   # change the layer's weights
    # after each step the samples are propagated through the (possibly changed) layer, so layer
    # i+1 sees the outputs of the layer i that the stage left behind.

Only the current layer runs on `device` (the rest of the model stays where it was loaded), and
only one set of hidden states is held between layers, so activation memory does not grow with
depth: one buffer for all samples (`runner.hidden` is its per-batch views) that each layer's
outputs are copied into, so a stage that keeps a layer's inputs must copy them. With
`dtype=torch.bfloat16` the layers run in bf16 (the hidden states are held in it too) while the
model's own weights stay as loaded: about 3x faster matmuls on CPUs with AVX512-BF16 and on
GPUs, at bf16's precision for the activations.
"""

from __future__ import annotations

import ctypes
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import nn

from pipelines.models import decoder_layers


def _to(value, device, dtype=None):
    """Tensors in nested args to `device`, floating ones also to `dtype` (when given)."""
    if isinstance(value, torch.Tensor):
        return value.to(device, dtype) if dtype is not None and value.is_floating_point() else value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to(item, device, dtype) for item in value)
    if isinstance(value, dict):
        return {key: _to(item, device, dtype) for key, item in value.items()}
    return value


def release_free_memory() -> None:
    """Hand freed heap memory back to the OS (glibc only). Each layer frees one set of hidden
    states and allocates the next, tens of MB in pieces below glibc's (self-raising) mmap
    threshold; without a trim the heap keeps every hole and the process's resident memory
    ratchets up layer after layer."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


@contextmanager
def _running_in(layer: nn.Module, dtype: torch.dtype | None):
    """The layer's floating parameters cast to `dtype` for the duration, then put back as they
    were (the originals are kept, not cast back, so nothing is rounded)."""
    originals = {name: p.data for name, p in layer.named_parameters() if dtype is not None and p.is_floating_point()}
    try:
        for name, p in layer.named_parameters():
            if name in originals:
                p.data = p.data.to(dtype)
        yield
    finally:
        for name, p in layer.named_parameters():
            if name in originals:
                p.data = originals[name]


class LayerRunner:
    def __init__(
        self,
        model: nn.Module,
        input_ids: torch.Tensor,
        batch_size: int = 8,
        device: torch.device | str | None = None,
        on_layer_done: Callable[[int], None] | None = None,
        dtype: torch.dtype | None = None,
    ):
        self.model = model
        self.dtype = dtype
        self.layers = decoder_layers(model)
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.on_layer_done = on_layer_done
        self.hidden, self.calls = self._record_layer_calls(input_ids, batch_size)
        self._propagated = False

    @torch.no_grad()
    def _record_layer_calls(self, input_ids: torch.Tensor, batch_size: int):
        """Run the model once with every decoder layer replaced by a pass-through that records
        its arguments. The masks and position embeddings a layer receives depend on its type
        (sliding or global attention in Gemma/Qwen3), so each layer keeps its own; the tensors
        are shared between layers of one type, so this costs little memory. The base model is
        called without its LM head, which on many samples would dwarf everything else."""
        hidden: list[torch.Tensor] = []
        calls: list[list[tuple[tuple, dict]]] = [[] for _ in self.layers]

        def recorder(index: int):
            def forward(hidden_states, *args, **kwargs):
                calls[index].append((args, kwargs))
                if index == 0:
                    if not hidden:  # the first batch: now the shape is known, one buffer for all samples
                        buffer = hidden_states.new_empty((len(input_ids), *hidden_states.shape[1:]), dtype=self.dtype)
                        hidden.extend(buffer.split(batch_size))
                    hidden[len(calls[0]) - 1].copy_(hidden_states)
                if index == len(self.layers) - 1:
                    raise _Stopped  # nothing after the last layer is needed (the final norm's transients are skipped)
                return hidden_states

            return forward

        for index, layer in enumerate(self.layers):
            layer.forward = recorder(index)  # instance attribute shadows the class's forward
        try:
            for batch in input_ids.split(batch_size):
                try:
                    self.model.base_model(input_ids=batch.to(self.device), use_cache=False)
                except _Stopped:
                    pass
        finally:
            for layer in self.layers:
                del layer.forward
        release_free_memory()  # the full-precision embeddings of every batch, freed
        return hidden, calls

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[tuple[int, nn.Module]]:
        for index, layer in enumerate(self.layers):
            home = next(layer.parameters()).device
            layer.to(self.device)
            self._index, self._propagated = index, False
            yield index, layer
            if not self._propagated:
                self.forward(layer)
            layer.to(home)
            if self.on_layer_done is not None:
                self.on_layer_done(index)
            release_free_memory()

    def _batch_calls(self, layer: nn.Module) -> Iterator[tuple[torch.Tensor, tuple, dict]]:
        """The current layer's recorded call arguments for every batch, on the device and in the
        runner's dtype, while the layer's parameters are in that dtype."""
        with _running_in(layer, self.dtype):
            for hidden, (args, kwargs) in zip(self.hidden, self.calls[self._index]):
                yield hidden, _to(args, self.device, self.dtype), _to(kwargs, self.device, self.dtype)

    @torch.no_grad()
    def capture_inputs(self, layer: nn.Module, module: nn.Module) -> list[tuple[tuple, dict]]:
        """The (args, kwargs) that `module`, a part of the current layer, is called with on every
        batch. The layer runs only up to that call, so capturing costs almost nothing."""
        captured = []
        handle = module.register_forward_pre_hook(lambda _, args, kwargs: captured.append((args, kwargs)), with_kwargs=True)
        try:
            self.forward(layer, propagate=False, until=module)
        finally:
            handle.remove()
        return captured

    @torch.no_grad()
    def forward(self, layer: nn.Module, propagate: bool = True, until: nn.Module | None = None) -> None:
        """Run the current layer on every batch of samples (hooks on it see the real inputs).
        With `propagate`, its outputs become the inputs of the next layer. Without, nothing
        after `until` (a part of the layer), when given, is needed: each batch stops once
        its pre-hooks have run, so a pass that only collects statistics skips the rest."""
        assert until is None or not propagate, "a propagating pass needs the whole layer"
        stop = until.register_forward_pre_hook(_stop) if until is not None else None  # after the hooks already there
        try:
            for batch, (hidden, args, kwargs) in enumerate(self._batch_calls(layer)):
                try:
                    output = layer(hidden, *args, **kwargs)
                except _Stopped:
                    continue
                if propagate:  # in place: a batch's input is dead once its output exists, so one set is held, not two
                    self.hidden[batch].copy_(output)
        finally:
            if stop is not None:
                stop.remove()
        self._propagated = self._propagated or propagate
        release_free_memory()  # the pass's transients, so that what runs next (a compressor) starts from its floor


class _Stopped(Exception):
    pass


def _stop(module, args):
    raise _Stopped
