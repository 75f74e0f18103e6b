"""lmpress against its peers on the same model, calibration tokens and held-out text:
llm-compressor's GPTQ and HQQ (calibration-free half-quadratic quantization).

    .venv/bin/python benchmarks/peers_side_by_side.py [--calibration artifacts/calibration]
        [--reference artifacts/reference] [--bits 4,3] [--group-size 64]
        [--tools llm-compressor,hqq,lmpress+clip,...] [--out FILE]
    .venv/bin/python benchmarks/peers_side_by_side.py --merge A.json B.json [--out FILE]

Each peer is installed by this script into its own environment (benchmarks/.venv-PEER: CPU
torch 2.13.0 and the versions pinned in PEERS, which may differ from lmpress's) and run by its
worker script there (benchmarks/llmcompressor_gptq.py, benchmarks/hqq_quantize.py).
llm-compressor runs symmetric GPTQ with static act-order and damping 0.01 on the calibration
artifact's very token samples; HQQ runs as its `BaseQuantizeConfig(nbits, group_size)` sets it
(asymmetric, no calibration); `llm-compressor+asym` is its GPTQ with asymmetric groups (its
W4A16_ASYM scheme: integer zero points, packed as lmpress packs them). The lmpress tools are
GPTQ, symmetric, on the same samples:
    lmpress         layer-sequential in fp32, as llm-compressor here, and true-sequential inside
                    each layer (lmpress's default since 2026-11-25; the runs before it were -whole)
    lmpress-whole   layer-sequential in fp32, each layer's statistics collected for all its
                    linears in one pass of the whole layer (--true-sequential false)
    lmpress-bf16    layer-sequential with bf16 layer passes
    lmpress-stored  from the calibration artifact's stored statistics (the calibrate stage
                    makes them once for every later stage)
    TOOL+clip       the same with `--clip-search true` (lmpress's default; the tools without
                    it run GPTQ as llm-compressor does, min-max groups)
    TOOL+asym       the same with asymmetric groups (`--symmetric false`, integer zero points)
    TOOL+noshrink   the same with GPTQ's Hessian as published (`--hessian-shrinkage 0`; lmpress's
                    default since 2026-12-01 is 0.25)
Each run is its own process, timed, with its peak RSS (the child's own VmHWM: getrusage's
ru_maxrss would count the parent's resident memory at fork, which Linux carries across exec),
under the same thread count and CPU affinity: run one invocation per core, each as
`OMP_NUM_THREADS=1 taskset -c N ... --out FILE_N`, then `--merge` their .json files. Every
artifact is scored by `lmpress evaluate` against the same base reference, on its corpora.
Results: benchmarks/results/peers_side_by_side.{json,md} (the llm-compressor runs before HQQ
joined: llmcompressor_side_by_side.{json,md}).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Peer:
    packages: tuple[str, ...]  # pinned as measured
    module: str  # imported to check the environment
    worker: str  # benchmarks/WORKER MODEL_FOLDER [SAMPLES] BITS GROUP OUT [OPTIONS], printing {wall_time_s, peak_rss_mb}
    calibrated: bool  # the worker takes the calibration samples


PEERS = {
    "llm-compressor": Peer(("llmcompressor==0.14.0.1", "compressed-tensors==0.19.0", "transformers==5.17.0"), "llmcompressor",
                           "llmcompressor_gptq.py", calibrated=True),
    "hqq": Peer(("hqq==0.2.8.post1", "transformers==5.23.0"), "hqq", "hqq_quantize.py", calibrated=False),
}
LMPRESS_RUN = """
import json, sys, time
from pathlib import Path
from pipelines.stages import QuantizeConfig, quantize
start = time.perf_counter()
tool, *options = sys.argv[5].split("+")
config = QuantizeConfig(method="gptq", bits=int(sys.argv[2]), group_size=int(sys.argv[3]), sequential=tool != "lmpress-stored",
                        forward_dtype="bfloat16" if tool == "lmpress-bf16" else "float32", clip_search="clip" in options,
                        symmetric="asym" not in options, true_sequential=False if tool == "lmpress-whole" else None,
                        **({"hessian_shrinkage": 0.0} if "noshrink" in options else {}))
quantize("smollm2-135m", Path(sys.argv[1]), Path(sys.argv[4]), config)
from pipelines.artifact import peak_rss_bytes
print(json.dumps({"wall_time_s": round(time.perf_counter() - start, 1), "peak_rss_mb": round(peak_rss_bytes() / 2**20)}))
"""


def environment_name(tool: str) -> str:
    return tool.replace("-", "")


def peer_of(tool: str) -> str | None:
    """The peer a tool runs (`llm-compressor+asym`: llm-compressor, with options); None for lmpress's."""
    name = tool.split("+")[0]
    return name if name in PEERS else None


def ensure_environment(tool: str) -> Path:
    """The peer's own virtual environment, built once: torch first and pinned, so nothing pulls a CUDA build."""
    peer, venv = PEERS[tool], ROOT / "benchmarks" / f".venv-{environment_name(tool)}"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    if subprocess.run([str(python), "-c", f"import {peer.module}"], capture_output=True).returncode != 0:
        pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        subprocess.run([*pip, "torch==2.13.0"], check=True)
        constraints = venv / "constraints.txt"
        constraints.write_text("torch==2.13.0\n")
        subprocess.run([*pip, "-c", str(constraints), *peer.packages], check=True)
    return python


def run_json(command: list[str]) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "LMPRESS_QUIET": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"{command[:3]} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calibration", type=Path, default=ROOT / "artifacts" / "calibration")
    parser.add_argument("--reference", type=Path, default=ROOT / "artifacts" / "reference")
    parser.add_argument("--bits", default="4,3")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--tools", default="llm-compressor,hqq,lmpress-bf16+clip,lmpress-bf16+clip+noshrink")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "peers_side_by_side")
    parser.add_argument("--merge", type=Path, nargs="*", help="only write the table from these earlier --out .json files "
                        "(runs split over cores: one invocation per core, each pinned with taskset)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.merge:
        rows = [row for file in args.merge for row in json.loads(file.read_text())]
        write_table(sorted(rows, key=lambda row: -row["bits"]), args.out)  # stable: each bit-width in the files' order
        return

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("LMPRESS_QUIET", "1")
    from benchmarks._report import evaluation_config, flatten
    from pipelines.models import resolve_model
    from pipelines.stages import evaluate

    tools = args.tools.split(",")
    pythons = {peer: ensure_environment(peer) for peer in {peer_of(tool) for tool in tools} - {None}}  # each built once
    evaluation = evaluation_config(args.reference)
    model_folder = resolve_model("smollm2-135m")
    work = Path(tempfile.mkdtemp())
    rows = []
    for bits in (int(b) for b in args.bits.split(",")):
        for tool in tools:
            out = work / f"{tool}-w{bits}g{args.group_size}"
            if (peer := peer_of(tool)) is not None:
                samples = [str(args.calibration / "samples.safetensors")] if PEERS[peer].calibrated else []
                command = [str(pythons[peer]), str(ROOT / "benchmarks" / PEERS[peer].worker), str(model_folder), *samples,
                           str(bits), str(args.group_size), str(out), *tool.split("+")[1:]]
            else:
                command = [sys.executable, "-c", LMPRESS_RUN, str(args.calibration), str(bits), str(args.group_size), str(out), tool]
            cost = run_json(command)
            metrics = evaluate(str(out), args.reference, None, evaluation, base="smollm2-135m")
            row = {"tool": tool, "bits": bits, "group_size": args.group_size, **cost, "threads": os.environ.get("OMP_NUM_THREADS", "default"),
                   "cpus": len(os.sched_getaffinity(0))}
            row.update({key: value for key, value in flatten(metrics).items() if key.endswith((".perplexity", ".kl_to_base", ".top1_agreement"))})
            rows.append(row)
            print(json.dumps(row), flush=True)

    write_table(rows, args.out)


def write_table(rows: list[dict], out: Path) -> None:
    from benchmarks._report import row_corpora

    corpora = row_corpora(rows[0])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=2) + "\n")
    header = "| tool | scheme | " + " | ".join(f"{c} ppl | {c} KL" for c in corpora) + " | wall s | peak RSS MB |"
    lines = [header, "|" + "---|" * (2 * len(corpora) + 4)]
    for row in rows:
        cells = [row["tool"], f"W{row['bits']} g{row['group_size']}"]
        for corpus in corpora:
            cells += [f"{row[f'{corpus}.perplexity']:.2f}", f"{row[f'{corpus}.kl_to_base']:.4f}"]
        cells += [str(row["wall_time_s"]), str(row["peak_rss_mb"])]
        lines.append("| " + " | ".join(cells) + " |")
    settings = sorted({(row["threads"], row["cpus"]) for row in rows})
    lines.append("\n" + "; ".join(f"OMP_NUM_THREADS={threads}, {cpus} CPU(s) in the affinity mask" for threads, cpus in settings)
                 + ", each tool's run alone on its core.")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
