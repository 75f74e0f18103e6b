"""Batch-1 int4 GEMV: ways of decoding and multiplying, timed side by side on a GPU.

    python benchmarks/gemv_variants.py [--shapes 4096x4096,...] [--out DIR]   # on a CUDA GPU
    python benchmarks/gemv_variants.py --sass                                 # here: SASS counts

An experiment for issue 3's batch-1 goal (over 3x fp16), not a serving path: int4, symmetric,
group 128, shapes that divide the launch evenly. Modes:
  0  fp32 (pure Triton, as compressors/packed_int.py was): per code a shift, an OR with 2^23's
     bits, a subtraction and an FMA;
  1  PTX (`_DOT4_PTX`, which compressors/packed_int.py now serves): a word's 8 codes decoded two
     at a time into half2 with lop3 (the magic-number decode of FasterTransformer and Marlin,
     exact), converted to fp32 and FMA'd with fp32 x;
  2  PTX: as 1, but multiplied and summed in half2 against x pairs (x[c], x[c + 4]), fp32 after
     each word's 8 products.
Every (mode, launch shape) is timed from a CUDA graph over L2-overflowing copies of the weight
(compressors.kernels.weight_seconds) next to torch's fp16 matmul, and checked against the torch
reference.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if "--sass" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from compressors.packed_int import _DOT4_PTX as ASM_FP32  # noqa: E402  (mode 1: the served decode; x0..x7 fp32 in $2..$9)
from compressors.packed_int import HALF2_DECODE4  # noqa: E402
from compressors.packed_int_gluon import HALF2_DOT4  # noqa: E402

# mode 2: the same decode, then x pairs (x[c], x[c + 4]) as half2 ($2..$5) multiplied in half2
ASM_FP16 = tl.constexpr("{\n .reg .b32 t, h0, h1, h2, h3, c1, c2, c3, a;\n .reg .b16 lo, hi;\n .reg .f32 flo, fhi;\n" + HALF2_DECODE4 + HALF2_DOT4 + "}")


@triton.jit
def _pair(lo, hi):
    """Two fp16 vectors as one int32 vector of half2 (lo in the low half)."""
    return (lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) | (hi.to(tl.int16, bitcast=True).to(tl.int32) << 16)


@triton.jit
def gemv_int4(x_ptr, packed_ptr, scale_ptr, y_ptr, N, K, stride_pn, stride_sn,
              GROUP: tl.constexpr, MODE: tl.constexpr, X2D: tl.constexpr, BLOCK_N: tl.constexpr, WORDS: tl.constexpr, SPLIT_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    span = K // 8 // SPLIT_K
    start = tl.program_id(1) * span
    acc = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
    for u0 in range(start, start + span, WORDS):
        u0 = tl.multiple_of(u0, WORDS)
        ru = u0 + tl.arange(0, WORDS)
        w = tl.load(packed_ptr + rn[:, None] * stride_pn + ru[None, :])
        scale = tl.load(scale_ptr + rn[:, None] * stride_sn + (ru * 8 // GROUP)[None, :]).to(tl.float32)
        if X2D:  # x through a [BLOCK_N, WORDS] pointer tensor (row stride 0): w's layout, no conversion
            xp = x_ptr + (ru * 8)[None, :] + (rn * 0)[:, None]
        else:
            xp = x_ptr + (ru * 8)[None, :]
        x0 = tl.load(xp + 0)
        x1 = tl.load(xp + 1)
        x2 = tl.load(xp + 2)
        x3 = tl.load(xp + 3)
        x4 = tl.load(xp + 4)
        x5 = tl.load(xp + 5)
        x6 = tl.load(xp + 6)
        x7 = tl.load(xp + 7)
        if MODE == 0:
            dot = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
            for j in tl.static_range(8):
                xj = tl.load(xp + j).to(tl.float32)
                q = (((w >> (4 * j)) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
                dot += q * xj
        elif MODE == 1:
            dot = tl.inline_asm_elementwise(
                ASM_FP32, "=f,r,f,f,f,f,f,f,f,f",
                [w, tl.broadcast_to(x0.to(tl.float32), (BLOCK_N, WORDS)), tl.broadcast_to(x1.to(tl.float32), (BLOCK_N, WORDS)), tl.broadcast_to(x2.to(tl.float32), (BLOCK_N, WORDS)),
                 tl.broadcast_to(x3.to(tl.float32), (BLOCK_N, WORDS)), tl.broadcast_to(x4.to(tl.float32), (BLOCK_N, WORDS)), tl.broadcast_to(x5.to(tl.float32), (BLOCK_N, WORDS)),
                 tl.broadcast_to(x6.to(tl.float32), (BLOCK_N, WORDS)), tl.broadcast_to(x7.to(tl.float32), (BLOCK_N, WORDS))],
                dtype=tl.float32, is_pure=True, pack=1)
        else:
            dot = tl.inline_asm_elementwise(
                ASM_FP16, "=f,r,r,r,r,r",
                [w, tl.broadcast_to(_pair(x0, x4), (BLOCK_N, WORDS)), tl.broadcast_to(_pair(x1, x5), (BLOCK_N, WORDS)), tl.broadcast_to(_pair(x2, x6), (BLOCK_N, WORDS)),
                 tl.broadcast_to(_pair(x3, x7), (BLOCK_N, WORDS))],
                dtype=tl.float32, is_pure=True, pack=1)
        acc += dot * scale
    y = tl.sum(acc, axis=1)
    if SPLIT_K == 1:
        tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty))
    else:
        tl.atomic_add(y_ptr + rn, y.to(y_ptr.dtype.element_ty), sem="relaxed")


LAUNCHES = [  # BLOCK_N, WORDS, SPLIT_K, warps
    (8, 128, 1, 4), (16, 64, 1, 4), (16, 128, 1, 4), (32, 64, 1, 4), (32, 128, 1, 8), (64, 64, 1, 8), (4, 256, 1, 4),
    (8, 256, 1, 8), (16, 256, 1, 8), (32, 128, 1, 4), (8, 128, 2, 4), (16, 64, 2, 4), (16, 128, 4, 4), (32, 64, 2, 4), (16, 128, 2, 8), (8, 64, 4, 4), (16, 64, 4, 4), (32, 32, 4, 4), (64, 32, 2, 4),
]


def launch(x, weight, y, mode, x2d, block_n, words, split_k, warps):
    if split_k > 1:
        y.zero_()
    gemv_int4[(weight.rows // block_n, split_k)](x, weight.packed, weight.scale, y, weight.rows, weight.columns, weight.packed.stride(0),
                                                 weight.scale.stride(0), GROUP=weight.group_size, MODE=mode, X2D=x2d, BLOCK_N=block_n, WORDS=words,
                                                 SPLIT_K=split_k, num_warps=warps, num_stages=1)
    return y


def fits(n, k, block_n, words, split_k):
    return n % block_n == 0 and (k // 8) % (words * split_k) == 0


def sass_counts() -> None:
    """Compile each mode for sm_90 here (Triton's own ptxas) and count the loop's instructions."""
    import collections
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    for mode in (0, 1, 2):
        for block_n, words, split_k, warps in [(8, 128, 1, 4), (32, 64, 1, 4)]:
            signature = {"x_ptr": "*fp16", "packed_ptr": "*i32", "scale_ptr": "*fp16", "y_ptr": "*fp16", "N": "i32", "K": "i32",
                         "stride_pn": "i32", "stride_sn": "i32", "GROUP": "constexpr", "MODE": "constexpr", "X2D": "constexpr", "BLOCK_N": "constexpr",
                         "WORDS": "constexpr", "SPLIT_K": "constexpr"}
            attrs = {(i,): [["tt.divisibility", 16]] for i in range(8)}
            src = ASTSource(gemv_int4, signature, {"GROUP": 128, "MODE": mode, "X2D": 0, "BLOCK_N": block_n, "WORDS": words, "SPLIT_K": split_k}, attrs)
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 1})
            with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
                cubin.write(compiled.asm["cubin"])
                cubin.flush()
                text = subprocess.run([tools / "cuobjdump", "-sass", cubin.name], capture_output=True, text=True, check=True).stdout
                usage = subprocess.run([tools / "cuobjdump", "-res-usage", cubin.name], capture_output=True, text=True, check=True).stdout
                regs = re.search(r"REG:(\d+)", usage).group(1)
                stack = re.search(r"STACK:(\d+)", usage).group(1)
            ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", text)
            counts = collections.Counter(op.split(".")[0] for op in ops)
            loads = collections.Counter(op for op in ops if op.startswith("LDG"))
            print(f"mode {mode} {block_n}x{words} split {split_k} warps {warps}: {len(ops)} instructions, regs {regs}, "
                  f"stack {stack}; loads {dict(loads)}; top {counts.most_common(12)}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="4096x4096,4096x14336,14336x4096")
    parser.add_argument("--modes", default="0,1,2")
    parser.add_argument("--sass", action="store_true")
    parser.add_argument("--production", action="store_true",
                        help="time compressors/packed_int.py's GEMV at each of its launch shapes instead, in unit order and interleaved")
    parser.add_argument("--layouts", default="unit order,interleaved", help="with --production: which layouts to time")
    parser.add_argument("--compile-workers", type=int, default=0, help="with --production: compile every launch shape first in this many processes")
    parser.add_argument("--out", type=Path, default=Path("/tmp/gemv_variants"))
    args = parser.parse_args()
    if args.sass:
        return sass_counts()

    from compressors.kernels import gpu_seconds, l2_overflowing_copies, weight_seconds
    from compressors.packed_int import matmul_reference, matmul_triton, random_packed_weight

    layouts = args.layouts.split(",")
    if args.production and args.compile_workers:
        from benchmarks.kernel_speed import launch_tasks, precompile

        ks = sorted({int(shape.split("x")[1]) for shape in args.shapes.split(",")})
        precompile([task for layout in layouts for task in launch_tasks(None, (4, "symmetric", 128, layout == "interleaved"), ks, [1])],
                   args.compile_workers)
    rows = []
    for shape in args.shapes.split(","):
        n, k = map(int, shape.split("x"))
        weight = random_packed_weight(4, n, k, 128).to("cuda")
        dense = (torch.randn(n, k, device="cuda") / 50).half()
        x = torch.randn(1, k, device="cuda", dtype=torch.float16)
        reference = matmul_reference(x, weight).float()
        fp16 = weight_seconds(lambda w: x @ w.T, dense)
        current = weight_seconds(lambda w: matmul_triton(x, w), weight)
        print(f"{shape}: fp16 {fp16 * 1e6:.1f} us, current kernel {current * 1e6:.1f} us ({fp16 / current:.2f}x)", flush=True)
        if args.production:  # each launch shape the autotuner chooses from, timed as serving replays it, in both layouts
            from compressors.packed_int import GEMV_CONFIGS, _grid_matmul

            for layout in layouts:
                served = weight.interleave() if layout == "interleaved" else weight
                autotuned = current if layout == "unit order" else weight_seconds(lambda w: matmul_triton(x, w), served)
                copies = [served] + [served.clone() for _ in range(l2_overflowing_copies(served.nbytes) - 1)]  # as weight_seconds, made once
                y = torch.empty(1, n, device="cuda", dtype=torch.float16)
                for config in GEMV_CONFIGS:
                    y.fill_(float("nan"))  # a launch that leaves an output unwritten shows as NaN error
                    error = ((_grid_matmul(x, served, y, config).float() - reference).norm() / reference.norm()).item()
                    seconds = gpu_seconds([lambda copy=copy: _grid_matmul(x, copy, y, config) for copy in copies])
                    row = dict(shape=shape, layout=layout, launch=str(config.all_kwargs()), stages=config.kwargs["STAGES"], us=round(seconds * 1e6, 2),
                               speedup=round(fp16 / seconds, 2),
                               rel_error=error, fp16_us=round(fp16 * 1e6, 1), autotuned_us=round(autotuned * 1e6, 1),
                               read_TBps=round(weight.nbytes / seconds / 1e12, 2))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            continue
        for mode, x2d in itertools.product(map(int, args.modes.split(",")), (0, 1)):
            for block_n, words, split_k, warps in LAUNCHES:
                if mode == 0 and x2d:
                    continue
                if not fits(n, k, block_n, words, split_k):
                    continue
                y = torch.empty(1, n, device="cuda", dtype=torch.float16)
                error = ((launch(x, weight, y, mode, x2d, block_n, words, split_k, warps).float() - reference).norm() / reference.norm()).item()
                seconds = weight_seconds(lambda w: launch(x, w, torch.empty(1, n, device="cuda", dtype=torch.float16), mode, x2d, block_n, words,
                                                          split_k, warps), weight)
                row = dict(shape=shape, mode=mode, x2d=x2d, block_n=block_n, words=words, split_k=split_k, warps=warps, us=round(seconds * 1e6, 2),
                           speedup=round(fp16 / seconds, 2), rel_error=error, fp16_us=round(fp16 * 1e6, 1), current_us=round(current * 1e6, 1),
                           read_TBps=round(weight.nbytes / seconds / 1e12, 2))
                rows.append(row)
                print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gemv_variants.json").write_text(json.dumps(rows, indent=1))
    if args.production:
        for (shape, layout), group in itertools.groupby(sorted(rows, key=lambda r: (r["shape"], r["layout"], r["us"])), key=lambda r: (r["shape"], r["layout"])):
            best = next(group)
            print(f"{shape} {layout}: autotuned {best['autotuned_us']} us = {best['fp16_us'] / best['autotuned_us']:.2f}x fp16 ({best['fp16_us']} us); "
                  f"best launch {best['us']} us = {best['speedup']}x, {best['read_TBps']} TB/s, {best['launch']}, rel error {best['rel_error']:.1e}")
        print(f"largest rel error of any launch: {max(r['rel_error'] for r in rows):.1e}")
        for (shape, layout), group in itertools.groupby(sorted(rows, key=lambda r: (r["shape"], r["layout"])), key=lambda r: (r["shape"], r["layout"])):
            group = list(group)
            for pipelined in (False, True):  # the best launch that loads one block at a time, and the best that copies blocks ahead
                best = min((r for r in group if (r["stages"] > 1) == pipelined), key=lambda r: r["us"], default=None)
                if best:
                    print(f"{shape} {layout} {'copied ahead' if pipelined else 'one block at a time'}: {best['us']} us = {best['speedup']}x, {best['launch']}")
        return
    print("\nbest per shape and mode:")
    for (shape, mode), group in itertools.groupby(sorted(rows, key=lambda r: (r["shape"], r["mode"], r["us"])), key=lambda r: (r["shape"], r["mode"])):
        best = next(group)
        print(f"{shape} mode {mode}: {best['us']} us = {best['speedup']}x fp16 ({best['fp16_us']} us; current {best['current_us']} us), "
              f"{best['read_TBps']} TB/s, x2d {best['x2d']}, launch {best['block_n']}x{best['words']} split {best['split_k']} warps {best['warps']}, "
              f"rel error {best['rel_error']:.1e}")


if __name__ == "__main__":
    main()
