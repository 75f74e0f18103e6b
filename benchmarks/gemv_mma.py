"""Int4 GEMV for 1 to 8 rows of x on the tensor cores (Marlin's approach), an experiment: a weight
layout in which each thread's 32-bit word decodes straight into its A fragment of
`mma.sync.m16n8k16`.

    python benchmarks/gemv_mma.py --emulate          # here: the sm_90 PTX of each launch run on the CPU
    python benchmarks/gemv_mma.py --sass             # here: sm_90 loop instructions per word
    python benchmarks/gemv_mma.py --traffic          # here: what each launch reads, counted in its PTX
    python benchmarks/gemv_mma.py [--shapes ...] [--batches 1,8]   # on a CUDA GPU: timed beside fp16 and the served kernel

Why. The served batch-1 GEMVs multiply on the CUDA cores: per 32-bit word (8 codes) the grid
GEMV spends about 36 machine instructions and the Gluon one 19-24 (benchmarks/results/
gemv_gluon_sass.md): decode, then 4 half2 or 8 fp32 FMAs, x regrouped or widened, reductions.
At 4096x14336 that is a third to half of the kernel's time in instruction issue alone, and the
batch-1 goal (over 3x fp16) needs the weight streamed at about 0.83 of the copy rate, where
these read at 0.73. A tensor core takes a whole m16n8k16 product in one instruction: a thread's
A fragment is 8 fp16 values, exactly what one word's 8 codes decode to (`HALF2_DECODE4`: 9
instructions, exact integers code - 8). So the product costs about 10 instructions a word, with
x as B (thread g supplies B's column g: x's row g, zero past the batch) and the fp32
accumulators as D. B's 8 columns make a batch of up to 8 cost what batch 1 does: the weight is
read once either way.

The layout ("mma order", `pack_mma`). The weight in tiles of 16 rows x 64 columns (a chunk);
in each, thread (g, t) of a warp (lane 4 g + t) holds 4 words, one per k-step j of 16 columns,
contiguous (one 16-byte load; a warp's 512 bytes contiguous). The mma sums over its 16 k
positions in any order as long as A and B agree, so the k positions are assigned such that
thread t's B, x pairs (k 2t, 2t + 1) and (k 2t + 8, 2t + 9), are x columns
64 c + 32 (j // 2) + 8 t + 4 (j % 2) + 0..3: its x for a chunk is two runs of 8 values (two
16-byte loads, each of them 64 contiguous bytes over a warp's 4 t), not 8 scattered pairs. Word
j of thread (g, t): nibble e is the code of row 16 r + g + 8 (e % 2), column
64 c + 32 (j // 2) + 8 t + 4 (j % 2) + 2 (e % 4 // 2) + e // 4, so that the decode's half2 pairs
(code e, code e + 4) are the fragment's registers (PTX ISA, m16n8k16 .f16 A: rows g / g + 8, k
pairs).

Scales: each chunk's 4 products are summed on the tensor core in fp32 from exact codes, then
multiplied by the chunk's group scale in fp32 (groups of 64 or more columns, or one per row):
the grid GEMV's fp32 arithmetic, not fp16 sums.

Loads. ptxas places each global load just before its first use (in this kernel's SASS and the
Gluon GEMV's), so a warp's loads of one iteration go out one round trip after another,
and a prefetch into registers ends up at the loop's end. The launches with `ahead` therefore
have one thread of each block prefetch its words and scales into L2 that many iterations ahead
(cp.async.bulk.prefetch.L2: one instruction for a contiguous run, which the mma order makes an
iteration's words and scales): the round trips then end in L2.

Stand-alone: int4 symmetric, K a multiple of 64 x the launch's chunks an iteration, N of 16 x
its tiles (no masks), fp16 x. Not served; its place in serving waits on its GPU timing.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if {"--sass", "--emulate", "--traffic"} & set(sys.argv):  # compile for sm_90, not interpret: set before triton is imported
    os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import async_copy  # noqa: E402

from compressors.packed_int import HALF2_DECODE4, dequantize_reference, pdl_launch  # noqa: E402
from compressors.packed_int_gluon import await_predecessor, copy_to_shared  # noqa: E402

CHUNK = 64  # columns of a tile a warp's one 16-byte load a thread covers
MMA = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
# four words (j = 0..3: $4-$7) and their x pairs ($8-$11 and $12-$15) -> the chunk's D ($0-$3),
# four products chained on the tensor core from zero
MMA_CHUNK = gl.constexpr("{\n.reg .b32 t, h0, h1, h2, h3, c1, c2, c3;\n.reg .f32 z;\nmov.f32 z, 0f00000000;\n" + "".join(
    HALF2_DECODE4.replace("$1", f"${4 + j}")
    + f"{MMA} {{$0, $1, $2, $3}}, {{h0, h1, h2, h3}}, {{${8 + j}, ${12 + j}}}, "
    + ("{z, z, z, z};\n" if j == 0 else "{$0, $1, $2, $3};\n") for j in range(4)) + "}")


# one thread of the block asks for $2 bytes from $1 on to be brought into L2: ptxas issues a
# load where its value is first used (this kernel's SASS and the Gluon GEMV's show loads sunk
# into the loop, after products that wait on earlier loads), so a warp's loads of an iteration
# go out one round trip after another; prefetched iterations ahead, those round trips end in L2
PREFETCH_L2 = gl.constexpr("""{
.reg .pred p;
.reg .b32 tid;
mov.u32 tid, %tid.x;
setp.eq.u32 p, tid, 0;
@p cp.async.bulk.prefetch.L2.global [$1], $2;
mov.u32 $0, 0;
}""")


def pack_mma(weight) -> tuple[torch.Tensor, torch.Tensor]:
    """A symmetric int4 PackedWeight (either layout) in mma order: words [N / 16 x K / 64 x 128]
    int32, and scales [N / 16 x groups x 16] fp16 (a tile's 16 rows of a group together, so an
    iteration's scales are one contiguous run)."""
    n, k = weight.rows, weight.columns
    assert weight.bits == 4 and weight.zero is None and weight.codebook is None and weight.bitmask is None, "int4 symmetric grids only"
    assert n % 16 == 0 and k % CHUNK == 0 and (weight.group_size % CHUNK == 0), "N a multiple of 16, K and the group of 64"
    nibbles = (weight.codes().to(torch.int64) + 8)
    # rows 16 r + 8 h + g; columns 64 c + 32 i + 8 t + 4 l + 2 a + b -> word (r, c, g, t, j = 2 i + l), nibble e = 4 b + 2 a + h
    tiles = nibbles.reshape(n // 16, 2, 8, k // CHUNK, 2, 4, 2, 2, 2).permute(0, 3, 2, 5, 4, 6, 8, 7, 1).reshape(-1, 8)
    words = (tiles << (4 * torch.arange(8, device=tiles.device))).sum(dim=1)
    scale = weight.scale.reshape(n // 16, 16, -1).permute(0, 2, 1).contiguous()
    return (words - (words >= 2**31) * 2**32).to(torch.int32), scale


@gluon.jit
def _prefetch_l2(pointers, size):
    gl.inline_asm_elementwise(PREFETCH_L2, "=r,l,r", [pointers, size], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _along(size: gl.constexpr, axis: gl.constexpr, layout: gl.constexpr):
    """0 .. size - 1 along `axis` of a 4-D `layout`, broadcastable to its tensors."""
    if axis == 0:
        along = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.arange(0, size, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, layout)))), 1), 2), 3)
    elif axis == 1:
        along = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.arange(0, size, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, layout)))), 0), 2), 3)
    elif axis == 2:
        along = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.arange(0, size, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, layout)))), 0), 1), 3)
    else:
        along = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.arange(0, size, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, layout)))), 0), 1), 2)
    return along


@gluon.jit
def gemv_mma(x_ptr, packed_ptr, scale_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
             GROUP: gl.constexpr, ROWT: gl.constexpr, WK: gl.constexpr, CPW: gl.constexpr, AHEAD: gl.constexpr,
             STAGES: gl.constexpr, PDL: gl.constexpr = False):
    # [tiles, chunks a thread, slots]: a thread holds the block's ROWT tiles x CPW chunks x its 4
    # words; a slot is (warp along K, lane, word)
    L3: gl.constexpr = gl.BlockedLayout([ROWT, CPW, 4], [1, 1, 32], [1, 1, WK], [2, 1, 0])
    # x pairs [chunks, threads along K, 2, 4]: a thread's two runs of 4 pairs (8 x values) of a chunk, (j, e) for its words j
    LX: gl.constexpr = gl.BlockedLayout([CPW, 1, 2, 4], [1, 32, 1, 1], [1, WK, 1, 1], [3, 2, 1, 0])
    T: gl.constexpr = ROWT  # tiles of 16 rows a block
    S: gl.constexpr = 128 * WK
    STEP: gl.constexpr = WK * CPW  # chunks a block an iteration
    chunks = K // 64
    groups = K // GROUP
    r = gl.arange(0, T, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    u = gl.arange(0, CPW, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    s = gl.arange(0, S, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    tile = gl.expand_dims(gl.expand_dims(gl.program_id(0) * T + r, 1), 2)
    u3 = gl.expand_dims(gl.expand_dims(u, 0), 2)
    s3 = gl.expand_dims(gl.expand_dims(s, 0), 1)
    words_at = packed_ptr + tile * (chunks * 128) + u3 * S + s3  # chunk c0 + u WK + s // 128
    chunk = u3 * WK + s3 // 128  # after c0
    # the D element's row in the tile: d0, d1 row g; d2, d3 row g + 8
    scales_at = scale_ptr + tile * (groups * 16) + s3 % 128 // 16 + 8 * (s3 % 4 // 2)
    # x pairs of slot (wk, lane, j), chunk c: x columns 64 c + 32 (j // 2) + 8 t + 4 (j % 2) + (0, 1) and + (2, 3):
    # pairs 32 c + 16 (j // 2) + 4 t + 2 (j % 2) + e
    xu = _along(CPW, 0, LX)
    xl = _along(32 * WK, 1, LX)
    # thread (g, t) supplies B's column g: x's row g (rows past M read as 0); at M = 1 (a constant:
    # Triton specializes it) every thread reads row 0, unmasked, and D's every column is y
    x_row = xl % 32 // 4 * (M > 1)
    x_at = (x_ptr.to(gl.pointer_type(gl.int32), bitcast=True) + xu * (32 * WK) + x_row * (stride_xm // 2) + xl // 32 * 32 + xl % 4 * 4
            + _along(2, 2, LX) * 16 + _along(4, 3, LX))
    x_in = x_row < M
    LP: gl.constexpr = gl.BlockedLayout([T], [32], [WK], [0])  # the block's tiles, in every thread (thread 0 prefetches)
    tiles = gl.program_id(0) * T + gl.arange(0, T, layout=LP)
    acc = gl.zeros([T, CPW, S], gl.float32, L3)
    FIRST: gl.constexpr = AHEAD + (PDL and not AHEAD)
    if FIRST:  # the first AHEAD iterations' words and scales into L2 (a programmatic dependent's first, before its wait)
        _prefetch_l2(packed_ptr + tiles * (chunks * 128), gl.full([T], gl.minimum(FIRST * STEP, chunks) * 512, gl.int32, LP))
        _prefetch_l2(scale_ptr + tiles * (groups * 16), gl.full([T], gl.minimum((FIRST * STEP * 64 + GROUP - 1) // GROUP, groups) * 32, gl.int32, LP))
    if PDL:  # launched as a programmatic dependent (as packed_int's kernels are on sm_90): x only once the kernel before is done
        await_predecessor(WK)
    iterations = chunks // STEP
    if STAGES:  # the words through a ring of STAGES iterations in shared memory, copied STAGES - 1 ahead
        ring = gl.allocate_shared_memory(gl.int32, [STAGES, T, CPW, S], gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
        for i in gl.static_range(STAGES - 1):
            copy_to_shared(ring.index(i), words_at + i * STEP * 128, mask=s3 * 0 + i < iterations)
            async_copy.commit_group()
    for it in range(iterations):
        c0 = it * STEP
        if STAGES:  # each thread reads back only the words it copied (Triton's membar pass still adds a barrier)
            async_copy.wait_group(STAGES - 2)
            w = ring.index(it % STAGES).load(L3)
            following = it + STAGES - 1  # into the slot read last iteration
            copy_to_shared(ring.index(following % STAGES), words_at + following * STEP * 128, mask=s3 * 0 + following < iterations)
            async_copy.commit_group()
        else:
            w = gl.load(words_at + c0 * 128)
        if AHEAD:  # iteration + AHEAD's (the last iterations prefetch the last one again)
            ahead = gl.minimum(c0 + AHEAD * STEP, chunks - STEP)
            _prefetch_l2(packed_ptr + tiles * (chunks * 128) + ahead * 128, gl.full([T], STEP * 512, gl.int32, LP))
            first_group = ahead * 64 // GROUP
            _prefetch_l2(scale_ptr + tiles * (groups * 16) + first_group * 16,
                         gl.full([T], ((ahead + STEP) * 64 + GROUP - 1) // GROUP - first_group, gl.int32, LP) * 32)
        xa, xb = gl.split(gl.reshape(gl.load(x_at + c0 * 32, mask=x_in, other=0), [CPW, S, 2]))  # (lane, j // 2, j % 2, e) -> (slot, e)
        xa = gl.broadcast(gl.expand_dims(gl.convert_layout(xa, gl.SliceLayout(0, L3)), 0), w)[0]
        xb = gl.broadcast(gl.expand_dims(gl.convert_layout(xb, gl.SliceLayout(0, L3)), 0), w)[0]
        d = gl.inline_asm_elementwise(MMA_CHUNK, "=f,=f,=f,=f,r,r,r,r,r,r,r,r,r,r,r,r", [w, xa, xb], dtype=gl.float32, is_pure=True, pack=4)
        acc += d * gl.load(scales_at + (c0 + chunk) * 64 // GROUP * 16).to(gl.float32)
    if STAGES:  # the last iterations' (masked, zero-filling) copies are still in flight, and the sum
        async_copy.wait_group(0)  # below reuses the ring's shared memory: on the H200 they landed in it (y 1.3-1.8e-2 off)
    # element j of thread (g, t): D's row g + 8 (j // 2), column (x's row) 2 t + j % 2; summed over the warps along K
    total = gl.sum(gl.reshape(gl.sum(acc, axis=1), [T, WK, 128]), axis=1)  # [T, 128]: slot 16 g + 4 t + j
    LY: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [1, WK], [1, 0])
    total = gl.convert_layout(total, LY)
    q = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, LY)), 0)
    row = gl.expand_dims((gl.program_id(0) * T + gl.arange(0, T, layout=gl.SliceLayout(1, LY))) * 16, 1) + q // 16 + 8 * (q % 4 // 2)
    batch = q // 4 % 4 * 2 + q % 2
    gl.store(y_ptr + batch * stride_ym + row, total.to(gl.float16), mask=(batch < M) & (row < N))


class Launch(NamedTuple):
    rowt: int  # tiles of 16 rows a block (each thread has a word of each)
    wk: int  # warps, along K
    cpw: int  # chunks (16-byte loads) a thread per tile an iteration
    ahead: int = 0  # iterations ahead a block prefetches its words and scales into L2 (0: none)
    stages: int = 0  # iterations of words in a shared-memory ring, copied (cp.async) stages - 1 ahead (0: loaded directly)

    @property
    def block_n(self) -> int:
        return 16 * self.rowt

    @property
    def chunks(self) -> int:  # chunks of 64 columns a block an iteration
        return self.wk * self.cpw

    def __str__(self) -> str:
        return f"{self.block_n}x{64 * self.chunks} ({self.rowt} tile x {self.cpw} chunk a thread), {self.wk} warps" + (f", L2 prefetch {self.ahead} ahead" if self.ahead else "") + (
            f", {self.stages} stages" if self.stages else "")


# A batch-1 GEMV reads each word once, so its speed is bytes in flight: at 4096 rows there are
# only 256 tiles, so K is split over a block's warps (WK, summed in shared memory at the end), and
# each thread loads ROWT x CPW 16 bytes an iteration. ptxas issues each load just before its
# first use, one round trip after another, so half the launches also prefetch into L2.
LAUNCHES = [Launch(*shape) for shape in [
    (1, 4, 1), (1, 4, 2), (1, 4, 4), (1, 8, 1), (1, 8, 2), (1, 8, 4), (1, 16, 1), (1, 16, 2), (1, 2, 4), (2, 4, 1), (2, 4, 2), (2, 8, 1),
    (2, 8, 2), (2, 2, 4), (4, 4, 1), (4, 2, 2),
    (1, 4, 2, 2), (1, 8, 1, 2), (1, 8, 2, 2), (1, 8, 2, 4), (2, 4, 1, 2), (2, 8, 1, 2), (1, 16, 1, 2), (1, 4, 4, 2),
    (1, 4, 2, 0, 4), (1, 8, 1, 0, 4), (1, 8, 2, 0, 2), (1, 8, 2, 0, 4), (2, 4, 1, 0, 4), (1, 4, 1, 0, 8), (1, 8, 1, 2, 4), (2, 8, 1, 2, 4),
]]


def fits(n: int, k: int, launch: Launch) -> bool:
    return n % launch.block_n == 0 and k % (64 * launch.chunks) == 0


def run(x: torch.Tensor, words: torch.Tensor, scale: torch.Tensor, n: int, k: int, launch: Launch, y: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T for x [M, K] fp16, M at most 8 (B's 8 columns), and W in mma order (`pack_mma`)."""
    assert x.shape[0] <= 8 and x.stride(1) == 1
    y = torch.empty(x.shape[0], n, dtype=torch.float16, device=x.device) if y is None else y
    gemv_mma[(n // launch.block_n,)](x, words, scale, y, x.shape[0], n, k, x.stride(0), y.stride(0), GROUP=k // scale.shape[1], ROWT=launch.rowt,
                                     WK=launch.wk, CPW=launch.cpw, AHEAD=launch.ahead, STAGES=launch.stages, num_warps=launch.wk, **pdl_launch(x.device))
    return y


def compiled(launch: Launch, group: int = 128, batch: int = 1):
    """The launch compiled for sm_90 (here, no GPU needed), as on 4096-wide layers (aligned), for
    `batch` rows of x (1 specialized, as Triton does), launched as the served kernels are there
    (a programmatic dependent: ON_HOPPER)."""
    from benchmarks.kernel_sass import ON_HOPPER, compile_for

    constexprs = dict(GROUP=group, ROWT=launch.rowt, WK=launch.wk, CPW=launch.cpw, AHEAD=launch.ahead, STAGES=launch.stages, **ON_HOPPER)
    return compile_for(gemv_mma, constexprs | ({"M": 1} if batch == 1 else {}), num_warps=launch.wk, aligned=True, unaligned=("M",))


def emulated(launches: list[Launch]) -> list[dict]:
    """Each launch compiled for sm_90 and its PTX run on the CPU (benchmarks/ptx_emulator.py) on
    random weights of two blocks' rows and two iterations' columns, or more than `ahead` and
    `stages` (so the prefetches reach the end and the ring wraps): x of 1 row in groups of 64 and
    128 and per channel, and of 5 and 8 rows in groups of 128: y's error relative to the torch
    reference (fp32 weights, fp16-rounded y)."""
    import numpy as np

    from benchmarks.ptx_emulator import launch as emulate
    from compressors.packed_int import random_packed_weight

    results = []
    for launch in launches:
        iterations = max(2, launch.ahead + 1, launch.stages + 1)
        if launch.stages:  # a whole number of turns of the ring: the copies still in flight at the end go into its first slots
            iterations = -(-iterations // launch.stages) * launch.stages
        rows, columns = 2 * launch.block_n, CHUNK * launch.chunks * iterations
        for group, batch in ((64, 1), (128, 1), (None, 1), (128, 5), (128, 8)):
            x = torch.randn(batch, columns, generator=torch.Generator().manual_seed(batch)).half()
            weight = random_packed_weight(4, rows, columns, group, seed=rows + (group or 0))
            reference = (x.float() @ dequantize_reference(weight).T).half().float()
            words, scale = pack_mma(weight)
            y = np.full((batch, rows), np.nan, np.float16)  # outputs a launch leaves unwritten show as NaN error
            arguments = [x.numpy(), words.numpy(), scale.numpy(), y, *([] if batch == 1 else [batch]), rows, columns, columns, rows]
            emulate(compiled(launch, weight.group_size, batch).asm["ptx"], (rows // launch.block_n,), arguments)
            error = ((torch.from_numpy(y).float() - reference).norm() / reference.norm()).item()
            results.append(dict(launch=str(launch), group=group or "per channel", batch=batch, rel_error=error))
            print(json.dumps(results[-1]), flush=True)
    return results


def traffic(launches: list[Launch], rows: int = 64, columns: int = 4096) -> list[dict]:
    """What each launch reads at batch 1, counted by running its sm_90 PTX on the CPU, on `rows`
    x `columns` in groups of 128 (as `gemv_gluon.py --traffic` counts the served GEMVs, with
    whom the rows compare): per array, bytes asked for and the 32-byte sectors the warps'
    accesses touch, per byte of the weight, and the share of each sector's bytes used (x's
    threads of one t ask for the same bytes, so its share exceeds 1). Prefetches, being hints,
    are not reads."""
    import numpy as np

    from benchmarks.ptx_emulator import reads_per_byte
    from compressors.packed_int import random_packed_weight

    weight = random_packed_weight(4, rows, columns, 128)
    words, scale = pack_mma(weight)
    x = torch.randn(1, columns, generator=torch.Generator().manual_seed(0)).half()
    needed = words.numel() * 4 + scale.numel() * 2
    results = []
    for launch in launches:
        if not fits(rows, columns, launch):
            continue
        arguments = [x.numpy(), words.numpy(), scale.numpy(), np.zeros(rows, np.float16), rows, columns, columns, rows]
        row = {"kernel": f"mma {launch}", **reads_per_byte(compiled(launch).asm["ptx"], (rows // launch.block_n,), arguments, ("x", "words", "scales"), needed)}
        results.append(row)
        print(json.dumps(row), flush=True)
    return results


def sass_counts(launches: list[Launch]) -> list[dict]:
    """Each launch compiled for sm_90 here: its loop's instructions per word and memory instructions."""
    import collections
    import re

    from benchmarks.kernel_sass import disassemble, loop_body

    rows = []
    for launch in launches:
        code = disassemble(compiled(launch), usage=True)
        body = loop_body(code, executed=True)  # not the never-run `@!PT LDS` padding of cp.async
        row = dict(launch=str(launch), registers=int(re.search(r"REG:(\d+)", code).group(1)), loop=len(body),
                   per_word=round(len(body) / (4 * launch.rowt * launch.cpw), 1),
                   memory=dict(collections.Counter(op for op in body if op.startswith(("LD", "ST", "BAR")))),
                   mma=sum(op.startswith("HMMA") for op in body))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


class MmaWeight(NamedTuple):
    """A weight in mma order, as `weight_seconds` copies it round-robin."""

    words: torch.Tensor
    scale: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.words.numel() * 4 + self.scale.numel() * 2

    def clone(self) -> "MmaWeight":
        return MmaWeight(self.words.clone(), self.scale.clone())


def compile_launch(task: tuple) -> bool:
    """Runs one launch (LAUNCHES[index]) once at one K and batch, on a weight of one block's rows:
    Triton caches on disk what the timed run then loads (its key holds the constexprs, M if 1,
    and which ints are multiples of 16, not N). For `precompile`'s processes."""
    from compressors.packed_int import random_packed_weight

    index, k, batch, group = task
    launch = LAUNCHES[index]
    if not fits(launch.block_n, k, launch):
        return False
    words, scale = pack_mma(random_packed_weight(4, launch.block_n, k, group).to("cuda"))
    run(torch.randn(batch, k, device="cuda", dtype=torch.float16), words, scale, launch.block_n, k, launch)
    return True


@functools.cache
def _memory_roof() -> float:
    from benchmarks.kernel_speed import memory_roofs

    roofs = memory_roofs("cuda")
    print(f"{torch.cuda.get_device_name()}: copy {roofs['copy'] / 1e9:.0f} GB/s (read + write), read {roofs['read'] / 1e9:.0f} GB/s", flush=True)
    return roofs["roof"]


def timed(shapes: list[str], batches: list[int], launches: list[Launch], group: int = 128) -> list[dict]:
    """On a CUDA GPU: at each N x K and batch (rows of x, at most 8), cuBLAS fp16, the served int4
    kernel (interleaved, autotuned; at batch 1 the Gluon GEMV where it times faster: what
    `matmul_triton` runs) and each fitting launch here, side by side in this run, as GPU time per
    call (CUDA-graph replays round-robin over L2-overflowing copies of the weight); each
    launch's y against the reference."""
    from compressors import packed_int_gluon
    from compressors.kernels import weight_seconds
    from compressors.packed_int import matmul_triton, random_packed_weight

    bandwidth = _memory_roof()
    rows = []
    for shape in shapes:
        n, k = map(int, shape.split("x"))
        weight = random_packed_weight(4, n, k, group).to("cuda")
        served = weight.interleave()
        mma = MmaWeight(*pack_mma(weight))
        dense = (torch.randn(n, k, device="cuda") / 50).half()
        for batch in batches:
            x = torch.randn(batch, k, device="cuda", dtype=torch.float16)
            reference = (x.float() @ dequantize_reference(weight).T).half().float()
            fp16 = weight_seconds(lambda w: x @ w.T, dense)  # noqa: B023  (timed in this iteration)
            int4 = weight_seconds(lambda w: matmul_triton(x, w), served)  # noqa: B023
            pick = packed_int_gluon.picked(x, served)  # at batch 1, what serving timed fastest on its first call
            kernel = "the grid GEMM" if batch > 1 else f"Gluon {pick}" if pick else "the grid GEMV"
            print(f"{shape} batch {batch}: fp16 {fp16 * 1e6:.2f} us; served int4 ({kernel}) {int4 * 1e6:.2f} us ({fp16 / int4:.2f}x)", flush=True)
            for launch in launches:
                if not fits(n, k, launch):
                    continue
                try:
                    error = ((run(x, mma.words, mma.scale, n, k, launch).float() - reference).norm() / reference.norm()).item()
                    seconds = weight_seconds(lambda w: run(x, w.words, w.scale, n, k, launch), mma)  # noqa: B023
                except Exception as failure:  # noqa: BLE001  (an experiment: report and go on)
                    print(f"{shape} batch {batch} {launch}: {type(failure).__name__}: {str(failure)[:300]}", flush=True)
                    continue
                rows.append(dict(shape=shape, batch=batch, launch=str(launch), us=round(seconds * 1e6, 2), speedup=round(fp16 / seconds, 2),
                                 vs_served=round(int4 / seconds, 2), rel_error=error, fp16_us=round(fp16 * 1e6, 2), served_us=round(int4 * 1e6, 2),
                                 read_TBps=round(mma.nbytes / seconds / 1e12, 2), bandwidth_fraction=round(mma.nbytes / seconds / bandwidth, 3)))
                print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="4096x14336,14336x4096,4096x4096", help="N x K, the goal's shapes first (a call cut short keeps them)")
    parser.add_argument("--batches", default="1,8", help="rows of x (at most 8), on a GPU")
    parser.add_argument("--launches", help="indices into LAUNCHES (default: all)")
    parser.add_argument("--sass", action="store_true", help="here: each launch's sm_90 loop, counted")
    parser.add_argument("--emulate", action="store_true", help="here: each launch's sm_90 PTX run on the CPU; exit 1 if one is off")
    parser.add_argument("--traffic", action="store_true", help="here: what each launch reads at batch 1, counted in its PTX")
    parser.add_argument("--out", type=Path, default=Path("/tmp/gemv_mma"))
    parser.add_argument("--compile-workers", type=int, default=0, help="on a GPU: compile each launch here and the served kernel's first, in this many processes")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    chosen = [LAUNCHES[int(i)] for i in args.launches.split(",")] if args.launches else LAUNCHES
    if args.sass:
        (args.out / "gemv_mma_sass.json").write_text(json.dumps(sass_counts(chosen), indent=1))
        return
    if args.traffic:
        (args.out / "gemv_mma_traffic.json").write_text(json.dumps(traffic(chosen), indent=1))
        return
    if args.emulate:
        from benchmarks.kernel_sass import EMULATED_TOLERANCE

        results = emulated(chosen)
        (args.out / "gemv_mma_emulated.json").write_text(json.dumps(results, indent=1))
        errors = [r["rel_error"] for r in results]
        print(f"{len(errors)} runs of {len(chosen)} compiled launches emulated, relative error {min(errors):.1e} to {max(errors):.1e}")
        off = [r for r in results if not r["rel_error"] <= EMULATED_TOLERANCE["fp16"]]  # NaN is off too
        if off:
            raise SystemExit(f"{len(off)} runs off the reference (over {EMULATED_TOLERANCE['fp16']}): {off}")
        return
    batches = [int(b) for b in args.batches.split(",")]
    if args.compile_workers:  # Triton would compile each launch, and the served kernel's tuner each of its shapes, one by one
        from benchmarks.gemv_mma import compile_launch  # (by its module's name, which a spawned process imports)
        from benchmarks.kernel_speed import launch_tasks, precompile

        ks = sorted({int(shape.split("x")[1]) for shape in args.shapes.split(",")})
        precompile(launch_tasks(None, (4, "symmetric", 128, True), ks, batches), args.compile_workers)
        precompile([(LAUNCHES.index(launch), k, batch, 128) for launch in chosen for k in ks for batch in batches], args.compile_workers, compile_launch)
    rows = []
    for shape in args.shapes.split(","):  # written after each shape, so a call cut short keeps what it timed
        rows += timed([shape], batches, chosen)
        (args.out / "gemv_mma.json").write_text(json.dumps(rows, indent=1))
    for shape, batch in [(shape, batch) for shape in args.shapes.split(",") for batch in batches]:
        best = min((r for r in rows if r["shape"] == shape and r["batch"] == batch), key=lambda r: r["us"], default=None)
        if best:
            print(f"{shape} batch {batch} best: {best['us']} us = {best['speedup']}x fp16 ({best['fp16_us']} us), {best['vs_served']}x the served kernel "
                  f"({best['served_us']} us), {best['read_TBps']} TB/s = {best['bandwidth_fraction']} of the device's streaming rate, {best['launch']}, "
                  f"rel error {best['rel_error']:.1e}")


if __name__ == "__main__":
    main()
