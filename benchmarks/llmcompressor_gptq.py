"""Runs inside benchmarks/.venv-llmcompressor (llm-compressor's own environment): GPTQ with
llm-compressor on the given token samples; prints wall time and peak RSS as JSON.

    python llmcompressor_gptq.py MODEL_FOLDER SAMPLES.safetensors BITS GROUP OUT [asym]

`asym`: asymmetric groups (integer zero points, as its W4A16_ASYM preset), else symmetric.
"""

import json
import sys
import time

import torch
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

model_folder, samples, bits, group, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
options = sys.argv[6:]
if set(options) - {"asym"}:
    raise SystemExit(f"unknown options {options}: the only one is asym")
start = time.perf_counter()
input_ids = load_file(samples)["input_ids"]
dataset = Dataset.from_dict({"input_ids": input_ids.tolist(), "attention_mask": torch.ones_like(input_ids).tolist()})
model = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32)
tokenizer = AutoTokenizer.from_pretrained(model_folder)
weights = {"num_bits": bits, "type": "int", "symmetric": "asym" not in options, "strategy": "group", "group_size": group}
recipe = GPTQModifier(
    config_groups={"group_0": {"targets": ["Linear"], "weights": weights}}, ignore=["lm_head"], actorder="static", dampening_frac=0.01,
)
oneshot(model=model, dataset=dataset, recipe=recipe, max_seq_length=input_ids.shape[1], num_calibration_samples=input_ids.shape[0])
model.save_pretrained(out, save_compressed=True)
tokenizer.save_pretrained(out)
# VmHWM, not ru_maxrss: the latter includes the parent's resident memory at fork (kept across exec)
peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
print(json.dumps({"wall_time_s": round(time.perf_counter() - start, 1), "peak_rss_mb": round(peak / 1024)}))
