"""Warp-collective instructions: shuffles, reductions, ``ldmatrix`` and the integer ``mma``. Each
needs all 32 lanes of every warp executing it (``m.whole_warps`` raises otherwise)."""

from __future__ import annotations

import numpy as np

from ptx_gen.emulator.instructions import op
from ptx_gen.emulator.memory import EmulatorError
from ptx_gen.emulator.parse import NP, Inst


def _reg_list(text: str) -> list[str]:
    return [x.strip() for x in text.strip("{}").split(",")]


@op("shfl")
def shfl(m, inst: Inst, act: np.ndarray, mask: np.ndarray) -> None:
    """``shfl.sync.{bfly,down,up,idx}.b32`` with a full member mask, in whole warps."""
    mode = inst.mods[1]
    d, a, b, c, membermask = inst.args
    if int(membermask, 0) & 0xFFFFFFFF != 0xFFFFFFFF:
        raise EmulatorError(f"only full-mask shuffles are emulated: {inst.text}")
    m.whole_warps(inst, act)
    val = m.read(a, "b32")
    bb = m.read(b, "u32").astype(np.int64)
    cc = m.read(c, "u32").astype(np.int64)
    lane = m.lane
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
    src = np.arange(m.n) - lane + j
    m.write(d, val[src], act, "b32")


@op("redux")
def redux(m, inst: Inst, act: np.ndarray, mask: np.ndarray) -> None:
    """``redux.sync.<op>.<type>`` over full warps (every lane gets the warp's result)."""
    rop, ty = inst.mods[1], inst.mods[2]
    d, a, membermask = inst.args
    if int(membermask, 0) & 0xFFFFFFFF != 0xFFFFFFFF:
        raise EmulatorError(f"only full-mask reductions are emulated: {inst.text}")
    m.whole_warps(inst, act)
    val = m.read(a, ty).astype(np.int64).reshape(-1, 32)
    fn = {"add": lambda v: v.sum(axis=1), "min": lambda v: v.min(axis=1), "max": lambda v: v.max(axis=1),
          "and": lambda v: np.bitwise_and.reduce(v, axis=1), "or": lambda v: np.bitwise_or.reduce(v, axis=1),
          "xor": lambda v: np.bitwise_xor.reduce(v, axis=1)}[rop]
    res = np.repeat(fn(val), 32) & 0xFFFFFFFF
    if ty == "s32":
        res = np.where(res >= 2**31, res - 2**32, res)
    m.write(d, res.astype(NP[ty]), act, ty)


@op("ldmatrix")
def ldmatrix(m, inst: Inst, act: np.ndarray, mask: np.ndarray) -> None:
    """``ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16``: lane 8j + r addresses row r of matrix j (16
    bytes); lane l gets bytes 4 (l % 4) .. + 3 of row l / 4 of each matrix (``.trans``: 16-bit elements
    2 (l % 4) and 2 (l % 4) + 1 of column l / 4)."""
    trans = inst.mods == ["sync", "aligned", "m8n8", "x4", "trans", "shared", "b16"]
    if inst.mods != ["sync", "aligned", "m8n8", "x4", "shared", "b16"] and not trans:
        raise EmulatorError(f"ldmatrix form not emulated: {inst.text}")
    warps = m.whole_warps(inst, act)
    addrs, _ = m.addr(inst.args[1], "shared")
    if (addrs[act] % 16).any():
        raise EmulatorError(f"ldmatrix row address not 16-byte aligned: {inst.text}")
    rows, cols = m.shared_idx(addrs, 16, act, inst)  # [n_act, 16]
    m.check_landed(rows, cols, inst)
    if m.racecheck:
        m.race(rows, cols, act, inst, write=False)
    data = np.zeros((m.n, 16), np.uint8)
    data[act] = m.smem[rows[:, None], cols]
    dests = _reg_list(inst.args[0])
    lane = np.arange(32)
    for w in warps:
        base = 32 * w
        for j, d in enumerate(dests):
            if trans:  # lane i: elements (2 (i % 4), i / 4) and (2 (i % 4) + 1, i / 4) of matrix j
                mat = data[base + 8 * j: base + 8 * j + 8].view(np.uint16)  # [8 rows, 8 columns]
                pairs = np.stack([mat[2 * (lane % 4), lane // 4], mat[2 * (lane % 4) + 1, lane // 4]], 1)
                words = np.ascontiguousarray(pairs).view(np.uint32)[:, 0]
            else:
                src_rows = data[base + 8 * j + lane // 4]  # [32, 16]: the row each lane reads from
                words = np.stack([src_rows[i, 4 * (i % 4): 4 * (i % 4) + 4] for i in range(32)]).copy().view(np.uint32)[:, 0]
            full = m.reg(d).copy() if d in m.regs else np.zeros(m.n, np.uint32)
            full[base:base + 32] = words
            who = np.zeros(m.n, bool)
            who[base:base + 32] = True
            m.write(d, full, who, "b32")


@op("mma")
def mma(m, inst: Inst, act: np.ndarray, mask: np.ndarray) -> None:
    """``mma.sync.aligned.m16n8k32.row.col.s32.{s8,u8}.s8.s32``, exact int32 (wrapping) arithmetic, and
    ``mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32`` (:func:`_mma_f16`)."""
    if inst.mods == ["sync", "aligned", "m16n8k16", "row", "col", "f32", "f16", "f16", "f32"]:
        return _mma_f16(m, inst, act)
    if (inst.mods[:6] != ["sync", "aligned", "m16n8k32", "row", "col", "s32"] or inst.mods[6] not in ("s8", "u8")
            or inst.mods[7:] != ["s8", "s32"]):
        raise EmulatorError(f"mma form not emulated: {inst.text}")
    a_type = np.uint8 if inst.mods[6] == "u8" else np.int8
    warps = m.whole_warps(inst, act)
    dn, an, bn, cn = (_reg_list(x) for x in inst.args)
    a = [m.read(x, "b32").astype(np.uint32) for x in an]
    b = [m.read(x, "b32").astype(np.uint32) for x in bn]
    c = [m.read(x, "s32").astype(np.int64) for x in cn]
    lane = np.arange(32)
    g, t = lane // 4, lane % 4
    out = [np.zeros(m.n, np.int64) for _ in range(4)]
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
        m.write(d, wrapped, act, "s32")



def _mma_f16(m, inst: Inst, act: np.ndarray) -> None:
    """f16 A (16x16) times f16 B (16x8) plus f32 C: the exact products summed in float64, plus C, rounded
    once to f32 (the hardware rounds at least as finely: tests compare with a tolerance)."""
    warps = m.whole_warps(inst, act)
    dn, an, bn, cn = (_reg_list(x) for x in inst.args)
    halves = lambda x: m.read(x, "b32").astype(np.uint32).view(np.float16).reshape(-1, 2).astype(np.float64)  # noqa: E731
    a = [halves(x) for x in an]  # [n, 2] each: (low k, high k)
    b = [halves(x) for x in bn]
    c = [m.read(x, "f32").astype(np.float64) for x in cn]
    lane = np.arange(32)
    g, t = lane // 4, lane % 4
    out = [np.zeros(m.n, np.float64) for _ in range(4)]
    for w in warps:
        s = slice(32 * w, 32 * w + 32)
        A = np.zeros((16, 16))
        B = np.zeros((16, 8))
        for (r, k0), frag in zip(((0, 0), (8, 0), (0, 8), (8, 8)), a):
            A[g + r, k0 + 2 * t] = frag[s, 0]
            A[g + r, k0 + 2 * t + 1] = frag[s, 1]
        for k0, frag in zip((0, 8), b):
            B[k0 + 2 * t, g] = frag[s, 0]
            B[k0 + 2 * t + 1, g] = frag[s, 1]
        D = A @ B
        for k, (r, dc) in enumerate(((0, 0), (0, 1), (8, 0), (8, 1))):
            out[k][s] = D[g + r, 2 * t + dc] + c[k][s]
    for k, d in enumerate(dn):
        m.write(d, out[k].astype(np.float32), act, "f32")
