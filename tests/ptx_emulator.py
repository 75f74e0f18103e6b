"""Runs the few PTX instructions of lmpress's inline-assembly decodes (compressors/packed_int.py)
on the CPU, one element at a time, so tests can check the assembly's arithmetic where no GPU
is: the interpreter runs the Triton fallback instead and never reads the PTX. The instruction
semantics follow NVIDIA's PTX ISA; rounding is emulated with numpy (fp16 results rounded once
from an exact float64 value, which holds for the small integers and scales involved)."""

from __future__ import annotations

import re

import numpy as np


def _half(bits: int) -> float:
    return float(np.array(bits & 0xFFFF, dtype=np.uint16).view(np.float16))


def _bits(value: float) -> int:
    return int(np.array(value, dtype=np.float16).view(np.uint16))


def _half2(word: int) -> tuple[float, float]:
    return _half(word), _half(word >> 16)


def _pack(low: float, high: float) -> int:
    return _bits(low) | _bits(high) << 16


def _lop3(a: int, b: int, c: int, table: int) -> int:
    """Bit i of the result is bit (a_i b_i c_i) of the table (PTX: F(0xF0, 0xCC, 0xAA) = table)."""
    out = 0
    for i in range(32):
        out |= ((table >> ((a >> i & 1) << 2 | (b >> i & 1) << 1 | (c >> i & 1))) & 1) << i
    return out


def run(asm: str, inputs: dict[int, int | float], outputs: int) -> list[int | float]:
    """Operands $0..$(outputs - 1) as results, the rest from `inputs` (32-bit words as ints,
    16-bit registers as their fp16 value, fp32 as floats); returns the outputs (fp16 as floats)."""
    regs: dict[str, int | float] = {f"${i}": v for i, v in inputs.items()}
    value = lambda token: int(token, 16) if token.startswith("0x") else regs[token]  # noqa: E731
    body = asm.strip()
    body = body[1:-1] if body.startswith("{") and body.endswith("}") else body  # the block's own braces
    for line in body.split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        args = [a.strip() for a in re.split(r",(?![^{]*})", args)]
        if op == "mov.b32" and args[0].startswith("{"):  # unpack a half2 into two 16-bit registers
            low, high = (t.strip() for t in args[0].strip("{}").split(","))
            regs[low], regs[high] = _half2(value(args[1]))
        elif op == "mov.b32" and args[1].startswith("{"):  # pack two 16-bit registers
            low, high = (t.strip() for t in args[1].strip("{}").split(","))
            regs[args[0]] = _pack(regs[low], regs[high])
        elif op == "mov.b32":
            regs[args[0]] = value(args[1])
        elif op == "shr.u32":
            regs[args[0]] = (value(args[1]) & 0xFFFFFFFF) >> int(args[2])
        elif op == "prmt.b32":  # result byte i: byte (selector nibble i) of b:a (a bytes 0-3, b bytes 4-7); no sign mode
            source, selector = (value(args[2]) & 0xFFFFFFFF) << 32 | (value(args[1]) & 0xFFFFFFFF), int(args[3], 16)
            assert not selector & 0x8888, "the emulator has no prmt sign replication"
            regs[args[0]] = sum(((source >> (8 * (selector >> (4 * i) & 7))) & 0xFF) << (8 * i) for i in range(4))
        elif op == "lop3.b32":
            regs[args[0]] = _lop3(*(value(a) & 0xFFFFFFFF for a in args[1:4]), int(args[4], 16))
        elif op in ("sub.f16x2", "mul.rn.f16x2", "fma.rn.f16x2"):
            pairs = list(zip(*(_half2(value(a)) for a in args[1:])))
            combine = {"sub.f16x2": lambda a, b: a - b, "mul.rn.f16x2": lambda a, b: a * b,
                       "fma.rn.f16x2": lambda a, b, c: a * b + c}[op]
            regs[args[0]] = _pack(*(float(np.float16(combine(*p))) for p in pairs))
        elif op == "cvt.f32.f16":
            regs[args[0]] = regs[args[1]]
        elif op == "mul.f32":
            regs[args[0]] = float(np.float32(np.float32(regs[args[1]]) * np.float32(regs[args[2]])))
        elif op == "add.f32":
            regs[args[0]] = float(np.float32(np.float32(regs[args[1]]) + np.float32(regs[args[2]])))
        elif op == "fma.rn.f32":
            regs[args[0]] = float(np.float32(float(regs[args[1]]) * float(regs[args[2]]) + float(regs[args[3]])))
        else:
            raise NotImplementedError(f"the emulator has no {op}")
    return [regs[f"${i}"] for i in range(outputs)]
