"""The packed-weight kernels compiled for an H100 (sm_90) on a machine without a GPU, and what
the compiler made of them: machine instructions (SASS) counted by opcode.

    python benchmarks/kernel_sass.py [--baseline OLD_packed_int.py]   # counts -> results/kernel_sass.{json,md}
    python benchmarks/kernel_sass.py --check                          # every kernel path compiles, without ptxas warnings, and
                                                                      # each path's PTX, emulated, matches the reference; or exit 1
    python benchmarks/kernel_sass.py --gemv-layouts                   # the int4 GEMV's loop per launch shape and layout
    python benchmarks/kernel_sass.py --gemm-layouts [--bits 8]        # the same for the GEMM (int8: results/gemm_layouts_sass_int8)
    python benchmarks/kernel_sass.py --every-launch                   # every launch shape the tuner may pick, emulated
                                                                      # (results/every_launch_emulated.json)

Triton ships ptxas and cuobjdump, so lowering to Hopper machine code needs no GPU. This
catches what the interpreter cannot (it runs the Python, not the compiler: a kernel can pass
every interpreted test and still not compile; --check also runs each compiled kernel in
benchmarks/ptx_emulator.py), and it shows how a change moves the
instruction mix (int-to-float conversions, packed fp16 math, atomics) next to an earlier
version of the kernels. Counts are static (per compiled kernel, the loop body once), not
timings: speed is measured on a GPU (benchmarks/kernel_speed.py).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # compile, not interpret: must be set before triton is imported
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction  # noqa: E402

from benchmarks.kernel_speed import load_kernels  # noqa: E402
from compressors import packed_int  # noqa: E402

TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
# the dtype each pointer argument has in serving (fp16 activations; int8 zero points; uint8 2:4 masks)
POINTERS = {"x_ptr": "fp16", "y_ptr": "fp16", "out_ptr": "fp16", "packed_ptr": "i32", "scale_ptr": "fp16", "table_ptr": "fp16",
            "zero_ptr": "i8", "bitmask_ptr": "u8"}


def compile_for(kernel, constexprs: dict, activations: str = "fp16", arch: int = 90, num_warps: int = 4, num_stages: int = 3,
                aligned: bool = False, unaligned: tuple[str, ...] = (), maxnreg: int | None = None, types: dict | None = None):
    """The kernel compiled for compute capability `arch` (its `.asm`: ptx, cubin), given its
    constexpr arguments (and `types`: any other argument's type, e.g. a tensor descriptor's). aligned: every pointer and integer argument (but those `unaligned`)
    divisible by 16, as Triton specializes a launch on 4096-wide layers (for the GEMM, also a
    batch that is a multiple of 16), so loads may be vectorized as they are in serving."""
    signature, attrs = {}, {}
    for i, (name, param) in enumerate(zip(kernel.arg_names, kernel.params)):
        if param.is_constexpr or name in constexprs:  # an integer given a value: specialized, as Triton does a 1
            signature[name] = "constexpr"
            continue
        if name in (types or {}):
            signature[name] = types[name]
        elif name.endswith("_ptr"):
            stored = "fp16" if name == "packed_ptr" and constexprs.get("BITS") == 16 else POINTERS[name]  # 2:4 fp16 keeps values
            signature[name] = "*" + (activations if name in ("x_ptr", "y_ptr") else stored)
        else:
            signature[name] = "i32"
        if aligned and name not in unaligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = GluonASTSource if isinstance(kernel, GluonJITFunction) else ASTSource  # compressors/packed_int_gluon.py's kernel is Gluon
    return triton.compile(source(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages, **({"maxnreg": maxnreg} if maxnreg else {})})


def ptxas_notes(compiled, arch: int = 90) -> str:
    """ptxas' performance notes and spills for a compiled kernel, one a line. Triton keeps
    ptxas' log to itself, so ptxas runs again with the options Triton 3.9 gives it (make_cubin)."""
    with tempfile.TemporaryDirectory() as folder:
        ptx = Path(folder) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        log = subprocess.run([get_ptxas(arch).path, "-lineinfo", "-v", "--regAllocOptLevel=2", f"--gpu-name=sm_{arch}a", ptx,
                              "-o", Path(folder) / "again.cubin"], capture_output=True, text=True, check=True)
    text = log.stdout + log.stderr
    found = [line[line.index(PTXAS_NOTE):] for line in text.splitlines() if PTXAS_NOTE in line]
    found += [f"{SPILL_NOTE} {spilled} bytes" for spilled in re.findall(r"(\d+) bytes spill stores", text) if int(spilled)]
    return "".join(note + "\n" for note in found)


def disassemble(compiled, arch: int = 90, usage: bool = False) -> str:
    """A compiled kernel's SASS, then `ptxas_notes`, and with `usage` its resource usage
    (registers) between them."""
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        dump = lambda flag: subprocess.run([TOOLS / "cuobjdump", flag, cubin], capture_output=True, text=True, check=True).stdout  # noqa: E731
        return dump("-sass") + (dump("-res-usage") if usage else "") + ptxas_notes(compiled, arch)


def sass(kernel, constexprs: dict, activations: str = "fp16", arch: int = 90, num_warps: int = 4, num_stages: int = 3,
         aligned: bool = False, usage: bool = False) -> str:
    """`disassemble` of `compile_for`."""
    return disassemble(compile_for(kernel, constexprs, activations, arch, num_warps, num_stages, aligned), arch, usage)


PTXAS_NOTE = "Potential Performance Loss:"
# an emulated kernel's y against the reference, by y's dtype: about 4 roundings of it (y's own, and
# split-K's adds in y's dtype); a wrong decode, address or reduction is of order 1
EMULATED_TOLERANCE = {"fp16": 2e-3, "bf16": 1.6e-2, "fp32": 1e-5}
SPILL_NOTE = "Registers spilled to local memory:"


def notes(machine_code: str, kind: str = PTXAS_NOTE) -> list[str]:
    """ptxas' performance warnings for the kernel (PTXAS_NOTE), such as wgmma serialized
    (C7515: each tensor-core product waits for the one before, so decoding the next tile
    cannot overlap it); or its register spills (SPILL_NOTE)."""
    return [line for line in machine_code.splitlines() if line.startswith(kind)]


def opcodes(machine_code: str) -> collections.Counter:
    """Instructions by opcode (the part before the first dot: I2F.F32.U32 counts as I2F)."""
    found = re.findall(r"^\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)", machine_code, flags=re.M)
    return collections.Counter(found)


def loop_body(machine_code: str, executed: bool = False) -> list[str]:
    """The full opcodes (LDG.E.128, not LDG) of the longest innermost loop: the instructions
    between the target of a backward branch and the branch, holding no other such loop, which in
    these kernels is the loop over K (a persistent GEMV's loop over its blocks of rows holds it). With
    `executed`, without those under the never-true predicate `@!PT` (the `@!PT LDS RZ, [RZ]`
    ptxas pads cp.async copies with)."""
    lines = [(int(address, 16), op, rest) for address, guard, op, rest in
             re.findall(r"^\s+/\*([0-9a-f]{4})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)(.*)$", machine_code, flags=re.M)
             if not (executed and guard.strip() == "@!PT")]
    spans = []
    for address, op, rest in lines:
        target = re.search(r"0x([0-9a-f]+)", rest)
        if op == "BRA" and target and int(target.group(1), 16) < address:
            spans.append((int(target.group(1), 16), address))
    if not spans:
        return []
    innermost = [(start, end) for start, end in spans if not any(start <= s and e <= end and (s, e) != (start, end) for s, e in spans)]
    start, end = max(innermost, key=lambda span: span[1] - span[0])
    return [op for address, op, _ in lines if start <= address <= end]


# (name, kernel attribute, constexprs): the decode paths lmpress serves, grid kernels at one
# launch shape each (which shape the autotuner picks changes tiling, not the code paths). A case
# whose blocks along K are not whole (EVEN False) has groups narrower than a block: at 16 words
# (128 4-bit columns) a group of 128 always makes them whole, so that case would never be served;
# and an interleaved weight is whole tiles of 4 units (`served_width`).
# settings that an earlier kernel without them had implicitly (GROUP: it took the group size at run time)
NEUTRAL = {"SPLIT_K": 1, "CODEBOOK": False, "SPARSE24": False, "PTX": False, "EVEN": False, "GROUP": 128, "INTERLEAVED": False, "STAGES": 1}
GRID = dict(BITS=4, HAS_ZERO=False, **NEUTRAL)
# how the grid kernels launch on sm_90 (`packed_int.pdl_launch`): as programmatic dependents, a
# prefetch and griddepcontrol.wait ahead of their loop; what --check and --every-launch compile
ON_HOPPER = {"PDL": True}
GENERAL = dict(CODEBOOK=False, HAS_ZERO=False, SPARSE24=False)
CASES = [
    ("grid GEMV int4", "_grid_gemv_kernel", dict(GRID, BLOCK_N=8, WORDS=128)),
    ("grid GEMV int4 PTX decode", "_grid_gemv_kernel", dict(GRID, PTX=True, BLOCK_N=4, WORDS=256)),
    ("grid GEMV int4 PTX decode whole blocks per-channel", "_grid_gemv_kernel", dict(GRID, PTX=True, EVEN=True, GROUP=0, BLOCK_N=4, WORDS=256)),
    ("grid GEMV int4 asymmetric PTX decode whole blocks", "_grid_gemv_kernel", dict(GRID, HAS_ZERO=True, PTX=True, EVEN=True, BLOCK_N=8, WORDS=128)),
    ("grid GEMV codebook 3-bit whole blocks", "_grid_gemv_kernel", dict(GRID, BITS=3, CODEBOOK=True, EVEN=True, BLOCK_N=8, WORDS=128)),
    ("grid GEMV int8 asymmetric", "_grid_gemv_kernel", dict(GRID, BITS=8, HAS_ZERO=True, BLOCK_N=8, WORDS=128)),
    ("grid GEMV int4 split-K 4", "_grid_gemv_kernel", dict(GRID, BLOCK_N=32, WORDS=128, SPLIT_K=4)),
    ("grid GEMV int4 PTX decode whole blocks interleaved", "_grid_gemv_kernel", dict(GRID, PTX=True, EVEN=True, INTERLEAVED=True, BLOCK_N=2, WORDS=512)),
    ("grid GEMV int3 asymmetric interleaved", "_grid_gemv_kernel", dict(GRID, BITS=3, HAS_ZERO=True, INTERLEAVED=True, BLOCK_N=8, WORDS=128)),
    ("grid GEMV int4 PTX decode copied ahead", "_grid_gemv_kernel", dict(GRID, PTX=True, BLOCK_N=8, WORDS=128, STAGES=3)),
    ("grid GEMV codebook 4-bit interleaved", "_grid_gemv_kernel", dict(GRID, CODEBOOK=True, INTERLEAVED=True, BLOCK_N=8, WORDS=128)),
    ("grid GEMM int4 group 64 interleaved", "_grid_gemm_kernel", dict(GRID, GROUP=64, INTERLEAVED=True, BLOCK_M=16, BLOCK_N=64, WORDS=16)),
    ("grid GEMM codebook 3-bit interleaved", "_grid_gemm_kernel", dict(GRID, BITS=3, CODEBOOK=True, INTERLEAVED=True, BLOCK_M=16, BLOCK_N=64, WORDS=32)),
    ("grid GEMM int4 group 64", "_grid_gemm_kernel", dict(GRID, GROUP=64, BLOCK_M=16, BLOCK_N=64, WORDS=16)),
    ("grid GEMM int4 PTX decode whole blocks", "_grid_gemm_kernel", dict(GRID, PTX=True, EVEN=True, BLOCK_M=64, BLOCK_N=64, WORDS=16)),
    ("grid GEMM int4 asymmetric PTX decode interleaved", "_grid_gemm_kernel", dict(GRID, HAS_ZERO=True, PTX=True, INTERLEAVED=True, BLOCK_M=16, BLOCK_N=128, WORDS=32)),
    ("grid GEMM 2:4 int4 PTX, groups of 32 kept", "_grid_gemm_kernel", dict(GRID, GROUP=32, SPARSE24=True, PTX=True, BLOCK_M=16, BLOCK_N=64, WORDS=16)),  # 2:4 keeps the Triton decode
    ("grid GEMM int8 asymmetric group 32", "_grid_gemm_kernel", dict(GRID, BITS=8, GROUP=32, HAS_ZERO=True, BLOCK_M=16, BLOCK_N=64, WORDS=16)),
    ("grid GEMM int8 asymmetric PTX decode interleaved whole blocks", "_grid_gemm_kernel",
     dict(GRID, BITS=8, HAS_ZERO=True, PTX=True, INTERLEAVED=True, EVEN=True, BLOCK_M=64, BLOCK_N=64, WORDS=16)),
    ("grid GEMM int4 group 64 split-K 2", "_grid_gemm_kernel", dict(GRID, GROUP=64, BLOCK_M=16, BLOCK_N=64, WORDS=16, SPLIT_K=2)),
    ("grid GEMV int4 asymmetric group 48", "_grid_gemv_kernel", dict(GRID, HAS_ZERO=True, GROUP=48, BLOCK_N=8, WORDS=128)),  # scale runs of 2 units
    ("grid GEMM int8 group 12", "_grid_gemm_kernel", dict(GRID, BITS=8, GROUP=12, BLOCK_M=16, BLOCK_N=64, WORDS=16)),  # runs of 1 unit
    ("grid GEMV codebook 4-bit", "_grid_gemv_kernel", dict(GRID, CODEBOOK=True, BLOCK_N=8, WORDS=128)),
    ("grid GEMM codebook 4-bit", "_grid_gemm_kernel", dict(GRID, CODEBOOK=True, BLOCK_M=16, BLOCK_N=64, WORDS=16)),
    ("grid GEMV int3", "_grid_gemv_kernel", dict(GRID, BITS=3, BLOCK_N=8, WORDS=128)),
    ("grid GEMV int3 asymmetric", "_grid_gemv_kernel", dict(GRID, BITS=3, HAS_ZERO=True, BLOCK_N=8, WORDS=128)),
    ("grid GEMV int3 PTX decode", "_grid_gemv_kernel", dict(GRID, BITS=3, PTX=True, BLOCK_N=8, WORDS=128)),
    ("grid GEMV int3 asymmetric PTX decode interleaved whole blocks", "_grid_gemv_kernel",
     dict(GRID, BITS=3, HAS_ZERO=True, PTX=True, INTERLEAVED=True, EVEN=True, BLOCK_N=8, WORDS=128)),
    ("grid GEMM int3 group 64", "_grid_gemm_kernel", dict(GRID, BITS=3, GROUP=64, BLOCK_M=16, BLOCK_N=64, WORDS=16)),
    ("grid GEMM int3 group 64 PTX decode", "_grid_gemm_kernel", dict(GRID, BITS=3, GROUP=64, PTX=True, BLOCK_M=16, BLOCK_N=64, WORDS=16)),
    ("grid GEMM int3 asymmetric PTX decode interleaved whole blocks", "_grid_gemm_kernel",
     dict(GRID, BITS=3, HAS_ZERO=True, PTX=True, INTERLEAVED=True, EVEN=True, BLOCK_M=64, BLOCK_N=64, WORDS=16)),
    ("grid GEMV codebook 3-bit", "_grid_gemv_kernel", dict(GRID, BITS=3, CODEBOOK=True, BLOCK_N=8, WORDS=128)),
    ("grid GEMM codebook 3-bit", "_grid_gemm_kernel", dict(GRID, BITS=3, CODEBOOK=True, BLOCK_M=16, BLOCK_N=64, WORDS=16)),
    ("grid GEMV 2:4 int4", "_grid_gemv_kernel", dict(GRID, SPARSE24=True, BLOCK_N=8, WORDS=128)),
    ("grid GEMM 2:4 int4, groups of 32 kept", "_grid_gemm_kernel", dict(GRID, GROUP=32, SPARSE24=True, BLOCK_M=16, BLOCK_N=64, WORDS=16)),
    ("general GEMV 2:4 int4", "_gemv_kernel", dict(GENERAL, BITS=4, SPARSE24=True, BLOCK_N=64, BLOCK_K=64)),
    ("general GEMV int3 asymmetric", "_gemv_kernel", dict(GENERAL, BITS=3, HAS_ZERO=True, BLOCK_N=64, BLOCK_K=64)),
    ("general GEMV codebook 4-bit", "_gemv_kernel", dict(GENERAL, BITS=4, CODEBOOK=True, BLOCK_N=64, BLOCK_K=64)),
    ("general GEMM codebook 4-bit", "_gemm_kernel", dict(GENERAL, BITS=4, CODEBOOK=True, BLOCK_M=16, BLOCK_N=64, BLOCK_K=64)),
    ("general GEMM 2:4 int4", "_gemm_kernel", dict(GENERAL, BITS=4, SPARSE24=True, BLOCK_M=16, BLOCK_N=64, BLOCK_K=64)),
    ("general GEMM 2:4 fp16", "_gemm_kernel", dict(GENERAL, BITS=16, SPARSE24=True, BLOCK_M=16, BLOCK_N=64, BLOCK_K=64)),
    ("dequantize int4", "_dequantize_kernel", dict(GENERAL, BITS=4, BLOCK_N=64, BLOCK_K=64)),
]


def weights_per_thread(constexprs: dict, threads: int = 4 * 32) -> int:
    """Weights one thread covers per loop iteration (the tile over the default 4 warps; 2:4:
    dense weights, the zeros included); with the loop body compiled once, total / this is
    roughly the instructions spent per weight of the layer."""
    bits, sparse = constexprs["BITS"], constexprs.get("SPARSE24", False)
    if "WORDS" in constexprs:
        columns = packed_int.block_units(bits, constexprs["WORDS"], sparse) * packed_int.unit_codes(bits) * (2 if sparse else 1)
    else:
        columns = constexprs["BLOCK_K"]
    return constexprs["BLOCK_N"] * columns // threads


def taken(kernel, constexprs: dict) -> dict:
    """The constexprs a kernel takes (an earlier version may lack some)."""
    return {key: value for key, value in constexprs.items() if key in kernel.arg_names}


def compiles(module, name: str, constexprs: dict, activations: str, aligned: bool = False):
    """The case compiled (`compile_for`). Keep only the constexprs the kernel takes (an earlier
    version may lack SPLIT_K or CODEBOOK); None if the case needs a setting the kernel lacks."""
    kernel = getattr(module, name)
    if name.startswith("_grid") and constexprs["BITS"] == 3 and not hasattr(module, "unit_words"):
        return None  # grid kernels before 3-bit units took whole codes per word only
    settings = taken(kernel, constexprs)
    if any(constexprs[key] is not NEUTRAL.get(key) for key in constexprs.keys() - settings.keys()):
        return None
    return compile_for(kernel, settings, activations, aligned=aligned)


def case_sass(module, name: str, constexprs: dict, activations: str, aligned: bool = False) -> str:
    """The case's machine code; empty if the kernel lacks one of its settings."""
    compiled = compiles(module, name, constexprs, activations, aligned)
    return disassemble(compiled) if compiled is not None else ""


BATCH = 5  # the GEMMs' rows of x: fewer than any BLOCK_M, so the mask along M runs


def served_width(constexprs: dict) -> int:
    """The widest layer (K) a grid kernel case serves up to 6.5 of its blocks along K (enough to
    wrap a 4-stage copy pipeline; at most 4224): whole groups (or units), whole tiles where it is
    interleaved, and blocks along K whole exactly where the case says (EVEN), so the masked tail
    runs where it exists."""
    share = 2 if constexprs["SPARSE24"] else 1  # dense columns per stored one
    codes = packed_int.unit_codes(constexprs["BITS"])
    block = packed_int.block_units(constexprs["BITS"], constexprs["WORDS"], constexprs["SPARSE24"]) * codes * share
    widest = min(4224, 13 * block // 2)
    group = codes if constexprs["GROUP"] == 0 or constexprs["CODEBOOK"] else constexprs["GROUP"]
    tile = packed_int.INTERLEAVE_UNITS * codes if constexprs["INTERLEAVED"] else 1
    for columns in range(widest, 0, -32):
        stored = columns // share
        if stored % group == 0 and stored % tile == 0 and packed_int._k_blocks(columns, constexprs)[1] == constexprs["EVEN"]:
            return columns
    raise ValueError(f"no layer of whole groups has its blocks along K {'whole' if constexprs['EVEN'] else 'partial'}: the case is never served")


def emulated_error(compiled, name: str, constexprs: dict, activations: str = "fp16") -> float:
    """A kernel (any of CASES) as compiled for sm_90 (`activations`: x's and y's dtype), run on
    the CPU by benchmarks/ptx_emulator.py on a random weight of the case's kind: the output's
    error relative to the torch reference. The GEMVs take one row of x and 32 rows of weight;
    the GEMMs BATCH rows of x and a block and 8 rows of weight (so every warpgroup's product is
    checked, and the mask along N runs). The grid kernels get a layer `served_width` wide; the
    general kernels a per-channel weight 1056 wide, not a whole number of their blocks."""
    import torch

    from benchmarks.ptx_emulator import launch
    from compressors.packed_int import dequantize_reference, matmul_reference, random_packed_weight

    kind = ("2:4 " if constexprs["SPARSE24"] else "") + ("codebook" if constexprs["CODEBOOK"] else "asymmetric" if constexprs["HAS_ZERO"] else "symmetric")
    batch = BATCH if "gemm" in name else 1
    rows = constexprs["BLOCK_N"] + 8 if "gemm" in name else 32
    if name.startswith("_grid"):
        group = None if constexprs["GROUP"] == 0 or constexprs["CODEBOOK"] else constexprs["GROUP"] * (2 if constexprs["SPARSE24"] else 1)
        columns = served_width(constexprs)
        weight = random_packed_weight(constexprs["BITS"], rows, columns, group, kind)
        weight = weight.interleave() if constexprs["INTERLEAVED"] else weight
        blocks = packed_int._k_blocks(columns, constexprs)[0]
        grid, tensors, strides, flags = weight._launch
        unused = {"GROUP"} if constexprs["CODEBOOK"] else set()  # a codebook has no scales
        launched = (triton.cdiv(rows, constexprs["BLOCK_N"]), min(constexprs["SPLIT_K"], blocks))
    else:
        columns = 1056  # 33 x 32: whole 3-bit units, 16.5 of the general kernels' 64-wide blocks
        weight = random_packed_weight(constexprs["BITS"], rows, columns, None, kind)
        (tensors, strides, flags), unused = weight._kernel_args(), {"group_size"}
        strides = (*strides, flags["group_size"]) if "gemv" in name else strides
        launched = (triton.cdiv(rows, constexprs["BLOCK_N"]),) + ((triton.cdiv(columns, constexprs["BLOCK_K"]),) if name == "_dequantize_kernel" else ())
    assert all(flags[key] == constexprs[key] for key in flags.keys() - unused), f"the test weight is not the case's kind: {flags}"
    sizes = [rows, columns]
    if name == "_dequantize_kernel":
        out = torch.zeros(rows, columns, dtype=torch.float16)
        launch(compiled.asm["ptx"], launched, [*(t.numpy() for t in tensors), out.numpy(), *sizes, *strides, out.stride(0), flags["group_size"]])
        reference = dequantize_reference(weight).float()
        return ((out.float() - reference).norm() / reference.norm()).item()
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[activations]
    as_bits = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}[dtype]  # numpy has no bf16
    x = torch.randn(batch, columns, generator=torch.Generator().manual_seed(0)).to(dtype)
    y = torch.zeros(batch, rows, dtype=dtype)  # split-K blocks add into it
    y_bits = y.view(as_bits).numpy()  # shares y's memory: the emulator writes back into it
    arrays = [x.view(as_bits).numpy(), *(t.numpy() for t in tensors), y_bits]
    if "gemm" in name:  # programs over (x's rows, the weight's rows[, K's slices])
        launched = (triton.cdiv(batch, constexprs["BLOCK_M"]), *launched)
        after = [y.stride(0), min(triton.next_power_of_2(batch), 128)] if name.startswith("_grid") else [y.stride(0), flags["group_size"]]
        launch(compiled.asm["ptx"], launched, [*arrays, batch, *sizes, x.stride(0), *strides, *after])
    else:
        launch(compiled.asm["ptx"], launched, [*arrays, *sizes, *strides])
    reference = matmul_reference(x, weight).float()
    return ((y.float() - reference).norm() / reference.norm()).item()


def wgmma_waits(body: collections.Counter) -> int:
    """Waits for tensor-core products in a loop body (`WARPGROUP.DEPBAR`): one per group that
    Triton pipelines, or one per product where ptxas serialized them."""
    return sum(n for op, n in body.items() if op.startswith("WARPGROUP.DEPBAR"))


def layouts(kernel: str, out: Path, bits: int = 4, baseline: Path | None = None) -> None:
    """The served int4 (or `bits`) GEMV or GEMM (`kernel`; group 128, fp16 x; PTX decodes and
    whole blocks), compiled aligned as on 4096-wide layers, at each launch shape the
    autotuner may pick, in unit order and interleaved: the K loop's instructions, its memory
    instructions by width (shared-memory round trips and barriers included), registers and spills.
    Static counts: speed is measured on a GPU. baseline: an earlier packed_int.py, whose loop
    at the same launch shape is counted beside (compiled with the settings it takes)."""
    gemv, compiled = kernel == "gemv", getattr(packed_int, f"_grid_{kernel}_kernel")
    earlier = getattr(load_kernels(baseline), f"_grid_{kernel}_kernel") if baseline else None
    rows = []
    for config in packed_int.GEMV_CONFIGS if gemv else packed_int.GEMM_CONFIGS:
        launch = config.kwargs
        for interleaved in (False, True):
            constexprs = dict(GRID, BITS=bits, INTERLEAVED=interleaved, PTX=True, EVEN=True, **launch)
            code = sass(compiled, taken(compiled, constexprs), num_warps=config.num_warps, num_stages=config.num_stages, aligned=True, usage=True)
            body = collections.Counter(loop_body(code))
            memory = {op: body[op] for op in sorted(body) if op.split(".")[0] in ("LDG", "LDGSTS", "STS", "STSM", "LDS", "LDSM", "BAR")}
            block = " x ".join(str(launch[key]) for key in ("BLOCK_M", "BLOCK_N", "WORDS") if key in launch)
            rows.append({"launch": f"{block}, split {launch['SPLIT_K']}, {config.num_warps} warps" + (f", copied {launch['STAGES'] - 1} ahead" if launch.get("STAGES", 1) > 1 else ""), "layout": "interleaved" if interleaved else "unit order",
                         "registers": int(re.search(r"REG:(\d+)", code).group(1)),
                         "words_per_thread": launch["BLOCK_N"] * launch["WORDS"] // (32 * config.num_warps),
                         "loop_instructions": sum(body.values()), "loop_memory": memory,
                         "spilled_bytes": sum(int(note.split()[-2]) for note in notes(code, SPILL_NOTE))})
            if not gemv:
                rows[-1]["wgmma_waits"] = wgmma_waits(body)
            if earlier is not None:
                old = sass(earlier, taken(earlier, constexprs), num_warps=config.num_warps, num_stages=config.num_stages, aligned=True)
                rows[-1]["baseline_loop_instructions"] = len(loop_body(old))
                if not gemv:
                    rows[-1]["baseline_wgmma_waits"] = wgmma_waits(collections.Counter(loop_body(old)))
            print(json.dumps(rows[-1]), flush=True)
    what = "GEMV (PTX decode, whole blocks)" if gemv else "GEMM"
    report = {"target": f"sm_90 (H100), fp16 x, int{bits} symmetric group 128, {what}", "triton": triton.__version__,
              "baseline": baseline.name if baseline else None, "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    axes = "rows x words" if gemv else "batch rows x rows x words"
    lines = [f"The int{bits} {kernel.upper()}'s loop over K as compiled for {report['target']}, Triton {report['triton']} "
             f"(`python benchmarks/kernel_sass.py --{kernel}-layouts" + (f" --bits {bits}" if bits != 4 else "") + "`): instructions in the loop body, its memory instructions by width, "
             "registers and register spills. STS/STSM, LDS/LDSM and BAR are shared-memory traffic"
             + (" (x moved into the words' layout)" if gemv else " (tiles on their way to the tensor cores); a wgmma wait holds the "
                "warps until a tensor-core product is done (one per HGMMA: ptxas serialized them)") + ". Static counts, not timings.", "",
             f"| launch shape ({axes}) | layout | registers | bytes spilled | words a thread loads per iteration | loop instructions | "
             + (f"loop instructions, {baseline.name} | " if baseline else "")
             + ("" if gemv else "wgmma waits in the loop | " + (f"wgmma waits, {baseline.name} | " if baseline else ""))
             + "memory instructions in the loop |",
             "|---|---|---|---|---|---|" + ("---|" if baseline else "") + ("" if gemv else "---|" * (2 if baseline else 1)) + "---|"]
    lines += [f"| {r['launch']} | {r['layout']} | {r['registers']} | {r['spilled_bytes']} | {r['words_per_thread']} | {r['loop_instructions']} | "
              + (f"{r['baseline_loop_instructions']} | " if baseline else "")
              + ("" if gemv else f"{r['wgmma_waits']} | " + (f"{r['baseline_wgmma_waits']} | " if baseline else ""))
              + ", ".join(f"{op} {n}" for op, n in r["loop_memory"].items()) + " |" for r in rows]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


# the kinds --every-launch runs each launch shape on: how CUDA serves 4- and 3-bit grids (interleaved)
LAUNCH_KINDS = {"int4, group 128, interleaved": dict(GRID, PTX=True, INTERLEAVED=True),
                "int3 asymmetric, group 128, interleaved": dict(GRID, BITS=3, HAS_ZERO=True, PTX=True, INTERLEAVED=True)}


def every_launch(out: Path) -> None:
    """Each launch shape the autotuner may pick (GEMV_CONFIGS and GEMM_CONFIGS: warps, pipeline
    stages and split-K as configured) compiled for sm_90 with fp16 activations and emulated on
    each of LAUNCH_KINDS, its blocks along K whole as on 4096-wide layers: y's error against the
    reference. What a GPU's `every_tuned` test checks, as compiled, without a GPU."""
    rows, failed = [], []
    for config in packed_int.GEMV_CONFIGS + packed_int.GEMM_CONFIGS:
        name = "_grid_gemm_kernel" if "BLOCK_M" in config.kwargs else "_grid_gemv_kernel"
        for title, kind in LAUNCH_KINDS.items():
            constexprs = {**kind, **config.kwargs, **ON_HOPPER}
            constexprs["EVEN"] = packed_int._k_blocks(4096, constexprs)[1]
            launch = ", ".join(f"{key} {value}" for key, value in config.kwargs.items()) + f", {config.num_warps} warps, {config.num_stages} stages"
            try:
                compiled = compile_for(getattr(packed_int, name), taken(getattr(packed_int, name), constexprs), "fp16",
                                       num_warps=config.num_warps, num_stages=config.num_stages)
                error = emulated_error(compiled, name, constexprs)
            except Exception as problem:  # noqa: BLE001  (a compile error, fault or missing instruction is the finding)
                failed.append(f"{launch} on {title}: {type(problem).__name__}: {str(problem)[:200]}")
                continue
            rows.append({"kernel": "GEMM" if "gemm" in name else "GEMV", "launch": launch, "kind": title, "rel_error": error})
            print(json.dumps(rows[-1]), flush=True)
            if not error <= EMULATED_TOLERANCE["fp16"]:
                failed.append(f"{launch} on {title}: emulated y is {error:.1e} off the reference")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"target": "sm_90, fp16 activations", "triton": triton.__version__, "rows": rows,
                                                    "failed": failed}, indent=2) + "\n")
    print("\n".join(failed) or f"all {len(rows)} launches, emulated, within {max(r['rel_error'] for r in rows):.1e} of the reference")
    raise SystemExit(1 if failed else 0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true", help="compile every case for fp16 and bf16 activations; exit 1 on a failure")
    parser.add_argument("--baseline", type=Path, help="an earlier compressors/packed_int.py to count side by side")
    parser.add_argument("--gemv-layouts", action="store_true", help="the int4 GEMV's loop at each launch shape, unit order and interleaved")
    parser.add_argument("--gemm-layouts", action="store_true", help="the same for the int4 GEMM")
    parser.add_argument("--every-launch", action="store_true", help="emulate every launch shape the tuner may pick; exit 1 on a failure")
    parser.add_argument("--shard", default="1/1", help="with --check: I/N checks every N-th path from the I-th (the test runs shards in parallel)")
    parser.add_argument("--bits", type=int, default=4, help="with --gemv-layouts / --gemm-layouts: 3, 4 or 8")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "kernel_sass")
    args = parser.parse_args()

    if args.gemv_layouts or args.gemm_layouts:
        kernel = "gemv" if args.gemv_layouts else "gemm"
        return layouts(kernel, args.out.with_name(f"{kernel}_layouts_sass" + (f"_int{args.bits}" if args.bits != 4 else "")), args.bits, args.baseline)
    if args.every_launch:
        return every_launch(args.out.with_name("every_launch_emulated"))
    if args.check:
        shard, shards = (int(part) for part in args.shard.split("/"))
        cases = CASES[shard - 1 :: shards]
        failed, spilled, errors = [], [], []
        for title, name, constexprs in cases:
            constexprs = {**constexprs, **ON_HOPPER} if name.startswith("_grid") else constexprs
            # each kind of activation; fp16 GEMMs also as launched on aligned layers (4096 wide),
            # where ptxas schedules the tensor-core loop differently
            for activations, aligned in [("fp16", False), ("bf16", False), ("fp32", False)] + [("fp16", True)] * ("GEMM" in title):
                case = f"{title} ({activations}{', aligned' * aligned})"
                try:
                    compiled = compiles(packed_int, name, constexprs, activations, aligned)
                    code = ptxas_notes(compiled)  # only the notes are read here: no SASS dump (cuobjdump: 117 -> 82 s a shard)
                    failed += [f"{case}: {note}" for note in notes(code)]
                    spilled += [f"{case}: {note}" for note in notes(code, SPILL_NOTE)]
                except Exception as error:  # noqa: BLE001  (any compiler error is the finding)
                    cause = error.__cause__ or error  # a CompilationError quotes the source; its cause says what failed
                    failed.append(f"{case}: {type(cause).__name__}: {str(cause).strip().splitlines()[0][:200]}")
                    continue
                if not aligned and (activations == "fp16" or "x_ptr" in getattr(packed_int, name).arg_names):
                    # what the GPU would run, run here (the dequantize kernel once: it takes no activations)
                    try:
                        errors.append((activations, emulated_error(compiled, name, constexprs, activations)))
                    except Exception as error:  # noqa: BLE001  (a fault or an instruction the emulator lacks is the finding)
                        failed.append(f"{case}: emulated: {type(error).__name__}: {str(error)[:200]}")
                        continue
                    if not errors[-1][1] <= EMULATED_TOLERANCE[activations]:  # NaN fails too
                        failed.append(f"{case}: emulated y is {errors[-1][1]:.1e} off the reference (over {EMULATED_TOLERANCE[activations]})")
        # spills are reported, not failed: they depend on the launch shape, which the tuner times
        print("\n".join(spilled + failed) or "no register spills at these launch shapes")
        if not failed:
            print(f"all {len(cases)} kernel paths" + (f" of shard {args.shard}" if shards > 1 else "") + " compile for sm_90 with fp16, bf16 and fp32 activations "
                  "(GEMMs aligned too), with no performance warning from ptxas; the PTX of every one (GEMV, GEMM, dequantize), "
                  "emulated, is within " +
                  ", ".join(f"{max((e for kind, e in errors if kind == activations), default=0.0):.1e} ({activations}, {sum(kind == activations for kind, _ in errors)} paths)"
                            for activations in EMULATED_TOLERANCE) + " of the reference")
        raise SystemExit(1 if failed else 0)

    versions = {"new": packed_int}
    if args.baseline is not None:
        versions = {"baseline": load_kernels(args.baseline), **versions}
    watched = ["I2F", "I2FP", "F2F", "F2FP", "FFMA", "FADD", "HADD2", "HFMA2", "HMUL2", "LOP3", "SHF", "PRMT", "LDG", "HGMMA", "REDG", "ATOMG"]
    rows = []
    for title, name, constexprs in CASES:
        counts = {version: opcodes(case_sass(module, name, constexprs, "fp16")) for version, module in versions.items()}
        row = {"kernel": title, "weights_per_thread": weights_per_thread(constexprs)}
        for version, ops in counts.items():
            if ops:
                row[version] = {"total": sum(ops.values()), **{op: ops[op] for op in watched if ops[op]}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    report = {"target": "sm_90 (H100), fp16 activations", "triton": triton.__version__,
              "baseline": args.baseline.name if args.baseline else None, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [f"SASS instructions per compiled kernel, {report['target']}, Triton {report['triton']}"
             + (f"; baseline: {report['baseline']}" if args.baseline else ""), "",
             "| kernel | version | weights a thread covers per iteration (2:4: dense) | total | total per weight | " + " | ".join(watched) + " |",
             "|" + "---|" * (len(watched) + 5)]
    for row in rows:
        for version in versions:
            if version in row:
                lines.append(f"| {row['kernel']} | {version} | {row['weights_per_thread']} | {row[version]['total']} | "
                             f"{row[version]['total'] / row['weights_per_thread']:.1f} | "
                             + " | ".join(str(row[version].get(op, "")) for op in watched) + " |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
