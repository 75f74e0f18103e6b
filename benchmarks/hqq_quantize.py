"""Runs inside benchmarks/.venv-hqq (HQQ's own environment): HQQ, calibration-free, on every
decoder linear of the model, as `HQQLinear` with `BaseQuantizeConfig(nbits, group_size)` builds
it (asymmetric, axis 1, its half-quadratic zero-point solver; 4-bit zeros rounded, as HQQ
defaults to). HQQ's packed format is its own, so the model is saved with each weight replaced
by what HQQLinear serves (its fp16 dequantization, computed by HQQ) for lmpress to score.
Prints wall time and peak RSS as JSON.

    python hqq_quantize.py MODEL_FOLDER BITS GROUP OUT
"""

import json
import sys
import time

import torch
from hqq.core.quantize import BaseQuantizeConfig, HQQLinear
from transformers import AutoModelForCausalLM, AutoTokenizer

model_folder, bits, group, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
start = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32)
config = BaseQuantizeConfig(nbits=bits, group_size=group)
for name, module in model.model.layers.named_modules():  # lm_head (tied to the embeddings) stays dense, as in lmpress
    if isinstance(module, torch.nn.Linear):
        served = HQQLinear(module, quant_config=config, compute_dtype=torch.float16, device="cpu", del_orig=False).dequantize()
        module.weight.data = served.float().reshape(module.weight.shape)
seconds = time.perf_counter() - start
model.save_pretrained(out)
AutoTokenizer.from_pretrained(model_folder).save_pretrained(out)
peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
print(json.dumps({"wall_time_s": round(seconds, 1), "peak_rss_mb": round(peak / 1024)}))
