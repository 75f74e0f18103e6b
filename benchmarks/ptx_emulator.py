"""Runs PTX on the CPU, so what only a GPU would run can be checked here: lmpress's inline-assembly
decodes (`run`, one thread) and whole kernels as Triton compiles them for sm_90 (`launch`, every
thread of every block). No GPU simulator or PTX interpreter is installable here (the Triton
interpreter runs a kernel's Python, never its PTX, and knows nothing of Gluon), so this is
written by hand, for the instructions Triton's kernels here use, the tensor-core products
(mma.sync, and Hopper's wgmma with its shared-memory operand) included; anything else raises.

A block's threads run in lockstep, each register a numpy array over them holding bit patterns.
Lockstep makes `bar.sync` a no-op and lets a branch be taken only when every thread takes it
(Triton's GEMVs branch uniformly; a divergent branch raises). A `cp.async` copy lands in shared
memory only when a `cp.async.wait_group` lets its commit group go; until then a shared load or
store of its bytes raises, since on a GPU the copy may land before or after it (a pipeline that
reads a stage before waiting for it, or shared memory reused while a copy into it is in flight,
as the last, never-waited copies of a ring are when the loop ends). A kernel that waits for
the kernel before it (`griddepcontrol.wait`: launched as a programmatic dependent, it may start
while that one still runs) may only prefetch before the wait: a global load, store, atomic or
copy ahead of it raises, since on a GPU it could read x before it is written or write y while
it is read, but a read of an array the launch names read-only (a model's weights, which no
kernel before writes). A TMA copy (`cp.async.bulk.tensor`, of a `TensorMap` argument's tile)
lands, like a cp.async copy, only when a thread waits on its mbarrier's phase
(`mbarrier.try_wait.parity`), which completes when its arrivals are in and the bytes they expect
have landed; a wait that could never complete, and a block that exits with a copy in flight,
raise. Though lockstep lands a tile for all threads at once, a thread may read it only once it has
observed the phase: waited on it, or met at a barrier a thread that did (on a GPU the bytes are
visible to those threads only). Instruction semantics follow
NVIDIA's PTX ISA. Rounding: fp16 results are rounded once from the float64 value (exact for
fp16 products and sums of nearby magnitude), fp32 fma likewise from float64 (double rounding is
possible only when the product's low bits straddle a tie: rare, and far inside any tolerance a
test uses). Global memory holds the kernel's arrays in one byte array; a load or store outside
the array it starts in, or not aligned to its width, raises: a GPU would fault, or read another
tensor."""

from __future__ import annotations

import functools
import itertools
import re
from typing import NamedTuple

import numpy as np

_WIDTH = {"8": 8, "16": 16, "32": 32, "64": 64, "16x2": 32}
# numpy types by byte count (unsigned) and by bit count, built once, not per instruction (the
# emulator runs about a million instructions a check: per-call overhead is most of its time)
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_SIGNED_BITS = {8: np.int8, 16: np.int16, 32: np.int32, 64: np.int64}
_FLOAT_BITS = {16: np.float16, 32: np.float32, 64: np.float64}
_MASK = {width: np.uint64((1 << width) - 1) for width in (8, 16, 32, 64)}
TENSOR_MAPS = 0xD0000000  # where `launch` numbers its TensorMap arguments' handles: no array lies there (global memory starts at 1 MiB)
_SPECIAL = ("%tid.", "%ntid.", "%ctaid.", "%nctaid.", "%laneid", "%warpid")


def _pack(low: float, high: float) -> int:
    """Two fp16 values as a 32-bit word, `low` in bits 0-15."""
    return int(np.array([low, high], dtype=np.float16).view(np.uint32)[0])


def _as(bits: np.ndarray, kind: str) -> np.ndarray:
    """A register's bit patterns read as PTX type `kind` (u32, s64, f16, f32, ...)."""
    width = _WIDTH[kind[1:]]
    unsigned = (bits & _MASK[width]).astype(_UNSIGNED[width // 8])
    if kind[0] == "s":
        return unsigned.view(_SIGNED_BITS[width])
    if kind[0] == "f":
        return unsigned.view(_FLOAT_BITS[width])
    return unsigned


def _bits(values: np.ndarray) -> np.ndarray:
    """Values of any numpy type as zero-extended bit patterns."""
    values = np.asarray(values)
    return values.view(_UNSIGNED[values.dtype.itemsize]).astype(np.uint64) if values.dtype != np.bool_ else values.astype(np.uint64)


def _half2(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return _as(bits, "f16").astype(np.float64), _as(bits >> np.uint64(16), "f16").astype(np.float64)


def _join_half2(low: np.ndarray, high: np.ndarray) -> np.ndarray:
    return _bits(low.astype(np.float16)) | _bits(high.astype(np.float16)) << np.uint64(16)


def _from_bf16(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns as float32 (exact: bf16 is float32's upper half)."""
    return ((bits & np.uint64(0xFFFF)) << np.uint64(16)).astype(np.uint32).view(np.float32)


def _to_bf16(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bf16 (ties to even), as bit patterns (numpy has no bf16)."""
    bits = np.asarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + np.uint64(0x7FFF) + (bits >> np.uint64(16) & np.uint64(1))) >> np.uint64(16)
    return np.where(np.isnan(values), np.uint64(0x7FC0), rounded & np.uint64(0xFFFF))


def _lop3(a: np.ndarray, b: np.ndarray, c: np.ndarray, table: int) -> np.ndarray:
    """Bit i of the result is bit (a_i b_i c_i) of the table (PTX: F(0xF0, 0xCC, 0xAA) = table)."""
    ones = np.uint64(0xFFFFFFFF)
    out = np.zeros_like(a)
    for minterm in range(8):
        if table >> minterm & 1:
            out |= (a if minterm & 4 else ~a & ones) & (b if minterm & 2 else ~b & ones) & (c if minterm & 1 else ~c & ones)
    return out


def _prmt(a: np.ndarray, b: np.ndarray, selector: np.ndarray) -> np.ndarray:
    """Result byte i: byte (selector nibble i, bits 0-2) of b:a (a bytes 0-3, b bytes 4-7), or
    with the nibble's bit 3 set, that byte's sign bit in all 8 bits (default mode)."""
    source = b << np.uint64(32) | a
    out = np.zeros_like(a)
    for i in range(4):
        nibble = selector >> np.uint64(4 * i)
        byte = source >> ((nibble & np.uint64(7)) * np.uint64(8)) & np.uint64(0xFF)
        byte = np.where(nibble & np.uint64(8), (byte >> np.uint64(7)) * np.uint64(0xFF), byte)
        out |= byte << np.uint64(8 * i)
    return out


def _registers(operand: str) -> list[str]:
    """A `{%r1, %r2, ...}` vector operand (or a lone register) as its register names."""
    return [name.strip() for name in operand.strip("{} ").split(",")]


def _split_operands(text: str) -> list[str]:
    return [part.strip() for part in re.split(r",(?![^{]*})(?![^\[]*\])", text)] if text.strip() else []


def _scoped_labels(body: str) -> str:
    """The labels an inline-asm block defines, renamed apart: Triton inlines the same block (an
    mbarrier's wait loop, `waitLoop:`) once per wait, and each branch means its own block's."""
    blocks = itertools.count()

    def rename(block: re.Match) -> str:
        text, number = block.group(0), next(blocks)
        for label in re.findall(r"(?m)^\s*(\w+):(?!:)", text):
            text = re.sub(rf"\b{label}\b", f"{label}_{number}", text)
        return text

    return re.sub(r"\{[^{}]*\}", rename, body)


@functools.lru_cache(maxsize=64)
def _program(body: str) -> tuple[list[tuple], dict[str, int]]:
    """PTX statements as (guard, opcode, operands) and the labels' statement indices. Comments,
    `.loc` and register declarations go; an inline-asm block's braces only scope its register
    names, which it writes before it reads, so one flat namespace serves (its labels are renamed
    apart, `_scoped_labels`)."""
    body = "\n".join(line for line in re.sub(r"//[^\n]*", "", body).splitlines() if not line.strip().startswith((".loc", ".file")))
    body = _scoped_labels(body)
    statements, labels = [], {}
    for raw in body.split(";"):
        text = raw.strip()
        while True:  # labels and block braces before the statement
            match = re.match(r"^(\$?[\w.$]+):(?!:)\s*|^\{\s*|^\}\s*", text)  # not a state space's `::cta`
            if not match:
                break
            if match.group(1):
                labels[match.group(1)] = len(statements)
            text = text[match.end():]
        text = text.strip()
        if not text or text.startswith("."):  # declarations
            continue
        guard = None
        if text.startswith("@"):
            guard, text = text.split(None, 1)
            guard = (guard[1:].lstrip("!"), guard.startswith("@!"))
        opcode, _, rest = text.replace("\t", " ").partition(" ")
        statements.append((guard, opcode, _split_operands(rest)))
    return statements, labels


def _fragments(lane: np.ndarray, elements: int) -> tuple[np.ndarray, ...]:
    """Where a warp's tensor-core fragments sit (PTX ISA; mma.sync m16n8k16, and each warp's 16
    rows of a wgmma), as [lane, element] rows and columns. A [16, 16] of f16 / bf16 pairs: value
    2 j + h (register j, half h) is row g + 8 (j % 2), column 2 q + 8 (j // 2) + h, where
    g = lane // 4, q = lane % 4. D [16, 8 x elements / 4] of f32: element i is row
    g + 8 (i % 4 // 2), column 8 (i // 4) + 2 q + i % 2."""
    g, q = lane[:, None] // 4, lane[:, None] % 4
    a, i = np.arange(8)[None, :], np.arange(elements)[None, :]
    return g + 8 * (a // 2 % 2), 2 * q + 8 * (a // 4) + a % 2, g + 8 * (i % 4 // 2), 8 * (i // 4) + 2 * q + i % 2


_FLOAT_OPS = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "fma": lambda a, b, c: a * b + c,
              "max": np.maximum, "min": np.minimum, "neg": np.negative, "abs": np.abs}


def _immediate(token: str) -> int | None:
    """An immediate operand's bit pattern (hex float, or integer), or None for anything else."""
    if re.fullmatch(r"0[fF][0-9a-fA-F]{8}|0[dD][0-9a-fA-F]{16}", token):
        return int(token[2:], 16)
    if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)U?", token):
        return int(token.rstrip("U"), 0) & (1 << 64) - 1
    return None


class TensorMap(NamedTuple):
    """A TMA tensor descriptor as a `launch` argument: the 2-D array among the arguments (its
    index) it maps, copied in tiles of `box` (rows, columns), unswizzled, zeros past its edges.
    It takes the kernel parameters Triton expands a descriptor into: the descriptor, then the
    array's shape and strides."""
    array: int
    box: tuple[int, int]


class Memory:
    """A memory space (global, or a block's shared): numpy arrays in one byte array at 256-byte aligned addresses."""

    def __init__(self, arrays: list[np.ndarray], base: int = 1 << 20):  # global: no valid pointer is near 0
        self.traffic: dict | None = None  # reads per array index, and "shared" (bank wavefronts), when counted (`launch(traffic=...)`)
        self.base, self.addresses, offset = base, [], 0
        for array in arrays:
            self.addresses.append(base + offset)
            offset += (array.nbytes + 255) // 256 * 256
        self.bytes = np.zeros(offset, dtype=np.uint8)
        self.in_flight: np.ndarray | None = None  # shared memory: per byte, the cp.async copies into it not yet landed
        # shared memory in a kernel with TMA copies: per byte, the mbarrier (shared address) whose
        # phase a TMA copy landed it on (-1: none, or stored since) and that phase's count once
        # complete; per mbarrier, the completed phases each thread has observed (`Block.mbarrier`)
        self.landed: np.ndarray | None = None
        self.landed_phase: np.ndarray | None = None
        self.seen: dict[int, np.ndarray] = {}
        self.starts = np.array([a - base for a in self.addresses], dtype=np.int64)
        self.ends = self.starts + np.array([a.nbytes for a in arrays], dtype=np.int64)
        for address, array in zip(self.addresses, arrays):
            self.bytes[address - base:address - base + array.nbytes] = np.ascontiguousarray(array).view(np.uint8).ravel()

    def read_back(self, arrays: list[np.ndarray]) -> None:
        for address, array in zip(self.addresses, arrays):
            array.view(np.uint8).ravel()[:] = self.bytes[address - self.base:address - self.base + array.nbytes]

    def _index(self, address: np.ndarray, width: int, vector: int) -> np.ndarray:
        if np.any(address % np.uint64(width * vector)):
            raise MemoryError(f"misaligned {width * vector}-byte access at {[hex(a) for a in address[address % np.uint64(width * vector) != 0][:4]]}")
        return self.inside(address, width * vector)[:, None] + np.arange(width * vector)

    def _located(self, address: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each address's offset, and the index of the array it falls in (-1 before the first)."""
        start = address.astype(np.int64) - self.base
        return start, np.searchsorted(self.starts, start, side="right") - 1

    def inside(self, address: np.ndarray, size: int) -> np.ndarray:
        """The offsets of `size` bytes at each address, each run inside one array: a kernel reading
        past its tensor into the next is wrong even where a GPU would not fault."""
        start, array = self._located(address)
        outside = (array < 0) | (start + size > self.ends[np.maximum(array, 0)])
        if np.any(outside):
            raise MemoryError(f"access outside the arrays at {[hex(int(a)) for a in address[outside][:4]]}")
        return start

    def count(self, address: np.ndarray, size: int, threads: np.ndarray) -> None:
        """Count one read instruction (threads `threads` reading `size` bytes at `address`) into
        `traffic`, per array: the bytes asked for, the 32-byte sectors each warp's access touches
        (what the memory system moves for it: a thread's access of at most 32 bytes spans one or
        two), and the distinct sectors read over the kernel (what a perfect cache would fetch)."""
        if self.traffic is None or not len(address):
            return
        start, array = self._located(address)
        warp = (threads.astype(np.int64) // 32) << 40
        keys, owner = np.concatenate([warp | start // 32, warp | (start + size - 1) // 32]), np.concatenate([array, array])
        lines = np.concatenate([warp | start // 128, warp | (start + size - 1) // 128])
        for a in np.unique(array):
            entry = self.traffic.setdefault(int(a), {"requested": 0, "sectors": 0, "lines": 0, "distinct": set()})
            entry["requested"] += size * int((array == a).sum())
            touched = np.unique(keys[owner == a])
            entry["sectors"] += len(touched)
            entry["lines"] += len(np.unique(lines[owner == a]))
            entry["distinct"].update((touched & ((1 << 40) - 1)).tolist())

    def count_banks(self, address: np.ndarray, size: int, threads: np.ndarray) -> None:
        """Count one shared-memory load instruction into `traffic["shared"]`: its wavefronts. A
        warp's threads go in phases of 128 bytes' worth (8 threads of 16-byte loads, 16 of 8, 32
        of 4), and a phase takes as many wavefronts as the most distinct 4-byte words one of the
        32 banks holds in it (1: conflict-free)."""
        if self.traffic is None or not len(address):
            return
        words = (address.astype(np.int64) // 4)[:, None] + np.arange(max(size // 4, 1))
        phase = np.repeat(threads.astype(np.int64) // (128 // max(size, 4)), words.shape[1])
        keys = np.unique(np.stack([phase, words.ravel() % 32, words.ravel()], axis=1), axis=0)  # distinct words per (phase, bank)
        banks, per_bank = np.unique(keys[:, :2], axis=0, return_counts=True)
        worst = np.zeros(int(phase.max()) + 1, np.int64)
        np.maximum.at(worst, banks[:, 0], per_bank)
        entry = self.traffic.setdefault("shared", {"loads": 0, "wavefronts": 0, "conflicts": 0})
        entry["loads"] += len(np.unique(threads // 32))
        entry["wavefronts"] += int(worst.sum())
        entry["conflicts"] += int((worst - 1)[np.unique(phase)].sum())  # wavefronts past one a phase

    def _settled(self, index: np.ndarray) -> np.ndarray:
        """`index`, where no cp.async copy in flight writes: a shared access there raises."""
        if self.in_flight is not None and self.in_flight[index].any():
            raise MemoryError("a shared access to bytes a copy in flight still writes (wait for its cp.async group or its mbarrier first)")
        return index

    def _observed(self, index: np.ndarray, threads: np.ndarray | None) -> np.ndarray:
        """`index` (a row of byte offsets per thread of `threads`), where each thread has observed
        the mbarrier phase a TMA copy landed its bytes on: a load of a tile raises in a thread that
        neither waited on that phase nor met, at a barrier, a thread that did (in lockstep the
        bytes are there once any thread's wait lands them; on a GPU, only for those threads)."""
        if self.landed is None:
            return index
        at = self.landed[index]
        for barrier in np.unique(at[at >= 0]):
            needed = np.where(at == barrier, self.landed_phase[index], 0).max(axis=1)
            seen = self.seen[int(barrier)]
            if np.any((seen.min() if threads is None else seen[threads]) < needed):
                raise MemoryError("a thread loads bytes a TMA copy landed on an mbarrier phase it has not waited for "
                                  "(nor met, at a barrier, a thread that did)")
        return index

    def load(self, address: np.ndarray, width: int, vector: int, threads: np.ndarray | None = None) -> list[np.ndarray]:
        """The loads of `threads` (thread indices, one an address; None: a collective load, such
        as wgmma's operand, for which every thread must have observed a TMA copy's phase)."""
        raw = self.bytes[self._observed(self._settled(self._index(address, width, vector)), threads)]
        words = raw.reshape(len(address), vector, width).copy().view(_UNSIGNED[width])
        return [words[:, i, 0].astype(np.uint64) for i in range(vector)]

    def store(self, address: np.ndarray, values: list[np.ndarray], width: int) -> None:
        index = self._settled(self._index(address, width, len(values)))
        if self.landed is not None:
            self.landed[index] = -1  # the threads' own bytes now, ordered for others by barriers as any store
        self.bytes[index] = np.stack([v.astype(_UNSIGNED[width]) for v in values], axis=1).view(np.uint8).reshape(len(address), -1)


class Block:
    """One thread block's threads in lockstep."""

    def __init__(self, threads: int, memory: Memory | None = None, params: dict[str, int] | None = None, block: tuple[int, ...] = (0,),
                 grid: tuple[int, ...] = (1,), shared_bytes: int = 0, read_only: tuple[int, ...] = (), maps: dict | None = None):
        self.threads, self.memory, self.params = threads, memory, params or {}
        self.maps = maps or {}  # a TensorMap's parameter value: (its array's index among the memory's, the array, the box)
        self.barriers: dict[int, dict] = {}  # mbarriers by shared address: count, arrivals pending, bytes expected, phase, TMA copies on it
        # with TMA copies: shared bytes loaded since the last barrier, which a TMA copy must not
        # overwrite (in lockstep every load is done by then; on a GPU another warp's may not be)
        self.read_since_barrier: np.ndarray | None = None
        self.read_only = set(read_only)  # indices of the memory's arrays no kernel before writes: readable before griddepcontrol.wait
        self.regs: dict[str, np.ndarray] = {}
        self.everyone = np.ones(threads, bool)  # an instruction's threads when it has no guard
        self.everyone.flags.writeable = False
        self.constants: dict[str, np.ndarray] = {}  # immediates, read-only, parsed once
        lanes = np.arange(threads, dtype=np.uint64)
        self.special = {"%tid.x": lanes, "%ntid.x": np.full(threads, threads, np.uint64), "%laneid": lanes % np.uint64(32), "%warpid": lanes // np.uint64(32)}
        for i, axis in enumerate("xyz"):
            self.special[f"%ctaid.{axis}"] = np.full(threads, block[i] if i < len(block) else 0, np.uint64)
            self.special[f"%nctaid.{axis}"] = np.full(threads, grid[i] if i < len(grid) else 1, np.uint64)
            if axis != "x":
                self.special.update({f"%tid.{axis}": 0 * lanes, f"%ntid.{axis}": 0 * lanes + np.uint64(1)})
        self.shared = Memory([np.zeros(shared_bytes, dtype=np.uint8)], base=0) if shared_bytes else None  # `global_smem` is 0
        if self.shared is not None:
            self.shared.in_flight = np.zeros(shared_bytes, np.int32)
        # cp.async copies not yet landed: those issued since the last commit, and each committed group's
        self.copying: list[tuple[np.ndarray, np.ndarray]] = []
        self.committed: list[list[tuple[np.ndarray, np.ndarray]]] = []
        self.awaiting = False  # before the griddepcontrol.wait of a kernel that has one: no global access but prefetches (`execute`)

    def value(self, token: str) -> np.ndarray:
        """An operand as bit patterns, one per thread."""
        token = token.strip()
        if token in self.regs:
            return self.regs[token]
        if token.startswith(_SPECIAL):
            return self.special[token]
        if token == "global_smem":
            return np.zeros(self.threads, np.uint64)
        if token in self.params:  # `mov.b32 %r, k_param_0`: a parameter's address, which Triton takes only of a tensor map (here its handle), then cvta.param
            return np.full(self.threads, self.params[token], np.uint64)
        if token not in self.constants:
            bits = _immediate(token)
            if bits is None:
                raise KeyError(f"the emulator has no value for {token!r} (a register read before it is written?)")
            self.constants[token] = np.full(self.threads, bits, np.uint64)
            self.constants[token].flags.writeable = False  # shared by every instruction that reads it
        return self.constants[token]

    def typed(self, token: str, kind: str) -> np.ndarray:
        return _as(self.value(token), kind)

    def write(self, token: str, bits: np.ndarray, active: np.ndarray | None) -> None:
        """Bit patterns (or a predicate's bools) into a register, where `active` (all threads if None)."""
        bits = np.asarray(bits)
        bits = bits if bits.dtype == np.bool_ else bits.astype(np.uint64)
        if active is not None and token in self.regs:
            bits = np.where(active, bits, self.regs[token])
        self.regs[token] = bits

    def address(self, operand: str) -> np.ndarray:
        """`[reg + offset]` (the offset may be negative: `[reg+-12]`), `[reg]` or `[param]` as one address per thread."""
        inside = operand.strip()[1:-1].replace(" ", "")
        base, _, offset = inside.partition("+")
        return self.value(base) + np.uint64((int(offset, 0) if offset else 0) % (1 << 64))  # wraps modulo 2^64, as the address does

    def _reads_only(self, operand: str, active: np.ndarray | None) -> bool:
        """Whether every active thread's address of `operand` lies in a read-only array."""
        address = self.address(operand)
        arrays = self.memory._located(address if active is None else address[active])[1]
        return set(arrays.tolist()) <= self.read_only

    def execute(self, body: str) -> None:
        self.awaiting = "griddepcontrol.wait" in body
        if "cp.async.bulk.tensor" in body and self.shared is not None:  # bytes of shared memory loaded since the last barrier
            self.read_since_barrier = np.zeros(len(self.shared.bytes), bool)
            self.shared.landed = np.full(len(self.shared.bytes), -1, np.int64)
            self.shared.landed_phase = np.zeros(len(self.shared.bytes), np.int64)
        statements, labels = _program(body)
        pc = 0
        while pc < len(statements):
            guard, opcode, ops = statements[pc]
            pc += 1
            active = None
            if guard is not None:
                active = self.regs[guard[0]].astype(bool)
                active = ~active if guard[1] else active
            if opcode.startswith("bra"):
                taken = np.ones(self.threads, bool) if active is None else active
                if taken.all():
                    pc = labels[ops[0]]
                elif taken.any():
                    raise NotImplementedError("a divergent branch: the emulator runs a block's threads in lockstep")
                continue
            if opcode == "ret" or opcode.startswith("exit"):
                if any(barrier["copies"] for barrier in self.barriers.values()):
                    raise MemoryError("the block exits with a TMA copy in flight (never waited for): it may land in another block's shared memory")
                return
            try:
                self.step(opcode, ops, active)
            except (AssertionError, IndexError, KeyError, MemoryError, NotImplementedError, RuntimeError, ValueError) as error:
                raise type(error)(f"{error} (at `{opcode} {', '.join(ops)}`)") from error

    def step(self, opcode: str, ops: list[str], active: np.ndarray | None) -> None:  # noqa: C901  (one branch per instruction)
        parts = opcode.split(".")
        name, kind = parts[0], parts[-1]
        if name in ("bar", "barrier", "membar", "fence"):
            if name in ("bar", "barrier") and self.read_since_barrier is not None:
                self.read_since_barrier[:] = False
                for seen in self.shared.seen.values():  # what one thread observed, every thread has after a barrier with it
                    seen[:] = seen.max()
            return  # lockstep: every thread is already here
        if name == "griddepcontrol":  # wait: the kernel before is done (here, there is none); launch_dependents: a hint
            self.awaiting = self.awaiting and parts[1] != "wait"
            return
        if opcode.startswith("cp.async.bulk.tensor.2d.shared"):
            self.tma_copy(ops, self.everyone if active is None else active)
            return
        if name == "mbarrier":
            self.mbarrier(parts, ops, self.everyone if active is None else active)
            return
        if name == "elect":  # elect.sync %r|%p, membermask: each warp's first active lane
            threads = self.everyone if active is None else active
            lane = np.arange(self.threads) % 32
            first = np.full(self.threads, 32)
            for warp in range(0, self.threads, 32):
                chosen = np.flatnonzero(threads[warp:warp + 32])
                first[warp:warp + 32] = chosen[0] if len(chosen) else 32
            leader, elected = _registers(ops[0].replace("|", ","))
            self.write(leader, first.astype(np.uint64), active)
            self.write(elected, threads & (lane == first), active)
            return
        if name == "cvta":  # a parameter's or shared address as a generic one: the same number here
            self.write(ops[0], self.value(ops[1]), active)
            return
        copy = name == "cp" and "prefetch" not in parts and not {"commit_group", "wait_group", "wait_all"} & set(parts)
        if self.awaiting and (copy or name in ("red", "atom") or name in ("ld", "st") and parts[1] == "global") and not (
                (copy or name == "ld") and self._reads_only(ops[1], active)):
            raise MemoryError(f"{opcode} before griddepcontrol.wait: the kernel before may not have written its input, or may still read its output")
        if opcode == "cp.async.commit_group":
            self.committed.append(self.copying)
            self.copying = []
            return
        if opcode in ("cp.async.wait_group", "cp.async.wait_all"):  # the copies of all but the newest `n` groups land now
            waiting = int(ops[0]) if opcode == "cp.async.wait_group" else 0
            if opcode == "cp.async.wait_all":
                self.committed.append(self.copying)
                self.copying = []
            while len(self.committed) > waiting:
                for index, data in self.committed.pop(0):
                    self.shared.bytes[index] = data
                    np.subtract.at(self.shared.in_flight, index, 1)
            return
        threads = self.everyone if active is None else active
        if name == "prefetch" or opcode.startswith("cp.async.bulk.prefetch."):  # a cache hint: no value changes, but its bytes must be there
            address = self.address(ops[0])[threads]
            sizes = np.broadcast_to(self.value(ops[1]), (self.threads,))[threads] if name == "cp" else np.ones(len(address), np.uint64)
            for size in np.unique(sizes):  # cp.async.bulk: 16-byte aligned, a multiple of 16 bytes, inside one array
                if name == "cp" and (size % 16 or np.any(address[sizes == size] % np.uint64(16))):
                    raise MemoryError(f"bulk prefetch of {int(size)} bytes at {[hex(int(a)) for a in address[sizes == size][:4]]}: not 16-byte aligned")
                self.memory.inside(address[sizes == size], int(size))
            return
        if name == "cp":  # cp.async.cg.shared.global [shared], [global], 16, bytes: copy `bytes`, zero the rest
            size, copied = int(ops[2], 0), self.value(ops[3]) if len(ops) > 3 else np.full(self.threads, int(ops[2], 0), np.uint64)
            target, source = self.address(ops[0]), self.address(ops[1])
            for count in np.unique(copied[threads]):  # the threads copying `count` bytes, together
                chosen = threads & (copied == count)
                data = np.zeros((int(chosen.sum()), size), np.uint8)
                if count:
                    data[:, :count] = self.memory.bytes[self.memory._index(source[chosen], int(count), 1)]
                    self.memory.count(source[chosen], int(count), np.flatnonzero(chosen))
                index = self.shared._index(target[chosen], size, 1)
                np.add.at(self.shared.in_flight, index, 1)
                self.copying.append((index, data))  # lands at the wait for its group
            return
        if name in ("stmatrix", "ldmatrix"):
            self.matrix(name == "ldmatrix", parts, ops, active)
            return
        if name in ("wgmma", "mma"):
            assert active is None, f"the emulator has no predicated {opcode}"
            if name == "mma":
                self.mma_sync(parts, ops)
            elif parts[1] == "mma_async":
                self.wgmma(parts, ops)
            return  # wgmma.fence, commit_group, wait_group: each product is done as it is issued (see `wgmma`)
        if name in ("red", "atom"):  # red...add.TYPE [address], value; atom...add.TYPE old, [address], value (Triton 3.6's
            # split-K fp16, its result unused): one thread at a time, each add rounded
            assert "add" in parts and kind in ("f16", "bf16", "f32"), f"the emulator has no {opcode}"
            result, ops = (ops[0], ops[1:]) if name == "atom" else (None, ops)
            read = _from_bf16 if kind == "bf16" else lambda bits: _as(bits, kind)
            address, value, width = self.address(ops[0]), read(self.value(ops[1])), _WIDTH[kind[-2:]] // 8
            olds = np.zeros(self.threads, np.uint64)
            for thread in np.flatnonzero(threads):
                at = address[thread:thread + 1]
                (old,) = self.memory.load(at, width, 1)
                olds[thread] = old[0]
                total = read(old).astype(np.float64) + float(value[thread])
                self.memory.store(at, [_to_bf16(total.astype(np.float32)) if kind == "bf16" else _bits(total.astype(read(old).dtype))], width)
            if result is not None:
                self.write(result, olds, active)
            return
        if name == "mov":
            if ops[0].startswith("{"):  # unpack into parts
                targets = _registers(ops[0])
                width, source = _WIDTH[kind[1:]] // len(targets), self.value(ops[1])
                for i, target in enumerate(targets):
                    self.write(target, source >> np.uint64(width * i) & np.uint64((1 << width) - 1), active)
            elif ops[1].startswith("{"):  # pack parts
                sources = _registers(ops[1])
                width, out = _WIDTH[kind[1:]] // len(sources), np.zeros(self.threads, np.uint64)
                for i, source in enumerate(sources):
                    # a part never written is LLVM's undef (Triton 3.6 packs one where only the other
                    # half is read): all ones, a NaN or -1, so that a result that did use it is wrong
                    unwritten = source.startswith("%") and source not in self.regs and not source.startswith(_SPECIAL)
                    part = np.full(self.threads, (1 << width) - 1, np.uint64) if unwritten else self.value(source)
                    out |= (part & np.uint64((1 << width) - 1)) << np.uint64(width * i)
                self.write(ops[0], out, active)
            else:
                self.write(ops[0], self.value(ops[1]) & np.uint64((1 << _WIDTH[kind[1:]]) - 1) if kind != "pred" else self.value(ops[1]), active)
            return
        if name in ("ld", "st"):
            space = parts[1]
            vector = int(parts[-2][1:]) if parts[-2].startswith("v") else 1
            width = _WIDTH[kind[1:]] // 8
            memory = self.shared if space == "shared" else self.memory
            if name == "ld" and space == "param":
                self.write(ops[0], np.full(self.threads, self.params[ops[1].strip("[] ")], np.uint64), active)
                return
            if name == "ld":
                targets = _registers(ops[0])
                address = self.address(ops[1])
                loaded = [np.zeros(self.threads, np.uint64) for _ in targets]
                if threads.any():
                    for whole, part in zip(loaded, memory.load(address[threads], width, vector, np.flatnonzero(threads))):
                        whole[threads] = part
                    if space == "shared":
                        self.memory.count_banks(address[threads], width * vector, np.flatnonzero(threads))
                        if self.read_since_barrier is not None:
                            self.read_since_barrier[self.shared._index(address[threads], width, vector)] = True
                    else:
                        memory.count(address[threads], width * vector, np.flatnonzero(threads))
                for target, bits in zip(targets, loaded):
                    if kind[0] == "s":  # ld.s8 / .s16 into a wider register sign-extends (Triton 3.6's int8 zero points)
                        bits = _bits(_as(bits, kind).astype(np.int64))
                    self.write(target, bits, active)
            else:
                values = [self.value(t) for t in _registers(ops[1])]
                if threads.any():
                    memory.store(self.address(ops[0])[threads], [v[threads] for v in values], width)
            return
        if name == "setp":
            compare, kind = parts[1], parts[2]
            a, b = self.typed(ops[1], kind), self.typed(ops[2], kind)
            result = {"eq": a == b, "ne": a != b, "lt": a < b, "le": a <= b, "gt": a > b, "ge": a >= b}[compare]
            self.write(ops[0], result, active)
            return
        if name == "selp":
            self.write(ops[0], np.where(self.value(ops[3]).astype(bool), self.value(ops[1]), self.value(ops[2])), active)
            return
        if name == "shfl":
            # the lane operand may differ across threads (idx: each reads the lane it names)
            mode, source, operand = parts[2], self.value(ops[1]), (self.value(ops[2]) & np.uint64(31)).astype(np.int64)
            lane = np.arange(self.threads) % 32
            partner = {"bfly": lane ^ operand, "idx": operand, "down": lane + operand, "up": lane - operand}[mode]
            partner = np.where((partner < 0) | (partner > 31), lane, partner)
            self.write(ops[0], source[np.arange(self.threads) - lane + partner], active)
            return
        if name == "cvt":
            to, source = parts[-2], parts[-1]
            if to == "f16x2":  # cvt.rn.f16x2.f32 d, a, b: a to the upper half
                self.write(ops[0], _join_half2(self.typed(ops[2], "f32"), self.typed(ops[1], "f32")), active)
                return
            if to in ("bf16", "bf16x2"):  # from f32: rounded to nearest; bf16x2 as f16x2
                low = _to_bf16(self.typed(ops[-1], "f32"))
                self.write(ops[0], low | _to_bf16(self.typed(ops[1], "f32")) << np.uint64(16) if to == "bf16x2" else low, active)
                return
            value = _from_bf16(self.value(ops[1])) if source == "bf16" else self.typed(ops[1], source)
            if to[0] == "f":
                out = value.astype({"f16": np.float16, "f32": np.float32, "f64": np.float64}[to])
            elif source[0] == "f":
                out = np.trunc(value) if "rzi" in parts else np.rint(value)
                out = out.astype({"s": np.int64, "u": np.uint64}[to[0]])
            else:
                out = value.astype(np.int64 if source[0] == "s" else np.uint64)
            out = _bits(out) & np.uint64((1 << _WIDTH[to[1:]]) - 1)
            if to[0] == "s":  # a signed result is sign-extended to the register (cvt.s8.s32 into a 16-bit one)
                out = _bits(_as(out, to).astype(np.int64))
            self.write(ops[0], out, active)
            return
        if kind in ("f16x2", "f16") or (name in ("add", "sub", "mul", "fma", "neg", "abs") and kind == "f32"):
            self.write(ops[0], self.float_math(name, kind, ops), active)
            return
        self.write(ops[0], self.integer_math(name, parts, ops), active)

    def tma_copy(self, ops: list[str], threads: np.ndarray) -> None:
        """cp.async.bulk.tensor.2d.shared::cta.global.mbarrier::complete_tx::bytes [shared], [map,
        {column, row}], [mbarrier]: each issuing thread's tile of the map's array (zeros past its
        edges) into shared memory, in flight until a wait on the mbarrier lands it (`mbarrier`)."""
        target, barrier = self.address(ops[0]), self.address(ops[2])
        handle, coordinates = ops[1].strip("[] ").split(",", 1)
        columns, rows = (_as(self.value(c), "s32").astype(np.int64) for c in _registers(coordinates))
        for thread in np.flatnonzero(threads):
            index, array, (box_rows, box_columns) = self.maps[int(self.value(handle)[thread])]
            if self.awaiting and index not in self.read_only:
                raise MemoryError("a TMA copy before griddepcontrol.wait of an array the kernel before may write")
            if target[thread] % 128:  # (the CUDA guide's rule for tensor copies; 16 bytes for plain bulk copies)
                raise MemoryError(f"a TMA copy into shared memory at {hex(int(target[thread]))}: not 128-byte aligned")
            row, column, size = int(rows[thread]), int(columns[thread]), array.itemsize
            tile = np.zeros((box_rows, box_columns), array.dtype)
            inside = array[max(row, 0):max(row + box_rows, 0), max(column, 0):max(column + box_columns, 0)]
            tile[max(-row, 0):max(-row, 0) + inside.shape[0], max(-column, 0):max(-column, 0) + inside.shape[1]] = inside
            if self.memory.traffic is not None and inside.size:  # its bytes read, in 16-byte pieces of its rows (one access, as a warp's)
                start = self.memory.addresses[index] + max(row, 0) * array.strides[0] + max(column, 0) * size
                pieces = (start + np.arange(inside.shape[0])[:, None] * array.strides[0] + np.arange(0, inside.shape[1] * size, 16)[None, :]).ravel()
                self.memory.count(pieces.astype(np.uint64), 16, np.zeros(len(pieces), np.int64))
            written = self.shared._index(target[thread:thread + 1], tile.nbytes, 1)[0]
            if self.shared.in_flight[written].any():
                raise MemoryError("a TMA copy into shared memory another copy in flight still writes")
            if self.read_since_barrier[written].any():
                raise MemoryError("a TMA copy into shared memory loaded since the last barrier: another warp may not have read it yet")
            np.add.at(self.shared.in_flight, written, 1)
            self._barrier(int(barrier[thread]))["copies"].append((written, tile.view(np.uint8).ravel()))

    def _barrier(self, address: int) -> dict:
        if address not in self.barriers:
            raise RuntimeError(f"an mbarrier at shared {hex(address)} used before mbarrier.init")
        return self.barriers[address]

    def mbarrier(self, parts: list[str], ops: list[str], threads: np.ndarray) -> None:
        """mbarrier.init [b], count; mbarrier.arrive.expect_tx _, [b], bytes (an arrival that also
        expects `bytes` of copies); mbarrier.try_wait.parity done, [b], parity (whether the phase of
        that parity has completed); mbarrier.inval [b]. A phase completes when its arrivals are in
        and its copies have landed; here the copies land when a thread waits on it."""
        operation = parts[1]
        if operation == "try_wait" and "parity" not in parts:
            raise NotImplementedError(f"the emulator has no {'.'.join(parts)} (only the .parity form)")
        at = ops[0] if operation in ("init", "inval") else ops[1]
        addresses = self.address(at)
        if operation == "init":
            if np.any(addresses[threads] % np.uint64(8)):
                raise MemoryError("an mbarrier not 8-byte aligned")
            for thread in np.flatnonzero(threads):
                count = int(self.value(ops[1])[thread])
                self.barriers[int(addresses[thread])] = dict(count=count, pending=count, expected=0, phase=0, copies=[])
                self.shared.seen[int(addresses[thread])] = np.zeros(self.threads, np.int64)
        elif operation == "inval":
            for address in np.unique(addresses[threads]):
                if self._barrier(int(address))["copies"]:
                    raise MemoryError("an mbarrier invalidated with a TMA copy on it in flight")
                del self.barriers[int(address)]
                self.shared.landed[self.shared.landed == address] = -1
        elif operation == "arrive":
            for thread in np.flatnonzero(threads):
                barrier = self._barrier(int(addresses[thread]))
                barrier["pending"] -= 1
                barrier["expected"] += int(self.value(ops[2])[thread]) if "expect_tx" in parts else 0
                if barrier["pending"] < 0:  # (phases complete at a wait here: a second phase's arrival before it is a slot asked twice)
                    raise MemoryError("more arrivals on an mbarrier than its count before a wait completes the phase")
        elif operation == "try_wait":
            done = np.zeros(self.threads, bool)
            parity = self.value(ops[2]) & np.uint64(1)
            for address in np.unique(addresses[threads]):
                barrier, mine = self._barrier(int(address)), threads & (addresses == address)
                if np.all((barrier["phase"] & 1) != parity[mine]):  # that phase is over: the wait returns at once, landing nothing
                    done[mine] = True
                    self.shared.seen[int(address)][mine] = barrier["phase"]
                    continue
                for written, data in barrier["copies"]:
                    self.shared.bytes[written] = data
                    self.shared.landed[written], self.shared.landed_phase[written] = address, barrier["phase"] + 1
                    np.subtract.at(self.shared.in_flight, written, 1)
                    barrier["expected"] -= len(data)
                barrier["copies"] = []
                if barrier["expected"] < 0:
                    raise MemoryError("TMA copies landed more bytes on an mbarrier than its arrivals expected")
                if barrier["pending"] <= 0 and barrier["expected"] == 0:  # the phase completes; the next awaits all its arrivals
                    barrier.update(phase=barrier["phase"] + 1, pending=barrier["count"])
                done[mine] = (barrier["phase"] & 1) != parity[mine]
                self.shared.seen[int(address)][mine & done] = barrier["phase"]  # they observed every phase completed so far
            if not done[threads].any():  # in lockstep every thread is here: nothing else could arrive
                raise RuntimeError("an mbarrier wait that never completes (its phase lacks arrivals or expected bytes)")
            self.write(ops[0], done, None if threads.all() else threads)
        else:
            raise NotImplementedError(f"the emulator has no mbarrier.{operation}")

    def matrix(self, load: bool, parts: list[str], ops: list[str], active: np.ndarray | None) -> None:
        """ldmatrix / stmatrix of 8x8 b16 matrices: a thread's word i is row t // 4, columns
        2 (t % 4) and + 1 of matrix i, whose rows threads 8 i .. 8 i + 7 address; .trans: the
        matrix is transposed in memory (that word's two halves are rows 2 (t % 4), + 1 at column t // 4)."""
        assert parts[3] == "m8n8" and parts[-1] == "b16" and active is None, f"the emulator has no {'.'.join(parts)}"
        registers, where = (ops[0], ops[1]) if load else (ops[1], ops[0])
        registers, rows = _registers(registers), self.address(where)
        lane = np.arange(self.threads) % 32
        warp = np.arange(self.threads) - lane
        for i, register in enumerate(registers):
            if "trans" in parts:
                halves = [rows[warp + 8 * i + lane % 4 * 2 + h] + (lane // 4).astype(np.uint64) * np.uint64(2) for h in range(2)]
                if load:
                    low, high = (self.shared.load(address, 2, 1, np.arange(self.threads))[0] for address in halves)
                    self.write(register, low | high << np.uint64(16), None)
                else:
                    for h, address in enumerate(halves):
                        self.shared.store(address, [self.value(register) >> np.uint64(16 * h) & np.uint64(0xFFFF)], 2)
            else:
                address = rows[warp + 8 * i + lane // 4] + (lane % 4 * 4).astype(np.uint64)
                if load:
                    self.write(register, self.shared.load(address, 4, 1, np.arange(self.threads))[0], None)
                else:
                    self.shared.store(address, [self.value(register)], 4)

    def _fragment(self, registers: list[str], kind: str) -> np.ndarray:
        """Registers of 16-bit pairs (f16x2 or bf16x2) as float64 [threads, 2 x registers], low half first."""
        read = (lambda bits: _from_bf16(bits).astype(np.float64)) if kind == "bf16" else (lambda bits: _as(bits, "f16").astype(np.float64))
        return np.stack([read(self.value(r) >> np.uint64(16 * half)) for r in registers for half in (0, 1)], axis=1)

    def _accumulate(self, d: list[str], c: list[str] | None, product: np.ndarray, threads: np.ndarray, rows: np.ndarray,
                    columns: np.ndarray) -> None:
        """d[i] = product[rows[t, i], columns[t, i]] (+ c[i]) in f32, for threads `threads`."""
        for i, register in enumerate(d):
            value = product[rows[:, i], columns[:, i]]
            if c is not None:
                value = value + _as(self.value(c[i])[threads], "f32").astype(np.float64)
            bits = self.regs.get(register, np.zeros(self.threads, np.uint64)).copy()
            bits[threads] = _bits(value.astype(np.float32))
            self.regs[register] = bits

    def mma_sync(self, parts: list[str], ops: list[str]) -> None:
        """mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32 d, a, b, c per warp, its
        fragments as `_fragments` says; B [16, 8]: register j of lane l holds column l // 4, rows
        2 (l % 4) + 8 j and + 1."""
        assert parts[3:7] == ["m16n8k16", "row", "col", "f32"] and parts[-1] == "f32", f"the emulator has no {'.'.join(parts)}"
        d, a, b, c = (_registers(op) for op in ops)
        lane = np.arange(32)
        a_rows, a_cols, d_rows, d_cols = _fragments(lane, len(d))
        b_rows = np.stack([lane % 4 * 2 + 8 * j + h for j in range(2) for h in (0, 1)], axis=1)
        for warp in range(self.threads // 32):
            threads = np.arange(32 * warp, 32 * warp + 32)
            A, B = np.zeros((16, 16)), np.zeros((16, 8))
            A[a_rows, a_cols] = self._fragment(a, parts[7])[threads]
            B[b_rows, lane[:, None] // 4] = self._fragment(b, parts[8])[threads]
            self._accumulate(d, c, A @ B, threads, d_rows, d_cols)

    def wgmma(self, parts: list[str], ops: list[str]) -> None:
        """wgmma.mma_async.sync.aligned.m64nNk16.f32.{f16,bf16}.{f16,bf16} d, a, b-desc, scale-d,
        imm-scale-a, imm-scale-b, imm-trans-b, per warpgroup (4 warps), with A [64, 16] in
        registers and B [16, N] in shared memory as its descriptor says (`_shared_matrix`). Warp
        w of the group holds rows 16 w .. 16 w + 15 of A and D, in `_fragments`. Done as issued:
        PTX leaves the registers and shared operands of a product in flight untouched until
        wgmma.wait_group, so the result is the same."""
        m, n, k = (int(v) for v in re.fullmatch(r"m(\d+)n(\d+)k(\d+)", parts[4]).groups())
        kind = parts[6]
        assert (m, k) == (64, 16) and parts[5] == "f32" and kind == parts[7] and kind in ("f16", "bf16") and ops[1].startswith("{"), \
            f"the emulator has no {'.'.join(parts)} {ops[1][:10]}"
        d, a = _registers(ops[0]), _registers(ops[1])
        scale_d, scale_a, scale_b, transposed = self.value(ops[3]), int(ops[4], 0), int(ops[5], 0), int(ops[6], 0)
        assert not transposed, "the emulator has no wgmma with B in MN-major order"
        t = np.arange(128)
        a_rows, a_cols, d_rows, d_cols = _fragments(t % 32, len(d))
        a_rows, d_rows = a_rows + 16 * (t // 32)[:, None], d_rows + 16 * (t // 32)[:, None]  # warp w: rows 16 w ..
        for group in range(self.threads // 128):
            threads = np.arange(128 * group, 128 * group + 128)
            descriptor = self.value(ops[2])[threads]
            assert np.all(descriptor == descriptor[0]) and np.all(scale_d[threads] == scale_d[threads[0]]), "wgmma operands differ across a warpgroup"
            A = np.zeros((64, 16))
            A[a_rows, a_cols] = self._fragment(a, kind)[threads]
            product = scale_a * scale_b * (A @ self._shared_matrix(int(descriptor[0]), n, kind).T)
            self._accumulate(d, d if scale_d[threads[0]] else None, product, threads, d_rows, d_cols)

    def _shared_matrix(self, descriptor: int, rows: int, kind: str) -> np.ndarray:
        """The [rows, 16] K-major operand a wgmma matrix descriptor points at (PTX ISA, "matrix
        descriptor": start address in bits 0-13 and the stride byte offset in bits 32-45, both in
        16-byte units; swizzle mode in bits 62-63). Only the 128-byte swizzle, the one Triton's
        GEMMs here use, is modelled: rows 128 bytes apart, 8-row groups SBO apart, and each
        address' 16-byte chunk (bits 4-6) XORed with bits 7-9 (cute's Swizzle<3, 4, 3>)."""
        assert descriptor >> 62 & 3 == 1 and descriptor >> 49 & 7 == 0, f"the emulator has only 128-byte swizzled wgmma operands, not {descriptor:#x}"
        start, stride = (descriptor & 0x3FFF) << 4, (descriptor >> 32 & 0x3FFF) << 4
        n, k = np.arange(rows)[:, None], np.arange(16)[None, :]
        address = start + n // 8 * stride + n % 8 * 128 + 2 * k
        address = address ^ ((address >> 7 & 7) << 4)
        (bits,) = self.shared.load(address.ravel().astype(np.uint64), 2, 1)
        values = _from_bf16(bits) if kind == "bf16" else _as(bits, "f16")
        return values.astype(np.float64).reshape(rows, 16)

    def float_math(self, name: str, kind: str, ops: list[str]) -> np.ndarray:
        combine = _FLOAT_OPS[name]
        if kind == "f16x2":
            halves = [_half2(self.value(t)) for t in ops[1:]]
            return _join_half2(combine(*(h[0] for h in halves)), combine(*(h[1] for h in halves)))
        inputs = [self.typed(t, kind).astype(np.float64) for t in ops[1:]]
        return _bits(combine(*inputs).astype(np.float16 if kind == "f16" else np.float32))

    def integer_math(self, name: str, parts: list[str], ops: list[str]) -> np.ndarray:
        kind = parts[-1]
        if kind == "pred":
            a = self.value(ops[1]).astype(bool)
            return ~a if name == "not" else {"and": np.logical_and, "or": np.logical_or, "xor": np.logical_xor}[name](a, self.value(ops[2]).astype(bool))
        width = _WIDTH[kind[1:]]
        mask = _MASK[width]
        if name in ("mul", "mad") and parts[1] in ("wide", "hi"):  # the double-width product (32 x 32 -> 64 bits), or its high half
            wide = np.int64 if kind[0] == "s" else np.uint64
            product = self.typed(ops[1], kind).astype(wide) * self.typed(ops[2], kind).astype(wide)
            result, kept = (_bits(product), np.uint64((1 << 64) - 1)) if parts[1] == "wide" else (_bits(product >> wide(width)) & mask, mask)
            return (result + self.value(ops[3])) & kept if name == "mad" else result
        if name == "shf":  # funnel shift of b:a by c (wrap: c mod 32; clamp: at most 32); l: the high word, r: the low
            amount = self.value(ops[3]) & np.uint64(31) if parts[2] == "wrap" else np.minimum(self.value(ops[3]), np.uint64(32))
            joined = (self.value(ops[2]) & mask) << np.uint64(32) | (self.value(ops[1]) & mask)
            return (joined << amount >> np.uint64(32) if parts[1] == "l" else joined >> amount) & mask
        if name == "lop3":
            return _lop3(*(self.value(t) & mask for t in ops[1:4]), int(ops[4], 0))
        if name == "prmt":
            return _prmt(self.value(ops[1]) & mask, self.value(ops[2]) & mask, self.value(ops[3]) & mask)
        if name == "bfe":  # bits position .. position + length - 1; .s: sign-extended from the last of them
            position, length = self.value(ops[2]) & np.uint64(0xFF), self.value(ops[3]) & np.uint64(0xFF)
            field = ((self.value(ops[1]) & mask) >> np.minimum(position, np.uint64(width - 1))) & ((np.uint64(1) << length) - np.uint64(1))
            if kind[0] == "s":
                top = np.minimum(position + length, np.uint64(width)) - np.uint64(1)  # the field's last bit, or the word's sign
                sign = (self.value(ops[1]) >> top) & np.uint64(1)
                kept = np.minimum(top - position + np.uint64(1), length)
                field = np.where(sign == 1, field | (mask & ~((np.uint64(1) << kept) - np.uint64(1))), field)
            return np.where(length == 0, np.uint64(0), field) & mask
        if name in ("shl", "shr"):
            amount = np.minimum(self.value(ops[2]) & np.uint64(0xFFFFFFFF), np.uint64(width))
            within = np.minimum(amount, np.uint64(width - 1))
            if name == "shl":
                return np.where(amount >= width, np.uint64(0), self.value(ops[1]) << within) & mask
            if kind[0] == "s":  # arithmetic: the sign fills in
                return _bits(self.typed(ops[1], kind).astype(np.int64) >> within.astype(np.int64)) & mask
            return np.where(amount >= width, np.uint64(0), (self.value(ops[1]) & mask) >> within)
        if name in ("and", "or", "xor", "not"):
            a = self.value(ops[1])
            return (~a if name == "not" else {"and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor}[name](a, self.value(ops[2]))) & mask
        if name in ("div", "rem"):  # integer: truncates toward zero, as C
            a, b = self.typed(ops[1], kind).astype(np.int64), self.typed(ops[2], kind).astype(np.int64)
            quotient = np.sign(a) * np.sign(b) * (np.abs(a) // np.abs(b))
            return _bits(quotient if name == "div" else a - quotient * b) & mask
        if name in ("min", "max"):
            return _bits((np.minimum if name == "min" else np.maximum)(self.typed(ops[1], kind), self.typed(ops[2], kind))) & mask
        if name not in ("add", "sub", "mul", "mad", "neg"):
            raise NotImplementedError(f"the emulator has no {'.'.join(parts)}")
        a, b = self.value(ops[1]), self.value(ops[2]) if len(ops) > 2 else None
        if name == "add":
            return (a + b) & mask
        if name == "sub":
            return (a - b) & mask
        if name == "mul" and parts[1] == "lo":
            return (a * b) & mask
        if name == "mad" and parts[1] == "lo":
            return (a * b + self.value(ops[3])) & mask
        if name == "neg":
            return (~a + np.uint64(1)) & mask
        raise NotImplementedError(f"the emulator has no {'.'.join(parts)}")


def run(asm: str, constraints: str, inputs: list[int | float]) -> list[int | float]:
    """One thread through an inline-assembly snippet, as `inline_asm_elementwise(asm, constraints,
    inputs)` runs it: constraints `=h`/`=r`/`=f` name the outputs $0.., then `h` (fp16, given as
    a float), `r` (32-bit word, an int) or `f` (fp32 float) the inputs. Returns the outputs as
    floats (h, f) or ints (r)."""
    kinds = constraints.split(",")
    outputs = [k[1:] for k in kinds if k.startswith("=")]
    block = Block(1)
    for i, (kind, value) in enumerate(zip(kinds[len(outputs):], inputs)):
        dtype = {"h": np.float16, "f": np.float32, "r": np.uint32, "l": np.uint64}[kind]
        block.regs[f"${len(outputs) + i}"] = _bits(np.array([value if kind in "hf" else int(value) & 0xFFFFFFFFFFFFFFFF], dtype=dtype))
    body = asm.strip()
    block.execute(body[1:-1] if body.startswith("{") and body.endswith("}") else body)
    reader = {"h": lambda b: float(_as(b, "f16")[0]), "f": lambda b: float(_as(b, "f32")[0]), "r": lambda b: int(_as(b, "u32")[0])}
    return [reader[kind](block.regs[f"${i}"]) for i, kind in enumerate(outputs)]


def launch(ptx: str, grid: tuple[int, ...], args: list[np.ndarray | int | TensorMap], traffic: dict | None = None, read_only: tuple[int, ...] = ()) -> None:
    """A compiled kernel's every block (`grid`: blocks along x, y, z), one after another, on `args` (numpy arrays for its
    pointers, written back in place; ints for its integers) in its parameter order. Parameters
    past `args` (Triton's scratch pointers) are null. With a `traffic` dict, its global reads
    are counted into it, by the index of the array among `args`' arrays (`Memory.count`; the
    distinct sectors as bytes). `read_only`: indices of those arrays no kernel before this one
    writes, which it may read before its griddepcontrol.wait. A `TensorMap` in `args` stands for
    a tensor descriptor of one of the arrays."""
    entry = re.search(r"\.entry\s+(\w+)\(([^)]*)\)", ptx)
    names = re.findall(r"\.param\s+[^\n]*?(\w+_param_\d+)", entry.group(2))
    threads = int(re.search(r"\.reqntid\s+(\d+)", ptx).group(1))
    shared = re.search(r"\.shared\s+\.align\s+\d+\s+\.b8\s+global_smem\[(\d*)\]", ptx)
    body = ptx[entry.end():]
    body = body[body.index("{") + 1:]
    body = body[:body.find("\t.file") if "\t.file" in body else len(body)]
    arrays = [a for a in args if isinstance(a, np.ndarray)]
    memory = Memory(arrays)
    memory.traffic = traffic
    pointer = iter(memory.addresses)
    values, maps = [], {}
    for a in args:
        if isinstance(a, TensorMap):  # the descriptor (a handle to its map, here), then the array's shape and strides
            mapped = args[a.array]
            if max(a.box) > 256 or a.box[1] * mapped.itemsize % 16 or mapped.strides[0] % 16 or mapped.strides[1] != mapped.itemsize:
                raise ValueError(f"no tensor map of a {mapped.shape} array (strides {mapped.strides}) in boxes {a.box}: boxes at most 256 a side, "
                                 "16-byte rows of a box, 16-byte aligned rows, contiguous along them")
            handle = TENSOR_MAPS + 128 * len(maps)
            maps[handle] = (sum(isinstance(b, np.ndarray) for b in args[:a.array]), mapped, a.box)
            values += [handle, *mapped.shape, *(stride // mapped.itemsize for stride in mapped.strides)]
        else:
            values.append(next(pointer) if isinstance(a, np.ndarray) else int(a) & 0xFFFFFFFF)
    params = {name: values[i] if i < len(values) else 0 for i, name in enumerate(names)}
    for block in itertools.product(*(range(n) for n in grid)):
        # Triton's shared memory is `extern` (sized at launch): give the most a block may have on sm_90
        Block(threads, memory, params, block, grid, shared_bytes=232448 if shared else 0, read_only=read_only, maps=maps).execute(body)
    memory.read_back(arrays)
    for entry in (traffic or {}).values():
        if "distinct" in entry:
            entry["distinct"] = 32 * len(entry["distinct"])


def reads_per_byte(ptx: str, grid: tuple[int, ...], args: list[np.ndarray | int], arrays: tuple[str, ...], needed: int,
                   read_only: tuple[int, ...] = ()) -> dict:
    """`launch` with its reads counted, per array (`arrays` names the first arrays of `args`, in
    order): bytes asked for, 32-byte sectors the warps' accesses touch and distinct sectors,
    each per byte of `needed` (what the kernel must read at best), and the share of each
    sector's bytes used; and the L1 wavefronts, per byte of `needed`: each warp's global load
    takes one per 128-byte line it touches, each shared load as many as its bank conflicts make
    (`Memory.count_banks`; under "shared")."""
    counted: dict = {}
    launch(ptx, grid, args, traffic=counted, read_only=read_only)
    report = {}
    for index, name in enumerate(arrays):
        entry = counted.get(index, {"requested": 0, "sectors": 0, "lines": 0, "distinct": 0})
        report[name] = {"requested_per_weight_byte": entry["requested"] / needed, "sectors_per_weight_byte": 32 * entry["sectors"] / needed,
                        "sector_use": entry["requested"] / max(32 * entry["sectors"], 1), "distinct_per_weight_byte": entry["distinct"] / needed,
                        "wavefronts_per_weight_byte": entry["lines"] / needed}
    shared = counted.get("shared", {"loads": 0, "wavefronts": 0, "conflicts": 0})
    report["shared"] = {"wavefronts_per_weight_byte": shared["wavefronts"] / needed, "wavefronts_per_load": shared["wavefronts"] / max(shared["loads"], 1),
                        "bank_conflicts": shared["conflicts"]}
    return report
