"""Walk a causal LM one decoder layer at a time over a fixed set of token samples.

    runner = LayerRunner(model, input_ids, batch_size=8)
    for index, layer in runner:
        ...                                   # hooks, runner.forward(layer, propagate=False),
        ...                                   # change the layer's weights
    # after each step the samples are propagated through the (possibly changed) layer, so layer
    # i+1 sees the outputs of the layer i that the stage left behind.

Only the current layer runs on `device` (the rest of the model stays where it was loaded), and
only one set of hidden states is kept between layers, so activation memory does not grow with
depth: one tensor per batch, each layer's outputs written over its inputs batch by batch. On the
CPU they are kept in a scratch file (`scratch`, a temporary folder by default), not in the
process's memory: a pass reads one batch at a time, so the process holds one batch of hidden
states, not all of them (151 MB for 128 x 512 tokens of SmolLM2-135M in fp32, a sixth of a
quantize run's peak), at the cost of a copy through the page cache per batch. On a GPU they stay
in its memory (`hidden_in_file` chooses otherwise). `runner.hidden` gives a copy of them all.
With `dtype=torch.bfloat16` the layers run in bf16 (the hidden states are kept in it too) while
the model's own weights stay as loaded: about 3x faster matmuls on CPUs with AVX512-BF16 and on
GPUs, at bf16's precision for the activations.
"""

from __future__ import annotations

import ctypes
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from calibrate.stats import Moments
from pipelines.models import Architecture, decoder_layers


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


CAUSAL_CHUNK = 64  # queries per SDPA call in causal_sdpa_in_chunks (the fastest of 32-256 at 512 tokens here)
CHUNKED_ATTENTION = "lmpress_causal_chunks"  # its name in transformers' AttentionInterface


def causal_sdpa_in_chunks(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' sdpa attention for the layer passes, with a causal prefill on the CPU split
    into chunks of CAUSAL_CHUNK queries, each attending only the keys up to its own last query.
    torch's CPU flash attention (2.13) takes keys in blocks of 512 and skips only whole blocks
    above the diagonal, so at the calibration's 512 tokens it computes every masked score too:
    chunked, SDPA takes 24 ms instead of 36 on a SmolLM2-135M layer's 4 x 512 tokens (one AVX2
    core), with outputs equal up to float rounding (3e-7). Anything else (a mask, decoding, a
    GPU, softcapping, a position bias, dropout) goes to transformers' own sdpa."""
    length = query.shape[2]
    causal = getattr(module, "is_causal", True) and kwargs.get("is_causal") is not False
    if (attention_mask is not None or not causal or dropout or query.device.type != "cpu" or key.shape[2] != length
            or length <= CAUSAL_CHUNK or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    chunks = []
    for start in range(0, length, CAUSAL_CHUNK):
        end = min(start + CAUSAL_CHUNK, length)
        visible = torch.ones(end - start, end, dtype=torch.bool).tril(start)  # query start + i sees keys 0 .. start + i
        chunks.append(torch.nn.functional.scaled_dot_product_attention(
            query[:, :, start:end], key[:, :, :end], value[:, :, :end], attn_mask=visible, scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1]))
    return torch.cat(chunks, dim=2).transpose(1, 2).contiguous(), None


AttentionInterface.register(CHUNKED_ATTENTION, causal_sdpa_in_chunks)


@contextmanager
def _chunked_causal_attention(model: nn.Module):
    """The model's sdpa layers attend through causal_sdpa_in_chunks for the duration."""
    config = model.config
    original = config._attn_implementation
    if original != "sdpa":
        yield
        return
    config._attn_implementation = CHUNKED_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = original


class LayerRunner:
    def __init__(
        self,
        model: nn.Module,
        input_ids: torch.Tensor,
        batch_size: int = 8,
        device: torch.device | str | None = None,
        on_layer_done: Callable[[int], None] | None = None,
        dtype: torch.dtype | None = None,
        scratch: Path | None = None,
        hidden_in_file: bool | None = None,
    ):
        self.model = model
        self.dtype = dtype
        self.layers = decoder_layers(model)
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.on_layer_done = on_layer_done
        self.scratch = scratch
        in_file = self.device.type == "cpu" if hidden_in_file is None else hidden_in_file
        self._hidden = _BatchFile(scratch) if in_file else _BatchList()
        self.calls = self._record_layer_calls(input_ids, batch_size)
        self._propagated = False
        self._kept: _BatchFile | None = None  # forward_true_sequential's scratch file

    def close(self) -> None:
        """Close the scratch files (a stage does, before its partial output folder is renamed)."""
        self._hidden.close()
        if self._kept is not None:
            self._kept.close()
            self._kept = None

    @property
    def hidden(self) -> list[torch.Tensor]:
        """The hidden states as they are now (a copy), one tensor per batch."""
        return [self._hidden.read(batch, self.device).clone() for batch in range(len(self._hidden))]

    @torch.no_grad()
    def _record_layer_calls(self, input_ids: torch.Tensor, batch_size: int):
        """Run the model once with every decoder layer replaced by a pass-through that records
        its arguments, and the first layer's inputs. The masks and position embeddings a layer
        receives depend on its type (sliding or global attention in Gemma/Qwen3), so each layer
        keeps its own; the tensors are shared between layers of one type, so this costs little
        memory. The base model is called without its LM head, which on many samples would dwarf
        everything else."""
        calls: list[list[tuple[tuple, dict]]] = [[] for _ in self.layers]

        def recorder(index: int):
            def forward(hidden_states, *args, **kwargs):
                calls[index].append((args, kwargs))
                if index == 0:
                    self._hidden.append(hidden_states.to(self.dtype) if self.dtype is not None else hidden_states)
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
        return calls

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[tuple[int, nn.Module]]:
        try:
            with _chunked_causal_attention(self.model):  # the calls were recorded with the model's own (its masks are made for it)
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
        finally:
            if self._kept is not None:
                self._kept.close()
                self._kept = None

    def _batch_calls(self, layer: nn.Module) -> Iterator[tuple[torch.Tensor, tuple, dict]]:
        """The current layer's hidden states and recorded call arguments for every batch, on the
        device and in the runner's dtype, while the layer's parameters are in that dtype. A
        caller that changes the hidden states writes them back (`self._hidden.write`)."""
        with _running_in(layer, self.dtype):
            for batch, (args, kwargs) in enumerate(self.calls[self._index]):
                yield self._hidden.read(batch, self.device), _to(args, self.device, self.dtype), _to(kwargs, self.device, self.dtype)

    @torch.no_grad()
    def capture_inputs(self, layer: nn.Module, module: nn.Module) -> list[tuple[tuple, dict]]:
        """The (args, kwargs) that `module`, a part of the current layer, is called with on every
        batch. The layer runs only up to that call, so capturing costs almost nothing. On a GPU
        a module that takes the layer's input unchanged gets the kept hidden states themselves,
        which the next propagating pass overwrites: clone what must outlive it."""
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
                if propagate:  # over its input: a batch's input is dead once its output exists, so one set is kept, not two
                    self._hidden.write(batch, output)
        finally:
            if stop is not None:
                stop.remove()
        self._propagated = self._propagated or propagate
        release_free_memory()  # the pass's transients, so that what runs next (a compressor) starts from its floor

    @torch.no_grad()
    def forward_true_sequential(self, layer: nn.Module, arch: Architecture, compress: Callable[[dict], None]) -> None:
        """GPTQ's true-sequential order over the current layer, propagating its outputs, with
        each linear run once. The four groups of linears that read one tensor (q/k/v, o,
        gate/up, down: `arch.input_groups`) are compressed in turn, each from the moments of
        its input as computed with the groups before it compressed: `compress({linear:
        LinearStatistics})` changes the group's weights (under no_grad). Re-running the layer up
        to each group (the simple way) runs its linears 2.5 times over; here the layer goes in
        steps along its pre-norm structure (`Architecture`'s docstring), and the two inputs that
        would cost a re-run, the attention's output (o's input) and the MLP's product (down's),
        are kept between the step that makes them and the one that reads them in a scratch file
        in the runner's `scratch` (one file for the walk): disk traffic instead of holding 2.7x
        the hidden states in memory, or re-running gate/up. The hidden states hold the layer's
        input, then the residual after attention, then the layer's output."""
        qkv, o, gate_up, down = arch.input_groups
        attention_norm, mlp_norm = layer.get_submodule(arch.attention_norm), layer.get_submodule(arch.mlp_norm)
        attention_out_norm, mlp_out_norm = (layer.get_submodule(name) if name else nn.Identity() for name in (arch.attention_out_norm, arch.mlp_out_norm))
        o_proj, down_proj, mlp = layer.get_submodule(o[0]), layer.get_submodule(down[0]), layer.get_submodule(down[0].rpartition(".")[0])
        moments = None

        def compress_group(group: tuple[str, ...]) -> None:
            nonlocal moments
            statistics = dict.fromkeys(group, moments.statistics())
            moments = None  # its fp64 sums and buffers, and the pass's transients, before the compressor's own working memory
            release_free_memory()
            compress(statistics)

        def keep(module, args):  # the input's moments, and a copy for the step that reads it
            moments.add(args[0])
            kept.append(args[0])

        if self._kept is None:  # one file for the walk: each layer rewrites the pages of the one before
            self._kept = _BatchFile(self.scratch)
        kept = self._kept
        kept.clear()
        moments = Moments(layer.get_submodule(qkv[0]).in_features)
        for hidden, _, _ in self._batch_calls(layer):  # q/k/v read the normed input: no linear runs
            moments.add(attention_norm(hidden))
        compress_group(qkv)

        moments = Moments(o_proj.in_features)
        with _hooked(o_proj, keep):
            self.forward(layer, propagate=False, until=o_proj)  # attention with q/k/v compressed, up to o
        compress_group(o)

        moments = Moments(layer.get_submodule(gate_up[0]).in_features)
        for batch, (hidden, _, _) in enumerate(self._batch_calls(layer)):  # the residual, in place of the input
            hidden.add_(attention_out_norm(o_proj(kept.read(batch, self.device))))
            self._hidden.write(batch, hidden)
            moments.add(mlp_norm(hidden))
        compress_group(gate_up)

        kept.clear()
        moments = Moments(down_proj.in_features)
        with _hooked(down_proj, keep), _hooked(down_proj, _stop):
            for hidden, _, _ in self._batch_calls(layer):  # gate/up compressed, up to down
                try:
                    mlp(mlp_norm(hidden))
                except _Stopped:
                    pass
        compress_group(down)

        for batch, (hidden, _, _) in enumerate(self._batch_calls(layer)):  # the layer's output, in place of the residual
            self._hidden.write(batch, hidden.add_(mlp_out_norm(down_proj(kept.read(batch, self.device)))))
        self._propagated = True
        release_free_memory()


@contextmanager
def _hooked(module: nn.Module, pre_hook):
    handle = module.register_forward_pre_hook(pre_hook)
    try:
        yield
    finally:
        handle.remove()


class _BatchFile:
    """One tensor per batch, in an unnamed temporary file in `folder`, read back by batch index
    into fresh memory; `write` replaces a batch's tensor with one of its shape in place, and
    `clear` starts over in the same file, whose pages are then rewritten rather than allocated
    (8x faster here). The file is gone when closed, or when the process dies. Hand-written
    because what torch offers keeps the data in the process: `torch.from_file` maps the file,
    and pages a map has touched count as the process's until it is unmapped."""

    def __init__(self, folder: Path | None):
        self.file = tempfile.TemporaryFile(dir=folder)
        self.clear()

    def __len__(self) -> int:
        return len(self.entries)

    def close(self) -> None:
        self.file.close()

    def append(self, tensor: torch.Tensor) -> None:
        self.write(len(self.entries), tensor)

    def write(self, batch: int, tensor: torch.Tensor) -> None:
        """`tensor` as batch `batch`: the next one, or in place of one of its shape (cast to its dtype)."""
        if batch == len(self.entries):
            data = tensor.detach().to("cpu").contiguous()
            self.entries.append((self.end, data.shape, data.dtype))
            self.end += data.numel() * data.element_size()
        else:
            _, shape, dtype = self.entries[batch]
            _require_shape(batch, shape, tensor)
            data = tensor.detach().to("cpu", dtype).contiguous()
        self.file.seek(self.entries[batch][0])
        self.file.write(_bytes_of(data))

    def read(self, batch: int, device: torch.device) -> torch.Tensor:
        start, shape, dtype = self.entries[batch]
        tensor = torch.empty(shape, dtype=dtype)
        self.file.seek(start)
        if self.file.readinto(_bytes_of(tensor)) != tensor.numel() * tensor.element_size():
            raise RuntimeError(f"the scratch file gave back less than batch {batch} holds: was it truncated?")
        return tensor.to(device)

    def clear(self) -> None:
        self.entries: list[tuple[int, torch.Size, torch.dtype]] = []
        self.end = 0


class _BatchList:
    """_BatchFile's reading and writing over tensors held where they are (a GPU's memory):
    `read` gives the kept tensor itself, so changing it in place changes the batch."""

    def __init__(self):
        self.tensors: list[torch.Tensor] = []

    def __len__(self) -> int:
        return len(self.tensors)

    def close(self) -> None:
        self.tensors.clear()

    def append(self, tensor: torch.Tensor) -> None:
        self.write(len(self.tensors), tensor)

    def write(self, batch: int, tensor: torch.Tensor) -> None:
        if batch == len(self.tensors):
            self.tensors.append(tensor.detach().clone())
        else:
            _require_shape(batch, self.tensors[batch].shape, tensor)
            self.tensors[batch].copy_(tensor)  # torch skips a copy onto itself

    def read(self, batch: int, device: torch.device) -> torch.Tensor:
        return self.tensors[batch].to(device)


def _require_shape(batch: int, shape: torch.Size, tensor: torch.Tensor) -> None:
    """A batch is replaced only by a tensor of its shape (copy_ would broadcast a smaller one)."""
    if tensor.shape != shape:
        raise ValueError(f"batch {batch} holds {tuple(shape)}, not {tuple(tensor.shape)}")


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's memory as flat bytes (through uint8: bf16 has no numpy dtype)."""
    return memoryview(tensor.view(-1).view(torch.uint8).numpy())


class _Stopped(Exception):
    pass


def _stop(module, args):
    raise _Stopped
