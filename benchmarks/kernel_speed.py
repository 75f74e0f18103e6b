"""Speed of the packed-weight kernels at realistic layer shapes, side by side in one run.

    python benchmarks/kernel_speed.py [--shapes 4096x4096,4096x14336,14336x4096] [--batches 1,16,64]

Needs a CUDA GPU (on the CPU Triton only interprets, so no speed means anything there; run it
with --smoke to check the script itself on tiny shapes). Random weights, since speed does not
depend on values. Per shape (N x K: out x in) and batch: torch fp16 matmul (dense), lmpress's
Triton kernels for int4 group 128, int8 group 128, int3 group 128, int4 asymmetric group
128, 4 and 3-bit codebooks, and 2:4 sparse weights with fp16 values or int4 values (group 128 over the inputs);
bitsandbytes NF4 when it is installed, and torch's own 2:4 path (`to_sparse_semi_structured`,
cuSPARSELt/CUTLASS) on the same 2:4 weight; each as time and speedup over fp16. Times are GPU
time per call, median, replayed from a CUDA graph (no launch overhead, as in serving engines),
round-robin over copies of the weight that overflow the L2 cache, so weights come from device
memory (`compressors.kernels.weight_seconds`). At batch 1 it also reports the bandwidth each kernel achieves (bytes it must read / time) as a
fraction of the device's measured streaming rate, the roof for a memory-bound GEMV: the higher
of a 1 GiB device-to-device copy (read + write counted) and a 1 GiB read (`read_bandwidth`),
both reported. Results: benchmarks/results/kernel_speed.{json,md}.

`--pdl-off` also times each kind with programmatic dependent launch off (LMPRESS_PDL=0;
`compressors.packed_int.pdl_launch`), side by side: on sm_90 the grid kernels launch as
programmatic dependents, so in the timed graph, as in a model's, each call's start overlaps the
call before it. torch's fp16 matmul launches plainly either way.

`--baseline FILE` times another version of the kernels next to these, in the same run, e.g.
    git show 71b8012:compressors/packed_int.py > .gpu-baseline/packed_int.py
    python benchmarks/kernel_speed.py --baseline .gpu-baseline/packed_int.py
(a GPU lease is too short and too noisy across machines to compare runs made apart).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import os
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from compressors import packed_int, packed_int_gluon  # noqa: E402
from compressors.kernels import gpu_seconds, l2_overflowing_copies, weight_seconds  # noqa: E402
from compressors.packed_int import PackedWeight, matmul_reference, matmul_triton, random_packed_weight  # noqa: E402
import triton  # noqa: E402  (after compressors, which selects Triton's backend)
import triton.language as tl  # noqa: E402


# the kinds timed here, as (bits, stored kind) of compressors.packed_int.random_packed_weight
KINDS = {
    "int4": (4, "symmetric"), "int8": (8, "symmetric"), "int3": (3, "symmetric"), "int4-asym": (4, "asymmetric"),
    "codebook4": (4, "codebook"), "codebook3": (3, "codebook"), "sparse24-fp16": (16, "2:4 fp16"), "sparse24-int4": (4, "2:4 symmetric"),
}


def kind_spec(kind: str, group: int = 128) -> tuple:
    """(bits, stored kind, group, interleaved) of a kind of KINDS; with "-interleaved"
    (int4-interleaved, ...) in the interleaved layout."""
    bits, stored = KINDS[kind.removesuffix("-interleaved")]
    return bits, stored, None if stored == "codebook" else group, kind.endswith("-interleaved")


def random_packed(spec: "str | tuple", n: int, k: int, device) -> PackedWeight:
    """A random N x K weight of a kind of KINDS, or of a `kind_spec` tuple."""
    bits, stored, group, interleaved = kind_spec(spec) if isinstance(spec, str) else spec
    weight = random_packed_weight(bits, n, k, group, stored)
    return (weight.interleave() if interleaved else weight).to(device)


def load_kernels(path: Path):
    """Another version of compressors/packed_int.py as a module of its own (it takes this one's
    PackedWeight: the kernels read its fields, not its class)."""
    spec = importlib.util.spec_from_file_location("packed_int_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def pdl_off():
    """Programmatic dependent launch off (LMPRESS_PDL=0) inside, the environment restored after."""
    return mock.patch.dict(os.environ, LMPRESS_PDL="0")


def without_pdl(matmul):
    """`matmul` with programmatic dependent launch off for the call."""
    def run(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
        with pdl_off():
            return matmul(x, weight)
    return run


@functools.lru_cache(maxsize=None)
def _kernels(path: str | None):
    return packed_int if path is None else load_kernels(Path(path))


@functools.lru_cache(maxsize=4)
def _small_weight(spec: tuple, k: int) -> PackedWeight:
    return random_packed(spec, 256, k, "cuda")


def _compile_launch_shape(task: tuple) -> bool:
    """Runs one launch shape the autotuner may time, for one (kernels, `kind_spec`, K, batch), once, on
    a weight of 256 rows: what Triton caches on disk for it is what the timed run then loads
    (its cache key holds the constexprs and which ints are multiples of 16, not N itself).
    Or (`gluon`) one of the Gluon GEMV's launches that serving times against the grid GEMV at
    batch 1 (compressors/packed_int_gluon.py). `pdl` False: as launched with programmatic
    dependent launch off (a kernel of its own). False where the GPU cannot hold the tile (the
    tuner times it as infinite) or the Gluon launch does not fit the kind."""
    path, spec, k, batch, index, gluon, pdl = task
    with contextlib.nullcontext() if pdl else pdl_off():
        return _compile_one(path, spec, k, batch, index, gluon)


def _compile_one(path: str | None, spec: tuple, k: int, batch: int, index: int, gluon: bool) -> bool:
    from triton.runtime.errors import OutOfResources

    module = _kernels(path)
    x, weight = torch.randn(batch, k, device="cuda", dtype=torch.float16), _small_weight(spec, k)
    y = torch.empty(batch, 256, device="cuda", dtype=torch.float16)
    if gluon:
        launch = packed_int_gluon.SERVED[index]
        if not packed_int_gluon.fits(weight, launch):
            return False
        packed_int_gluon.run(x, weight, y, launch)
        return True
    config = (module.GEMV_CONFIGS if batch == 1 else module.GEMM_CONFIGS)[index]
    try:
        module._grid_matmul(x, weight, y, config)
    except OutOfResources:
        return False
    return True


def launch_tasks(path: str | None, spec: tuple, ks: list[int], batches: list[int], pdl: bool = True) -> list[tuple]:
    """`_compile_launch_shape`'s tasks: every launch shape of one version of the kernels for one
    kind, at each K and batch; for this version at batch 1, the Gluon GEMV's served launches too
    (a kind they do not fit compiles nothing). pdl False: as launched with PDL off."""
    module = _kernels(path)
    gluon = [(path, spec, k, 1, index, True, pdl) for k in ks for index in range(len(packed_int_gluon.SERVED))] if path is None and 1 in batches else []
    return [(path, spec, k, batch, index, False, pdl) for k in ks for batch in batches
            for index in range(len(module.GEMV_CONFIGS if batch == 1 else module.GEMM_CONFIGS))] + gluon


def level_tasks(levels: Path, batches: list[int]) -> list[tuple]:
    """The launches `lmpress latency` times for a level database: each quantized level's kind,
    in the layout CUDA serves it (`serves_interleaved`), at each input width of its units."""
    from compressors.kernels import serves_interleaved
    from pipelines.latency import level_kind
    from pipelines.levels import LevelDatabase

    database = LevelDatabase(levels)
    tasks = []
    for level in filter(lambda name: name.startswith("bits"), database.config.level_names):
        bits, stored, group = level_kind(level)
        for k in sorted({unit["in_features"] for unit in database.manifest["units"]}):
            interleaved = serves_interleaved(random_packed_weight(bits, 16, k, group, stored))
            tasks += launch_tasks(None, (bits, stored, group, interleaved), [k], batches)
    return tasks


def precompile(tasks: list[tuple], workers: int, compile_one=_compile_launch_shape) -> None:
    """Triton's autotuner compiles the launch shapes it times one after another, a few seconds
    each for the GEMMs; compiling them first in parallel processes (one CUDA context each) makes
    a GPU lease go several times further. Kinds whose kernels a baseline version lacks fail in
    its process only, and are left to the tuner. `compile_one(task)` runs one launch (a
    module-level function, so a spawned process can import it)."""
    import time
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    start = time.perf_counter()
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        futures = [pool.submit(compile_one, task) for task in tasks]
        ran = sum(future.exception() is None and future.result() for future in futures)
    print(f"precompiled {ran} of {len(tasks)} launches in {time.perf_counter() - start:.0f} s on {workers} processes", flush=True)


def fixed_and_rate(rows: list[dict], name: str) -> dict | None:
    """A kernel's batch-1 time as a fixed cost a call plus its bytes at a streaming rate, fitted
    by least squares over the shapes timed (`name`: fp16 or a kind's column prefix): what a
    call costs besides streaming its weight. None under two sizes."""
    points = [(row[f"{name}_bytes"], row[f"{name}_us"]) for row in rows if row["batch"] == 1 and f"{name}_bytes" in row]
    if len({size for size, _ in points}) < 2:
        return None
    slope, intercept = np.polyfit([size for size, _ in points], [us for _, us in points], 1)  # us a byte, us
    return {"fixed_us": round(float(intercept), 2), "rate_TBps": round(1e-6 / float(slope), 2), "shapes": len(points)}


def copy_bandwidth(device) -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write counted)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / gpu_seconds([lambda: dst.copy_(src)])


# A read-only stream, written here because a GEMV's roof is how fast the device reads, which no
# library at hand measures: a copy also writes, and on an H200 torch's 1 GiB copy came out at
# 2.75 TB/s where cuBLAS's fp16 GEMV read 4.3-4.4 (benchmarks/results/gpu_h200.md).
READ_BLOCK, READ_ITERATIONS = 2048, 8  # 16 words (four 16-byte loads) a thread at 4 warps; 64 KiB a program


@triton.jit
def _xor_words(src_ptr, out_ptr, BLOCK: tl.constexpr, ITERATIONS: tl.constexpr):
    """out[program] = XOR of its BLOCK x ITERATIONS consecutive int32 words (kept, so every load is)."""
    start = tl.program_id(0).to(tl.int64) * BLOCK * ITERATIONS
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(ITERATIONS):
        acc ^= tl.load(src_ptr + start + i * BLOCK + tl.arange(0, BLOCK))
    tl.store(out_ptr + tl.program_id(0), tl.xor_sum(acc, 0))


def xor_words(src: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Each 64 KiB chunk of int32 `src` XOR-ed to one word (into `out`): the read stream's kernel."""
    chunk = READ_BLOCK * READ_ITERATIONS
    if src.dtype != torch.int32 or not src.is_contiguous() or src.numel() % chunk:
        raise ValueError(f"xor_words reads contiguous int32 in whole chunks of {chunk} words")
    out = torch.empty(src.numel() // chunk, dtype=torch.int32, device=src.device) if out is None else out
    _xor_words[(out.numel(),)](src, out, BLOCK=READ_BLOCK, ITERATIONS=READ_ITERATIONS, num_warps=4)
    return out


def read_bandwidth(device) -> float:
    """Bytes/s of reading 1 GiB once (`xor_words`)."""
    src = torch.randint(-(1 << 31), 1 << 31, (1 << 28,), dtype=torch.int32, device=device)
    out = xor_words(src)
    return src.nbytes / gpu_seconds([lambda: xor_words(src, out)])


def memory_roofs(device) -> dict:
    """The device's measured streaming rates in bytes/s: a copy (read + write counted) and a
    read-only stream; a batch-1 kernel's bandwidth fraction is over the higher of the two."""
    rates = {"copy": copy_bandwidth(device), "read": read_bandwidth(device)}
    return {**rates, "roof": max(rates.values())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="4096x4096,4096x14336,14336x4096", help="NxK (out x in), comma-separated")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--kinds", default="int4,int8,int3,int4-asym,codebook4,codebook3,sparse24-fp16,sparse24-int4",
                        help="packed weights to time; a kind + '-interleaved' (int4-interleaved) is that kind in the interleaved layout")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, correctness only (works in the Triton interpreter)")
    parser.add_argument("--baseline", type=Path, help="another version of compressors/packed_int.py to time side by side")
    parser.add_argument("--baseline-kinds", help="time the baseline on these kinds only (default: every kind)")
    parser.add_argument("--pdl-off", action="store_true", help="also time each kind with programmatic dependent launch off (LMPRESS_PDL=0)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "kernel_speed")
    parser.add_argument("--compile-workers", type=int, default=0, help="compile every launch shape first in this many processes (0: let the tuner compile)")
    parser.add_argument("--levels", type=Path, help="only compile (in --compile-workers processes, at --batches) the launches "
                        "`lmpress latency` times for this level database, then exit (benchmarks/gpu_check.sh latency)")
    args = parser.parse_args()

    kinds = tuple(args.kinds.split(","))
    versions = {"": matmul_triton}  # column prefix -> the kernels' entry point
    if args.baseline is not None:
        versions["baseline_"] = _kernels(str(args.baseline)).matmul_triton
    if args.pdl_off:
        versions["no_pdl_"] = without_pdl(matmul_triton)

    def baseline_runs(kind: str) -> bool:
        """A baseline's kernels read unit order only, and --baseline-kinds may limit them."""
        return args.baseline is not None and not kind.endswith("-interleaved") and (not args.baseline_kinds or kind in args.baseline_kinds.split(","))

    def timed(kind: str) -> dict:
        """The versions to run on a kind's weight."""
        return {prefix: matmul for prefix, matmul in versions.items() if prefix != "baseline_" or baseline_runs(kind)}
    if args.smoke:
        for kind in kinds:
            weight = random_packed(kind, 64, 256, "cpu")
            for batch in (1, 3):
                x = torch.randn(batch, 256)
                for prefix, matmul in timed(kind).items():
                    error = (matmul(x, weight) - matmul_reference(x, weight)).abs().max().item()
                    print(f"{prefix}{kind} batch {batch}: max abs error {error:.2e}")
                    assert error < 1e-4
        return
    if not torch.cuda.is_available():
        raise SystemExit("kernel speed needs a CUDA GPU (the CPU only interprets Triton); use --smoke to check the script")

    device = torch.device("cuda")
    batches = list(map(int, args.batches.split(",")))
    if args.levels is not None:
        precompile(level_tasks(args.levels, batches), args.compile_workers or 14)
        return
    if args.compile_workers:
        ks = sorted({int(shape.split("x")[1]) for shape in args.shapes.split(",")})
        tasks = [task for kind in kinds for path in [None] + ([str(args.baseline)] if baseline_runs(kind) else [])
                 for task in launch_tasks(path, kind_spec(kind), ks, batches)]
        if args.pdl_off:  # the same kernels compiled without the programmatic dependent's wait
            tasks += [task for kind in kinds for task in launch_tasks(None, kind_spec(kind), ks, batches, pdl=False)]
        precompile(tasks, args.compile_workers)
    try:
        import bitsandbytes
        import bitsandbytes.functional as bnb
    except ImportError:
        bnb = None
    roofs = memory_roofs(device)
    bandwidth = roofs["roof"]
    rows = []
    for shape in args.shapes.split(","):
        n, k = map(int, shape.split("x"))
        dense = (torch.randn(n, k, device=device) / 50).half()
        weights = {kind: random_packed(kind, n, k, device) for kind in kinds}
        nf4 = bnb.quantize_4bit(dense, quant_type="nf4") if bnb is not None else None
        try:  # torch's 2:4 path on a 2:4 weight of the same shape
            from torch.sparse import to_sparse_semi_structured

            dense24 = dense * (torch.arange(k, device=device) % 4 < 2)
            semi_structured = [to_sparse_semi_structured(dense24.clone()) for _ in range(l2_overflowing_copies(dense24.nbytes // 2))]
        except (RuntimeError, ValueError, ImportError) as error:
            semi_structured = None
            print(f"torch semi-structured sparsity unavailable: {error}")
        for batch in batches:
            x = torch.randn(batch, k, device=device, dtype=torch.float16)
            fp16 = weight_seconds(lambda w: x @ w.T, dense)
            row = {"shape": f"{n}x{k}", "batch": batch, "fp16_us": round(fp16 * 1e6, 1)}
            if batch == 1:
                row["fp16_bandwidth_fraction"], row["fp16_bytes"] = round(2 * n * k / fp16 / bandwidth, 3), 2 * n * k
            for kind, weight in weights.items():
                for prefix, matmul in timed(kind).items():
                    error = (matmul(x, weight).float() - matmul_reference(x, weight).float()).abs().max().item()
                    seconds = weight_seconds(lambda w: matmul(x, w), weight)
                    row[f"{prefix}{kind}_us"], row[f"{prefix}{kind}_speedup"] = round(seconds * 1e6, 1), round(fp16 / seconds, 2)
                    row[f"{prefix}{kind}_max_abs_error"] = error
                    if batch == 1:
                        row[f"{prefix}{kind}_bandwidth_fraction"] = round(weight.nbytes / seconds / bandwidth, 3)
                        row[f"{prefix}{kind}_bytes"] = weight.nbytes
                if kind.removesuffix("-interleaved") in ("int4", "int8", "int3"):  # the launch shape served: Gluon's pick, or the tuner's
                    tuned = (packed_int._GEMV if batch == 1 else packed_int._GEMM)[0]
                    gluon = packed_int_gluon.picked(x, weight) if batch == 1 else None
                    row[f"{kind}_config"] = f"Gluon {gluon}" if gluon is not None else str(getattr(tuned, "best_config", ""))
            if semi_structured is not None:
                try:  # its sparse kernels may refuse a shape, a batch or graph capture
                    seconds = gpu_seconds([lambda s=s: torch.nn.functional.linear(x, s) for s in semi_structured])
                    row["torch_24_us"], row["torch_24_speedup"] = round(seconds * 1e6, 1), round(fp16 / seconds, 2)
                except (RuntimeError, ValueError) as error:  # shapes/batches its backend does not take
                    row["torch_24_error"] = str(error).splitlines()[0][:120]
            if nf4 is not None:
                packed, state = nf4  # as transformers' Linear4bit calls it: GEMV at batch 1, else dequantize + matmul
                try:
                    seconds = weight_seconds(lambda w: bitsandbytes.matmul_4bit(x, w.t(), quant_state=state), packed)
                    row["bnb_nf4_us"], row["bnb_nf4_speedup"] = round(seconds * 1e6, 1), round(fp16 / seconds, 2)
                except RuntimeError as error:
                    row["bnb_nf4_error"] = str(error).splitlines()[0][:120]
            rows.append(row)
            print(json.dumps(row), flush=True)

    fits = {name: fit for name in ["fp16", *[f"{prefix}{kind}" for kind in kinds for prefix in versions]] if (fit := fixed_and_rate(rows, name))}
    report = {"device": torch.cuda.get_device_name(), **{f"{name}_bandwidth_GBps": round(rate / 1e9, 1) for name, rate in roofs.items()},
              "rows": rows, "batch1_fits": fits}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    columns = ["fp16_us", *[f"{prefix}{kind}_speedup" for kind in kinds for prefix in versions], "torch_24_speedup", "bnb_nf4_speedup", "fp16_bandwidth_fraction",
               *[f"{prefix}{kind}_bandwidth_fraction" for kind in kinds for prefix in versions]]
    lines = [f"{report['device']}: a 1 GiB copy {report['copy_bandwidth_GBps']} GB/s (read + write), a 1 GiB read {report['read_bandwidth_GBps']} GB/s; "
             f"bandwidth fractions are over {report['roof_bandwidth_GBps']} GB/s", "",
             "| shape | batch | " + " | ".join(columns) + " |", "|" + "---|" * (len(columns) + 2)]
    for row in rows:
        lines.append(f"| {row['shape']} | {row['batch']} | " + " | ".join(str(row.get(c, "")) for c in columns) + " |")
    if fits:
        lines += ["", "Batch 1, time = fixed + bytes read / rate, fitted over the shapes (least squares):", ""]
        lines += [f"- {name}: {fit['fixed_us']} us a call + {fit['rate_TBps']} TB/s" for name, fit in fits.items()]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
