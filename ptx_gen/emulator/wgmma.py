"""Hopper's warpgroup MMA (sm_90a): ``wgmma.mma_async.sync.aligned.m64nNk16.f32.f16.f16`` with A from registers
or from shared memory and B from shared memory, both K-major in the 128-byte swizzle, read through 64-bit matrix
descriptors; and ``wgmma.fence`` / ``commit_group`` / ``wait_group``.

The emulator runs each MMA when it is issued (the earliest completion the hardware allows), so ``commit_group``
and ``wait_group`` order nothing more here; a kernel that reads an accumulator before its ``wait_group`` is not
caught. Every MMA needs whole warpgroups (128 threads from a multiple of 128) with one descriptor each.

Descriptor fields (the PTX ISA's shared-memory matrix descriptor): bits 0-13 the start address >> 4, 16-29 the
leading offset >> 4 (unused in the swizzled K-major form), 32-45 the stride offset >> 4 (bytes between groups of
8 rows), 62-63 the swizzle (1: 128 bytes). Row ``r`` of the operand, k value ``j`` (0..15) lies at the logical
address ``start + (r / 8) stride + 128 (r % 8) + 2 j``, whose bits 4-6 the swizzle XORs with bits 7-9.
"""

from __future__ import annotations

import re

import numpy as np

from ptx_gen.emulator.instructions import op
from ptx_gen.emulator.memory import EmulatorError
from ptx_gen.emulator.parse import Inst

_LANE = np.arange(32)
_G, _T = _LANE // 4, _LANE % 4


def _reg_list(text: str) -> list[str]:
    return [x.strip() for x in text.strip("{}").split(",")]


def _groups(m, inst: Inst, act: np.ndarray) -> np.ndarray:
    """First threads of the whole warpgroups executing ``inst`` (else an error)."""
    if m.tpb % 128:
        raise EmulatorError(f"wgmma in a block of {m.tpb} threads (not whole warpgroups): {inst.text}")
    a128 = act.reshape(-1, 128)
    bad = a128.any(axis=1) & ~a128.all(axis=1)
    if bad.any():
        g = int(np.flatnonzero(bad)[0])
        raise EmulatorError(f"wgmma reached by {int(a128[g].sum())} of 128 threads (warpgroup {g}): {inst.text}")
    return np.flatnonzero(a128.all(axis=1)) * 128


def _operand(m, inst: Inst, desc: np.ndarray, t0: int, rows: int) -> np.ndarray:
    """The ``rows`` x 16 f16 operand of the warpgroup at thread ``t0`` through its descriptor."""
    d = desc[t0:t0 + 128]
    if (d != d[0]).any():
        raise EmulatorError(f"a warpgroup's threads give different wgmma descriptors: {inst.text}")
    d = int(d[0])
    start, stride, swizzle = (d & 0x3FFF) << 4, ((d >> 32) & 0x3FFF) << 4, (d >> 62) & 3
    if swizzle != 1:
        raise EmulatorError(f"only 128-byte swizzled K-major wgmma operands are emulated (swizzle {swizzle}): "
                            f"{inst.text}")
    r = np.arange(rows)[:, None]
    logical = start + (r // 8) * stride + 128 * (r % 8) + 2 * np.arange(16)[None, :]
    phys = logical ^ (((logical >> 7) & 7) << 4)
    block = int(m.block_of[t0])
    if phys.min() < 0 or phys.max() + 2 > m.smem_size:
        raise EmulatorError(f"wgmma operand outside shared memory ({int(phys.min())}..{int(phys.max()) + 1} of "
                            f"{m.smem_size}): {inst.text}")
    cols = (phys[..., None] + np.arange(2)).reshape(rows, -1)
    if m.pending and m.inflight[block, cols].any():
        raise EmulatorError(f"wgmma reads shared memory a cp.async has not landed in: {inst.text}")
    return m.smem[block, cols].reshape(rows, 16, 2).copy().view(np.float16)[..., 0].astype(np.float64)


@op("wgmma")
def wgmma(m, inst: Inst, act: np.ndarray, mask: np.ndarray) -> None:
    kind = inst.mods[0]
    if kind in ("fence", "commit_group", "wait_group"):
        _groups(m, inst, act)
        return None
    shape = re.fullmatch(r"m64n(\d+)k16", inst.mods[3]) if len(inst.mods) > 3 else None
    if kind != "mma_async" or inst.mods[1:3] != ["sync", "aligned"] or shape is None or \
            inst.mods[4:] != ["f32", "f16", "f16"]:
        raise EmulatorError(f"wgmma form not emulated: {inst.text}")
    n = int(shape.group(1))
    d_regs = _reg_list(inst.args[0])
    if len(d_regs) != n // 2:
        raise EmulatorError(f"wgmma m64n{n}k16 takes {n // 2} accumulators: {inst.text}")
    from_regs = inst.args[1].startswith("{")
    rest = inst.args[2:]
    imm = [int(x) for x in rest[2:]]
    if imm[:2] != [1, 1] or any(imm[2:]):
        raise EmulatorError(f"only unscaled, untransposed wgmma operands are emulated: {inst.text}")
    scale_d = m.reg(rest[1])
    b_desc = m.read(rest[0], "u64").astype(np.int64)
    acc = np.stack([m.read(r, "f32").astype(np.float64) for r in d_regs])  # [N/2, threads]
    out = acc.copy()
    if from_regs:
        a_words = np.stack([m.read(r, "b32").astype(np.uint32) for r in _reg_list(inst.args[1])])  # [4, threads]
    else:
        a_desc = m.read(inst.args[1], "u64").astype(np.int64)
    for t0 in _groups(m, inst, act):
        if from_regs:
            A = np.zeros((64, 16))
            halves = a_words[:, t0:t0 + 128].copy().view(np.float16).reshape(4, 128, 2).astype(np.float64)
            w, lane = np.arange(128) // 32, np.arange(128) % 32
            row, col = 16 * w + _G[lane], 2 * _T[lane]
            for i, (dr, dc) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
                A[row + dr, col + dc] = halves[i, :, 0]
                A[row + dr, col + dc + 1] = halves[i, :, 1]
        else:
            A = _operand(m, inst, a_desc, t0, 64)
        B = _operand(m, inst, b_desc, t0, n)  # [N, 16]
        D = A @ B.T  # [64, N]
        thr = np.arange(t0, t0 + 128)
        w, lane = (thr - t0) // 32, (thr - t0) % 32
        for j in range(n // 8):
            for e in range(4):
                r = 16 * w + _G[lane] + (8 if e >= 2 else 0)
                c = 8 * j + 2 * _T[lane] + (e & 1)
                old = np.where(scale_d[thr], acc[4 * j + e, thr], 0.0)
                out[4 * j + e, thr] = old + D[r, c]
    for i, r in enumerate(d_regs):
        m.write(r, out[i].astype(np.float32), act, "f32")
    return None
