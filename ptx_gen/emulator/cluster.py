"""Clusters (sm_90, ``.reqnctapercluster``): the CTAs of a cluster run in one batch, side by side, and address each
other's shared memory and mbarriers. Clusters here extend along x only (``n, 1, 1``), which is what the kernels use.

A shared::cluster address from ``mapa`` is ``(rank + 1) << 24 | offset`` (a CTA's shared memory is below 16 MB); a
plain shared address in a shared::cluster operand is the issuing CTA's own. ``barrier.cluster.arrive`` / ``wait``
hold each thread at the wait until every live thread of its cluster has arrived.
"""

from __future__ import annotations

import numpy as np

from ptx_gen.emulator.instructions import op
from ptx_gen.emulator.memory import EmulatorError
from ptx_gen.emulator.parse import Inst

RANK_SHIFT = 24


def cluster_extent(kern, grid: tuple[int, int, int]) -> int:
    """CTAs a cluster along x (1 without ``.reqnctapercluster``); the grid must hold whole clusters."""
    cx, cy, cz = kern.cluster
    if (cy, cz) != (1, 1):
        raise EmulatorError(f"clusters of {kern.cluster} CTAs: the emulator runs clusters along x only")
    if grid[0] % cx:
        raise EmulatorError(f"a grid of {grid} CTAs does not hold whole clusters of {cx} along x")
    return cx


def specials(bidx: np.ndarray, gx: int, cx: int) -> dict:
    """The cluster special registers of the threads of blocks ``bidx``."""
    x = bidx % gx
    n = bidx.size
    rank = (x % cx).astype(np.uint32)
    return {"cluster_ctarank": rank, "cluster_nctarank": np.full(n, cx, np.uint32), "cluster_ctaid.x": rank,
            "cluster_ctaid.y": np.zeros(n, np.uint32), "cluster_ctaid.z": np.zeros(n, np.uint32),
            "cluster_nctaid.x": np.full(n, cx, np.uint32), "cluster_nctaid.y": np.ones(n, np.uint32),
            "cluster_nctaid.z": np.ones(n, np.uint32), "clusterid.x": (x // cx).astype(np.uint32)}


def start_batch(m, blocks: np.ndarray) -> None:
    """The batch's cluster state: each thread's cluster (its first batch-local block), the cluster barrier."""
    cx = m.cluster_x
    if blocks.size % cx or (blocks.size and blocks[0] % cx):
        raise EmulatorError("a batch of blocks that splits a cluster")
    m.cluster_base = m.block_of - m.block_of % cx  # (batch-local block of rank 0)
    m.cbar_arrived = {}  # cluster base -> threads arrived in the open phase
    m.cbar_phase = {}  # cluster base -> phases completed
    m.cbar_target = np.full(m.n, -1, np.int64)  # per thread: the phase count its wait needs


def target(m, t: int, addr: int, inst: Inst) -> tuple[int, int]:
    """(batch-local block, offset) of thread ``t``'s shared::cluster address ``addr``."""
    rank = addr >> RANK_SHIFT
    if rank == 0:
        return int(m.block_of[t]), addr
    rank -= 1
    if rank >= m.cluster_x:
        raise EmulatorError(f"shared::cluster address of rank {rank} in a cluster of {m.cluster_x}: {inst.text}")
    return int(m.cluster_base[t]) + rank, addr & ((1 << RANK_SHIFT) - 1)


@op("mapa")
def mapa(m, inst: Inst, act: np.ndarray, mask: np.ndarray) -> None:
    """``mapa.shared::cluster.u32 d, a, rank``."""
    if inst.mods != ["shared::cluster", "u32"]:
        raise EmulatorError(f"mapa form not emulated: {inst.text}")
    a = m.read(inst.args[1], "u32").astype(np.int64)
    r = m.read(inst.args[2], "u32").astype(np.int64)
    if (a[act] >> RANK_SHIFT).any():
        raise EmulatorError(f"mapa of an address that is not a shared::cta one: {inst.text}")
    if (r[act] >= m.cluster_x).any():
        raise EmulatorError(f"mapa to a rank outside the cluster of {m.cluster_x}: {inst.text}")
    m.write(inst.args[0], ((r + 1) << RANK_SHIFT | a).astype(np.uint32), act, "u32")


@op("barrier")
def barrier(m, inst: Inst, act: np.ndarray, mask: np.ndarray) -> None:
    """``barrier.cluster.arrive[.release][.aligned]`` and ``barrier.cluster.wait[.acquire][.aligned]``."""
    if inst.mods[:1] != ["cluster"] or inst.mods[1] not in ("arrive", "wait"):
        raise EmulatorError(f"barrier form not emulated: {inst.text}")
    tids = np.flatnonzero(act)
    if inst.mods[1] == "arrive":
        for t in tids:
            base = int(m.cluster_base[t])
            if m.cbar_target[t] > m.cbar_phase.get(base, 0):
                raise EmulatorError(f"barrier.cluster.arrive twice without a wait between: {inst.text}")
            m.cbar_target[t] = m.cbar_phase.get(base, 0) + 1
            m.cbar_arrived[base] = m.cbar_arrived.get(base, 0) + 1
            if m.cbar_arrived[base] == m.cluster_x * m.tpb:  # (every thread of the cluster: the phase completes)
                m.cbar_phase[base] = m.cbar_phase.get(base, 0) + 1
                m.cbar_arrived[base] = 0
                m.phase_ended = True
                if m.racecheck:
                    for b in range(base, base + m.cluster_x):
                        m.writer[b] = -1
                        m.reader[b] = -1
        return
    failed = np.zeros(m.n, bool)
    for t in tids:
        if m.cbar_target[t] < 0:
            raise EmulatorError(f"barrier.cluster.wait without an arrive: {inst.text}")
        failed[t] = m.cbar_phase.get(int(m.cluster_base[t]), 0) < m.cbar_target[t]
    if failed.any():
        m.waiting = failed if m.waiting is None else m.waiting | failed
    for t in tids[~failed[tids]]:
        m.cbar_target[t] = -1
