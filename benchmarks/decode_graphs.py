"""`lmpress generate`'s greedy decoding, eagerly and as CUDA-graph replays, for a model dense and
with every decoder linear packed, side by side in one run.

    python benchmarks/decode_graphs.py --model .gpu-latency/model [--level bits4g64] [--out DIR]

The model is built from its folder's config.json with random weights (speed does not depend on
them, and a GPU machine need not hold the weights), in fp16 on a GPU (fp32 on the CPU). "packed"
swaps each decoder linear for lmpress's PackedLinear at `--level` (`pipelines.latency.serving_module`:
the kernel a packed artifact serves with). Each row decodes `--new-tokens` tokens greedily after a
random prompt of `--prompt-tokens`, timed end to end as a user waits for it (prefill and, for the
graphs, the warm-up and capture included), median of `--rounds` rounds that take every row in
turn, after a warm-up call of each (compiling and autotuning the kernels):

    generate     transformers' generate (dynamic cache): how `lmpress generate` decoded before
    eager        `pipelines.serving.greedy_decode`, static cache, each step run eagerly
    cuda graph   the same, each step after the prompt one replay of a captured CUDA graph (GPU only)

Each row also says whether its tokens equal the eager row's (the same kernels, so the same
tokens, unless split-K's atomic adds land in another order and flip a near tie). Results:
decode_graphs.json and .md under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("LMPRESS_QUIET", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402


def packed_linears(network: nn.Module, level: str, dtype: torch.dtype, device: torch.device) -> dict[str, nn.Module]:
    """Every linear of the decoder blocks as lmpress serves it at `level`, by module name."""
    from pipelines.latency import serving_module

    return {
        name: serving_module(level, module.out_features, module.in_features, dtype, device)[0]
        for name, module in network.named_modules()
        if isinstance(module, nn.Linear) and ".layers." in f".{name}"
    }


def decode_rows(network: nn.Module, prompt: torch.Tensor, new_tokens: int, rounds: int) -> list[dict]:
    """Each way of decoding, timed side by side (see above)."""
    from pipelines.serving import greedy_decode

    cuda = prompt.device.type == "cuda"
    ways = {
        "generate": lambda: (network.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                                              min_new_tokens=new_tokens, do_sample=False), False),
        "eager": lambda: greedy_decode(network, prompt, new_tokens),
        **({"cuda graph": lambda: greedy_decode(network, prompt, new_tokens, cuda_graph=True)} if cuda else {}),
    }

    def timed(way):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        tokens, graphed = ways[way]()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start, tokens, graphed

    outputs = {way: timed(way)[1:] for way in ways}  # warm-up: compile, autotune, pick launches
    seconds = {way: [] for way in ways}
    for _ in range(rounds):
        for way in ways:
            seconds[way].append(timed(way)[0])
    eager = outputs["eager"][0]
    return [
        {"decoding": way, "graphed": outputs[way][1], "tokens_per_s": round(new_tokens / statistics.median(seconds[way]), 2),
         "same_tokens_as_eager": bool(torch.equal(outputs[way][0], eager))}
        for way in ways
    ]


@torch.no_grad()
def main() -> None:
    from transformers import AutoModelForCausalLM

    from pipelines.latency import _linears_swapped
    from pipelines.models import load_config, resolve_model

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m", help="a model spec or a folder with its config.json")
    parser.add_argument("--level", default="bits4g64", help="the packed level (a level database's name: bits4g64, bits3g64, ...)")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("/tmp/decode_graphs"))
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    network = AutoModelForCausalLM.from_config(load_config(resolve_model(args.model))).eval().to(device, dtype)
    prompt = torch.randint(0, network.config.vocab_size, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(0)).to(device)
    rows = [{"model": "dense", **row} for row in decode_rows(network, prompt, args.new_tokens, args.rounds)]
    with _linears_swapped(network, packed_linears(network, args.level, dtype, device)):
        rows += [{"model": f"packed {args.level}", **row} for row in decode_rows(network, prompt, args.new_tokens, args.rounds)]
    base = rows[0]  # dense, transformers' generate
    for row in rows:
        row["speed_vs_dense_generate"] = round(row["tokens_per_s"] / base["tokens_per_s"], 3)
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    report = {"device": device_name, "torch": torch.__version__, "params": vars(args) | {"out": str(args.out)}, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_graphs.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [f"Greedy decoding of {args.model}'s architecture (random weights), {args.new_tokens} new tokens after {args.prompt_tokens}, "
             f"end to end, median of {args.rounds} rounds; {device_name}, {dtype}", "",
             "| model | decoding | tokens/s | vs dense generate | same tokens as eager |", "|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['decoding']} | {r['tokens_per_s']} | {r['speed_vs_dense_generate']}x | {r['same_tokens_as_eager']} |" for r in rows]
    (args.out / "decode_graphs.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
