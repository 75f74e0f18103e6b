"""What bounds the batch-1 int4 GEMV on a GPU: a fit of measured times to the bytes it streams
from device memory and the L1 wavefronts its loads take, and what that fit predicts for
launches not yet timed.

    python benchmarks/gemv_l1_model.py [--timings benchmarks/results/gemv_gluon_h200.json] [--out DIR]

Each Gluon launch's wavefronts per byte of the weight are counted here, on the CPU, by running
its sm_90 PTX (`gemv_gluon.traffic`, `ptx_emulator.Memory.count` and `count_banks`): a warp's
global load takes one per 128-byte line it touches, a shared load one per 128 bytes when free
of bank conflicts. The timings are one GPU run of `benchmarks/gemv_gluon.py` (every launch, both
layouts, three layer shapes); the fit, by least squares over its half2 rows,

    time = fixed + bytes / rate + bytes x wavefronts per byte x cost per wavefront

gives the cost of a wavefront, to set beside one a cycle on each SM (1 / (SMs x clock)): if the
fit finds about that, and explains the times, the loads' L1 wavefronts cost as much time as the
DRAM bytes do, and cutting them speeds the GEMV up as much as the fit says.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
if __name__ == "__main__":  # the kernels compiled for sm_90, not interpreted: before triton is imported
    os.environ["TRITON_INTERPRET"] = "0"

from compressors.packed_int_gluon import LAUNCHES  # noqa: E402

SMS, CLOCK = 132, 1.98e9  # H100 SXM and H200: streaming multiprocessors, boost clock


def total_wavefronts(row: dict) -> float:
    """L1 wavefronts of all a kernel's loads per byte of the weight, from its traffic row."""
    return sum(entry["wavefronts_per_weight_byte"] for name, entry in row.items() if name != "kernel")


def wavefronts_per_byte(launch, interleaved: bool) -> float:
    """L1 wavefronts of all the launch's loads per byte of the weight (words and scales)."""
    from benchmarks.gemv_gluon import traffic

    (row,) = traffic([launch], interleaved=interleaved)
    return total_wavefronts(row)


def predicted_us(fit: dict, shape: str, per_byte: float) -> float:
    """The fit's time for a kernel taking `per_byte` wavefronts a weight byte at this shape."""
    return (fit["fixed_us"] * 1e-6 + weight_bytes(shape) * (1 / (fit["rate_TBps"] * 1e12) + per_byte * fit["wavefront_ps"] * 1e-12)) * 1e6


def out_of_sample(timings: Path, fits: dict) -> list[dict]:
    """The tensor-core GEMV (benchmarks/gemv_mma.py), which the fit never saw: its batch-1
    timings beside what the fit predicts from its own wavefronts, counted the same way. Its
    launches with at least MIN_WARPS warps an SM only."""
    from benchmarks import gemv_mma

    counted = {row["kernel"].removeprefix("mma "): total_wavefronts(row) for row in gemv_mma.traffic(gemv_mma.LAUNCHES)}
    launches = {str(launch): launch for launch in gemv_mma.LAUNCHES}
    rows = []
    for r in json.loads(timings.read_text()):
        launch = launches.get(r["launch"])
        if r["batch"] != 1 or r["launch"] not in counted or warps_per_sm(launch.block_n, launch.wk, r["shape"]) < MIN_WARPS:
            continue
        rows.append(dict(shape=r["shape"], launch=r["launch"], measured_us=r["us"], wavefronts_per_byte=round(counted[r["launch"]], 4),
                         predicted_us={f: round(predicted_us(m, r["shape"], counted[r["launch"]]), 2) for f, m in fits.items()}))
        print(f"mma {r['shape']} {r['launch']}: measured {r['us']} us, predicted {rows[-1]['predicted_us']}", flush=True)
    return rows


def warps_per_sm(block_n: int, warps: int, shape: str) -> float:
    """A launch's warps at this shape, per SM (blocks of `block_n` rows and `warps` warps): under
    MIN_WARPS too few to hide the loads' latency, which the fit leaves out (on the H200, 16-row
    blocks of 4 warps at 4096 rows took twice their 4096x14336 time at 14336 rows)."""
    return int(shape.split("x")[0]) // block_n * warps / SMS


def r_squared(seconds, predicted) -> float:
    return float(1 - ((seconds - predicted) ** 2).sum() / ((seconds - seconds.mean()) ** 2).sum())


MIN_WARPS = 12


def weight_bytes(shape: str) -> int:
    n, k = map(int, shape.split("x"))
    return n * k // 2 + n * (k // 128) * 2  # int4 words and fp16 scales in groups of 128


def fit(nbytes, waves, seconds, rate: float | None = None) -> dict:
    """Least squares of time = fixed + bytes / rate + wavefronts x cost, over the rows given;
    with `rate` given, only fixed and cost are fitted."""
    import numpy as np

    design = np.stack([np.ones_like(nbytes), waves] + ([] if rate else [nbytes]), axis=1)
    target = seconds - (nbytes / rate if rate else 0)
    solved, *_ = np.linalg.lstsq(design, target, rcond=None)
    fixed, per_wave = solved[:2]
    per_byte = 1 / rate if rate else solved[2]
    predicted = fixed + nbytes * per_byte + waves * per_wave
    return dict(fixed_us=float(fixed * 1e6), rate_TBps=float(1 / per_byte / 1e12), wavefront_ps=float(per_wave * 1e12), rate_fitted=rate is None,
                r2=r_squared(seconds, predicted),
                median_abs_error=float(np.median(np.abs(predicted - seconds) / seconds)))


def fit_max(nbytes, waves, seconds) -> dict:
    """The other way the two could combine, time = fixed + max(bytes / rate, wavefronts x cost)
    (each SM's DRAM traffic and L1 work overlapping fully): the best of a grid of rates and
    costs, the fixed part by least squares."""
    import numpy as np

    best = None
    for rate in np.linspace(2e12, 8e12, 121):
        for per_wave in np.linspace(2e-12, 6e-12, 81):
            bound = np.maximum(nbytes / rate, waves * per_wave)
            fixed = (seconds - bound).mean()
            r2 = r_squared(seconds, fixed + bound)
            if best is None or r2 > best["r2"]:
                best = dict(fixed_us=fixed * 1e6, rate_TBps=rate / 1e12, wavefront_ps=per_wave * 1e12, r2=r2)
    return best


def main() -> None:
    import numpy as np

    parser = argparse.ArgumentParser()
    parser.add_argument("--timings", type=Path, default=Path("benchmarks/results/gemv_gluon_h200.json"))
    parser.add_argument("--out", type=Path, default=Path("/tmp/gemv_l1_model"))
    parser.add_argument("--mma-timings", type=Path, default=Path("benchmarks/results/gemv_mma_h200.json"),
                        help="the tensor-core GEMV's timings, predicted out of sample (none: skip)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    timed = [r for r in json.loads(args.timings.read_text()) if r["launch"].startswith("half2")]
    by_name = {str(launch): launch for launch in LAUNCHES}
    counted = {}  # (launch, layout) -> wavefronts per weight byte
    for launch in [launch for launch in LAUNCHES if launch.half2]:
        for layout in ("interleaved", "unit order"):
            counted[str(launch), layout] = wavefronts_per_byte(launch, layout == "interleaved")
            print(f"{launch}, {layout}: {counted[str(launch), layout]:.4f} wavefronts a weight byte", flush=True)
    def warps(name: str, shape: str) -> float:
        return warps_per_sm(by_name[name].block_n, by_name[name].warps, shape)

    rows = [r for r in timed if (r["launch"], r["layout"]) in counted and warps(r["launch"], r["shape"]) >= MIN_WARPS]
    nbytes = np.array([weight_bytes(r["shape"]) for r in rows], float)
    waves = np.array([counted[r["launch"], r["layout"]] for r in rows]) * nbytes
    seconds = np.array([r["us"] for r in rows]) * 1e-6
    # cuBLAS's fp16 GEMV in the same run streams its 2-byte weights at about the device's rate: fitted over the shapes
    fp16 = {r["shape"]: r["fp16_us"] for r in timed}
    dense = np.array([2 * int(shape.split("x")[0]) * int(shape.split("x")[1]) for shape in fp16], float)
    (_, fp16_per_byte), *_ = np.linalg.lstsq(np.stack([np.ones_like(dense), dense], axis=1), np.array(list(fp16.values())) * 1e-6, rcond=None)
    fits = {"free": fit(nbytes, waves, seconds), "cuBLAS rate": fit(nbytes, waves, seconds, rate=1 / fp16_per_byte)}
    for name, summary in fits.items():
        print(f"fit ({name}) over {len(rows)} timings: {json.dumps(summary)}; one wavefront a cycle on each SM: {1e12 / (SMS * CLOCK):.2f} ps", flush=True)
    overlapped = fit_max(nbytes, waves, seconds)
    print(f"fit (max of the two, not their sum): {json.dumps(overlapped)}; cuBLAS fp16 in this run: {1 / fp16_per_byte / 1e12:.2f} TB/s", flush=True)
    predictions = []
    for (name, layout), per in counted.items():
        launch = by_name[name]
        for shape, fp16_us in fp16.items():
            n, k = map(int, shape.split("x"))
            if n % launch.block_n or (k // 8) % launch.words:
                continue
            us = {f: predicted_us(m, shape, per) for f, m in fits.items()}
            measured = next((r["us"] for r in timed if (r["launch"], r["layout"], r["shape"]) == (name, layout, shape)), None)
            predictions.append(dict(launch=name, layout=layout, shape=shape, wavefronts_per_byte=round(per, 4), fp16_us=fp16_us, measured_us=measured,
                                    predicted_us={f: round(t, 2) for f, t in us.items()}, predicted_speedup={f: round(fp16_us / t, 2) for f, t in us.items()},
                                    warps_per_sm=round(warps(name, shape), 1), in_fit=warps(name, shape) >= MIN_WARPS))
    mma = out_of_sample(args.mma_timings, fits) if args.mma_timings.name != "none" else []
    (args.out / "gemv_l1_model.json").write_text(json.dumps(dict(fits=fits, max_fit=overlapped, timings=str(args.timings), min_warps_per_sm=MIN_WARPS,
                                                                one_wavefront_a_cycle_ps=1e12 / (SMS * CLOCK), predictions=predictions,
                                                                mma_out_of_sample=mma), indent=1))
    for shape in fp16:
        best = sorted((p for p in predictions if p["shape"] == shape and p["layout"] == "interleaved" and p["in_fit"]),
                      key=lambda p: p["predicted_us"]["cuBLAS rate"])[:5]
        for p in best:
            print(f"{shape} (fp16 {p['fp16_us']} us): {p['launch']}: predicted " +
                  ", ".join(f"{p['predicted_us'][f]} us ({p['predicted_speedup'][f]}x, {f})" for f in fits) + f"; measured {p['measured_us']}")


if __name__ == "__main__":
    main()
