"""The SIMT machine: runs every thread of a launch as a lane of NumPy arrays.

Each thread has its own program counter; the threads at the lowest one step together, which
reconverges structured branches. Blocks run in batches (all threads of a batch side by side).
Besides executing instructions through the table in :mod:`ptx_gen.emulator.instructions`, the
machine owns the checks: shared-memory bounds and alignment, races between barriers, barrier and
warp-collective divergence, reads of registers never written.
"""

from __future__ import annotations

import re

import numpy as np

from ptx_gen.emulator import cluster, memops, warp, wgmma  # noqa: F401  (they register their instructions)
from ptx_gen.emulator.instructions import OPS, not_implemented
from ptx_gen.emulator.memory import EmulatorError, Memory
from ptx_gen.emulator.parse import BITS, NP, RAW, Inst, Kernel, immediate, parse


class Machine:
    """One launch: its geometry, and the state of the batch of blocks being run (registers as arrays
    over the batch's threads, shared memory per block, race records, pending async copies)."""

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
        # byte-array parameters (tensor maps passed by value) live in global memory here: their symbol's value is
        # that address, and cvta.param keeps it (generic and global addresses are the same numbers)
        self.param_addr = {}
        for pname, t in kern.params:
            if "[" in t:
                raw = params[pname]
                if not isinstance(raw, (bytes, bytearray)) or len(raw) != int(t[t.index("[") + 1:-1]):
                    raise EmulatorError(f"parameter {pname} is {t}: pass that many bytes, got {type(raw).__name__}")
                self.param_addr[f"{kern.name}_param_{pname}"] = memory.alloc_array(np.frombuffer(bytes(raw), np.uint8))
        self.smem_size = kern.static_shared + int(shared_bytes)
        self.cluster_x = cluster.cluster_extent(kern, self.grid)
        self.racecheck = racecheck
        self.max_steps = max_steps

    def _start_batch(self, blocks: np.ndarray) -> None:
        """Fresh per-thread state for the blocks ``blocks`` (indices into the grid)."""
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
            **cluster.specials(bidx, gx, self.cluster_x),
        }
        cluster.start_batch(self, blocks)
        self.lane = local % 32
        self.warp_global = t // 32 if self.tpb % 32 == 0 else None
        self.local = local
        self.regs: dict[str, np.ndarray] = {}
        self.smem = np.full((nb, max(self.smem_size, 1)), 0xFF, np.uint8)
        self.inflight = np.zeros(self.smem.shape, bool)  # shared bytes a cp.async will write
        self.pending: list[tuple] = []  # cp.async copies not landed yet: (threads, rows, cols, data, groups)
        self.cp_group = np.zeros(n, np.int64)  # per thread: the cp.async group now open (commit_group closes it)
        self.mbars: dict = {}  # (block, address) -> [expected arrivals, pending arrivals, tx bytes, phase parity]
        self.waiting: np.ndarray | None = None  # threads whose mbarrier wait just failed (they wait for a phase)
        self.phase_ended = False  # an mbarrier phase completed since the waiting threads last tried
        self.bulk: list = []  # bulk copies not landed: (block, mbar address, row, cols, data)
        if self.racecheck:
            self.writer = np.full((nb, max(self.smem_size, 1)), -1, np.int64)
            self.reader = np.full((nb, max(self.smem_size, 1)), -1, np.int64)

    def run_blocks(self, blocks: np.ndarray) -> None:
        """Run a batch of blocks to completion: the threads at the lowest program counter step together."""
        self._start_batch(blocks)
        n = self.n
        pc = np.zeros(n, np.int64)
        alive = np.ones(n, bool)
        blocked = None  # threads waiting on an mbarrier (None: none): they step again once some phase completes
        insts = self.k.insts
        steps = 0
        with np.errstate(all="ignore"):
            while alive.any():
                if self.phase_ended:
                    blocked = None
                    self.phase_ended = False
                ready = alive if blocked is None else alive & ~blocked
                if blocked is not None and not ready.any():
                    t = int(np.flatnonzero(alive)[0])
                    raise EmulatorError(f"deadlock: every live thread waits on an mbarrier phase that cannot complete "
                                        f"(thread {int(self.local[t])} at {insts[int(pc[t])].text!r})")
                cur = int(pc[ready].min())
                mask = ready & (pc == cur)
                if cur >= len(insts):
                    raise EmulatorError("fell off the end of the kernel without ret")
                inst = insts[cur]
                steps += 1
                if steps > self.max_steps:
                    raise EmulatorError(f"more than {self.max_steps} steps: endless loop? at {inst.text}")
                act = mask
                if inst.guard is not None:
                    g = self.reg(inst.guard)
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
                    handler = OPS.get(inst.op)
                    if handler is None:
                        raise not_implemented(inst)
                    handler(self, inst, act, mask)
                if self.waiting is not None:  # (a failed mbarrier wait: retried, not passed, once a phase completes)
                    blocked = self.waiting if blocked is None else blocked | self.waiting
                    pc[mask & ~self.waiting] += 1
                    self.waiting = None
                    continue
                pc[mask] += 1

    # registers
    def reg(self, name: str) -> np.ndarray:
        try:
            return self.regs[name]
        except KeyError:
            raise EmulatorError(f"register {name} read before it was ever written") from None

    def read(self, text: str, t: str) -> np.ndarray:
        """Operand as an array of type t (a register, an immediate, a special register or a symbol)."""
        if text.startswith("%"):
            key = text[1:]
            if key in self.special:
                return self.special[key].view(NP[t]) if BITS[t] == 32 else self.special[key].astype(NP[t])
            raw = self.reg(text)
            want = np.dtype(NP[t])
            if raw.dtype == np.bool_:
                return raw
            if raw.dtype.itemsize == want.itemsize:
                return raw.view(want)
            return raw.astype(want)  # e.g. cvt reading a narrower/wider class
        if text in self.k.shared:
            return np.full(self.n, self.k.shared[text][0], NP[t])
        if text in self.param_addr:
            return np.full(self.n, self.param_addr[text], NP[t])
        if text == self.k.dynamic_symbol:
            return np.full(self.n, self.k.static_shared, NP[t])
        v = immediate(text, t)
        if v is None:
            raise EmulatorError(f"unknown operand {text!r}")
        return np.broadcast_to(v, (self.n,))

    def write(self, name: str, value: np.ndarray, act: np.ndarray, t: str) -> None:
        bits = BITS[t]
        value = np.asarray(value)
        if bits == 1:
            raw = value.astype(np.bool_)
        else:
            value = value.astype(NP[t], copy=False) if value.dtype != NP[t] else value
            raw = value.view(RAW[bits])
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
    def addr(self, text: str, space: str) -> tuple[np.ndarray | str, int]:
        m = re.fullmatch(r"\[(\S+?)([+-]\d+)?\]", text)
        if not m:
            raise EmulatorError(f"cannot parse address {text!r}")
        base, off = m.group(1), int(m.group(2) or 0)
        if space == "param":
            return base, off
        if base.startswith("%"):
            t = "u32" if self.reg(base).dtype == np.uint32 else "u64"
            return self.read(base, t).astype(np.int64) + off, off
        return self.read(base, "u64").astype(np.int64) + off, off

    def shared_idx(self, addrs: np.ndarray, nbytes: int, act: np.ndarray, inst: Inst) -> tuple[np.ndarray, np.ndarray]:
        a = addrs[act]
        if (a % nbytes).any():
            raise EmulatorError(f"misaligned shared access in {inst.text}")
        if (a < 0).any() or (a + nbytes > self.smem_size).any():
            bad = int(a[(a < 0) | (a + nbytes > self.smem_size)][0])
            raise EmulatorError(f"out-of-bounds shared access at {bad} (size {self.smem_size}) in {inst.text}")
        rows = self.block_of[act]
        cols = a[:, None] + np.arange(nbytes)[None, :]
        return rows, cols

    def race(self, rows, cols, act, inst: Inst, write: bool) -> None:
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
        if len(inst.args) == 2:
            return self._named_barrier(inst, mask)
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

    def _named_barrier(self, inst: Inst, mask: np.ndarray) -> None:
        """``bar.sync id, count``: in each block, the threads standing here with barrier ``id`` must number ``count``
        (threads reaching it at different times are not modelled: an error). Afterwards the block's race records
        are cleared, as at a full barrier (a race across it can go unreported, never a false one)."""
        ids = self.read(inst.args[0], "u32")
        count = int(self.read(inst.args[1], "u32")[np.flatnonzero(mask)[0]])
        if count % 32 or count > self.tpb:
            raise EmulatorError(f"named barrier of {count} threads in a block of {self.tpb}: {inst.text}")
        for b in np.unique(self.block_of[mask]):
            here = mask & (self.block_of == b)
            for bid in np.unique(ids[here]):
                n = int((here & (ids == bid)).sum())
                if n != count:
                    raise EmulatorError(f"bar.sync {int(bid)}, {count} reached by {n} threads of block {int(b)} at "
                                        f"once: {inst.text}")
            if self.racecheck:
                self.writer[b] = -1
                self.reader[b] = -1

    def _warp_barrier(self, inst: Inst, mask: np.ndarray) -> None:
        """``bar.warp.sync 0xFFFFFFFF``: all 32 lanes of each warp standing here; afterwards the race
        records made by that warp are cleared (bytes written by other warps keep theirs)."""
        if int(inst.args[0], 0) & 0xFFFFFFFF != 0xFFFFFFFF or self.warp_global is None:
            raise EmulatorError(f"only full-mask bar.warp.sync in whole warps is emulated: {inst.text}")
        warps = self.whole_warps(inst, mask)
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
    def whole_warps(self, inst: Inst, act: np.ndarray) -> np.ndarray:
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

    def check_landed(self, rows: np.ndarray, cols: np.ndarray, inst: Inst) -> None:
        if self.pending and self.inflight[rows[:, None], cols].any():
            raise EmulatorError(f"shared memory touched while a cp.async to it has not landed (no "
                                f"cp.async.wait_all + barrier in between): {inst.text}")


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
    launch = Machine(kern, grid, block, params, memory, shared_bytes, racecheck, max_steps)
    try:
        per_batch = max(1, batch_threads // launch.tpb)
        per_batch = max(launch.cluster_x, per_batch // launch.cluster_x * launch.cluster_x)  # (whole clusters)
        for b0 in range(0, launch.nblocks, per_batch):
            launch.run_blocks(np.arange(b0, min(launch.nblocks, b0 + per_batch)))
    finally:  # (the byte-array parameters' copies live as long as the launch)
        for addr in launch.param_addr.values():
            memory.free(addr)

