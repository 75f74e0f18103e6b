"""Kernel registry and the linear layer that serves packed weights.

Each entry declares which packed weights it can run and carries its torch reference; before
its first use on a device it passes a self-check against that reference (GPTQModel keeps
kernel selection honest the same way), so a broken kernel is never selected silently.
"""

from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from compressors import packed_int, packed_int_gluon
from compressors.packed_int import KERNEL_BITS, PackedWeight


@dataclass(frozen=True)
class Kernel:
    name: str
    format: str
    supports: Callable[[PackedWeight], bool]
    run: Callable[[torch.Tensor, PackedWeight], torch.Tensor]
    reference: Callable[[torch.Tensor, PackedWeight], torch.Tensor]
    sources: tuple[Path, ...]  # the files an artifact bundles to serve with it
    # what the self-check runs: `run` without autotuning. Tuning the check's small weights cost
    # 6-26 s per decode path on an H100 (over 2 minutes before `lmpress latency` timed anything)
    check: Callable[[torch.Tensor, PackedWeight], torch.Tensor]

    def source_hashes(self) -> dict[str, str]:
        """Each source's path inside an artifact (`kernels/<file>`) and its sha256."""
        return {f"kernels/{source.name}": hashlib.sha256(source.read_bytes()).hexdigest() for source in self.sources}


def _packed_matmul_serves(weight: PackedWeight) -> bool:
    """Every packed kind but 2:4 weights with fp16 values: the general kernel decodes them
    (the tests check it), but ran 5-20x slower than dense fp16 on an H100 (and torch's own 2:4
    path 0.5-1.0x; benchmarks/results/kernel_speed_h100.md), so a dense copy serves them."""
    return weight.bits in KERNEL_BITS and not (weight.bitmask is not None and weight.bits == 16)


KERNELS = [
    Kernel(
        name="triton-packed-matmul",
        format="pack-quantized, lmpress-packed (grids, codebooks, 2:4 sparse quantized)",
        supports=_packed_matmul_serves,
        run=packed_int.matmul_triton,
        reference=packed_int.matmul_reference,
        sources=(Path(packed_int.__file__), Path(packed_int_gluon.__file__)),  # the Gluon GEMV serves int4 at batch 1 where faster
        check=functools.partial(packed_int.matmul_triton, tune=False),
    ),
]

_self_checked: dict[tuple[str, str], bool] = {}


def triton_runs_on(device: torch.device) -> bool:
    """Triton compiles for CUDA; elsewhere only its interpreter runs it (slowly, for tests)."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _self_check_weights(device: torch.device) -> list[PackedWeight]:
    """Small weights of each decoding path: 4-bit symmetric (the whole-word kernels), 3-bit
    asymmetric in groups of 40 (the general kernels: codes straddle words and groups), 3-bit
    in groups of 32 and a 3-bit codebook (the whole-unit kernels: 32 codes in 3 words), 2:4
    sparse with fp16 values (general) or 4-bit values (whole-word), and 4- and 3-bit
    interleaved unless LMPRESS_INTERLEAVE=0."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from compressors.packed_int import pack_sparse24

    generator = torch.Generator().manual_seed(0)
    codes = lambda bits, columns=80: pack_to_int32(  # noqa: E731
        torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (48, columns), generator=generator, dtype=torch.int8), bits)
    scale = lambda groups=2: (torch.rand(48, groups, generator=generator) / 50).half()  # noqa: E731
    weights = [
        PackedWeight(codes(4), scale(), 4, 80),
        PackedWeight(codes(3), scale(), 3, 80, torch.randint(-2, 2, (48, 2), generator=generator, dtype=torch.int8)),
        PackedWeight(codes(3, 96), scale(3), 3, 96),
        PackedWeight(codes(3), None, 3, 80, codebook=torch.randn(48, 8, generator=generator).half() / 50),
    ]
    keep = torch.rand(48, 20, 4, generator=generator).argsort(dim=2) < 2  # 2 of every 4, at random
    values, bitmask = pack_sparse24(torch.randn(48, 80, generator=generator).half(), keep.reshape(48, 80))
    weights.append(PackedWeight(values, None, 16, 80, bitmask=bitmask))
    weights.append(PackedWeight(codes(4)[:, :5], scale()[:, :1], 4, 80, bitmask=bitmask))
    if interleave_setting() != "0":  # checked only where it may serve, so that turning it off cannot take the kernel from unit order
        weights += [PackedWeight(codes(4, 64), scale(), 4, 64).interleave(), PackedWeight(codes(3, 128), scale(1), 3, 128).interleave()]
    return [weight.to(device) for weight in weights]


def self_check(kernel: Kernel, device: torch.device) -> bool:
    key = (kernel.name, str(device), interleave_setting())
    if key not in _self_checked:
        generator = torch.Generator().manual_seed(1)
        dtype = torch.float16 if device.type == "cuda" else torch.float32
        ok = True
        for weight in _self_check_weights(device):
            for rows in (1, 5):
                x = torch.randn(rows, weight.columns, generator=generator).to(device, dtype)
                expected = kernel.reference(x, weight).float()
                ok &= bool(torch.allclose(kernel.check(x, weight).float(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item()))
        _self_checked[key] = ok
    return _self_checked[key]


def capture_graph(call: Callable[[], object], warm_up: Callable[[], object] | None = None) -> torch.cuda.CUDAGraph:
    """`call` captured in a CUDA graph, to replay with no Python or launch overhead. `warm_up`
    (by default `call` itself) runs twice first, on a side stream as torch asks before a
    capture: kernels compile, autotune and are picked there, since a capture can neither time
    nor synchronize. A capture that fails raises torch's RuntimeError."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            (warm_up or call)()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph


def replay_seconds(graph: torch.cuda.CUDAGraph, replays: int, before: Callable[[], object] | None = None) -> float:
    """Median GPU seconds of a replay of `graph`, timed by CUDA events; `before()` runs
    untimed ahead of each."""
    times = []
    for _ in range(replays):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def gpu_seconds(calls: list[Callable[[], object]], replays: int = 25) -> float:
    """Median GPU seconds per call. The calls are captured in one CUDA graph and replayed, so
    launch overhead is not counted (serving engines replay graphs too). Give one call per copy
    of the weights, enough copies to overflow the L2 cache (`l2_overflowing_copies`), so the
    weights come from device memory as they do when a model serves."""
    def every_call():
        for call in calls:
            call()

    return replay_seconds(capture_graph(every_call), replays) / len(calls)


def weight_seconds(run: Callable[[object], object], weight) -> float:
    """GPU seconds of `run(weight)` with the weight read from device memory: timed round-robin
    over enough copies of it (a tensor or a PackedWeight) to overflow the L2 cache."""
    copies = [weight] + [weight.clone() for _ in range(l2_overflowing_copies(weight.nbytes) - 1)]
    return gpu_seconds([lambda copy=copy: run(copy) for copy in copies])


def l2_overflowing_copies(nbytes: int, limit: int = 512) -> int:
    """How many copies of `nbytes` of weights fill three times the GPU's L2 cache."""
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return max(1, min(limit, -(-3 * l2 // nbytes)))


def select_kernel(weight: PackedWeight, device: torch.device) -> Kernel | None:
    if not triton_runs_on(device):
        return None
    return next((k for k in KERNELS if k.supports(weight) and self_check(k, device)), None)


def interleave_setting() -> str:
    """LMPRESS_INTERLEAVE: unset ("auto") serves each stored kind in the layout it was timed
    fastest in (`serves_interleaved`); "1" interleaves every weight that can be, "0" none."""
    return {"0": "0", "1": "1"}.get(os.environ.get("LMPRESS_INTERLEAVE", ""), "auto")


def serves_interleaved(weight: PackedWeight) -> bool:
    """Whether CUDA serving repacks `weight` into the interleaved layout (`interleave_order`).
    By default grids of 3, 4 and 8 bits. Timed on an H100 at 4096x4096, 4096x14336 and 14336x4096
    (benchmarks/results/kernel_speed_h100.md), the 4- and 8-bit GEMM (batch 16 and 64) ran
    1.12-1.52x faster interleaved at 16 of 18 rows, where each thread decodes whole words straight
    into its tensor-core fragment instead of reordering the tile through shared memory (int8
    4096x14336 batch 16 even, int4 4096x4096 batch 16 0.83x), their GEMV (batch 1) 0.84-1.18x;
    with the half2 3-bit decode (bd5c4c6) the 3-bit GEMM ran 1.07-2.24x faster interleaved and
    its GEMV 0.99-1.10x. Codebooks ran as fast or slower interleaved (0.53-1.04x), so they keep
    unit order, as do 2-bit grids (not timed)."""
    setting = interleave_setting()
    if setting == "0" or weight.interleaved or not weight.can_interleave():
        return False
    return setting == "1" or (weight.codebook is None and weight.bits in (3, 4, 8))


def serving_layout(weight: PackedWeight, device: torch.device) -> PackedWeight:
    """The weight as its kernel serves it on `device` (PackedLinear and `lmpress validate`)."""
    return weight.interleave() if device.type == "cuda" and serves_interleaved(weight) else weight


def serving_kernel(weight: PackedWeight, device: torch.device) -> Kernel | None:
    """The kernel a PackedLinear runs `weight` with on `device`; None is the dense path, from a
    cached dequantized copy: on the CPU, and for a weight no kernel serves (2:4 fp16 values)."""
    return select_kernel(weight, device) if device.type == "cuda" else None


class PackedLinear(nn.Module):
    """A linear whose weight stays packed: Triton kernel on CUDA; on the CPU, for bf16
    activations, torch's int4 kernel where it takes the weight (a 4-bit grid: `cpu_int4_group`),
    else the torch reference from a cached dense copy (fp32, or bf16 for bf16 activations), as
    for the weights `serving_kernel` serves dense on CUDA too. At its
    first CUDA call (a repack synchronizes: not inside graph capture) it takes the layout its
    kernel serves (`serving_layout`), in place: `interleaved` then says its `packed` buffer is
    in that layout. Its state dict is always the artifact's layout, saved and loaded."""

    def __init__(self, weight: PackedWeight, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = weight.columns, weight.rows
        self.bits = weight.bits
        for name in ("packed", "scale", "zero", "codebook", "bitmask"):
            self.register_buffer(name, getattr(weight, name))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.interleaved = weight.interleaved
        self._dense: torch.Tensor | None = None
        self._cpu_int4: packed_int.CpuInt4Weight | bool | None = None  # made at the first bf16 call on a CPU (False: the kernel cannot take the weight)
        self._kernels: dict[torch.device, int | None] = {}  # index in KERNELS, chosen once per device (picklable)
        self._served: PackedWeight | None = None  # the weight its kernel runs, kept so its launch arguments are worked out once

    @property
    def weight_packed(self) -> PackedWeight:
        return PackedWeight(self.packed, self.scale, self.bits, self.in_features, self.zero, self.codebook, self.bitmask, self.interleaved)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.interleaved:
            destination[prefix + "packed"] = self.weight_packed.unit_order().packed

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self.interleaved, self._dense, self._cpu_int4, self._kernels, self._served = False, None, None, {}, None  # the artifact's layout: choose kernel and layout again

    def _apply(self, fn, recurse=True):
        self._served, self._cpu_int4 = None, None  # .to(), .cuda(), .half() replace the buffers it holds
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.device not in self._kernels:  # a decode step calls every linear: choose once
            kernel = serving_kernel(self.weight_packed, flat.device)
            self._kernels[flat.device] = None if kernel is None else KERNELS.index(kernel)
            if kernel is not None:
                served = serving_layout(self.weight_packed, flat.device)
                self.packed, self.interleaved, self._served = served.packed, served.interleaved, None
        index = self._kernels[flat.device]
        if index is not None:
            if self._served is None:
                self._served = self.weight_packed
            out = KERNELS[index].run(flat, self._served)
        elif flat.device.type == "cpu" and flat.dtype == torch.bfloat16 and self._cpu_int4_weight() is not None:
            out = packed_int.matmul_cpu_int4(flat, self._cpu_int4)
        else:
            # a copy in the activations' dtype on a GPU (tensor cores, half the memory) and for bf16 on a CPU; fp32 for the rest on a CPU
            dtype = flat.dtype if flat.device.type != "cpu" or flat.dtype == torch.bfloat16 else torch.float32
            if self._dense is None or self._dense.device != flat.device or self._dense.dtype != dtype:
                self._dense = packed_int.dequantize_reference(self.weight_packed).to(dtype)
            out = nn.functional.linear(flat.to(self._dense.dtype), self._dense)
        out = (out if out.dtype == x.dtype else out.to(x.dtype)).reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias.to(out.dtype)  # in x's dtype, as nn.Linear's output is

    def _cpu_int4_weight(self) -> packed_int.CpuInt4Weight | None:
        """The weight in torch's CPU int4 layout, or None where that kernel cannot take it."""
        if self._cpu_int4 is None:
            weight = self.weight_packed
            self._cpu_int4 = packed_int.cpu_int4(weight) if packed_int.cpu_int4_group(weight) is not None else False
        return self._cpu_int4 or None
