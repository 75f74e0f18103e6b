"""Batch-1 int4 GEMV in Gluon (Triton's explicit-layout dialect): a second kernel for
packed_int's symmetric 4-bit grids, for fp16 x at batch 1 on CUDA, served where it times faster
than the grid GEMV (`served_launch`).

Why Gluon: in plain Triton the compiler picks each tensor's layout, and a thread's x never lines
up with its words: the grid GEMV (`_grid_gemv_kernel`) moves x through shared memory every block
(8 STSM, 8 LDS.128 and up to 16 barriers a loop, benchmarks/results/gemv_layouts_sass.md) at
about 36 instructions a word. Here the layout is stated: a thread holds ROWS rows x VEC
words in runs of 4 consecutive words (one 16-byte load a row each; VEC 8: two runs, a warp's
width of runs apart, so each warp load uses whole sectors) and the 8 VEC x values those words
cover (XVEC: 16-byte loads, from L1), so the loop has no barrier: 19-24 instructions a word
in half2 on sm_90 (benchmarks/results/gemv_gluon_sass.md). Loaded so, each warp's x load touches
16 cache lines for 512 bytes, and those L1 wavefronts cost time on a GPU
(benchmarks/results/gemv_l1_model.md); XSMEM launches copy all of x into shared memory once per
block instead (`_x_to_shared`) and read it back free of bank conflicts, one barrier before the
loop and none in it.

The product, per word (HALF2=1): the 8 codes decode (lop3, the magic-number trick) straight to
(code - 8) / 32 in half2 pairs (j, j + 4), exact; x is taken as half2 pairs (x_j, x_j+4) (in unit
order regrouped by prmt, once per word column, shared by the thread's rows; in the interleaved
layout those columns are adjacent, so x's own pairs serve as loaded); 4 half2 FMAs; the two
halves summed in fp32. The 1/32 bounds each half's sum by max|x|, so it cannot overflow; the
cost is fp16 rounding in 4 products and 3 sums (about 5e-4 relative, the size of the fp16
output's own rounding). HALF2=2 ("pairs") sums two words' 16 products in half2 before widening,
decoding to (code - 8) / 64 so each half still stays within max|x|: 2 fewer instructions a word
(18.6-19.1 against 20.0-21.4 on sm_90), twice the fp16 rounding (5-7e-4 relative in the emulator);
on an H200 it ran 4-12% faster where the grid is over one wave (14336x4096) and up to 6% slower
in some launches at 4096 rows (benchmarks/results/gpu_h200.md, stop 69). HALF2=0 is the grid GEMV's arithmetic: x widened to fp32 once per word
column, each code - 8 decoded in half2 and widened, 8 fp32 FMAs (`_DOT4_PTX`). PREFETCH loads
the next block's words and scales before this block's arithmetic. STAGES streams the words
through a ring of tiles in shared memory instead of registers (`_words_ring`: cp.async, STAGES - 1
tiles ahead, each thread copying the runs it reads back), so the bytes in flight no longer cost
registers or warps: the structure cuBLAS's fp16 GEMV reaches 80% of DRAM peak with, where the
register-streamed launches reach 43-49% (benchmarks/results/gpu_h200.md, stop 69); each ask
also sends the tile's scales to L2, so their load in the loop does not wait on device memory,
and the first asks go out before the wait for the kernel ahead. A persistent launch (`persist`:
a few programs an SM) streams every block of rows it takes through one ring, asking for its
next block's first words while it sums this one's last, and copies x once for all of them.
Triton's barrier pass puts two barriers an iteration around the ring's slots (the data is each
thread's own, which the pass cannot see). TMA launches (`tma`) fill a persistent ring with the
copy engine instead, as cuBLAS's fp16 GEMV does: one thread asks for a whole tile, which lands on
its slot's mbarrier, and every thread waits on that. Untimed on a GPU yet.

No interpreter runs Gluon: the kernel runs only on a GPU, and here through its compiled PTX in
benchmarks/ptx_emulator.py (`benchmarks/gemv_gluon.py --emulate`, and a test).
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import NamedTuple

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from compressors.packed_int import _DOT4_PTX, HALF2_NIBBLES4, PREFETCH_L2, _capability, pdl_launch  # (_DOT4_PTX, HALF2=0: the grid GEMV's decode and 8 fp32 FMAs)

PAIR_LO = gl.constexpr("prmt.b32 $0, $1, $2, 0x5410;")  # (x_2i, x_2i+1), (x_2i+4, x_2i+5) -> (x_2i, x_2i+4)
PAIR_HI = gl.constexpr("prmt.b32 $0, $1, $2, 0x7632;")  # -> (x_2i+1, x_2i+5)
_DECODE = """
    mov.b32 c1, 0x28002800;
    mov.b32 c2, 0xd008d008;
    mov.b32 c3, 0x18001800;
    mov.b32 c4, 0xc080c080;""" + HALF2_NIBBLES4 + """    fma.rn.f16x2 h0, h0, c1, c2;
    fma.rn.f16x2 h1, h1, c3, c4;
    fma.rn.f16x2 h2, h2, c1, c2;
    fma.rn.f16x2 h3, h3, c3, c4;
"""  # (1024 + c) / 32 - 32.25 and (1024 + 16 c) / 512 - 2.25: (c - 8) / 32, pairs (c_j, c_j+4) in h_j
_REGISTERS = """
    .reg .b32 t, h0, h1, h2, h3, c1, c2, c3, c4, a;
    .reg .b16 lo, hi;
    .reg .f32 flo, fhi;"""


def _products(first_x: int, fresh: bool) -> str:
    """PTX: decoded pairs h0..h3 times x pairs $first_x.. $first_x+3, summed in half2 into a (a new
    sum where `fresh`)."""
    start = f"    mul.rn.f16x2 a, h0, ${first_x};\n" if fresh else f"    fma.rn.f16x2 a, h0, ${first_x}, a;\n"
    return start + "".join(f"    fma.rn.f16x2 a, h{j}, ${first_x + j}, a;\n" for j in (1, 2, 3))


_HALVES_ADDED = """    mov.b32 {lo, hi}, a;
    cvt.f32.f16 flo, lo;
    cvt.f32.f16 fhi, hi;
    add.f32 $0, flo, fhi;
"""  # the half2 sum's two halves added in fp32
DOT4_HALF2 = gl.constexpr("{" + _REGISTERS + _DECODE + _products(2, True) + _HALVES_ADDED + "}")  # word $1, x pairs $2..$5
# HALF2=2: two words' 16 products summed in half2 before the halves widen, so the widening, the fp32
# add and the scale's FMA are paid once per two words (about 2 of a word's 21 instructions). To keep
# the no-overflow bound with twice the terms, codes decode to (code - 8) / 64: each half sums 8
# products of at most |x| / 8, so it stays within max|x|. The constants: (1024 + c) / 64 - 16.125 and
# (1024 + 16 c) / 1024 - 1.125, exact like the /32 pair above.
_DECODE_64 = _DECODE.replace("0x28002800", "0x24002400").replace("0xd008d008", "0xcc08cc08").replace(
    "0x18001800", "0x14001400").replace("0xc080c080", "0xbc80bc80")
DOT8_HALF2 = gl.constexpr("{" + _REGISTERS + _DECODE_64 + _products(3, True) + _DECODE_64.replace("$1,", "$2,").split("0xbc80bc80;")[1]
                          + _products(7, False) + _HALVES_ADDED + "}")  # words $1 and $2, x pairs $3..$6 and $7..$10: sum of (code - 8) / 64 x
_PREFETCH_L2 = gl.constexpr(PREFETCH_L2)
# Triton 3.9's names; 3.6's (the GPU images'): thread_barrier, async_copy_global_to_shared
_block_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
copy_to_shared = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared  # cp.async, global to shared
tma_to_shared = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared  # a tile by the copy engine (TMA), global to shared
# a TMA ring's tiles as the copy engine writes them: row-major, unswizzled (a warp's 32 runs of a
# row are 512 contiguous bytes, read back in the minimum 4 wavefronts with no swizzle)
TMA_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
# a programmatic dependent's wait for the kernel before it (complete, its writes visible), then
# the next kernel let launch; as packed_int's grid kernels do with Triton's gdc_wait and
# gdc_launch_dependents, which Gluon lacks. $0: an inline asm needs a result.
_AWAIT_INPUTS = gl.constexpr("{\ngriddepcontrol.wait;\ngriddepcontrol.launch_dependents;\nmov.u32 $0, 0;\n}")


@gluon.jit
def _runs(LF: gl.constexpr, BLOCK_N: gl.constexpr, WORDS: gl.constexpr):
    """A block's rows and the first words of its runs of 4, as each thread holds them (LF: a
    thread's rows at its runs' first words)."""
    return gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LF)), gl.arange(0, WORDS // 4, layout=gl.SliceLayout(0, LF)) * 4


@gluon.jit
def _await_inputs(packed_ptr, scale_ptr, block, stride_pn, stride_sn, span, LF: gl.constexpr, BLOCK_N: gl.constexpr, WORDS: gl.constexpr,
                  WARPS: gl.constexpr, AHEAD: gl.constexpr = 1):
    """Launched as a programmatic dependent (`pdl_launch`), a program may start before the
    kernel ahead of it has finished: it prefetches into L2 its rows' words of the first AHEAD
    iterations (each thread its own runs; past the row's `span` words, the last iteration's
    again) and first scales, which serving never writes, then waits for that kernel before the
    loop reads x, as packed_int's `_await_inputs` does."""
    rows, runs = _runs(LF, BLOCK_N, WORDS)
    rows += block * BLOCK_N
    words = packed_ptr + gl.expand_dims(rows * stride_pn, 1) + gl.expand_dims(runs, 0)
    gl.inline_asm_elementwise(_PREFETCH_L2, "=r,l", [words], dtype=gl.int32, is_pure=False, pack=1)
    for i in gl.static_range(1, AHEAD):
        gl.inline_asm_elementwise(_PREFETCH_L2, "=r,l", [words + gl.minimum(i * WORDS, span - WORDS)], dtype=gl.int32, is_pure=False, pack=1)
    gl.inline_asm_elementwise(_PREFETCH_L2, "=r,l", [scale_ptr + rows * stride_sn], dtype=gl.int32, is_pure=False, pack=1)
    await_predecessor(WARPS)


@gluon.jit
def await_predecessor(WARPS: gl.constexpr):
    """Each thread waits for the kernel before (griddepcontrol.wait), then lets the next launch."""
    threads = gl.arange(0, 32 * WARPS, layout=gl.BlockedLayout([1], [32], [WARPS], [0]))  # one element a thread: one wait each
    gl.inline_asm_elementwise(_AWAIT_INPUTS, "=r,r", [threads], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _x_pairs(xq_ptr, units, LU: gl.constexpr, LX: gl.constexpr, XVEC: gl.constexpr, INTERLEAVED: gl.constexpr, XSMEM: gl.constexpr, x_tiles,
             LT: gl.constexpr):
    """x as 4 half2 pairs for each unit of `units` (xq_ptr: x as int32, pairs (x_2i, x_2i+1)). Unit
    order: unit u's pairs (x_8u+2i, x_8u+2i+1) at 4u + i. Interleaved (`interleave_order`): code
    p + 4 b of unit q in a tile of 4 stands for the tile's column 8 p + 2 q + b, so the decode's
    pair (code p, code p + 4) meets the x pair at 16 (u // 4) + 4 p + u % 4, as it is: no
    regrouping. XVEC: a thread's 4 units' 16 pairs (32 contiguous x) in four 16-byte loads."""
    if INTERLEAVED:
        step: gl.constexpr = 4  # between a unit's pairs
        first = units // 4 * 16 + units % 4
    else:
        step: gl.constexpr = 1
        first = units * 4
    if XSMEM or XVEC:
        if XSMEM:  # this block's tiles of x in shared memory (`_x_to_shared`): tile T's 16 pairs in four 16-byte loads
            t = gl.permute(x_tiles.permute((1, 0)).load(LT), (1, 0))
            if INTERLEAVED:  # pair 16 T + 4 p + q is unit 4 T + q's pair p
                t = gl.permute(gl.reshape(t, [t.shape[0], 4, 4]), [0, 2, 1])
            p = gl.reshape(t, [4 * t.shape[0], 4])  # each thread's units as LU has them (not via LX: in unit order its warps differ)
        else:
            rx = gl.convert_layout(first, gl.SliceLayout(1, LX))
            p = gl.load(xq_ptr + gl.expand_dims(rx, 1) + gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, LX)) * step, 0))
        p = gl.reshape(p, [p.shape[0], 2, 2])  # pair 2a + b
        even, odd = gl.split(p)
        a0, a2 = gl.split(even)
        a1, a3 = gl.split(odd)
        a0 = gl.convert_layout(a0, LU)
        a1 = gl.convert_layout(a1, LU)
        a2 = gl.convert_layout(a2, LU)
        a3 = gl.convert_layout(a3, LU)
    else:
        a0 = gl.load(xq_ptr + first)
        a1 = gl.load(xq_ptr + first + step)
        a2 = gl.load(xq_ptr + first + 2 * step)
        a3 = gl.load(xq_ptr + first + 3 * step)
    return a0, a1, a2, a3


@gluon.jit
def _x_to_shared(xq_ptr, ITERS: gl.constexpr, TILES: gl.constexpr, WARPS: gl.constexpr):
    """All of x (ITERS x TILES tiles of 16 pairs), copied once per block into shared memory, so
    the loop reads each thread's tile in four conflict-free 16-byte loads (4 wavefronts a warp
    each) instead of four global loads that each touch 16 cache lines (a warp's 32 tiles lie 64
    bytes apart, 16 bytes each; on an H200 the GEMV's time followed those line lookups, not its
    DRAM bytes: benchmarks/results/gemv_l1_model.md). The swizzle: tile T's 16-byte piece c sits
    at piece c ^ (T // 2 % 4) of its row, so the 8 tiles a quarter-warp reads at once cover all
    32 banks. Copied by cp.async, 512 contiguous bytes a warp, all in flight at once (loaded into
    registers and stored, each store would wait for its load, and Triton puts a barrier between
    stores); the caller waits for them, and puts one barrier, before its loop."""
    x_shared = gl.allocate_shared_memory(gl.int32, [ITERS, TILES, 16], gl.SwizzledSharedLayout(4, 2, 4, [1, 0]))
    LF: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [WARPS, 1], [1, 0])
    pairs = gl.expand_dims(gl.arange(0, TILES, layout=gl.SliceLayout(1, LF)) * 16, 1) + gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, LF)), 0)
    for i in gl.static_range(ITERS):
        copy_to_shared(x_shared.index(i), xq_ptr + i * (TILES * 16) + pairs)
    async_copy.commit_group()
    return x_shared


@gluon.jit
def _words_ring(words_at, scales_at, stride_pn, stride_sn, first, programs, tiles, BLOCK_N: gl.constexpr, WORDS: gl.constexpr,
                STAGES: gl.constexpr, ITERS: gl.constexpr, GROUP: gl.constexpr, TMA: gl.constexpr):
    """A ring of STAGES tiles of words in shared memory, its first STAGES - 1 tiles asked for: (the
    tiles, each tile's barrier). By cp.async (one group a tile), each thread copying the 16-byte
    runs it will read itself (the words' own layout), so the bytes in flight sit in shared
    memory, not in registers: Nsight Compute found the register-streamed launches at 26-29 warps
    an SM and 43-49% of DRAM peak, waiting on memory, where cuBLAS's fp16 GEMV reaches 80% from a
    shared-memory ring filled by the copy engine (benchmarks/results/gpu_h200.md). With TMA, as
    cuBLAS's: one thread asks for a whole tile (words_at: the words' tensor descriptor), which
    lands on the tile's mbarrier, so a tile costs one instruction, not one a thread and row."""
    if TMA:
        tiles_of_words = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, WORDS], TMA_LAYOUT)
        landed = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(landed.index(i), count=1)
        fence_async_shared()  # the barriers' initialization, seen by the copy engine
    else:
        tiles_of_words = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, WORDS], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        landed = tiles_of_words  # (unused: a thread waits for its own cp.async groups)
    ring = (tiles_of_words, landed)
    for i in gl.static_range(STAGES - 1):
        _ask_words(ring, i, words_at, scales_at, stride_pn, stride_sn, i, first, programs, tiles, BLOCK_N, WORDS, ITERS, GROUP, TMA)
    return ring


@gluon.jit
def _ask_words(ring, slot, words_at, scales_at, stride_pn, stride_sn, j, first, programs, tiles, BLOCK_N: gl.constexpr, WORDS: gl.constexpr,
               ITERS: gl.constexpr, GROUP: gl.constexpr, TMA: gl.constexpr):
    """Tile j of this program's words asked into the ring's `slot`, and their scales into L2, so
    the loop's load of them STAGES - 1 tiles on does not wait on device memory. A program's tiles
    run along its blocks of rows in turn (blocks first, first + programs, ..., ITERS tiles each),
    so one ring streams on across them. By cp.async: 16 bytes a thread and row, as one group;
    words_at and scales_at: each thread's runs and their scales in tile 0 of block 0 (a tile adds
    one offset, the same for every thread); past the program's last tile (`tiles`) the group is
    empty, and the addresses stay those of the last. By TMA: the tile at its row and word, its
    bytes expected on the slot's barrier; past the last tile, neither."""
    asked = gl.minimum(j, tiles - 1)
    row = (first + asked // ITERS * programs) * BLOCK_N
    u0 = asked % ITERS * WORDS
    if TMA:
        mbarrier.expect(ring[1].index(slot), BLOCK_N * WORDS * 4, pred=j < tiles)
        tma_to_shared(words_at, [row, u0], ring[1].index(slot), ring[0].index(slot), pred=j < tiles)
    else:
        copy_to_shared(ring[0].index(slot), words_at + (row * stride_pn + u0),
                       mask=gl.full(words_at.shape, j, gl.int32, words_at.type.layout) < tiles)  # (one value: the runs stay 16-byte copies)
        async_copy.commit_group()
    gl.inline_asm_elementwise(_PREFETCH_L2, "=r,l", [scales_at + (row * stride_sn + u0 // (GROUP // 8))], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _next_words(ring, words_at, scales_at, stride_pn, stride_sn, j, first, programs, tiles, LW: gl.constexpr, BLOCK_N: gl.constexpr,
                WORDS: gl.constexpr, STAGES: gl.constexpr, ITERS: gl.constexpr, GROUP: gl.constexpr, TMA: gl.constexpr):
    """This program's tile j of words, from the ring, after asking for its tile STAGES - 1 ahead
    into the slot read last iteration (by TMA once every thread has read it: Triton's barrier pass
    puts a barrier and an async-proxy fence before the copy, as it does before any write to
    shared memory that other threads read)."""
    _ask_words(ring, (j + STAGES - 1) % STAGES, words_at, scales_at, stride_pn, stride_sn, j + STAGES - 1, first, programs, tiles,
               BLOCK_N, WORDS, ITERS, GROUP, TMA)
    if TMA:
        mbarrier.wait(ring[1].index(j % STAGES), j // STAGES & 1)  # tile j's bytes have landed
    else:
        async_copy.wait_group(STAGES - 1)  # this thread's copies of tile j have landed
    return ring[0].index(j % STAGES).load(LW)


@gluon.jit
def _regroup(p, q):
    """Pairs (x_2i, x_2i+1) and (x_2i+4, x_2i+5) -> (x_2i, x_2i+4) and (x_2i+1, x_2i+5), as half2."""
    lo = gl.inline_asm_elementwise(PAIR_LO, "=r,r,r", [p, q], dtype=gl.int32, is_pure=True, pack=1)
    hi = gl.inline_asm_elementwise(PAIR_HI, "=r,r,r", [p, q], dtype=gl.int32, is_pure=True, pack=1)
    return lo, hi


@gluon.jit
def _widen(p):
    """A pair (x_2i, x_2i+1) as two fp32 values."""
    lo = (p & 0xFFFF).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
    hi = (p >> 16).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
    return lo, hi


@gluon.jit
def _pairs(t):
    """The elements 2i and 2i + 1 along the second axis of `t`, as two tensors (each thread's own
    registers: a thread holds runs of 4 words, so no data moves)."""
    return gl.split(gl.reshape(t, [t.shape[0], t.shape[1] // 2, 2]))


@gluon.jit
def _rows(column, like):
    """A word column's value for every row of the block."""
    return gl.broadcast(gl.expand_dims(column, 0), like)[0]


@gluon.jit
def gemv_gluon(x_ptr, packed_ptr, scale_ptr, y_ptr, N, K, stride_pn, stride_sn, words_desc,
               GROUP: gl.constexpr, HALF2: gl.constexpr, ROWS: gl.constexpr, WARPS_N: gl.constexpr, PREFETCH: gl.constexpr,
               XVEC: gl.constexpr, WARPS: gl.constexpr, INTERLEAVED: gl.constexpr = 0, VEC: gl.constexpr = 4, PDL: gl.constexpr = False,
               XSMEM: gl.constexpr = 0, ITERS: gl.constexpr = 0, STAGES: gl.constexpr = 0, TMA: gl.constexpr = 0):
    # words_desc: with TMA, the words' tensor descriptor (blocks of BLOCK_N x WORDS), else None
    # a thread: ROWS rows x runs of 4 consecutive words (a 16-byte load a row); a warp: 32 threads along
    # the words; warps over rows x words. The block is VEC // 4 such tiles along the words, so with
    # VEC 8 a thread's second run lies a tile's width (128 x warps along K words) after its first:
    # each warp load then reads 512 contiguous bytes (8 consecutive words a thread would touch each
    # sector in two loads, half of it each time)
    LW: gl.constexpr = gl.BlockedLayout([ROWS, 4], [1, 32], [WARPS_N, WARPS // WARPS_N], [1, 0])
    BLOCK_N: gl.constexpr = ROWS * WARPS_N
    WORDS: gl.constexpr = VEC * 32 * (WARPS // WARPS_N)
    LF: gl.constexpr = gl.BlockedLayout([ROWS, 1], [1, 32], [WARPS_N, WARPS // WARPS_N], [1, 0])  # a thread's rows, at its runs' first words
    first = gl.program_id(0)
    xq_ptr = x_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    span = K // 8
    if STAGES:  # a ring's first asks go out before the wait for the kernel ahead (serving never writes words or scales)
        programs = gl.num_programs(0)  # the grid may be smaller than the blocks of rows (`Launch.persist`): a program takes every programs-th
        tiles = (N // BLOCK_N - first + programs - 1) // programs * ITERS
        rf, runs = _runs(LF, BLOCK_N, WORDS)  # (a word's scale is its run's)
        if TMA:
            words_at = words_desc
        else:
            words_at = packed_ptr + gl.expand_dims(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LW)) * stride_pn, 1) + gl.expand_dims(
                gl.arange(0, WORDS, layout=gl.SliceLayout(0, LW)), 0)
        scales_at = scale_ptr + gl.expand_dims(rf * stride_sn, 1) + gl.expand_dims(runs // (GROUP // 8), 0)  # (a hint, exact for groups of 32-128 and per channel)
        ring = _words_ring(words_at, scales_at, stride_pn, stride_sn, first, programs, tiles, BLOCK_N, WORDS, STAGES, ITERS, GROUP, TMA)
        if PDL:
            await_predecessor(WARPS)
    else:
        programs = 1
        tiles = 0
        ring = xq_ptr  # (unused)
        words_at = xq_ptr
        scales_at = xq_ptr
        if PDL:  # where x is copied to shared memory first, a block's first loads of words wait for it: more words to L2 while it flies
            _await_inputs(packed_ptr, scale_ptr, first, stride_pn, stride_sn, span, LF, BLOCK_N, WORDS, WARPS, 3 if XSMEM else 1)
    if XSMEM:
        x_shared = _x_to_shared(xq_ptr, ITERS, WORDS // 4, WARPS)
    else:
        x_shared = xq_ptr  # (unused)
    if PREFETCH:
        ru = gl.arange(0, WORDS, layout=gl.SliceLayout(0, LW))
        rn = first * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LW))
        w = gl.load(packed_ptr + gl.expand_dims(rn * stride_pn, 1) + gl.expand_dims(ru, 0))
        s = gl.load(scale_ptr + gl.expand_dims(rn * stride_sn, 1) + gl.expand_dims(ru // (GROUP // 8), 0))
    else:
        w = xq_ptr  # (unused)
        s = xq_ptr
    if XSMEM:  # x's copies landed (the first words' loads, where prefetched, went out while they flew)
        async_copy.wait_group(0)
        _block_barrier()  # here, once: left to Triton's membar pass, the barrier lands inside the loop that reads x
    if STAGES:
        for t in range(0, tiles // ITERS):
            _rows_times_x(xq_ptr, packed_ptr, scale_ptr, y_ptr, span, stride_pn, stride_sn, first + t * programs, t * ITERS, first, programs, tiles,
                          ring, words_at, scales_at, x_shared, w, s, LW, BLOCK_N, WORDS, GROUP, HALF2, PREFETCH, XVEC, WARPS, WARPS_N, INTERLEAVED, XSMEM, ITERS, STAGES, TMA)
        if not TMA:  # (a TMA ring asks for nothing past its last tile)
            async_copy.wait_group(0)  # the loop's last asks (empty groups) before the ring's memory is let go
    else:
        _rows_times_x(xq_ptr, packed_ptr, scale_ptr, y_ptr, span, stride_pn, stride_sn, first, 0, first, programs, tiles,
                      ring, words_at, scales_at, x_shared, w, s, LW, BLOCK_N, WORDS, GROUP, HALF2, PREFETCH, XVEC, WARPS, WARPS_N, INTERLEAVED, XSMEM, ITERS, STAGES, TMA)


@gluon.jit
def _rows_times_x(xq_ptr, packed_ptr, scale_ptr, y_ptr, span, stride_pn, stride_sn, block, j0, first, programs, tiles, ring, words_at,
                  scales_at, x_shared, w, s, LW: gl.constexpr, BLOCK_N: gl.constexpr, WORDS: gl.constexpr, GROUP: gl.constexpr, HALF2: gl.constexpr, PREFETCH: gl.constexpr, XVEC: gl.constexpr,
                  WARPS: gl.constexpr, WARPS_N: gl.constexpr, INTERLEAVED: gl.constexpr, XSMEM: gl.constexpr, ITERS: gl.constexpr,
                  STAGES: gl.constexpr, TMA: gl.constexpr):
    """y for one block of rows: its words (from the ring from this program's tile j0 on, or loaded,
    the first iteration's already in w and s where PREFETCH) times x, summed along K."""
    # x pairs [units, 4]: a run's 4 units x 4 pairs, contiguous along the pairs (unit order) or along the units (interleaved)
    LX: gl.constexpr = gl.BlockedLayout([4, 4], [32, 1], [WARPS // WARPS_N, WARPS_N], [0, 1] if INTERLEAVED else [1, 0])
    LR: gl.constexpr = gl.SliceLayout(1, LW)
    LU: gl.constexpr = gl.SliceLayout(0, LW)
    # a thread's tiles of x (16 pairs: 4 units' x) in shared memory, read as [16, tiles]: lanes and warps
    # laid out as LW's along the words (so the pairs reach LU in each thread's registers, not through shared memory)
    LT: gl.constexpr = gl.BlockedLayout([16, 1], [1, 32], [WARPS_N, WARPS // WARPS_N], [1, 0])
    rn = block * BLOCK_N + gl.arange(0, BLOCK_N, layout=LR)
    acc = gl.zeros([BLOCK_N, WORDS], gl.float32, LW)
    if HALF2 == 2:  # one sum a pair of words
        acc = _pairs(acc)[0]
    w_rows = packed_ptr + gl.expand_dims(rn * stride_pn, 1)
    s_rows = scale_ptr + gl.expand_dims(rn * stride_sn, 1)
    ru = gl.arange(0, WORDS, layout=LU)
    for u0 in range(0, span, WORDS):
        units = u0 + ru
        if STAGES:
            w_now = _next_words(ring, words_at, scales_at, stride_pn, stride_sn, j0 + u0 // WORDS, first, programs, tiles, LW, BLOCK_N, WORDS,
                                STAGES, ITERS, GROUP, TMA)
            s_now = gl.load(s_rows + gl.expand_dims(units // (GROUP // 8), 0))
        elif PREFETCH:  # this block's words came last iteration; the next block's load now (the last block re-reads itself)
            w_now = w
            s_now = s
            following = gl.expand_dims(gl.multiple_of(gl.minimum(u0 + WORDS, span - WORDS), WORDS) + ru, 0)
            w = gl.load(w_rows + following)
            s = gl.load(s_rows + following // (GROUP // 8))
        else:
            w_now = gl.load(w_rows + gl.expand_dims(units, 0))
            # a word's group as units // (GROUP // 8), not units * 8 // GROUP: ptxas then sees one scale a run and loads it once
            s_now = gl.load(s_rows + gl.expand_dims(units // (GROUP // 8), 0))
        a0, a1, a2, a3 = _x_pairs(xq_ptr, units, LU, LX, XVEC, INTERLEAVED, XSMEM, x_shared.index(u0 // WORDS) if XSMEM else x_shared, LT)
        if HALF2:
            if INTERLEAVED:
                q0, q1, q2, q3 = a0, a1, a2, a3
            else:  # x regrouped to (x_j, x_j+4) once per word column, shared by the thread's rows
                q0, q1 = _regroup(a0, a2)
                q2, q3 = _regroup(a1, a3)
            if HALF2 == 2:  # words 2i and 2i + 1 (a thread's, of one group) in one half2 sum
                w0, w1 = _pairs(w_now)
                x0, x1 = _pairs(_rows(q0, w_now))
                x2, x3 = _pairs(_rows(q1, w_now))
                x4, x5 = _pairs(_rows(q2, w_now))
                x6, x7 = _pairs(_rows(q3, w_now))
                s_now = _pairs(s_now)[0]
                dot = gl.inline_asm_elementwise(DOT8_HALF2, "=f,r,r,r,r,r,r,r,r,r,r", [w0, w1, x0, x2, x4, x6, x1, x3, x5, x7],
                                                dtype=gl.float32, is_pure=True, pack=1)
            else:
                dot = gl.inline_asm_elementwise(DOT4_HALF2, "=f,r,r,r,r,r", [w_now, _rows(q0, w_now), _rows(q1, w_now), _rows(q2, w_now), _rows(q3, w_now)],
                                                dtype=gl.float32, is_pure=True, pack=1)
        else:  # x widened once per word column
            if INTERLEAVED:  # pair p: (x for code p, for code p + 4)
                x0, x4 = _widen(a0)
                x1, x5 = _widen(a1)
                x2, x6 = _widen(a2)
                x3, x7 = _widen(a3)
            else:
                x0, x1 = _widen(a0)
                x2, x3 = _widen(a1)
                x4, x5 = _widen(a2)
                x6, x7 = _widen(a3)
            dot = gl.inline_asm_elementwise(_DOT4_PTX, "=f,r,f,f,f,f,f,f,f,f",
                                            [w_now, _rows(x0, w_now), _rows(x1, w_now), _rows(x2, w_now), _rows(x3, w_now), _rows(x4, w_now),
                                             _rows(x5, w_now), _rows(x6, w_now), _rows(x7, w_now)], dtype=gl.float32, is_pure=True, pack=1)
        acc += dot * s_now.to(gl.float32)
    y = gl.sum(acc, axis=1)
    if HALF2 == 2:
        y = gl.convert_layout(y, LR) * 64.0  # the decode's 1/64, exact
    elif HALF2:
        y = y * 32.0  # the decode's 1/32, exact
    gl.store(y_ptr + rn, y.to(gl.float16))


class Launch(NamedTuple):
    half2: int  # 1: half2 products, widened to fp32 a word; 2: a pair of words (DOT8_HALF2); 0: the grid GEMV's fp32 arithmetic
    rows: int  # a thread's rows
    warps_n: int  # warps along the rows (the rest along the words)
    prefetch: int
    xvec: int  # x in 16-byte loads from global memory (needs warps_n == warps: x's layout then matches the words')
    warps: int
    vec: int = 4  # a thread's words a row: runs of 4 consecutive words (8: two runs, a warp's runs apart)
    xsmem: int = 0  # all of x in shared memory, loaded once per block (`_x_to_shared`; xvec is then moot)
    maxnreg: int = 0  # registers a thread at most (0: as ptxas allocates), where fewer fit another block on each SM
    stages: int = 0  # the words through a ring of this many tiles in shared memory (`_words_ring`; 0: loaded into registers); at most 32 KiB in LAUNCHES
    persist: int = 0  # with a ring: programs an SM, each taking every grid-th block of rows through one ring and one copy of x (0: a program a block)
    tma: int = 0  # with a ring: its tiles copied by the copy engine (TMA), a tile an instruction, not by each thread's cp.async

    @property
    def block_n(self) -> int:
        return self.rows * self.warps_n

    @property
    def words(self) -> int:  # a block's words along K: 128 or 256 divide 4096 and 14336 inputs (512 and 1792 words)
        return self.vec * 32 * self.warps // self.warps_n

    def __str__(self) -> str:
        return (f"{('fp32', 'half2', 'half2 pairs')[self.half2]} {self.block_n}x{self.words} ({self.rows} row{'s' if self.rows > 1 else ''} x {self.vec} words "
                f"a thread), {self.warps} warp{'s' if self.warps > 1 else ''}" + (", prefetch" if self.prefetch else "") + (", x in shared memory" if self.xsmem else "" if self.xvec else ", x by 4-byte loads")
                + (f", at most {self.maxnreg} registers" if self.maxnreg else "") + (f", {self.stages}-stage ring" if self.stages else "")
                + (f", {self.persist} programs an SM" if self.persist else "") + (", by TMA" if self.tma else ""))


# Each launch's first six fields in order: half2, rows, warps_n, prefetch, xvec, warps. Grouped
# by what each family tried; LAUNCHES' order is the indices the benchmarks and notes cite.
_PERSISTENT_RINGS = [  # stop 70: a few programs an SM, one ring and one copy of x for all their blocks
    Launch(1, 2, 2, 0, 0, 4, stages=8, persist=4), Launch(2, 2, 2, 0, 0, 4, stages=8, persist=4),
    Launch(1, 2, 4, 0, 1, 4, xsmem=1, stages=8, persist=3), Launch(2, 2, 4, 0, 1, 4, xsmem=1, stages=8, persist=3),
    Launch(2, 4, 4, 0, 1, 4, xsmem=1, stages=4, persist=3), Launch(1, 2, 8, 0, 1, 8, xsmem=1, stages=4, persist=2),
]
LAUNCHES = [
    # words in registers, x by 16-byte loads (0-7), by 4-byte loads (8-10), two runs a thread (11-14), prefetching (15-17)
    Launch(1, 1, 4, 0, 1, 4), Launch(1, 2, 4, 0, 1, 4), Launch(1, 4, 4, 0, 1, 4), Launch(1, 1, 8, 0, 1, 8), Launch(1, 2, 8, 0, 1, 8),
    Launch(1, 4, 8, 0, 1, 8), Launch(1, 1, 2, 0, 1, 2), Launch(1, 2, 2, 0, 1, 2),
    Launch(1, 2, 2, 0, 0, 4), Launch(1, 1, 2, 0, 0, 4), Launch(1, 4, 2, 0, 0, 4),
    Launch(1, 1, 4, 0, 1, 4, vec=8), Launch(1, 2, 4, 0, 1, 4, vec=8), Launch(1, 1, 8, 0, 1, 8, vec=8), Launch(1, 2, 8, 0, 1, 8, vec=8),
    Launch(1, 2, 4, 1, 1, 4), Launch(1, 1, 4, 1, 1, 4), Launch(1, 2, 8, 1, 1, 8),
    # x in shared memory (18-25, stop 61), then a prefetching launch by 4-byte loads (26)
    Launch(1, 1, 4, 0, 1, 4, xsmem=1), Launch(1, 2, 4, 0, 1, 4, xsmem=1), Launch(1, 4, 4, 0, 1, 4, xsmem=1, maxnreg=72),
    Launch(1, 2, 8, 0, 1, 8, xsmem=1), Launch(1, 2, 2, 0, 1, 4, xsmem=1), Launch(1, 4, 2, 0, 1, 4, xsmem=1),
    Launch(1, 2, 4, 0, 1, 4, vec=8, xsmem=1), Launch(1, 2, 4, 1, 1, 4, xsmem=1),
    Launch(1, 2, 2, 1, 0, 4),
    # the pairs decode, HALF2=2 (27-32, stop 69)
    Launch(2, 2, 2, 1, 0, 4), Launch(2, 2, 2, 0, 0, 4), Launch(2, 2, 8, 0, 1, 8, xsmem=1), Launch(2, 2, 4, 0, 1, 4, xsmem=1),
    Launch(2, 2, 2, 0, 1, 4, xsmem=1), Launch(2, 4, 4, 0, 1, 4),
    # rings of tiles in shared memory filled by cp.async, a program a block (33-39, stop 69)
    Launch(1, 2, 2, 0, 0, 4, stages=4), Launch(2, 2, 2, 0, 0, 4, stages=4), Launch(1, 2, 2, 0, 0, 4, stages=8),
    Launch(1, 2, 2, 0, 1, 4, xsmem=1, stages=4), Launch(2, 2, 4, 0, 1, 4, xsmem=1, stages=4), Launch(2, 2, 8, 0, 1, 8, xsmem=1, stages=4),
    Launch(2, 4, 4, 0, 1, 4, stages=3),
    # persistent rings (40-45), and single-warp ones, 16 programs an SM (46-47)
    *_PERSISTENT_RINGS,
    Launch(1, 2, 1, 0, 1, 1, stages=8, persist=16), Launch(2, 4, 1, 0, 1, 1, stages=4, persist=16),
    # their TMA twins (48-53, stop 71): the copy engine fills the ring
    *[launch._replace(tma=1) for launch in _PERSISTENT_RINGS],
    # fp32 arithmetic, as the grid GEMV's (54-59): not served, they cover its code paths in the tests
    Launch(0, 1, 4, 0, 1, 4), Launch(0, 2, 4, 0, 1, 4), Launch(0, 4, 4, 0, 1, 4), Launch(0, 1, 8, 0, 1, 8), Launch(0, 2, 8, 0, 1, 8),
    Launch(0, 1, 4, 0, 1, 4, vec=8),
]


def run(x, weight, y, launch: Launch):
    """y = x @ weight^T (x: [1, K] fp16) for a weight that `fits` the launch, in either layout
    (its `interleaved` flag). A TMA launch's descriptor is encoded on the host at each launch
    (Triton's launcher): a few microseconds a call eagerly, none in a replayed CUDA graph, where
    serving times and runs it."""
    words_desc = TensorDescriptor.from_tensor(weight.packed, [launch.block_n, launch.words], TMA_LAYOUT) if launch.tma else None
    gemv_gluon[grid(launch, weight.rows, _sm_count(x.device.index))](x, weight.packed, weight.scale, y, weight.rows, weight.columns, weight.packed.stride(0),
                                                 weight.scale.stride(0), words_desc, GROUP=weight.group_size, HALF2=launch.half2, ROWS=launch.rows,
                                                 WARPS_N=launch.warps_n, PREFETCH=launch.prefetch, XVEC=launch.xvec, WARPS=launch.warps,
                                                 INTERLEAVED=int(weight.interleaved), VEC=launch.vec, XSMEM=launch.xsmem,
                                                 ITERS=iterations(launch, weight.columns), STAGES=launch.stages, TMA=launch.tma, num_warps=launch.warps,
                                                 **({"maxnreg": launch.maxnreg} if launch.maxnreg else {}), **pdl_launch(x.device))
    return y


# The launches `served_launch` times against the grid GEMV: every half2 one (54, the pairs,
# rings, persistent rings and TMA rings among them; a layer shape's first call compiles and times
# them, the TMA rings on sm_90 and later only). Not only those whose loops compiled shortest
# for sm_90 (no prefetch, 16-byte x loads; benchmarks/results/gemv_gluon_sass.md): on an H200 the
# fastest interleaved launch at 4096x4096 and 4096x14336 loads x in 4 bytes, and the next one
# prefetches (benchmarks/results/gpu_h200.md).
SERVED = [launch for launch in LAUNCHES if launch.half2]


def iterations(launch: Launch, columns: int) -> int:
    """The ITERS a launch takes at this K: its loop's iterations a block of rows where it holds x
    in shared memory (sized at compile time) or streams its words through a ring (which counts a
    program's tiles across its blocks), else 0."""
    return columns // (8 * launch.words) if launch.xsmem or launch.stages else 0


def grid(launch: Launch, rows: int, sms: int) -> tuple[int]:
    """The launch's programs on a weight of `rows` rows on a GPU of `sms` multiprocessors: one a
    block of rows, or for a persistent launch at most `persist` an SM, each streaming its blocks
    through one ring (its next block's first words are asked for while it sums this one's last)
    after copying x once: a program a block copied all of x per block, 7-29 MB from L2 at K = 14336
    against 30 MB of weight, and ran 2.33x fp16 there where it ran 3.09x at K = 4096
    (benchmarks/results/gpu_h200.md, stop 69)."""
    blocks = rows // launch.block_n
    return (min(blocks, launch.persist * sms) if launch.persist else blocks,)


@functools.cache
def _sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def fits(weight, launch: Launch) -> bool:
    """Whether `launch` computes x @ weight^T: a symmetric 4-bit grid (no codebook, no 2:4) whose
    groups hold whole words (pairs of words for HALF2=2; per-channel too), rows a whole number of the launch's blocks and K
    of its blocks along K (the kernel has no masks); x in shared memory at most X_SHARED_BYTES; by
    TMA, words whose rows start 16-byte aligned (the copy engine's rule), a tile at most 256 x 256."""
    plain = weight.bits == 4 and weight.zero is None and weight.codebook is None and weight.bitmask is None and weight.scale is not None
    return (plain and weight.group_size % (16 if launch.half2 == 2 else 8) == 0 and weight.columns % weight.group_size == 0 and weight.rows % launch.block_n == 0
            and weight.columns % (8 * launch.words) == 0 and (not launch.xsmem or weight.columns * 2 <= X_SHARED_BYTES)
            and (not launch.tma or (weight.packed.stride(0) % 4 == 0 and weight.packed.data_ptr() % 16 == 0 and max(launch.block_n, launch.words) <= 256)))


X_SHARED_BYTES = 96 * 1024  # x held in shared memory, at most: K up to 49152 (sm_90 gives a block up to 227 KiB)


_PICKS: dict[tuple, Launch | None] = {}


def _key(x: torch.Tensor, weight) -> tuple:
    return weight.rows, weight.columns, weight.group_size, weight.interleaved, x.device.index


def picked(x: torch.Tensor, weight) -> Launch | None:
    """What `served_launch` picked for this layer (None: the grid GEMV, or not picked yet)."""
    return _PICKS.get(_key(x, weight))


def served_launch(x: torch.Tensor, weight, grid_gemv) -> Launch | None:
    """The launch that serves x @ weight^T at batch 1, or None for the grid GEMV (`grid_gemv(out,
    copy)`: it, autotuned, for that copy of the weight, writing y into `out`). Only for fp16 x on
    CUDA with autotuning on (LMPRESS_AUTOTUNE=0 runs a fixed launch; LMPRESS_GLUON=0 turns this
    off), for a weight some launch `fits`. Once per layer shape, group and layout: the fitting
    launches of SERVED are timed against the grid GEMV (after its own tuning) as a model serves
    them, and the fastest serves; a launch that fails to compile, or whose y is not the grid
    GEMV's within fp16 rounding (5e-3 relative), is never picked, with a warning."""
    if (weight.bits != 4 or not x.is_cuda or x.dtype != torch.float16 or os.environ.get("LMPRESS_AUTOTUNE") == "0"
            or os.environ.get("LMPRESS_GLUON") == "0"):
        return None
    key = _key(x, weight)
    if key not in _PICKS:
        hopper = _capability(x.device.index) >= (9, 0)  # TMA and mbarrier transaction counts: sm_90 on
        _PICKS[key] = _fastest(x, weight, grid_gemv, [launch for launch in SERVED if fits(weight, launch) and (hopper or not launch.tma)])
    pick = _PICKS[key]
    return pick if pick is None or fits(weight, pick) else None  # (a weight of the picked shape whose words a TMA launch cannot take: not 16-byte aligned)


def _fastest(x: torch.Tensor, weight, grid_gemv, launches: list[Launch]) -> Launch | None:
    """The fastest of the grid GEMV (None) and those of `launches` that compute its y, each
    timed as a model runs it (`weight_seconds`): back to back in a CUDA graph, over copies of the
    weight that overflow the L2, so one call's tail overlaps the next one's start (programmatic
    dependent launch) and the words come from device memory. Timed one call at a time after an
    L2 flush (Triton's do_bench), the launches ranked differently: on an H200 that pick served
    14336x4096 in 14.1 us where another launch took 12.4 (benchmarks/results/gpu_h200.md)."""
    from compressors.kernels import weight_seconds  # here, not above: compressors.kernels imports packed_int, which imports this module

    if not launches:
        return None
    y = torch.empty(1, weight.rows, dtype=torch.float16, device=x.device)
    expected = grid_gemv(y).float()  # the grid GEMV tunes on this call
    try:
        timings = {None: weight_seconds(lambda copy: grid_gemv(y, copy), weight)}
    except Exception as failure:  # noqa: BLE001  (where no CUDA graph can be captured, serving goes on as it would untimed)
        warnings.warn(f"the batch-1 GEMVs could not be timed in a CUDA graph ({failure}): the grid GEMV serves", stacklevel=3)
        return None
    for launch in launches:
        try:
            error = ((run(x, weight, y, launch).float() - expected).norm() / expected.norm()).item()
            if not error <= 5e-3:
                warnings.warn(f"Gluon GEMV {launch} is {error:.1e} off the grid GEMV at {weight.rows}x{weight.columns}: not served", stacklevel=3)
                continue
            timings[launch] = weight_seconds(lambda copy: run(x, copy, y, launch), weight)  # noqa: B023  (timed here, in this iteration)
        except Exception as failure:  # noqa: BLE001  (a kernel that cannot run or be timed here must not stop serving)
            warnings.warn(f"Gluon GEMV {launch} failed on {torch.cuda.get_device_name(x.device)}: {failure}", stacklevel=3)
    return min(timings, key=timings.get)
