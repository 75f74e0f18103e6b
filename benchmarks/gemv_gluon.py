"""Batch-1 int4 GEMV in Gluon (Triton's explicit-layout dialect), timed beside the served kernel.

    python benchmarks/gemv_gluon.py [--shapes 4096x4096,...] [--out DIR]   # on a CUDA GPU
    python benchmarks/gemv_gluon.py --sass                                 # here: sm_90 loop counts
    python benchmarks/gemv_gluon.py --emulate [--launches 0,5,...]         # here: each launch's sm_90 PTX run on the CPU

An experiment for issue 3's batch-1 goal (over 3x fp16), not a serving path: int4, symmetric,
group 128, both layouts (unit order, and the interleaved one CUDA serves), shapes that divide
the launch evenly. Why Gluon: in plain Triton the
compiler picks each tensor's layout, and a thread's x never lines up with its words: the served
GEMV (`_grid_gemv_kernel`) moves x through shared memory every block (8 STSM, 8 LDS.128 and up
to 16 barriers a loop, benchmarks/results/gemv_layouts_sass.md) at about 36 instructions a
word. Here the layout is stated: a thread holds ROWS rows x 4 consecutive words (one 16-byte
load a row) and the 32 x values those 4 words cover (XVEC: four 16-byte loads, from L1), so the
loop touches no shared memory and has no barrier.

The product, per word (HALF2=1): the 8 codes decode (lop3, the magic-number trick) straight to
(code - 8) / 32 in half2 pairs (j, j + 4), exact; x is taken as half2 pairs (x_j, x_j+4) (in unit
order regrouped by prmt, once per word column, shared by the thread's rows; in the interleaved
layout those columns are adjacent, so x's own pairs serve as loaded); 4 half2 FMAs; the two halves summed in fp32.
The 1/32 bounds each half's sum by max|x|, so it cannot overflow; the cost is fp16 rounding in 4
products and 3 sums (about 5e-4 relative, the size of the fp16 output's own rounding).
HALF2=0 is the served kernel's arithmetic: x widened to fp32 once per word column, each code - 8
decoded in half2 and widened, 8 fp32 FMAs (`_DOT4_PTX`). PREFETCH loads the next
block's words and scales before this block's arithmetic.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if "--sass" in sys.argv or "--emulate" in sys.argv:  # compile for sm_90, not interpret: set before triton is imported
    os.environ["TRITON_INTERPRET"] = "0"

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402

from compressors.packed_int import _DOT4_PTX, HALF2_NIBBLES4  # noqa: E402  (_DOT4_PTX, HALF2=0: the served GEMV's decode and 8 fp32 FMAs)

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
HALF2_DOT4 = """
    mul.rn.f16x2 a, h0, $2;
    fma.rn.f16x2 a, h1, $3, a;
    fma.rn.f16x2 a, h2, $4, a;
    fma.rn.f16x2 a, h3, $5, a;
    mov.b32 {lo, hi}, a;
    cvt.f32.f16 flo, lo;
    cvt.f32.f16 fhi, hi;
    add.f32 $0, flo, fhi;
"""  # decoded pairs h0..h3 times x pairs $2..$5, summed in half2, the halves added in fp32
DOT4_HALF2 = gl.constexpr("""{
    .reg .b32 t, h0, h1, h2, h3, c1, c2, c3, c4, a;
    .reg .b16 lo, hi;
    .reg .f32 flo, fhi;""" + _DECODE + HALF2_DOT4 + "}")
@gluon.jit
def _x_pairs(xq_ptr, units, LU: gl.constexpr, LX: gl.constexpr, XVEC: gl.constexpr, INTERLEAVED: gl.constexpr):
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
    if XVEC:
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
def _rows(column, like):
    """A word column's value for every row of the block."""
    return gl.broadcast(gl.expand_dims(column, 0), like)[0]


@gluon.jit
def gemv_gluon(x_ptr, packed_ptr, scale_ptr, y_ptr, N, K, stride_pn, stride_sn,
               GROUP: gl.constexpr, HALF2: gl.constexpr, ROWS: gl.constexpr, WARPS_N: gl.constexpr, PREFETCH: gl.constexpr,
               XVEC: gl.constexpr, WARPS: gl.constexpr, INTERLEAVED: gl.constexpr = 0, VEC: gl.constexpr = 4):
    # a thread: ROWS rows x VEC consecutive words (4: one 16-byte load a row; 8: two); a warp: 32 threads
    # along the words; warps over rows x words
    LW: gl.constexpr = gl.BlockedLayout([ROWS, VEC], [1, 32], [WARPS_N, WARPS // WARPS_N], [1, 0])
    # x pairs [units, 4]: a thread's 4 units x 4 pairs, contiguous along the pairs (unit order) or along the units (interleaved)
    LX: gl.constexpr = gl.BlockedLayout([VEC, 4], [32, 1], [WARPS // WARPS_N, WARPS_N], [0, 1] if INTERLEAVED else [1, 0])
    LR: gl.constexpr = gl.SliceLayout(1, LW)
    LU: gl.constexpr = gl.SliceLayout(0, LW)
    BLOCK_N: gl.constexpr = ROWS * WARPS_N
    WORDS: gl.constexpr = VEC * 32 * (WARPS // WARPS_N)
    rn = gl.program_id(0) * BLOCK_N + gl.arange(0, BLOCK_N, layout=LR)
    xq_ptr = x_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    acc = gl.zeros([BLOCK_N, WORDS], gl.float32, LW)
    span = K // 8
    w_rows = packed_ptr + gl.expand_dims(rn * stride_pn, 1)
    s_rows = scale_ptr + gl.expand_dims(rn * stride_sn, 1)
    ru = gl.arange(0, WORDS, layout=LU)
    if PREFETCH:
        w = gl.load(w_rows + gl.expand_dims(ru, 0))
        s = gl.load(s_rows + gl.expand_dims(ru * 8 // GROUP, 0))
    for u0 in range(0, span, WORDS):
        units = u0 + ru
        if PREFETCH:  # this block's words came last iteration; the next block's load now (the last block re-reads itself)
            w_now = w
            s_now = s
            following = gl.expand_dims(gl.multiple_of(gl.minimum(u0 + WORDS, span - WORDS), WORDS) + ru, 0)
            w = gl.load(w_rows + following)
            s = gl.load(s_rows + following * 8 // GROUP)
        else:
            w_now = gl.load(w_rows + gl.expand_dims(units, 0))
            s_now = gl.load(s_rows + gl.expand_dims(units * 8 // GROUP, 0))
        a0, a1, a2, a3 = _x_pairs(xq_ptr, units, LU, LX, XVEC, INTERLEAVED)
        if HALF2:
            if INTERLEAVED:
                q0, q1, q2, q3 = a0, a1, a2, a3
            else:  # x regrouped to (x_j, x_j+4) once per word column, shared by the thread's rows
                q0, q1 = _regroup(a0, a2)
                q2, q3 = _regroup(a1, a3)
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
    if HALF2:
        y = y * 32.0  # the decode's 1/32, exact
    gl.store(y_ptr + rn, y.to(gl.float16))


class Launch(NamedTuple):
    half2: int  # 1: half2 products; 0: the served fp32 arithmetic
    rows: int  # a thread's rows
    warps_n: int  # warps along the rows (the rest along the words)
    prefetch: int
    xvec: int  # x in 16-byte loads (needs warps_n == warps: x's layout then matches the words')
    warps: int
    vec: int = 4  # a thread's consecutive words

    @property
    def block_n(self) -> int:
        return self.rows * self.warps_n

    @property
    def words(self) -> int:  # a block's words along K: 128 or 256 divide 4096 and 14336 inputs (512 and 1792 words)
        return self.vec * 32 * self.warps // self.warps_n

    def __str__(self) -> str:
        return (f"{'half2' if self.half2 else 'fp32'} {self.block_n}x{self.words} ({self.rows} row{'s' if self.rows > 1 else ''} x {self.vec} words "
                f"a thread), {self.warps} warps" + (", prefetch" if self.prefetch else "") + ("" if self.xvec else ", x by 4-byte loads"))


LAUNCHES = [Launch(*shape) for shape in [
    (1, 1, 4, 0, 1, 4), (1, 2, 4, 0, 1, 4), (1, 4, 4, 0, 1, 4), (1, 1, 8, 0, 1, 8), (1, 2, 8, 0, 1, 8), (1, 4, 8, 0, 1, 8),
    (1, 1, 2, 0, 1, 2), (1, 2, 2, 0, 1, 2), (1, 2, 2, 0, 0, 4), (1, 1, 2, 0, 0, 4), (1, 4, 2, 0, 0, 4),
    (1, 1, 4, 0, 1, 4, 8), (1, 2, 4, 0, 1, 4, 8), (1, 1, 8, 0, 1, 8, 8), (1, 2, 8, 0, 1, 8, 8),
    (1, 2, 4, 1, 1, 4), (1, 1, 4, 1, 1, 4), (1, 2, 8, 1, 1, 8),
    (0, 1, 4, 0, 1, 4), (0, 2, 4, 0, 1, 4), (0, 4, 4, 0, 1, 4), (0, 1, 8, 0, 1, 8), (0, 2, 8, 0, 1, 8), (0, 1, 4, 0, 1, 4, 8),
]]


def run(x, weight, y, launch: Launch):
    """y = x @ weight^T for a weight in either layout (its `interleaved` flag)."""
    gemv_gluon[(weight.rows // launch.block_n,)](x, weight.packed, weight.scale, y, weight.rows, weight.columns, weight.packed.stride(0),
                                                 weight.scale.stride(0), GROUP=weight.group_size, HALF2=launch.half2, ROWS=launch.rows,
                                                 WARPS_N=launch.warps_n, PREFETCH=launch.prefetch, XVEC=launch.xvec, WARPS=launch.warps,
                                                 INTERLEAVED=int(weight.interleaved), VEC=launch.vec, num_warps=launch.warps)
    return y


def compiled(launch: Launch, interleaved: int):
    """The launch compiled for sm_90 (here, no GPU needed), as on 4096-wide layers (aligned)."""
    from benchmarks.kernel_sass import compile_for

    constants = dict(GROUP=128, HALF2=launch.half2, ROWS=launch.rows, WARPS_N=launch.warps_n, PREFETCH=launch.prefetch, XVEC=launch.xvec,
                     WARPS=launch.warps, INTERLEAVED=interleaved, VEC=launch.vec)
    return compile_for(gemv_gluon, constants, num_warps=launch.warps, aligned=True)


def sass_counts() -> list[dict]:
    """Each launch compiled for sm_90 here; the loop's instructions per word and its memory traffic."""
    import collections
    import re

    from benchmarks.kernel_sass import disassemble, loop_body

    rows = []
    for launch, interleaved in [(launch, interleaved) for launch in LAUNCHES for interleaved in (0, 1)]:
        code = disassemble(compiled(launch, interleaved), usage=True)
        body = loop_body(code)
        memory = collections.Counter(op for op in body if op.startswith(("LD", "ST", "BAR")))
        row = dict(launch=str(launch), layout="interleaved" if interleaved else "unit order", registers=int(re.search(r"REG:(\d+)", code).group(1)),
                   loop=len(body), per_word=round(len(body) / (launch.rows * launch.vec), 1), memory=dict(memory))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def emulated(launches: list[Launch], rows: int = 32, columns: int = 4096) -> list[dict]:
    """Each launch compiled for sm_90 and its PTX run on the CPU (benchmarks/ptx_emulator.py),
    both layouts, on a random weight: y's error relative to the torch reference. No interpreter
    runs Gluon, so this is the only run the kernel gets without a GPU."""
    import numpy as np
    import torch

    from benchmarks.ptx_emulator import launch as emulate
    from compressors.packed_int import matmul_reference, random_packed_weight

    weight = random_packed_weight(4, rows, columns, 128)
    x = torch.randn(1, columns, generator=torch.Generator().manual_seed(0)).half()
    reference = matmul_reference(x, weight).float()[0]
    results = []
    for launch, interleaved in [(launch, interleaved) for launch in launches for interleaved in (0, 1)]:
        stored = weight.interleave() if interleaved else weight
        y = np.full(rows, np.nan, np.float16)  # rows a launch leaves unwritten show as NaN error
        emulate(compiled(launch, interleaved).asm["ptx"], (rows // launch.block_n,),
                [x.numpy(), stored.packed.numpy(), stored.scale.numpy(), y, rows, columns, stored.packed.stride(0), stored.scale.stride(0)])
        error = ((torch.from_numpy(y).float() - reference).norm() / reference.norm()).item()
        results.append(dict(launch=str(launch), layout="interleaved" if interleaved else "unit order", rel_error=error))
        print(json.dumps(results[-1]), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="4096x4096,4096x14336,14336x4096")
    parser.add_argument("--sass", action="store_true")
    parser.add_argument("--emulate", action="store_true", help="run each launch's sm_90 PTX on the CPU against the reference; exit 1 if one is off")
    parser.add_argument("--launches", help="with --emulate: indices into LAUNCHES (default: all)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/gemv_gluon"))
    parser.add_argument("--compile-workers", type=int, default=0, help="compile the served GEMV's launch shapes first in this many processes")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.sass:
        (args.out / "gemv_gluon_sass.json").write_text(json.dumps(sass_counts(), indent=1))
        return
    if args.emulate:
        from benchmarks.kernel_sass import EMULATED_TOLERANCE

        chosen = [LAUNCHES[int(i)] for i in args.launches.split(",")] if args.launches else LAUNCHES
        results = emulated(chosen)
        (args.out / "gemv_gluon_emulated.json").write_text(json.dumps(results, indent=1))
        off = [r for r in results if not r["rel_error"] <= EMULATED_TOLERANCE["fp16"]]  # NaN is off too
        for arithmetic in ("half2", "fp32"):
            errors = [r["rel_error"] for r in results if r["launch"].startswith(arithmetic)]
            if errors:
                print(f"{arithmetic}: {len(errors)} compiled kernels emulated, relative error {min(errors):.1e} to {max(errors):.1e}")
        if off:
            raise SystemExit(f"{len(off)} launches off the reference (over {EMULATED_TOLERANCE['fp16']}): {off}")
        return

    import torch

    from compressors.kernels import weight_seconds
    from compressors.packed_int import matmul_reference, matmul_triton, random_packed_weight

    if args.compile_workers:  # the served kernel's tuner would compile its launch shapes one by one
        from benchmarks.kernel_speed import launch_tasks, precompile

        ks = sorted({int(shape.split("x")[1]) for shape in args.shapes.split(",")})
        precompile([task for interleaved in (True, False) for task in launch_tasks(None, (4, "symmetric", 128, interleaved), ks, [1])],
                   args.compile_workers)
    rows = []
    for shape in args.shapes.split(","):
        n, k = map(int, shape.split("x"))
        weight = random_packed_weight(4, n, k, 128).to("cuda")
        served = weight.interleave()
        dense = (torch.randn(n, k, device="cuda") / 50).half()
        x = torch.randn(1, k, device="cuda", dtype=torch.float16)
        reference = matmul_reference(x, weight).float()
        fp16 = weight_seconds(lambda w: x @ w.T, dense)
        lmpress = {layout: weight_seconds(lambda w: matmul_triton(x, w), w) for layout, w in (("interleaved", served), ("unit order", weight))}
        print(f"{shape}: fp16 {fp16 * 1e6:.2f} us; served GEMV autotuned: " +
              ", ".join(f"{layout} {s * 1e6:.2f} us ({fp16 / s:.2f}x)" for layout, s in lmpress.items()), flush=True)
        for launch, layout in [(launch, layout) for launch in LAUNCHES for layout in ("unit order", "interleaved")]:
            if n % launch.block_n or (k // 8) % launch.words:
                continue
            stored = served if layout == "interleaved" else weight
            y = torch.full((1, n), float("nan"), device="cuda", dtype=torch.float16)  # rows a launch leaves unwritten show as NaN error
            try:
                error = ((run(x, stored, y, launch).float() - reference).norm() / reference.norm()).item()
                seconds = weight_seconds(lambda w: run(x, w, torch.empty(1, n, device="cuda", dtype=torch.float16), launch), stored)
            except Exception as failure:  # noqa: BLE001  (an experiment: report and go on)
                print(f"{shape} {launch} {layout}: {type(failure).__name__}: {str(failure)[:300]}", flush=True)
                continue
            row = dict(shape=shape, launch=str(launch), layout=layout, us=round(seconds * 1e6, 2), speedup=round(fp16 / seconds, 2), rel_error=error,
                       fp16_us=round(fp16 * 1e6, 2), served_interleaved_us=round(lmpress["interleaved"] * 1e6, 2),
                       served_unit_order_us=round(lmpress["unit order"] * 1e6, 2), read_TBps=round(weight.nbytes / seconds / 1e12, 2))
            rows.append(row)
            print(json.dumps(row), flush=True)
        (args.out / "gemv_gluon.json").write_text(json.dumps(rows, indent=1))
    for shape in args.shapes.split(","):
        group = [r for r in rows if r["shape"] == shape]
        for arithmetic in ("half2", "fp32"):
            best = min((r for r in group if r["launch"].startswith(arithmetic)), key=lambda r: r["us"], default=None)
            if best:
                print(f"{shape} best {arithmetic}: {best['layout']}, {best['us']} us = {best['speedup']}x fp16 ({best['fp16_us']} us), {best['read_TBps']} TB/s, "
                      f"{best['launch']}, rel error {best['rel_error']:.1e}; served GEMV {best['served_interleaved_us']} us interleaved, "
                      f"{best['served_unit_order_us']} unit order")


if __name__ == "__main__":
    main()
