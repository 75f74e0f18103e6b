"""Batch-1 int4 GEMV in Gluon (Triton's explicit-layout dialect), timed beside the served kernel.

    python benchmarks/gemv_gluon.py [--shapes 4096x4096,...] [--out DIR]   # on a CUDA GPU
    python benchmarks/gemv_gluon.py --sass                                 # here: sm_90 loop counts

An experiment for issue 3's batch-1 goal (over 3x fp16), not a serving path: int4, symmetric,
group 128, unit order, shapes that divide the launch evenly. Why Gluon: in plain Triton the
compiler picks each tensor's layout, and a thread's x never lines up with its words: the served
GEMV (`_grid_gemv_kernel`) moves x through shared memory every block (8 STSM, 8 LDS.128 and up
to 16 barriers a loop, benchmarks/results/gemv_layouts_sass.md) at about 36 instructions a
word. Here the layout is stated: a thread holds ROWS rows x 4 consecutive words (one 16-byte
load a row) and the 32 x values those 4 words cover (XVEC: four 16-byte loads, from L1), so the
loop touches no shared memory and has no barrier.

The product, per word (HALF2=1): the 8 codes decode (lop3, the magic-number trick) straight to
(code - 8) / 32 in half2 pairs (j, j + 4), exact; x is taken as half2 pairs (x_j, x_j+4) (prmt,
once per word column, shared by the thread's rows); 4 half2 FMAs; the two halves summed in fp32.
The 1/32 bounds each half's sum by max|x|, so it cannot overflow; the cost is fp16 rounding in 4
products and 3 sums (about 5e-4 relative, the size of the fp16 output's own rounding).
HALF2=0 widens everything to fp32 first (the served kernel's arithmetic). PREFETCH loads the next
block's words and scales before this block's arithmetic.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if "--sass" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "0"

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402

PAIR_LO = gl.constexpr("prmt.b32 $0, $1, $2, 0x5410;")  # (x_2i, x_2i+1), (x_2i+4, x_2i+5) -> (x_2i, x_2i+4)
PAIR_HI = gl.constexpr("prmt.b32 $0, $1, $2, 0x7632;")  # -> (x_2i+1, x_2i+5)
_DECODE = """
    mov.b32 c1, 0x28002800;
    mov.b32 c2, 0xd008d008;
    mov.b32 c3, 0x18001800;
    mov.b32 c4, 0xc080c080;
    shr.u32 t, $1, 8;
    lop3.b32 h0, $1, 0x000f000f, 0x64006400, 0xea;
    lop3.b32 h1, $1, 0x00f000f0, 0x64006400, 0xea;
    lop3.b32 h2, t, 0x000f000f, 0x64006400, 0xea;
    lop3.b32 h3, t, 0x00f000f0, 0x64006400, 0xea;
    fma.rn.f16x2 h0, h0, c1, c2;
    fma.rn.f16x2 h1, h1, c3, c4;
    fma.rn.f16x2 h2, h2, c1, c2;
    fma.rn.f16x2 h3, h3, c3, c4;
"""  # (1024 + c) / 32 - 32.25 and (1024 + 16 c) / 512 - 2.25: (c - 8) / 32, pairs (c_j, c_j+4) in h_j
DOT4_HALF2 = gl.constexpr("""{
    .reg .b32 t, h0, h1, h2, h3, c1, c2, c3, c4, a;
    .reg .b16 lo, hi;
    .reg .f32 flo, fhi;""" + _DECODE + """
    mul.rn.f16x2 a, h0, $2;
    fma.rn.f16x2 a, h1, $3, a;
    fma.rn.f16x2 a, h2, $4, a;
    fma.rn.f16x2 a, h3, $5, a;
    mov.b32 {lo, hi}, a;
    cvt.f32.f16 flo, lo;
    cvt.f32.f16 fhi, hi;
    add.f32 $0, flo, fhi;
}""")
DOT4_FP32 = gl.constexpr("""{
    .reg .b32 t, h0, h1, h2, h3, c1, c2, c3, c4;
    .reg .b16 l0, u0, l1, u1, l2, u2, l3, u3, a0, b0, a1, b1, a2, b2, a3, b3;
    .reg .f32 f0, f1, f2, f3, f4, f5, f6, f7, g0, g1, g2, g3, g4, g5, g6, g7;""" + _DECODE + """
    mov.b32 {l0, u0}, h0;
    mov.b32 {l1, u1}, h1;
    mov.b32 {l2, u2}, h2;
    mov.b32 {l3, u3}, h3;
    mov.b32 {a0, b0}, $2;
    mov.b32 {a1, b1}, $3;
    mov.b32 {a2, b2}, $4;
    mov.b32 {a3, b3}, $5;
    cvt.f32.f16 f0, l0;
    cvt.f32.f16 f4, u0;
    cvt.f32.f16 f1, l1;
    cvt.f32.f16 f5, u1;
    cvt.f32.f16 f2, l2;
    cvt.f32.f16 f6, u2;
    cvt.f32.f16 f3, l3;
    cvt.f32.f16 f7, u3;
    cvt.f32.f16 g0, a0;
    cvt.f32.f16 g4, b0;
    cvt.f32.f16 g1, a1;
    cvt.f32.f16 g5, b1;
    cvt.f32.f16 g2, a2;
    cvt.f32.f16 g6, b2;
    cvt.f32.f16 g3, a3;
    cvt.f32.f16 g7, b3;
    mul.f32 $0, f0, g0;
    fma.rn.f32 $0, f1, g1, $0;
    fma.rn.f32 $0, f2, g2, $0;
    fma.rn.f32 $0, f3, g3, $0;
    fma.rn.f32 $0, f4, g4, $0;
    fma.rn.f32 $0, f5, g5, $0;
    fma.rn.f32 $0, f6, g6, $0;
    fma.rn.f32 $0, f7, g7, $0;
}""")


@gluon.jit
def _x_pairs(xq_ptr, units, LU: gl.constexpr, LX: gl.constexpr, XVEC: gl.constexpr):
    """x as half2 pairs (x_j, x_j+4), j = 0..3, for `units` (xq_ptr: x as int32, unit u's 4 pairs
    (x_2i, x_2i+1) at 4u..4u+3). XVEC: a thread's 4 units' 16 pairs in four 16-byte loads."""
    if XVEC:
        rx = gl.convert_layout(units, gl.SliceLayout(1, LX))
        p = gl.load(xq_ptr + gl.expand_dims(rx * 4, 1) + gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, LX)), 0))
        p = gl.reshape(p, [p.shape[0], 2, 2])  # pair 2a + b
        even, odd = gl.split(p)
        p01, p45 = gl.split(even)
        p23, p67 = gl.split(odd)
        p01 = gl.convert_layout(p01, LU)
        p23 = gl.convert_layout(p23, LU)
        p45 = gl.convert_layout(p45, LU)
        p67 = gl.convert_layout(p67, LU)
    else:
        p01 = gl.load(xq_ptr + units * 4 + 0)
        p23 = gl.load(xq_ptr + units * 4 + 1)
        p45 = gl.load(xq_ptr + units * 4 + 2)
        p67 = gl.load(xq_ptr + units * 4 + 3)
    q0 = gl.inline_asm_elementwise(PAIR_LO, "=r,r,r", [p01, p45], dtype=gl.int32, is_pure=True, pack=1)
    q1 = gl.inline_asm_elementwise(PAIR_HI, "=r,r,r", [p01, p45], dtype=gl.int32, is_pure=True, pack=1)
    q2 = gl.inline_asm_elementwise(PAIR_LO, "=r,r,r", [p23, p67], dtype=gl.int32, is_pure=True, pack=1)
    q3 = gl.inline_asm_elementwise(PAIR_HI, "=r,r,r", [p23, p67], dtype=gl.int32, is_pure=True, pack=1)
    return q0, q1, q2, q3


@gluon.jit
def gemv_gluon(x_ptr, packed_ptr, scale_ptr, y_ptr, N, K, stride_pn, stride_sn,
               GROUP: gl.constexpr, HALF2: gl.constexpr, ROWS: gl.constexpr, WARPS_N: gl.constexpr, PREFETCH: gl.constexpr,
               XVEC: gl.constexpr, WARPS: gl.constexpr):
    # a thread: ROWS rows x 4 consecutive words; a warp: 32 threads along the words; warps over rows x words
    LW: gl.constexpr = gl.BlockedLayout([ROWS, 4], [1, 32], [WARPS_N, WARPS // WARPS_N], [1, 0])
    LX: gl.constexpr = gl.BlockedLayout([4, 4], [32, 1], [WARPS // WARPS_N, WARPS_N], [1, 0])
    LR: gl.constexpr = gl.SliceLayout(1, LW)
    LU: gl.constexpr = gl.SliceLayout(0, LW)
    BLOCK_N: gl.constexpr = ROWS * WARPS_N
    WORDS: gl.constexpr = 4 * 32 * (WARPS // WARPS_N)
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
        q0, q1, q2, q3 = _x_pairs(xq_ptr, units, LU, LX, XVEC)
        q0 = gl.broadcast(gl.expand_dims(q0, 0), w_now)[0]
        q1 = gl.broadcast(gl.expand_dims(q1, 0), w_now)[0]
        q2 = gl.broadcast(gl.expand_dims(q2, 0), w_now)[0]
        q3 = gl.broadcast(gl.expand_dims(q3, 0), w_now)[0]
        if HALF2:
            dot = gl.inline_asm_elementwise(DOT4_HALF2, "=f,r,r,r,r,r", [w_now, q0, q1, q2, q3], dtype=gl.float32, is_pure=True, pack=1)
        else:
            dot = gl.inline_asm_elementwise(DOT4_FP32, "=f,r,r,r,r,r", [w_now, q0, q1, q2, q3], dtype=gl.float32, is_pure=True, pack=1)
        acc += dot * s_now.to(gl.float32)
    y = gl.sum(acc, axis=1) * 32.0  # the decode's 1/32, exact
    gl.store(y_ptr + rn, y.to(gl.float16))


# (HALF2, ROWS, WARPS_N, PREFETCH, XVEC, WARPS): rows a program = ROWS x WARPS_N, words a block = 128 x WARPS / WARPS_N
# (128 or 256: 4096 and 14336 inputs are 512 and 1792 words). XVEC needs WARPS_N = WARPS (x's layout then matches).
LAUNCHES = [
    (1, 1, 4, 0, 1, 4), (1, 2, 4, 0, 1, 4), (1, 4, 4, 0, 1, 4), (1, 1, 8, 0, 1, 8), (1, 2, 8, 0, 1, 8), (1, 4, 8, 0, 1, 8),
    (1, 1, 2, 0, 1, 2), (1, 2, 2, 0, 1, 2), (1, 2, 2, 0, 0, 4), (1, 1, 2, 0, 0, 4), (1, 4, 2, 0, 0, 4),
    (1, 2, 4, 1, 1, 4), (1, 1, 4, 1, 1, 4), (1, 2, 8, 1, 1, 8),
    (0, 1, 4, 0, 1, 4), (0, 2, 4, 0, 1, 4), (0, 1, 8, 0, 1, 8), (0, 2, 8, 0, 1, 8),
]


def describe(launch) -> str:
    half2, rows, warps_n, prefetch, xvec, warps = launch
    return (f"{'half2' if half2 else 'fp32'} {rows * warps_n}x{128 * warps // warps_n} ({rows} rows a thread), {warps} warps"
            + (", prefetch" if prefetch else "") + ("" if xvec else ", x by 4-byte loads"))


def run(x, weight, y, launch):
    half2, rows, warps_n, prefetch, xvec, warps = launch
    gemv_gluon[(weight.rows // (rows * warps_n),)](x, weight.packed, weight.scale, y, weight.rows, weight.columns, weight.packed.stride(0),
                                                   weight.scale.stride(0), GROUP=weight.group_size, HALF2=half2, ROWS=rows, WARPS_N=warps_n,
                                                   PREFETCH=prefetch, XVEC=xvec, WARPS=warps, num_warps=warps)
    return y


def sass_counts() -> list[dict]:
    """Each launch compiled for sm_90 here; the loop's instructions per word and its memory traffic."""
    import collections
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from benchmarks.kernel_sass import TOOLS, loop_body

    import subprocess
    import tempfile
    rows = []
    for launch in LAUNCHES:
        half2, per_thread, warps_n, prefetch, xvec, warps = launch
        signature = {"x_ptr": "*fp16", "packed_ptr": "*i32", "scale_ptr": "*fp16", "y_ptr": "*fp16", "N": "i32", "K": "i32", "stride_pn": "i32",
                     "stride_sn": "i32"}
        signature.update({name: "constexpr" for name in ("GROUP", "HALF2", "ROWS", "WARPS_N", "PREFETCH", "XVEC", "WARPS")})
        constants = dict(GROUP=128, HALF2=half2, ROWS=per_thread, WARPS_N=warps_n, PREFETCH=prefetch, XVEC=xvec, WARPS=warps)
        attrs = {(i,): [["tt.divisibility", 16]] for i in range(8)}
        compiled = triton.compile(GluonASTSource(gemv_gluon, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": warps})
        with tempfile.TemporaryDirectory() as folder:
            cubin = Path(folder) / "kernel.cubin"
            cubin.write_bytes(compiled.asm["cubin"])
            text = subprocess.run([TOOLS / "cuobjdump", "-sass", cubin], capture_output=True, text=True, check=True).stdout
            usage = subprocess.run([TOOLS / "cuobjdump", "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
        body = loop_body(text)
        memory = collections.Counter(op for op in body if op.startswith(("LD", "ST", "BAR")))
        row = dict(launch=describe(launch), registers=int(re.search(r"REG:(\d+)", usage).group(1)), loop=len(body),
                   per_word=round(len(body) / (per_thread * 4), 1), memory=dict(memory))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="4096x4096,4096x14336,14336x4096")
    parser.add_argument("--sass", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("/tmp/gemv_gluon"))
    parser.add_argument("--compile-workers", type=int, default=0, help="compile the served GEMV's launch shapes first in this many processes")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.sass:
        (args.out / "gemv_gluon_sass.json").write_text(json.dumps(sass_counts(), indent=1))
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
        for launch in LAUNCHES:
            rows_per_program, words = launch[1] * launch[2], 128 * launch[5] // launch[2]
            if n % rows_per_program or (k // 8) % words:
                continue
            y = torch.full((1, n), float("nan"), device="cuda", dtype=torch.float16)
            try:
                error = ((run(x, weight, y, launch).float() - reference).norm() / reference.norm()).item()
                seconds = weight_seconds(lambda w: run(x, w, torch.empty(1, n, device="cuda", dtype=torch.float16), launch), weight)
            except Exception as failure:  # noqa: BLE001  (an experiment: report and go on)
                print(f"{shape} {describe(launch)}: {type(failure).__name__}: {str(failure)[:300]}", flush=True)
                continue
            row = dict(shape=shape, launch=describe(launch), us=round(seconds * 1e6, 2), speedup=round(fp16 / seconds, 2), rel_error=error,
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
                print(f"{shape} best {arithmetic}: {best['us']} us = {best['speedup']}x fp16 ({best['fp16_us']} us), {best['read_TBps']} TB/s, "
                      f"{best['launch']}, rel error {best['rel_error']:.1e}; served GEMV {best['served_interleaved_us']} us interleaved, "
                      f"{best['served_unit_order_us']} unit order")


if __name__ == "__main__":
    main()
