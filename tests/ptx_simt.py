"""A CPU emulator for the PTX our builder emits, so kernels can be checked without a GPU.

It runs every thread of a launch as a lane of NumPy arrays (SIMT with per-thread program counters;
the threads at the lowest program counter step together, which reconverges structured branches).
It checks what compute-sanitizer would on a GPU, at the level of the emulated semantics:

* memcheck: every global access must lie inside one allocation and be aligned to its size; every
  shared access inside the block's shared memory;
* barriers: a ``bar.sync`` must be reached by every live thread of the block at the same instruction;
  a full-mask ``shfl.sync`` by all 32 lanes of the warp;
* racecheck: between two barriers, a shared byte written by one thread and read or written by
  another is a hazard (reported with the instruction);
* reads of registers never written.

Floating point follows IEEE f32 (fma rounded once via float64, ``ex2.approx`` as float32 exp2), so
results match a GPU to a few ulps, not bit for bit. Only the instruction forms our kernels use are
implemented; anything else raises ``EmulatorError`` naming it.

    mem = Memory()
    a = mem.alloc_array(np.arange(8, dtype=np.float32))
    run(ptx, grid=(1,), block=(32,), params={"x": a, "n": 8}, memory=mem)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np


class EmulatorError(AssertionError):
    """A kernel did something a GPU would reject or a sanitizer would report."""


# ---------------------------------------------------------------------------------------------------
# memory

HEAP_BASE = 0x7F0000000000
GUARD = 256


class Memory:
    """Global memory: allocations in one byte heap with unallocated guard gaps between them."""

    def __init__(self) -> None:
        self.heap = np.zeros(1 << 16, np.uint8)
        self.valid = np.zeros(1 << 16, bool)
        self.top = GUARD
        self.allocs: dict[int, int] = {}  # address -> size

    def alloc(self, nbytes: int) -> int:
        nbytes = max(int(nbytes), 1)
        start = (self.top + 255) // 256 * 256
        end = start + nbytes
        if end + GUARD > self.heap.size:
            size = max(self.heap.size * 2, end + GUARD + (1 << 16))
            heap, valid = np.zeros(size, np.uint8), np.zeros(size, bool)
            heap[: self.heap.size] = self.heap
            valid[: self.valid.size] = self.valid
            self.heap, self.valid = heap, valid
        self.heap[start:end] = 0xFF  # fresh memory is garbage (NaN as float32)
        self.valid[start:end] = True
        self.top = end + GUARD
        addr = HEAP_BASE + start
        self.allocs[addr] = nbytes
        return addr

    def free(self, addr: int) -> None:
        size = self.allocs.pop(addr)
        off = addr - HEAP_BASE
        self.valid[off : off + size] = False

    def alloc_array(self, array: np.ndarray) -> int:
        array = np.ascontiguousarray(array)
        addr = self.alloc(array.nbytes)
        self.write_bytes(addr, array.view(np.uint8).reshape(-1))
        return addr

    def _span(self, addr: int, nbytes: int) -> slice:
        off = addr - HEAP_BASE
        if off < 0 or off + nbytes > self.heap.size or not self.valid[off : off + nbytes].all():
            raise EmulatorError(f"host access to unallocated memory {addr:#x} (+{nbytes})")
        return slice(off, off + nbytes)

    def write_bytes(self, addr: int, data: np.ndarray) -> None:
        data = np.asarray(data).view(np.uint8).reshape(-1)
        self.heap[self._span(addr, data.size)] = data

    def read_bytes(self, addr: int, nbytes: int) -> np.ndarray:
        return self.heap[self._span(addr, nbytes)].copy()

    def read(self, addr: int, dtype, count: int) -> np.ndarray:
        dtype = np.dtype(dtype)
        return self.read_bytes(addr, dtype.itemsize * count).view(dtype)

    def fill(self, addr: int, value: int, nbytes: int) -> None:
        self.heap[self._span(addr, nbytes)] = value & 0xFF

    # device side (vectorised over threads)
    def _offsets(self, addrs: np.ndarray, nbytes: int, where: str) -> np.ndarray:
        off = addrs.astype(np.int64) - HEAP_BASE
        if (addrs % nbytes).any():
            bad = addrs[(addrs % nbytes) != 0][0]
            raise EmulatorError(f"{where}: misaligned {nbytes}-byte global access at {int(bad):#x}")
        idx = off[:, None] + np.arange(nbytes)[None, :]
        inside = (idx >= 0) & (idx < self.heap.size)
        ok = inside.all(axis=1)
        ok[ok] = self.valid[idx[ok]].all(axis=1)
        if not ok.all():
            bad = int(addrs[~ok][0])
            raise EmulatorError(f"{where}: out-of-bounds global access of {nbytes} bytes at {bad:#x} "
                                f"({self._describe(bad)})")
        return idx

    def _describe(self, addr: int) -> str:
        best = None
        for a, s in self.allocs.items():
            if a <= addr < a + s + GUARD or (best is None or abs(addr - a) < abs(addr - best[0])):
                best = (a, s)
        if best is None:
            return "no allocations"
        a, s = best
        return f"nearest allocation {a:#x}..{a + s:#x}, offset {addr - a:+d}"

    def gather(self, addrs: np.ndarray, nbytes: int, where: str) -> np.ndarray:
        return self.heap[self._offsets(addrs, nbytes, where)]

    def scatter(self, addrs: np.ndarray, data: np.ndarray, where: str) -> None:
        self.heap[self._offsets(addrs, data.shape[1], where)] = data


# ---------------------------------------------------------------------------------------------------
# parsing

_NP = {
    "f32": np.float32, "f64": np.float64, "u32": np.uint32, "s32": np.int32, "b32": np.uint32,
    "u64": np.uint64, "s64": np.int64, "b64": np.uint64, "u16": np.uint16, "s16": np.int16, "b16": np.uint16,
    "f16": np.float16, "u8": np.uint8, "s8": np.int8, "b8": np.uint8, "pred": np.bool_,
}
_RAW = {1: np.bool_, 8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}
_BITS = {"f32": 32, "f64": 64, "u32": 32, "s32": 32, "b32": 32, "u64": 64, "s64": 64, "b64": 64,
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
            pm = re.match(r"\.param \.(\w+) (\w+)", p)
            sym = pm.group(2)
            params.append((sym[len(name) + len("_param_"):] if sym.startswith(name + "_param_") else sym, pm.group(1)))
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
    return Kernel(name, params, insts, shared, static, dyn, labels)


# ---------------------------------------------------------------------------------------------------
# execution


def _imm(text: str, t: str) -> np.ndarray | None:
    if text.startswith("0f") and len(text) == 10:
        return np.array([int(text[2:], 16)], np.uint32).view(np.float32)
    if text.startswith("0d") and len(text) == 18:
        return np.array([int(text[2:], 16)], np.uint64).view(np.float64)
    if re.fullmatch(r"-?(0x[0-9A-Fa-f]+|\d+)", text):
        v = int(text, 0)
        dt = np.dtype(_NP[t])
        if dt.kind == "f":
            return np.array([v], dt)
        bits = _BITS[t]
        return np.array([v & ((1 << bits) - 1)], _RAW[bits]).view(dt) if bits > 1 else np.array([bool(v)])
    return None


class _Launch:
    def __init__(self, kern: Kernel, grid, block, params: dict, memory: Memory, shared_bytes: int,
                 racecheck: bool, max_steps: int):
        self.k = kern
        self.mem = memory
        gx, gy, gz = (tuple(grid) + (1, 1))[:3]
        bx, by, bz = (tuple(block) + (1, 1))[:3]
        self.tpb = bx * by * bz
        self.nblocks = gx * gy * gz
        self.grid, self.block = (gx, gy, gz), (bx, by, bz)
        self.params = params
        self.smem_size = kern.static_shared + int(shared_bytes)
        self.racecheck = racecheck
        self.max_steps = max_steps

    # one batch of blocks
    def run_blocks(self, blocks: np.ndarray) -> None:
        k = self.k
        nb = blocks.size
        n = nb * self.tpb
        t = np.arange(n)
        local = t % self.tpb
        bidx = blocks[t // self.tpb]
        self.n = n
        self.block_of = t // self.tpb  # batch-local block index
        bx, by, _ = self.block
        gx, gy, _ = self.grid
        self.special = {
            "tid.x": (local % bx).astype(np.uint32), "tid.y": ((local // bx) % by).astype(np.uint32),
            "tid.z": (local // (bx * by)).astype(np.uint32),
            "ntid.x": np.full(n, bx, np.uint32), "ntid.y": np.full(n, by, np.uint32),
            "ntid.z": np.full(n, self.block[2], np.uint32),
            "ctaid.x": (bidx % gx).astype(np.uint32), "ctaid.y": ((bidx // gx) % gy).astype(np.uint32),
            "ctaid.z": (bidx // (gx * gy)).astype(np.uint32),
            "nctaid.x": np.full(n, gx, np.uint32), "nctaid.y": np.full(n, gy, np.uint32),
            "nctaid.z": np.full(n, self.grid[2], np.uint32),
            "laneid": (local % 32).astype(np.uint32), "warpid": (local // 32).astype(np.uint32),
        }
        self.lane = local % 32
        self.warp_global = t // 32 if self.tpb % 32 == 0 else None
        self.local = local
        self.regs: dict[str, np.ndarray] = {}
        self.smem = np.full((nb, max(self.smem_size, 1)), 0xFF, np.uint8)
        self.inflight = np.zeros(self.smem.shape, bool)  # shared bytes a cp.async will write
        self.pending: list[tuple] = []  # cp.async copies not landed yet: (threads, rows, cols, data, groups)
        self.cp_group = np.zeros(n, np.int64)  # per thread: the cp.async group now open (commit_group closes it)
        self.mbars: dict = {}  # (block, address) -> [expected arrivals, pending arrivals, tx bytes, phase parity]
        self.bulk: list = []  # bulk copies not landed: (block, mbar address, row, cols, data)
        if self.racecheck:
            self.writer = np.full((nb, max(self.smem_size, 1)), -1, np.int64)
            self.reader = np.full((nb, max(self.smem_size, 1)), -1, np.int64)
        pc = np.zeros(n, np.int64)
        alive = np.ones(n, bool)
        insts = k.insts
        steps = 0
        with np.errstate(all="ignore"):
            while alive.any():
                cur = int(pc[alive].min())
                mask = alive & (pc == cur)
                if cur >= len(insts):
                    raise EmulatorError("fell off the end of the kernel without ret")
                inst = insts[cur]
                steps += 1
                if steps > self.max_steps:
                    raise EmulatorError(f"more than {self.max_steps} steps: endless loop? at {inst.text}")
                act = mask
                if inst.guard is not None:
                    g = self._reg(inst.guard)
                    act = mask & (~g if inst.negate else g)
                if inst.op == "bra":
                    pc[act] = inst.target
                    pc[mask & ~act] += 1
                    continue
                if inst.op == "ret":
                    alive[act] = False
                    pc[mask & ~act] += 1
                    continue
                if inst.op == "bar":
                    self._barrier(inst, mask, alive, pc)
                elif act.any():
                    self._exec(inst, act, mask)
                pc[mask] += 1

    # registers
    def _reg(self, name: str) -> np.ndarray:
        try:
            return self.regs[name]
        except KeyError:
            raise EmulatorError(f"register {name} read before it was ever written") from None

    def _read(self, text: str, t: str) -> np.ndarray:
        """Operand as an array of type t (a register, an immediate, a special register or a symbol)."""
        if text.startswith("%"):
            key = text[1:]
            if key in self.special:
                return self.special[key].view(_NP[t]) if _BITS[t] == 32 else self.special[key].astype(_NP[t])
            raw = self._reg(text)
            want = np.dtype(_NP[t])
            if raw.dtype == np.bool_:
                return raw
            if raw.dtype.itemsize == want.itemsize:
                return raw.view(want)
            return raw.astype(want)  # e.g. cvt reading a narrower/wider class
        if text in self.k.shared:
            return np.full(self.n, self.k.shared[text][0], _NP[t])
        if text == self.k.dynamic_symbol:
            return np.full(self.n, self.k.static_shared, _NP[t])
        v = _imm(text, t)
        if v is None:
            raise EmulatorError(f"unknown operand {text!r}")
        return np.broadcast_to(v, (self.n,))

    def _write(self, name: str, value: np.ndarray, act: np.ndarray, t: str) -> None:
        bits = _BITS[t]
        value = np.asarray(value)
        if bits == 1:
            raw = value.astype(np.bool_)
        else:
            value = value.astype(_NP[t], copy=False) if value.dtype != _NP[t] else value
            raw = value.view(_RAW[bits])
        if name not in self.regs:
            self.regs[name] = np.zeros(self.n, raw.dtype)
        reg = self.regs[name]
        if reg.dtype != raw.dtype:
            if reg.dtype.itemsize == raw.dtype.itemsize:
                raw = raw.view(reg.dtype)
            else:
                raise EmulatorError(f"{name}: {t} value into a {reg.dtype} register")
        np.copyto(reg, np.broadcast_to(raw, reg.shape), where=act)

    # addresses
    def _addr(self, text: str, space: str) -> tuple[np.ndarray | str, int]:
        m = re.fullmatch(r"\[(\S+?)([+-]\d+)?\]", text)
        if not m:
            raise EmulatorError(f"cannot parse address {text!r}")
        base, off = m.group(1), int(m.group(2) or 0)
        if space == "param":
            return base, off
        if base.startswith("%"):
            t = "u32" if self._reg(base).dtype == np.uint32 else "u64"
            return self._read(base, t).astype(np.int64) + off, off
        return self._read(base, "u64").astype(np.int64) + off, off

    def _shared_idx(self, addrs: np.ndarray, nbytes: int, act: np.ndarray, inst: Inst) -> tuple[np.ndarray, np.ndarray]:
        a = addrs[act]
        if (a % nbytes).any():
            raise EmulatorError(f"misaligned shared access in {inst.text}")
        if (a < 0).any() or (a + nbytes > self.smem_size).any():
            bad = int(a[(a < 0) | (a + nbytes > self.smem_size)][0])
            raise EmulatorError(f"out-of-bounds shared access at {bad} (size {self.smem_size}) in {inst.text}")
        rows = self.block_of[act]
        cols = a[:, None] + np.arange(nbytes)[None, :]
        return rows, cols

    def _race(self, rows, cols, act, inst: Inst, write: bool) -> None:
        tids = self.local[act][:, None]
        r = np.broadcast_to(rows[:, None], cols.shape)
        w = self.writer[r, cols]
        conflict = (w >= 0) & (w != tids)
        if write:
            rd = self.reader[r, cols]
            conflict |= (rd >= 0) & (rd != tids)
            conflict |= rd == -2
        if conflict.any():
            i = np.argwhere(conflict)[0]
            kind = "write after read/write" if write else "read after write"
            raise EmulatorError(f"shared-memory race ({kind}) at byte {int(cols[tuple(i)])} by thread "
                                f"{int(tids[i[0], 0])} in {inst.text}")
        # several threads writing the same byte in one instruction is a race too
        if write:
            flat = (r.astype(np.int64) * self.smem_size + cols).reshape(-1)
            if np.unique(flat).size != flat.size:
                raise EmulatorError(f"shared-memory race: one byte written by several threads in {inst.text}")
            self.writer[r, cols] = tids
        else:
            prev = self.reader[r, cols]
            self.reader[r, cols] = np.where((prev == -1) | (prev == tids), tids, -2)

    def _barrier(self, inst: Inst, mask: np.ndarray, alive: np.ndarray, pc: np.ndarray) -> None:
        if inst.mods and inst.mods[0] == "warp":
            return self._warp_barrier(inst, mask)
        m2, a2 = mask.reshape(-1, self.tpb), alive.reshape(-1, self.tpb)
        here = m2.any(axis=1)
        partial = here & (m2 != a2).any(axis=1)
        if partial.any():
            b = int(np.flatnonzero(partial)[0])
            other = b * self.tpb + int(np.flatnonzero(a2[b] & ~m2[b])[0])
            raise EmulatorError(f"bar.sync reached by only part of block {b}: thread {int(self.local[other])} "
                                f"is at {self.k.insts[int(pc[other])].text!r}")
        if self.racecheck:
            self.writer[here] = -1
            self.reader[here] = -1

    def _warp_barrier(self, inst: Inst, mask: np.ndarray) -> None:
        """``bar.warp.sync 0xFFFFFFFF``: all 32 lanes of each warp standing here; afterwards the race
        records made by that warp are cleared (bytes written by other warps keep theirs)."""
        if int(inst.args[0], 0) & 0xFFFFFFFF != 0xFFFFFFFF or self.warp_global is None:
            raise EmulatorError(f"only full-mask bar.warp.sync in whole warps is emulated: {inst.text}")
        warps = self._whole_warps(inst, mask)
        if not self.racecheck:
            return
        for w in warps:
            t0 = int(w) * 32
            b = int(self.block_of[t0])
            lo = int(self.local[t0])
            wr, rd = self.writer[b], self.reader[b]
            mine_w = (wr >= lo) & (wr < lo + 32)
            mine_r = (rd >= lo) & (rd < lo + 32)
            # bytes read by several threads (-2) are cleared too unless another warp wrote them: a
            # race between warps through such a byte can go unreported (never a false report)
            clear = (mine_w | (wr == -1)) & (mine_r | (rd == -1) | (rd == -2))
            wr[clear] = -1
            rd[clear] = -1

    # instructions
    def _exec(self, inst: Inst, act: np.ndarray, mask: np.ndarray) -> None:
        op, mods, args = inst.op, inst.mods, inst.args
        t = mods[-1] if mods else ""
        if op in ("ld", "st"):
            return self._mem(inst, act)
        if op == "mov":
            if args[1].startswith("{"):  # pack: mov.b32 d, {lo, hi}
                parts = [x.strip() for x in args[1].strip("{}").split(",")]
                w = _BITS[t] // len(parts)
                acc = np.zeros(self.n, np.uint64)
                for i, p_ in enumerate(parts):
                    acc |= self._read(p_, f"b{w}").astype(np.uint64) << np.uint64(i * w)
                return self._write(args[0], acc.astype(_RAW[_BITS[t]]), act, f"b{_BITS[t]}")
            if args[0].startswith("{"):  # unpack: mov.b32 {lo, hi}, a
                parts = [x.strip() for x in args[0].strip("{}").split(",")]
                w = _BITS[t] // len(parts)
                v = self._read(args[1], f"b{_BITS[t]}").astype(np.uint64)
                for i, p_ in enumerate(parts):
                    part = (v >> np.uint64(i * w)) & np.uint64((1 << w) - 1)
                    self._write(p_, part.astype(_RAW[w]), act, f"b{w}")
                return None
            return self._write(args[0], self._read(args[1], t), act, t)
        if op == "prmt":
            a = self._read(args[1], "u32").astype(np.uint64)
            b = self._read(args[2], "u32").astype(np.uint64)
            sel = self._read(args[3], "u32").astype(np.uint64)
            both = a | (b << np.uint64(32))
            res = np.zeros(self.n, np.uint64)
            for i in range(4):
                s_ = (sel >> np.uint64(4 * i)) & np.uint64(0xF)
                byte = (both >> ((s_ & np.uint64(7)) * np.uint64(8))) & np.uint64(0xFF)
                byte = np.where(s_ & np.uint64(8), np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0)), byte)
                res |= byte << np.uint64(8 * i)
            return self._write(args[0], res.astype(np.uint32), act, "b32")
        if op == "shf":
            lo = self._read(args[1], "u32").astype(np.uint64)
            hi = self._read(args[2], "u32").astype(np.uint64)
            n_ = self._read(args[3], "u32").astype(np.uint64)
            n_ = np.minimum(n_, 32) if mods[1] == "clamp" else n_ & np.uint64(31)
            both = lo | (hi << np.uint64(32))
            if mods[0] == "l":
                res = ((both << n_) >> np.uint64(32)) & np.uint64(0xFFFFFFFF)
            else:
                res = (both >> n_) & np.uint64(0xFFFFFFFF)
            return self._write(args[0], res.astype(np.uint32), act, "b32")
        if op == "bfe":
            bits = _BITS[t]
            x = self._read(args[1], f"b{bits}").astype(np.uint64)
            pos = self._read(args[2], "u32").astype(np.int64) & 0xFF
            ln = self._read(args[3], "u32").astype(np.int64) & 0xFF
            if bits != 32:
                raise EmulatorError(f"only 32-bit bfe is emulated: {inst.text}")
            p_ = np.minimum(pos, 31)
            field_ = (x >> p_.astype(np.uint64)) & ((np.uint64(1) << np.minimum(ln, 32).astype(np.uint64)) - np.uint64(1))
            field_ = np.where((ln == 0) | (pos > 31), 0, field_).astype(np.uint64)
            if t.startswith("s"):
                top = np.minimum(pos + ln - 1, 31)
                sign = ((x >> top.astype(np.uint64)) & np.uint64(1)) == 1
                ext = ~((np.uint64(1) << np.minimum(ln, 32).astype(np.uint64)) - np.uint64(1)) & np.uint64(0xFFFFFFFF)
                field_ = np.where(sign & (ln > 0), field_ | ext, field_)
            return self._write(args[0], field_.astype(np.uint32), act, "b32")
        if op == "cvta":
            return self._write(args[0], self._read(args[1], "u64"), act, "u64")
        if op in ("add", "sub", "mul", "div", "rem", "min", "max", "and", "or", "xor", "shl", "shr"):
            return self._binary(inst, act)
        if op in ("mad", "fma"):
            return self._ternary(inst, act)
        if op in ("ex2", "lg2", "rcp", "sqrt", "rsqrt", "neg", "abs", "not", "sin", "cos"):
            return self._unary(inst, act)
        if op == "setp":
            cmp, ty = mods[0], mods[1]
            a, b = self._read(args[1], ty), self._read(args[2], ty)
            res = {"eq": a == b, "lt": a < b, "le": a <= b, "gt": a > b, "ge": a >= b, "ne": a != b,
                   "nan": np.isnan(a) | np.isnan(b) if ty.startswith("f") else a != a}[cmp]
            if ty.startswith("f") and cmp == "ne":
                res = res & ~np.isnan(a) & ~np.isnan(b)
            return self._write(args[0], res, act, "pred")
        if op == "selp":
            a, b, p = self._read(args[1], t), self._read(args[2], t), self._reg(args[3])
            return self._write(args[0], np.where(p, a, b), act, t)
        if op == "cvt":
            return self._cvt(inst, act)
        if op == "shfl":
            return self._shfl(inst, act, mask)
        if op == "redux":
            return self._redux(inst, act)
        if op == "ldmatrix":
            return self._ldmatrix(inst, act)
        if op == "mma":
            return self._mma(inst, act)
        if op == "createpolicy":  # an opaque L2 cache policy: only hints take it
            return self._write(inst.args[0], np.zeros(self.n, np.uint64), act, "b64")
        if op == "griddepcontrol":  # programmatic dependent launch: one grid at a time here, a no-op
            return
        if op == "membar" or op == "fence":
            return None
        if op == "cp" and mods[:4] == ["async", "bulk", "prefetch", "L2"]:
            return self._prefetch(inst, act)
        if op == "cp" and mods[:2] == ["async", "bulk"]:
            return self._cp_bulk(inst, act)
        if op == "cp" and mods[0] == "async":
            return self._cp_async(inst, act)
        if op == "mbarrier":
            return self._mbarrier(inst, act)
        if op in ("atom", "red"):
            return self._atom(inst, act)
        raise EmulatorError(f"instruction not implemented by the emulator: {inst.text}")

    def _binary(self, inst: Inst, act: np.ndarray) -> None:
        op, mods, args = inst.op, inst.mods, inst.args
        t = mods[-1]
        if op == "mul" and mods[0] == "wide":
            wide = "u64" if t.startswith("u") else "s64"
            a = self._read(args[1], t).astype(_NP[wide])
            b = self._read(args[2], t).astype(_NP[wide])
            return self._write(args[0], a * b, act, wide)
        if op in ("shl", "shr"):
            a = self._read(args[1], t)
            n = self._read(args[2], "u32").astype(np.int64)
            bits = _BITS[t]
            if op == "shl":
                res = np.where(n >= bits, 0, a.astype(_RAW[bits]) << np.minimum(n, bits - 1).astype(_RAW[bits]))
                return self._write(args[0], res.astype(_RAW[bits]), act, "b%d" % bits if t.startswith("b") else t)
            if t.startswith("s"):
                res = a >> np.minimum(n, bits - 1).astype(a.dtype)
            else:
                res = np.where(n >= bits, 0, a >> np.minimum(n, bits - 1).astype(a.dtype))
            return self._write(args[0], res.astype(a.dtype), act, t)
        if t == "pred":
            a, b = self._reg(args[1]), self._reg(args[2])
            res = {"and": a & b, "or": a | b, "xor": a ^ b}[op]
            return self._write(args[0], res, act, "pred")
        a, b = self._read(args[1], t), self._read(args[2], t)
        if op == "add":
            res = a + b
        elif op == "sub":
            res = a - b
        elif op == "mul":
            if "hi" in mods:
                bits = _BITS[t]
                wide = np.int64 if t.startswith("s") else np.uint64
                if bits == 32:
                    res = ((a.astype(wide) * b.astype(wide)) >> 32).astype(a.dtype)
                else:
                    raise EmulatorError(f"mul.hi.{t} not implemented")
            else:
                res = a * b
        elif op == "div":
            if t.startswith("f"):
                res = a / b
            elif t.startswith("s"):
                res = np.where(b == 0, -1, np.trunc(a.astype(np.float64) / np.where(b == 0, 1, b)).astype(a.dtype))
            else:
                res = np.where(b == 0, np.iinfo(a.dtype).max, a // np.where(b == 0, 1, b))
        elif op == "rem":
            if t.startswith("s"):
                res = np.fmod(a, np.where(b == 0, 1, b))
            else:
                res = a % np.where(b == 0, 1, b)
        elif op == "min":
            res = np.fmin(a, b) if t.startswith("f") else np.minimum(a, b)
        elif op == "max":  # max.f32 ignores a NaN operand, max.NaN.f32 returns it
            res = (np.maximum(a, b) if "NaN" in mods else np.fmax(a, b)) if t.startswith("f") else np.maximum(a, b)
        elif op in ("and", "or", "xor"):
            ua, ub = a.view(_RAW[_BITS[t]]), b.view(_RAW[_BITS[t]])
            res = {"and": ua & ub, "or": ua | ub, "xor": ua ^ ub}[op].view(a.dtype)
        else:
            raise EmulatorError(f"unsupported {inst.text}")
        self._write(args[0], np.asarray(res).astype(a.dtype, copy=False), act, t)

    def _ternary(self, inst: Inst, act: np.ndarray) -> None:
        op, mods, args = inst.op, inst.mods, inst.args
        t = mods[-1]
        if op == "fma" or (op == "mad" and t.startswith("f")):
            a, b, c = (self._read(x, t).astype(np.float64) for x in args[1:4])
            return self._write(args[0], (a * b + c).astype(_NP[t]), act, t)
        if mods[0] == "wide":
            wide = "u64" if t.startswith("u") else "s64"
            a = self._read(args[1], t).astype(_NP[wide])
            b = self._read(args[2], t).astype(_NP[wide])
            c = self._read(args[3], wide)
            return self._write(args[0], a * b + c, act, wide)
        if mods[0] == "lo":
            a, b, c = (self._read(x, t) for x in args[1:4])
            return self._write(args[0], a * b + c, act, t)
        raise EmulatorError(f"unsupported {inst.text}")

    def _unary(self, inst: Inst, act: np.ndarray) -> None:
        op, mods, args = inst.op, inst.mods, inst.args
        t = mods[-1]
        a = self._read(args[1], t) if t != "pred" else self._reg(args[1])
        if op == "ex2":
            res = np.exp2(a.astype(np.float32))
        elif op == "lg2":
            res = np.log2(a)
        elif op == "rcp":
            res = (np.float32(1.0) / a) if t == "f32" else 1.0 / a
        elif op == "sqrt":
            res = np.sqrt(a)
        elif op == "rsqrt":
            res = (1.0 / np.sqrt(a.astype(np.float64))).astype(a.dtype)
        elif op == "sin":
            res = np.sin(a.astype(np.float64)).astype(a.dtype)
        elif op == "cos":
            res = np.cos(a.astype(np.float64)).astype(a.dtype)
        elif op == "neg":
            res = -a
        elif op == "abs":
            res = np.abs(a)
        elif op == "not":
            res = ~a
        else:
            raise EmulatorError(f"unsupported {inst.text}")
        self._write(args[0], res, act, t)

    def _cvt(self, inst: Inst, act: np.ndarray) -> None:
        mods, args = inst.mods, inst.args
        dst, src = mods[-2], mods[-1]
        rnd = mods[0] if len(mods) == 3 else None
        a = self._read(args[1], src)
        if dst.startswith(("u", "s")) and src.startswith("f"):
            x = a.astype(np.float64)
            x = {"rzi": np.trunc, "rni": np.rint, "rmi": np.floor, "rpi": np.ceil, None: np.trunc}[rnd](x)
            info = np.iinfo(_NP[dst])
            res = np.clip(np.nan_to_num(x, nan=0), info.min, info.max).astype(_NP[dst])
        else:
            res = a.astype(_NP[dst])
        self._write(args[0], res, act, dst)

    def _shfl(self, inst: Inst, act: np.ndarray, mask: np.ndarray) -> None:
        mode = inst.mods[1]
        d, a, b, c, membermask = inst.args
        if int(membermask, 0) & 0xFFFFFFFF != 0xFFFFFFFF:
            raise EmulatorError(f"only full-mask shuffles are emulated: {inst.text}")
        self._whole_warps(inst, act)
        val = self._read(a, "b32")
        bb = self._read(b, "u32").astype(np.int64)
        cc = self._read(c, "u32").astype(np.int64)
        lane = self.lane
        clamp = cc & 0x1F
        segmask = (cc >> 8) & 0x1F
        max_lane = (lane & segmask) | (clamp & ~segmask)
        min_lane = lane & segmask
        if mode == "bfly":
            j = lane ^ bb
            ok = j <= max_lane
        elif mode == "down":
            j = lane + bb
            ok = j <= max_lane
        elif mode == "up":
            j = lane - bb
            ok = j >= max_lane
        else:  # idx
            j = min_lane | (bb & ~segmask)
            ok = j <= max_lane
        j = np.where(ok, j, lane)
        src = np.arange(self.n) - lane + j
        self._write(d, val[src], act, "b32")

    def _redux(self, inst: Inst, act: np.ndarray) -> None:
        """``redux.sync.<op>.<type>`` over full warps (every lane gets the warp's result)."""
        rop, ty = inst.mods[1], inst.mods[2]
        d, a, membermask = inst.args
        if int(membermask, 0) & 0xFFFFFFFF != 0xFFFFFFFF:
            raise EmulatorError(f"only full-mask reductions are emulated: {inst.text}")
        self._whole_warps(inst, act)
        val = self._read(a, ty).astype(np.int64).reshape(-1, 32)
        fn = {"add": lambda v: v.sum(axis=1), "min": lambda v: v.min(axis=1), "max": lambda v: v.max(axis=1),
              "and": lambda v: np.bitwise_and.reduce(v, axis=1), "or": lambda v: np.bitwise_or.reduce(v, axis=1),
              "xor": lambda v: np.bitwise_xor.reduce(v, axis=1)}[rop]
        res = np.repeat(fn(val), 32) & 0xFFFFFFFF
        if ty == "s32":
            res = np.where(res >= 2**31, res - 2**32, res)
        self._write(d, res.astype(_NP[ty]), act, ty)

    def _whole_warps(self, inst: Inst, act: np.ndarray) -> np.ndarray:
        """The warps executing a warp-collective instruction (all 32 lanes of each, or an error)."""
        if self.warp_global is None:
            raise EmulatorError(f"warp-collective instruction in a block whose size is not a multiple of 32: {inst.text}")
        a32 = act.reshape(-1, 32)
        bad = a32.any(axis=1) & ~a32.all(axis=1)
        if bad.any():
            w = int(np.flatnonzero(bad)[0])
            raise EmulatorError(f"{inst.op}{'.' + inst.mods[0] if inst.mods else ''} reached by {int(a32[w].sum())} of "
                                f"32 lanes (warp {w}): {inst.text}")
        return np.flatnonzero(a32.all(axis=1))

    @staticmethod
    def _reg_list(text: str) -> list[str]:
        return [x.strip() for x in text.strip("{}").split(",")]

    def _ldmatrix(self, inst: Inst, act: np.ndarray) -> None:
        """``ldmatrix.sync.aligned.m8n8.x4.shared.b16``: lane 8j + r addresses row r of matrix j (16
        bytes); lane l gets bytes 4 (l % 4) .. + 3 of row l / 4 of each matrix."""
        if inst.mods != ["sync", "aligned", "m8n8", "x4", "shared", "b16"]:
            raise EmulatorError(f"ldmatrix form not emulated: {inst.text}")
        warps = self._whole_warps(inst, act)
        addrs, _ = self._addr(inst.args[1], "shared")
        if (addrs[act] % 16).any():
            raise EmulatorError(f"ldmatrix row address not 16-byte aligned: {inst.text}")
        rows, cols = self._shared_idx(addrs, 16, act, inst)  # [n_act, 16]
        self._check_landed(rows, cols, inst)
        if self.racecheck:
            self._race(rows, cols, act, inst, write=False)
        data = np.zeros((self.n, 16), np.uint8)
        data[act] = self.smem[rows[:, None], cols]
        dests = self._reg_list(inst.args[0])
        lane = np.arange(32)
        for w in warps:
            base = 32 * w
            for j, d in enumerate(dests):
                src_rows = data[base + 8 * j + lane // 4]  # [32, 16]: the row each lane reads from
                words = np.stack([src_rows[i, 4 * (i % 4): 4 * (i % 4) + 4] for i in range(32)]).copy().view(np.uint32)[:, 0]
                full = self._reg(d).copy() if d in self.regs else np.zeros(self.n, np.uint32)
                full[base:base + 32] = words
                who = np.zeros(self.n, bool)
                who[base:base + 32] = True
                self._write(d, full, who, "b32")

    def _mma(self, inst: Inst, act: np.ndarray) -> None:
        """``mma.sync.aligned.m16n8k32.row.col.s32.{s8,u8}.s8.s32``, exact int32 (wrapping) arithmetic."""
        if (inst.mods[:6] != ["sync", "aligned", "m16n8k32", "row", "col", "s32"] or inst.mods[6] not in ("s8", "u8")
                or inst.mods[7:] != ["s8", "s32"]):
            raise EmulatorError(f"mma form not emulated: {inst.text}")
        a_type = np.uint8 if inst.mods[6] == "u8" else np.int8
        warps = self._whole_warps(inst, act)
        dn, an, bn, cn = (self._reg_list(x) for x in inst.args)
        a = [self._read(x, "b32").astype(np.uint32) for x in an]
        b = [self._read(x, "b32").astype(np.uint32) for x in bn]
        c = [self._read(x, "s32").astype(np.int64) for x in cn]
        lane = np.arange(32)
        g, t = lane // 4, lane % 4
        out = [np.zeros(self.n, np.int64) for _ in range(4)]
        for w in warps:
            base = 32 * w
            A = np.zeros((16, 32), np.int64)
            B = np.zeros((32, 8), np.int64)
            sb = lambda v, ty=np.int8: v[base:base + 32].copy().view(ty).reshape(32, 4).astype(np.int64)  # noqa: E731
            a_b = [sb(x, a_type) for x in a]
            b_b = [sb(x) for x in b]
            for i in range(32):
                A[g[i], 4 * t[i]:4 * t[i] + 4] = a_b[0][i]
                A[g[i] + 8, 4 * t[i]:4 * t[i] + 4] = a_b[1][i]
                A[g[i], 16 + 4 * t[i]:20 + 4 * t[i]] = a_b[2][i]
                A[g[i] + 8, 16 + 4 * t[i]:20 + 4 * t[i]] = a_b[3][i]
                B[4 * t[i]:4 * t[i] + 4, g[i]] = b_b[0][i]
                B[16 + 4 * t[i]:20 + 4 * t[i], g[i]] = b_b[1][i]
            D = A @ B
            for i in range(32):
                for k, (r, col) in enumerate(((g[i], 2 * t[i]), (g[i], 2 * t[i] + 1), (g[i] + 8, 2 * t[i]),
                                              (g[i] + 8, 2 * t[i] + 1))):
                    out[k][base + i] = D[r, col] + c[k][base + i]
        for k, d in enumerate(dn):
            wrapped = ((out[k] + (1 << 31)) % (1 << 32) - (1 << 31)).astype(np.int32)
            self._write(d, wrapped, act, "s32")

    def _prefetch(self, inst: Inst, act: np.ndarray) -> None:
        """An L2 prefetch changes nothing, but its whole range must lie inside one allocation (a
        stray prefetch is a bug even where the hardware would drop it) and be 16-byte granular."""
        addrs, _ = self._addr(inst.args[0], "global")
        sizes = self._read(inst.args[1], "u32").astype(np.int64)
        for a, n in zip(addrs[act], sizes[act]):
            if n % 16 or a % 16:
                raise EmulatorError(f"bulk prefetch of {int(n)} bytes at {int(a):#x} is not 16-byte granular: "
                                    f"{inst.text}")
            off = int(a) - HEAP_BASE
            if n and (off < 0 or off + n > self.mem.heap.size or not self.mem.valid[off:off + n].all()):
                raise EmulatorError(f"bulk prefetch of {int(n)} bytes at {int(a):#x} leaves its allocation "
                                    f"({self.mem._describe(int(a))}): {inst.text}")

    def _cp_async(self, inst: Inst, act: np.ndarray) -> None:
        """``cp.async.{ca,cg}.shared.global [dst], [src], 16``: the global bytes are read (and checked)
        now and land in shared memory at the issuing thread's ``cp.async.wait_all`` (or
        ``commit_group`` + ``wait_group 0``), as that thread's write; touching them before is an error."""
        kind = inst.mods[1]
        if kind == "commit_group":
            self.cp_group[act] += 1
            return
        if kind == "wait_all":
            return self._land(inst, act, None)
        if kind == "wait_group":  # every group but the newest N committed ones lands
            return self._land(inst, act, self.cp_group - int(inst.args[0]))
        hints = inst.mods[4:]  # L2 hints change no result: a cache policy operand, a prefetch size
        policy = "L2::cache_hint" in hints
        if (kind not in ("ca", "cg") or inst.mods[2:4] != ["shared", "global"] or len(inst.args) != 3 + policy
                or not set(hints) <= {"L2::cache_hint", "L2::64B", "L2::128B", "L2::256B"}):
            raise EmulatorError(f"cp.async form not emulated: {inst.text}")
        if policy:
            self._read(inst.args[3], "b64")  # (defined, like any operand)
        size = int(inst.args[2])
        dst, _ = self._addr(inst.args[0], "shared")
        src, _ = self._addr(inst.args[1], "global")
        data = self.mem.gather(src[act], size, inst.text)
        rows, cols = self._shared_idx(dst, size, act, inst)
        self._check_landed(rows, cols, inst)
        self.inflight[rows[:, None], cols] = True
        tids = np.flatnonzero(act)
        self.pending.append((tids, rows, cols, data, self.cp_group[tids].copy()))

    def _cp_bulk(self, inst: Inst, act: np.ndarray) -> None:
        """``cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [dst], [src], n, [mbar]``:
        the global bytes are read now (and checked) and land when a thread waits on the barrier; the
        destination may not be touched before (the issuing thread's write, for the race check)."""
        hint = inst.mods[5:] == ["L2::cache_hint"]  # an L2 policy operand after [mbar]: changes no result
        if inst.mods[:5] != ["async", "bulk", "shared::cluster", "global", "mbarrier::complete_tx::bytes"] or \
                inst.mods[5:] not in ([], ["L2::cache_hint"]) or len(inst.args) != 4 + hint:
            raise EmulatorError(f"bulk copy form not emulated: {inst.text}")
        if hint:
            self._read(inst.args[4], "b64")
        size = int(inst.args[2])
        dst, _ = self._addr(inst.args[0], "shared")
        src, _ = self._addr(inst.args[1], "global")
        bar, _ = self._addr(inst.args[3], "shared")
        if size % 16 or (dst[act] % 16).any() or (src[act] % 16).any():
            raise EmulatorError(f"bulk copy not 16-byte granular: {inst.text}")
        data = np.concatenate([self.mem.gather(src[act] + 16 * q, 16, inst.text) for q in range(size // 16)], axis=1)
        a = dst[act]
        if (a < 0).any() or (a + size > self.smem_size).any():
            raise EmulatorError(f"out-of-bounds bulk copy into shared memory: {inst.text}")
        rows = self.block_of[act]
        cols = a[:, None] + np.arange(size)[None, :]
        self._check_landed(rows, cols, inst)
        if self.racecheck:
            self._race(rows, cols, act, inst, write=True)
        self.inflight[rows[:, None], cols] = True
        for i, (r, b) in enumerate(zip(rows, bar[act])):
            if (int(r), int(b)) not in self.mbars:
                raise EmulatorError(f"bulk copy completing on an uninitialised mbarrier: {inst.text}")
            self.bulk.append((int(r), int(b), cols[i], data[i]))

    def _mbarrier(self, inst: Inst, act: np.ndarray) -> None:
        kind = inst.mods[0]
        tids = np.flatnonzero(act)
        if kind == "init":
            addrs, _ = self._addr(inst.args[0], "shared")
            for t_ in tids:
                self.mbars[(int(self.block_of[t_]), int(addrs[t_]))] = [int(inst.args[1])] * 2 + [0, 0]
            return None
        if kind == "arrive" and inst.mods[1] == "expect_tx":
            addrs, _ = self._addr(inst.args[1], "shared")
            tx = self._read(inst.args[2], "u32")
            for t_ in tids:
                b = self._bar_state(int(self.block_of[t_]), int(addrs[t_]), inst)
                b[2] += int(tx[t_])
                b[1] -= 1
                self._bar_complete(b)
            return None
        if kind == "try_wait" and inst.mods[1] == "parity":
            addrs, _ = self._addr(inst.args[1], "shared")
            parity = self._read(inst.args[2], "u32")
            res = np.zeros(self.n, bool)
            for t_ in tids:
                key = (int(self.block_of[t_]), int(addrs[t_]))
                b = self._bar_state(*key, inst)
                self._land_bulk(key, b)
                res[t_] = b[3] != (int(parity[t_]) & 1)
            return self._write(inst.args[0], res, act, "pred")
        raise EmulatorError(f"mbarrier form not emulated: {inst.text}")

    def _bar_state(self, block: int, addr: int, inst: Inst) -> list:
        b = self.mbars.get((block, addr))
        if b is None:
            raise EmulatorError(f"mbarrier at {addr} used before mbarrier.init: {inst.text}")
        return b

    @staticmethod
    def _bar_complete(b: list) -> None:
        if b[1] == 0 and b[2] == 0:  # all arrivals and bytes: the phase completes
            b[3] ^= 1
            b[1] = b[0]

    def _land_bulk(self, key: tuple, b: list) -> None:
        """Land the bulk copies of barrier ``key``; their bytes complete its transaction count. The
        bytes become clean for the race check (the wait orders them before every waiter's reads)."""
        keep = []
        for blk, bar, cols, data in self.bulk:
            if (blk, bar) != key:
                keep.append((blk, bar, cols, data))
                continue
            self.smem[blk, cols] = data
            self.inflight[blk, cols] = False
            if self.racecheck:
                self.writer[blk, cols] = -1
                self.reader[blk, cols] = -1
            b[2] -= cols.size
        self.bulk = keep
        self._bar_complete(b)

    def _land(self, inst: Inst, act: np.ndarray, before: np.ndarray | None) -> None:
        """Land the pending copies of the threads in ``act`` (those of groups < ``before[thread]``)."""
        keep = []
        for tids, rows, cols, data, groups in self.pending:
            mine = act[tids]
            if before is not None:
                mine = mine & (groups < before[tids])
            if mine.any():
                who = np.zeros(self.n, bool)
                who[tids[mine]] = True
                self.inflight[rows[mine][:, None], cols[mine]] = False
                if self.racecheck:
                    self._race(rows[mine], cols[mine], who, inst, write=True)
                self.smem[rows[mine][:, None], cols[mine]] = data[mine]
            if (~mine).any():
                keep.append((tids[~mine], rows[~mine], cols[~mine], data[~mine], groups[~mine]))
        self.pending = keep

    def _check_landed(self, rows: np.ndarray, cols: np.ndarray, inst: Inst) -> None:
        if self.pending and self.inflight[rows[:, None], cols].any():
            raise EmulatorError(f"shared memory touched while a cp.async to it has not landed (no "
                                f"cp.async.wait_all + barrier in between): {inst.text}")

    def _atom(self, inst: Inst, act: np.ndarray) -> None:
        space, op, t = inst.mods[0], inst.mods[1], inst.mods[-1]
        if space != "global":
            raise EmulatorError(f"only global atomics are emulated: {inst.text}")
        ret = inst.op == "atom"
        addr_text = inst.args[1] if ret else inst.args[0]
        addrs, _ = self._addr(addr_text, "global")
        vals = self._read(inst.args[2] if ret else inst.args[1], t)
        cmp = self._read(inst.args[3], t) if ret and op == "cas" else None
        nbytes = _BITS[t] // 8
        old_all = np.zeros(self.n, _NP[t])
        for i in np.flatnonzero(act):
            a = np.array([addrs[i]])
            old = self.mem.gather(a, nbytes, inst.text).view(_NP[t])[0, 0]
            if op == "add":
                new = old + vals[i]
            elif op == "cas":
                new = vals[i] if old == cmp[i] else old
            elif op == "exch":
                new = vals[i]
            elif op == "max":
                new = max(old, vals[i])
            elif op == "min":
                new = min(old, vals[i])
            else:
                raise EmulatorError(f"unsupported atomic {inst.text}")
            self.mem.scatter(a, np.array([new], _NP[t]).view(np.uint8).reshape(1, -1), inst.text)
            old_all[i] = old
        if ret:
            self._write(inst.args[0], old_all, act, t)

    def _mem(self, inst: Inst, act: np.ndarray) -> None:
        mods = inst.mods
        space = mods[0]
        t = mods[-1]
        vec = 1
        for m_ in mods:
            if m_ in ("v2", "v4"):
                vec = int(m_[1])
        size = _BITS[t] // 8
        if inst.op == "ld":
            dst_text, addr_text = inst.args
            dests = [x.strip() for x in dst_text.strip("{}").split(",")]
            if space == "param":
                base, off = self._addr(addr_text, "param")
                pname = base[len(self.k.name) + len("_param_"):]
                if pname not in self.params:
                    raise EmulatorError(f"parameter {pname} was not passed")
                val = np.array([self.params[pname]]).astype(_NP[t])
                return self._write(dests[0], np.broadcast_to(val, (self.n,)), act, t)
            addrs, _ = self._addr(addr_text, space)
            nbytes = size * vec
            if space == "global":
                data = self.mem.gather(addrs[act], nbytes, inst.text)
            elif space == "shared":
                rows, cols = self._shared_idx(addrs, nbytes, act, inst)
                self._check_landed(rows, cols, inst)
                if self.racecheck:
                    self._race(rows, cols, act, inst, write=False)
                data = self.smem[rows[:, None], cols]
            else:
                raise EmulatorError(f"unsupported space in {inst.text}")
            vals = np.ascontiguousarray(data).view(_NP[t]).reshape(-1, vec)
            wt = t
            if _BITS[t] == 8:  # ld of an 8-bit type fills a 16-bit register, sign- or zero-extended
                wt = "s16" if t == "s8" else "u16"
                vals = vals.astype(_NP[wt])
            for e, dname in enumerate(dests):
                full = np.zeros(self.n, _NP[wt])
                full[act] = vals[:, e]
                self._write(dname, full, act, wt)
            return None
        addr_text, src_text = inst.args
        srcs = [x.strip() for x in src_text.strip("{}").split(",")]
        addrs, _ = self._addr(addr_text, space)
        vals = np.stack([np.asarray(self._read(s, t))[act] for s in srcs], axis=1).astype(_NP[t])
        data = np.ascontiguousarray(vals).view(np.uint8).reshape(vals.shape[0], -1)
        if space == "global":
            self.mem.scatter(addrs[act], data, inst.text)
        elif space == "shared":
            rows, cols = self._shared_idx(addrs, data.shape[1], act, inst)
            self._check_landed(rows, cols, inst)
            if self.racecheck:
                self._race(rows, cols, act, inst, write=True)
            self.smem[rows[:, None], cols] = data
        else:
            raise EmulatorError(f"unsupported space in {inst.text}")


_PARSED: dict[str, Kernel] = {}


def run(ptx: str, grid, block, params: dict, memory: Memory, shared_bytes: int = 0, racecheck: bool = True,
        max_steps: int = 2_000_000, batch_threads: int = 1 << 15) -> None:
    """Execute the kernel in ``ptx`` on ``memory``. ``params`` maps parameter names to ints/floats
    (device pointers are addresses from ``memory``)."""
    kern = _PARSED.get(ptx)
    if kern is None:
        kern = _PARSED[ptx] = parse(ptx)
    missing = [p for p, _ in kern.params if p not in params]
    if missing:
        raise EmulatorError(f"missing kernel parameters {missing}")
    launch = _Launch(kern, grid, block, params, memory, shared_bytes, racecheck, max_steps)
    per_batch = max(1, batch_threads // launch.tpb)
    for b0 in range(0, launch.nblocks, per_batch):
        launch.run_blocks(np.arange(b0, min(launch.nblocks, b0 + per_batch)))


# ---------------------------------------------------------------------------------------------------
# a stand-in for ``realizar.cuda`` that runs launches on the emulator (CPU tests of host code)


class FakeCuda:
    """The subset of :mod:`realizar.cuda` the attention executor uses, backed by :class:`Memory`.

    ``monkeypatch.setattr(realizar.executor, "cuda", FakeCuda())`` runs the executor's real kernels
    and argument packing on the CPU; every launch is recorded in ``launches``."""

    def __init__(self, sm_count: int = 132, free_bytes: int = 8 << 30, racecheck: bool = True):
        from ptx_gen.target import Target

        fake = self
        self.memory = Memory()
        self.launches: list[tuple] = []
        self.racecheck = racecheck

        class Device:
            ordinal = 0
            name = "emulated sm_90"
            target = Target("sm_90")

            def __init__(self):
                self.sm_count = sm_count

            def memory_info(self):
                return free_bytes, free_bytes

            def synchronize(self):
                pass

        class GpuBuffer:
            def __init__(self, count, dtype=np.float32, device=None):
                count = int(count)
                if count <= 0:
                    raise ValueError(f"GpuBuffer needs a positive element count, got {count}")
                self.dtype = np.dtype(dtype)
                self.count = count
                self.nbytes = count * self.dtype.itemsize
                self._ptr = fake.memory.alloc(self.nbytes)
                self.alive = True

            @property
            def ptr(self):
                if not self.alive:
                    raise EmulatorError("use of a freed GpuBuffer")
                return self._ptr

            @classmethod
            def from_numpy(cls, array, stream=None):
                array = np.ascontiguousarray(array)
                buf = cls(array.size, array.dtype)
                buf.copy_from_host(array)
                return buf

            @classmethod
            def zeros(cls, count, dtype=np.float32):
                buf = cls(count, dtype)
                buf.fill_bytes(0)
                return buf

            def free(self):
                if self.alive:
                    fake.memory.free(self._ptr)
                    self.alive = False

            close = free

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.free()

            def copy_from(self, other, count=None, src_offset=0, dst_offset=0, stream=None):
                count = min(other.count - src_offset, self.count - dst_offset) if count is None else count
                size = self.dtype.itemsize
                data = fake.memory.read_bytes(other.ptr + src_offset * size, count * size)
                fake.memory.write_bytes(self.ptr + dst_offset * size, data)

            def copy_from_host_at(self, array, offset=0, stream=None):
                array = np.ascontiguousarray(array, dtype=self.dtype).reshape(-1)
                if offset + array.size > self.count:
                    raise ValueError("copy_from_host_at: does not fit")
                fake.memory.write_bytes(self.ptr + offset * self.dtype.itemsize, array.view(np.uint8))

            def copy_from_host(self, array, stream=None):
                array = np.asarray(array)
                if array.size != self.count:
                    raise ValueError(f"copy_from_host: buffer holds {self.count} elements, array has {array.size}")
                self.copy_from_host_at(array, 0, stream)

            def copy_to_host_at(self, offset=0, count=None, out=None, stream=None):
                count = (out.size if out is not None else self.count - offset) if count is None else count
                data = fake.memory.read(self.ptr + offset * self.dtype.itemsize, self.dtype, count)
                if out is None:
                    return data.copy()
                out.reshape(-1)[:] = data
                return out

            def copy_to_host(self, out=None, stream=None):
                return self.copy_to_host_at(0, self.count, out, stream)

            def to_numpy(self, shape=None):
                host = self.copy_to_host()
                return host.reshape(shape) if shape is not None else host

            def fill_bytes(self, value, stream=None):
                fake.memory.fill(self.ptr, value, self.nbytes)

            def poison(self, stream=None):
                self.fill_bytes(0xFF)

        class Kernel:
            def __init__(self, source):
                self.source = source

            @property
            def name(self):
                return self.source.name

            @property
            def meta(self):
                return self.source.meta

            def args(self, *values, **named):
                from realizar.cuda.args import KernelArgs

                return KernelArgs(self.source.params, *values, **named)

        class Cache:
            def __init__(self):
                self.kernels = {}

            def get(self, name, **shape):
                from ptx_gen.catalog import emit

                src = emit(name, target="sm_90", **shape)
                return self.kernels.setdefault(src.key, Kernel(src))

        class Stream:
            def __init__(self, device=None):
                pass

            @classmethod
            def null(cls, device=None):
                return cls()

            def synchronize(self):
                pass

        self.Device, self.GpuBuffer, self.Stream = Device, GpuBuffer, Stream
        self._device = Device()
        self._cache = Cache()
        _fake_extras(self)

    def current_device(self):
        return self._device

    def module_cache(self, device=None):
        return self._cache

    def is_available(self):
        return True

    def launch(self, kernel, grid, block, args, shared_bytes=0, stream=None):
        if args.params != kernel.source.params:
            raise EmulatorError(f"arguments {args.signature} do not match kernel {kernel.name}")
        params = {p.name: args.get(p.name) for p in args.params}
        grid = (grid,) if isinstance(grid, int) else tuple(grid)
        block = (block,) if isinstance(block, int) else tuple(block)
        self.launches.append((kernel.name, grid, block, shared_bytes, dict(params)))
        run(kernel.source.ptx, grid, block, params, self.memory, shared_bytes, racecheck=self.racecheck)


def _fake_extras(fake: FakeCuda) -> None:
    """Events (zero time), stream capture (records launches, replays them) for smoke tests of tools."""

    class Event:
        def __init__(self, timing=True, device=None):
            pass

        def record(self, stream=None):
            return self

        def synchronize(self):
            pass

        def elapsed_ms(self, end):
            return 1e-3

        def close(self):
            pass

    class GraphExec:
        def __init__(self, records):
            self.records = records

        def launch(self, stream=None):
            for rec in self.records:
                run(rec[0].source.ptx, rec[1], rec[2], rec[3], fake.memory, rec[4], racecheck=fake.racecheck)

        def close(self):
            pass

    class Graph:
        def __init__(self, records):
            self.records = records
            self.num_kernels = len(records)

        def instantiate(self):
            return GraphExec(self.records)

    class Capture:
        graph = None

    import contextlib

    @contextlib.contextmanager
    def capture(stream, mode="global"):
        cap = Capture()
        records = []
        real_launch = fake.launch

        def recording_launch(kernel, grid, block, args, shared_bytes=0, stream=None):
            params = {p.name: args.get(p.name) for p in args.params}
            g = (grid,) if isinstance(grid, int) else tuple(grid)
            b = (block,) if isinstance(block, int) else tuple(block)
            records.append((kernel, g, b, params, shared_bytes))

        fake.launch = recording_launch
        try:
            yield cap
        finally:
            fake.launch = real_launch
        cap.graph = Graph(records)

    @contextlib.contextmanager
    def programmatic_dependent_launch(enabled=True):
        yield  # one grid at a time on the emulator: nothing to overlap

    fake.Event = Event
    fake.capture = capture
    fake.programmatic_dependent_launch = programmatic_dependent_launch

