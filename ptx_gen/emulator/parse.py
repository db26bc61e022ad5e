"""PTX text -> :class:`Kernel`: the one ``.entry`` of a module, its parameters, shared-memory symbols
and instructions (opcode, modifiers, operands, guard predicate, resolved branch targets)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from ptx_gen.emulator.memory import EmulatorError

NP = {
    "f32": np.float32, "f64": np.float64, "u32": np.uint32, "s32": np.int32, "b32": np.uint32,
    "u64": np.uint64, "s64": np.int64, "b64": np.uint64, "u16": np.uint16, "s16": np.int16, "b16": np.uint16,
    "f16": np.float16, "u8": np.uint8, "s8": np.int8, "b8": np.uint8, "pred": np.bool_,
}
RAW = {1: np.bool_, 8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}
BITS = {"f32": 32, "f64": 64, "u32": 32, "s32": 32, "b32": 32, "u64": 64, "s64": 64, "b64": 64,
         "u16": 16, "s16": 16, "b16": 16, "f16": 16, "u8": 8, "s8": 8, "b8": 8, "pred": 1}


@dataclass
class Inst:
    text: str
    op: str
    mods: list[str]
    args: list[str]
    guard: str | None = None
    negate: bool = False
    target: int = -1  # branch target index


@dataclass
class Kernel:
    name: str
    params: list[tuple[str, str]]
    insts: list[Inst]
    shared: dict[str, tuple[int, int]]  # symbol -> (offset, size)
    static_shared: int
    dynamic_symbol: str | None
    labels: dict[str, int] = field(default_factory=dict)
    cluster: tuple[int, int, int] = (1, 1, 1)  # .reqnctapercluster


def _split_args(s: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in s:
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def parse(ptx: str) -> Kernel:
    """Parse a module holding one ``.entry``."""
    dyn = None
    m = re.search(r"\.extern \.shared \.align \d+ \.b8 (\w+)\[\];", ptx)
    if m:
        dyn = m.group(1)
    m = re.search(r"\.entry (\w+)\(\s*(.*?)\)", ptx, re.S)
    if not m:
        raise EmulatorError("no .entry in the PTX")
    name = m.group(1)
    params = []
    for p in m.group(2).split(","):
        p = p.strip()
        if p:
            pm = re.match(r"\.param (?:\.align \d+ )?\.(\w+) (\w+)(\[\d+\])?", p)
            sym = pm.group(2)
            t = f"{pm.group(1)}{pm.group(3)}" if pm.group(3) else pm.group(1)  # (a byte array: "b8[128]")
            params.append((sym[len(name) + len("_param_"):] if sym.startswith(name + "_param_") else sym, t))
    cm = re.search(r"\.reqnctapercluster\s+(\d+)\s*,\s*(\d+)\s*,\s*(\d+)", ptx[m.end():ptx.index("{", m.end())])
    cluster = tuple(int(x) for x in cm.groups()) if cm else (1, 1, 1)
    body = ptx[ptx.index("{", m.end()) + 1 : ptx.rindex("}")]
    insts: list[Inst] = []
    labels: dict[str, int] = {}
    shared: dict[str, tuple[int, int]] = {}
    offset = 0
    for raw in body.splitlines():
        line = raw.split("//", 1)[0].strip()
        if not line:
            continue
        if line.startswith(".reg"):
            continue
        sm = re.match(r"\.shared \.align (\d+) \.b8 (\w+)\[(\d+)\];", line)
        if sm:
            align, sym, size = int(sm.group(1)), sm.group(2), int(sm.group(3))
            offset = (offset + align - 1) // align * align
            shared[sym] = (offset, size)
            offset += size
            continue
        if line.endswith(":"):
            labels[line[:-1]] = len(insts)
            continue
        if not line.endswith(";"):
            raise EmulatorError(f"cannot parse line {line!r}")
        line = line[:-1].strip()
        guard, negate = None, False
        if line.startswith("@"):
            g, line = line.split(None, 1)
            negate = g.startswith("@!")
            guard = g[2:] if negate else g[1:]
        parts = line.split(None, 1)
        opfull = parts[0]
        args = _split_args(parts[1]) if len(parts) > 1 else []
        op, *mods = opfull.split(".")
        insts.append(Inst(raw.strip(), op, mods, args, guard, negate))
    for inst in insts:
        if inst.op == "bra":
            if inst.args[0] not in labels:
                raise EmulatorError(f"branch to unknown label {inst.args[0]}")
            inst.target = labels[inst.args[0]]
    static = (offset + 15) // 16 * 16
    return Kernel(name, params, insts, shared, static, dyn, labels, cluster)


def immediate(text: str, t: str) -> np.ndarray | None:
    if text.startswith("0f") and len(text) == 10:
        return np.array([int(text[2:], 16)], np.uint32).view(np.float32)
    if text.startswith("0d") and len(text) == 18:
        return np.array([int(text[2:], 16)], np.uint64).view(np.float64)
    if re.fullmatch(r"-?(0x[0-9A-Fa-f]+|\d+)", text):
        v = int(text, 0)
        dt = np.dtype(NP[t])
        if dt.kind == "f":
            return np.array([v], dt)
        bits = BITS[t]
        return np.array([v & ((1 << bits) - 1)], RAW[bits]).view(dt) if bits > 1 else np.array([bool(v)])
    return None

