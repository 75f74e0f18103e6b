"""Batch-1 int4 GEMV in Gluon (Triton's explicit-layout dialect), timed beside the served kernel.

    python benchmarks/gemv_gluon.py [--shapes 4096x4096,...] [--out DIR]   # on a CUDA GPU
    python benchmarks/gemv_gluon.py --sass                                 # here: sm_90 loop counts
    python benchmarks/gemv_gluon.py --emulate [--launches 0,5,...]         # here: each launch's sm_90 PTX run on the CPU
    python benchmarks/gemv_gluon.py --traffic [--launches 11,12,...]       # here: what each batch-1 GEMV reads, counted in its PTX

The kernel is compressors/packed_int_gluon.py (int4 symmetric grids, fp16 x at batch 1), which
serving times against the grid GEMV per layer shape and picks where it is faster. This script
times every launch of it in both layouts (unit order, and the interleaved one CUDA serves) at
shapes that divide the launch evenly, beside cuBLAS fp16 and the grid GEMV autotuned; counts
its sm_90 loop instructions here (--sass); and runs its compiled PTX on the CPU (--emulate),
since no interpreter runs Gluon.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if {"--sass", "--emulate", "--traffic"} & set(sys.argv):  # compile for sm_90, not interpret: set before triton is imported
    os.environ["TRITON_INTERPRET"] = "0"

from compressors.packed_int_gluon import LAUNCHES, TMA_LAYOUT, Launch, gemv_gluon, grid, iterations, run  # noqa: E402

EMULATED_SMS = 1  # the emulated GPU's multiprocessors: a persistent launch's programs each take several blocks of rows
WEIGHT_ARRAYS = (1, 2)  # the words and scales (after x): no kernel before a GEMV writes them, so it may read them before its wait


def compiled(launch: Launch, interleaved: int, group: int = 128, columns: int = 4096):
    """The launch compiled for sm_90 (here, no GPU needed), as on `columns`-wide layers (aligned:
    4096 by default), and as served there: a programmatic dependent (ON_HOPPER)."""
    from benchmarks.kernel_sass import ON_HOPPER, compile_for

    constants = dict(GROUP=group, HALF2=launch.half2, ROWS=launch.rows, WARPS_N=launch.warps_n, PREFETCH=launch.prefetch, XVEC=launch.xvec,
                     WARPS=launch.warps, INTERLEAVED=interleaved, VEC=launch.vec, XSMEM=launch.xsmem,
                     ITERS=iterations(launch, columns), STAGES=launch.stages, **ON_HOPPER)
    types = {}
    if launch.tma:  # the words' tensor descriptor, as `run` makes it
        types["words_desc"] = f"tensordesc<i32[{launch.block_n}, {launch.words}],{TMA_LAYOUT!r}>"
        constants["TMA"] = 1
    else:
        constants["words_desc"] = None  # (a None argument is a constexpr)
    return compile_for(gemv_gluon, constants, num_warps=launch.warps, aligned=True, maxnreg=launch.maxnreg or None, types=types)


def arguments(launch: Launch, x, weight, y) -> list:
    """The emulator's arguments for a launch, in `gemv_gluon`'s order, as `run` passes them: x,
    the words, the scales, y (numpy), the sizes and strides, and by TMA the words' descriptor."""
    from benchmarks.ptx_emulator import TensorMap

    return [x.numpy(), weight.packed.numpy(), weight.scale.numpy(), y, weight.rows, weight.columns, weight.packed.stride(0), weight.scale.stride(0),
            *([TensorMap(1, (launch.block_n, launch.words))] if launch.tma else [])]


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
    """Each launch compiled for sm_90 and its PTX run on the CPU (benchmarks/ptx_emulator.py) on
    a random weight in groups of 128, both layouts, and per channel (one scale a row: GROUP = K),
    interleaved as CUDA serves it: y's error relative to the torch reference. No interpreter
    runs Gluon, so this is the only run the kernel gets without a GPU."""
    import numpy as np
    import torch

    from benchmarks.ptx_emulator import launch as emulate
    from compressors.packed_int import matmul_reference, random_packed_weight

    x = torch.randn(1, columns, generator=torch.Generator().manual_seed(0)).half()
    results = []
    for group, interleaved in ((128, 0), (128, 1), (None, 1)):
        weight = random_packed_weight(4, rows, columns, group)
        reference = matmul_reference(x, weight).float()[0]
        stored = weight.interleave() if interleaved else weight
        for launch in launches:
            y = np.full(rows, np.nan, np.float16)  # rows a launch leaves unwritten show as NaN error
            emulate(compiled(launch, interleaved, stored.group_size, columns).asm["ptx"], grid(launch, rows, EMULATED_SMS), arguments(launch, x, stored, y),
                    read_only=WEIGHT_ARRAYS)
            error = ((torch.from_numpy(y).float() - reference).norm() / reference.norm()).item()
            results.append(dict(launch=str(launch), layout="interleaved" if interleaved else "unit order", group=group or "per channel", rel_error=error))
            print(json.dumps(results[-1]), flush=True)
    return results


def traffic(launches: list[Launch] | None = None, rows: int = 64, columns: int = 4096, interleaved: bool = True) -> list[dict]:
    """What each batch-1 int4 GEMV reads, counted by running its sm_90 PTX (compiled as on
    4096-wide layers) on the CPU: the served Gluon launches and the grid GEMV at its GEMV_CONFIGS
    (both interleaved, as CUDA serves), or only the Gluon `launches` given, on `rows` x `columns`
    in groups of 128. Per array (the weight's words, its scales, x): bytes asked for and the 32-byte sectors the warps' accesses
    touch, per byte of the weight (words and scales: what must come from device memory), and
    the share of each sector's bytes used. Counted in PTX: ptxas may merge a thread's repeated
    loads of one address (the Gluon kernel's scale, loaded per word in PTX, is one LDG.E.U16 a
    row in its SASS). Not a timing: it shows where a kernel reads more than it must, or wastes
    sectors."""
    import numpy as np
    import torch

    from benchmarks.kernel_sass import GRID, compile_for, taken
    from benchmarks.ptx_emulator import reads_per_byte
    from compressors import packed_int
    from compressors.packed_int_gluon import SERVED

    weight = packed_int.random_packed_weight(4, rows, columns, 128)
    weight = weight.interleave() if interleaved else weight
    x = torch.randn(1, columns, generator=torch.Generator().manual_seed(0)).half()
    needed = weight.packed.numel() * 4 + weight.scale.numel() * 2  # bytes the weight is: read once, at best
    kernels = []  # (name, ptx, grid, arguments); both kernels take x, then the words, then the scales
    for launch in launches or SERVED:
        kernels.append((f"Gluon {launch}", compiled(launch, int(interleaved), columns=columns).asm["ptx"], grid(launch, rows, EMULATED_SMS),
                        arguments(launch, x, weight, np.zeros(rows, np.float16))))
    _, tensors, strides, flags = weight._launch
    for config in [] if launches else packed_int.GEMV_CONFIGS:
        if config.kwargs["SPLIT_K"] > 1:
            continue  # split-K reads what its unsplit launch reads
        constexprs = {**GRID, **flags, **config.kwargs, "PTX": True}
        constexprs["EVEN"] = packed_int._k_blocks(columns, constexprs)[1]
        ptx = compile_for(packed_int._grid_gemv_kernel, taken(packed_int._grid_gemv_kernel, constexprs), num_warps=config.num_warps,
                          num_stages=config.num_stages, aligned=True).asm["ptx"]
        shape = ", ".join(f"{key} {value}" for key, value in config.kwargs.items() if key != "SPLIT_K")
        kernels.append((f"grid GEMV {shape}, {config.num_warps} warps", ptx, (rows // config.kwargs["BLOCK_N"], 1),
                        [x.numpy(), *(t.numpy() for t in tensors), np.zeros(rows, np.float16), rows, columns, *strides]))
    results = []
    for name, ptx, programs, args in kernels:
        row = {"kernel": name, **reads_per_byte(ptx, programs, args, ("x", "words", "scales"), needed, read_only=WEIGHT_ARRAYS)}
        results.append(row)
        print(json.dumps(row), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="4096x4096,4096x14336,14336x4096")
    parser.add_argument("--sass", action="store_true")
    parser.add_argument("--emulate", action="store_true", help="run each launch's sm_90 PTX on the CPU against the reference; exit 1 if one is off")
    parser.add_argument("--launches", help="with --emulate or --traffic: indices into LAUNCHES (default: all; --traffic: the served ones and the grid GEMV)")
    parser.add_argument("--traffic", action="store_true", help="count what each batch-1 GEMV reads, running its PTX on the CPU")
    parser.add_argument("--columns", type=int, default=4096, help="with --emulate: the weight's width (wide enough that a ring of words wraps)")
    parser.add_argument("--rows", type=int, default=32, help="with --emulate: the weight's rows (enough that a persistent launch's programs take several blocks)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/gemv_gluon"))
    parser.add_argument("--compile-workers", type=int, default=0, help="compile the served GEMV's launch shapes first in this many processes")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.sass:
        (args.out / "gemv_gluon_sass.json").write_text(json.dumps(sass_counts(), indent=1))
        return
    chosen = [LAUNCHES[int(i)] for i in args.launches.split(",")] if args.launches else None
    if args.traffic:
        (args.out / "gemv_traffic.json").write_text(json.dumps(traffic(chosen), indent=1))
        return
    if args.emulate:
        from benchmarks.kernel_sass import EMULATED_TOLERANCE

        chosen = chosen or LAUNCHES
        results = emulated(chosen, rows=args.rows, columns=args.columns)
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

    from compressors import packed_int_gluon
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
        os.environ["LMPRESS_GLUON"] = "0"  # the grid GEMV alone, autotuned
        lmpress = {layout: weight_seconds(lambda w: matmul_triton(x, w), w) for layout, w in (("interleaved", served), ("unit order", weight))}
        del os.environ["LMPRESS_GLUON"]  # as served: the Gluon launch `served_launch` picks where it times faster
        serving = weight_seconds(lambda w: matmul_triton(x, w), served)
        picked = packed_int_gluon.picked(x, served)
        print(f"{shape}: fp16 {fp16 * 1e6:.2f} us; grid GEMV autotuned: " +
              ", ".join(f"{layout} {s * 1e6:.2f} us ({fp16 / s:.2f}x)" for layout, s in lmpress.items()) +
              f"; served (interleaved, picks {picked or 'the grid GEMV'}): {serving * 1e6:.2f} us ({fp16 / serving:.2f}x)", flush=True)
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
        by_name = {str(launch): launch for launch in LAUNCHES}
        kinds = {"half2": lambda launch: launch.half2, "fp32": lambda launch: not launch.half2,
                 "ring": lambda launch: launch.stages and not launch.persist, "persistent ring": lambda launch: launch.persist and not launch.tma,
                 "TMA ring": lambda launch: launch.tma}
        for kind, chosen in kinds.items():
            best = min((r for r in group if chosen(by_name[r["launch"]])), key=lambda r: r["us"], default=None)
            if best:
                print(f"{shape} best {kind}: {best['layout']}, {best['us']} us = {best['speedup']}x fp16 ({best['fp16_us']} us), {best['read_TBps']} TB/s, "
                      f"{best['launch']}, rel error {best['rel_error']:.1e}; served GEMV {best['served_interleaved_us']} us interleaved, "
                      f"{best['served_unit_order_us']} unit order")


if __name__ == "__main__":
    main()
