"""Clusters (sm_90, ``.reqnctapercluster``) in the builder, ptxas and the emulator: ``mapa`` and a remote
``mbarrier.arrive`` (each CTA of a pair arrives on the other's barrier), ``barrier.cluster``, and a tensor copy
multicast to both CTAs (each CTA copies half of a box into both, each CTA's barrier completes on both halves): every
byte each CTA ends with against the box written out directly; the emulator's refusals."""

from __future__ import annotations

import numpy as np
import pytest

from ptx_gen.builder import Module
from ptx_gen.emulator import EmulatorError, Memory, run
from ptx_gen.emulator import tensormap as tm
from ptx_gen.ptxas import assemble
from tests.test_tensor_copy import BOX_INNER, _expected

ROWS = 16  # the box's rows; each CTA of the pair copies 8 of them into both


def _kernel(multicast: bool = True, remote: bool = True) -> str:
    """Each CTA of a pair: barrier ``bar`` expecting 2 arrivals (its own thread 0 and the other CTA's) and the box's
    bytes; thread 0 arrives on both CTAs' barriers and copies rows ``8 rank ..`` of the box into both; every thread
    waits, then writes the CTA's whole box and its cluster's size out (at ``y`` + (box bytes + 4) x its CTA index)."""
    m = Module("sm_90a")
    k = m.kernel("pair_copy", [("xmap", "tmap"), ("y", "u64"), ("c0", "s32"), ("c1", "s32")], max_threads=64,
                 cluster=(2, 1, 1))
    nbytes = BOX_INNER * 2 * ROWS
    half = nbytes // 2
    tid = k.tid()
    base = k.and_(k.add(k.dynamic_shared(), 1023), -1024 & 0xFFFFFFFF)
    bar = k.add(base, nbytes)
    first = k.setp("eq", tid, 0)
    with k.if_(first):
        k.mbarrier_init(bar, 2)
    k.fence_mbarrier_init()
    k.cluster_sync()  # (both barriers exist before either CTA arrives on or copies into the other)
    rank = k.cluster_rank()
    other = k.xor(rank, 1)
    with k.if_(first):
        k.mbarrier_expect_tx(bar, nbytes)
        if remote:
            k.mbarrier_arrive_cluster(k.mapa(bar, other))
        dst = k.add(base, k.mul(rank, half))
        row = k.add(k.param("c1"), k.mul(rank, ROWS // 2))
        k.cp_async_bulk_tensor_2d(dst, k.param_address("xmap"), k.param("c0"), row, bar,
                                  multicast=3 if multicast else None)
    k.mbarrier_wait(bar, 0)
    y = k.add(k.global_ptr("y"), k.cvt(k.mul(k.ctaid(), nbytes + 4), "u64"))
    with k.loop(tid, nbytes // 4, 64) as i:
        v = k.load("shared", "u32", k.add(base, k.shl(i, 2)))
        k.store("global", "u32", k.add(y, k.mul_wide(i, 4)), v)
    with k.if_(first):
        k.store("global", "u32", y, k.sreg("cluster_nctarank"), nbytes)
    k.cluster_sync()  # (no CTA leaves while the other may still arrive on its barrier)
    k.ret()
    return m.emit()


def _launch(ptx: str, rows: int = 20, c0: int = 0, c1: int = 3, grid=(2,)):
    rng = np.random.default_rng(rows)
    x = (rng.standard_normal((rows, 128)) + 0.5).astype(np.float16)
    mem = Memory()
    tmap = tm.encode(tm.TensorMap2d(mem.alloc_array(x), 128, rows, 256, BOX_INNER, ROWS // 2, 2, 128))
    nbytes = BOX_INNER * 2 * ROWS
    y = mem.alloc_array(np.full(grid[0] * (nbytes + 4) // 4, 0xFFFFFFFF, np.uint32))
    run(ptx, grid=grid, block=(64,), params=dict(xmap=tmap, y=y, c0=c0, c1=c1), memory=mem,
        shared_bytes=nbytes + 1024 + 8)
    got = mem.read(y, np.uint8, grid[0] * (nbytes + 4)).reshape(grid[0], nbytes + 4)
    return x, got


@pytest.mark.parametrize("c0,c1", [(0, 3), (64, 10), (8, -2)])
def test_a_pair_multicasts_halves_of_a_box_into_both(c0, c1):
    """Both CTAs of each of two clusters end with the whole box (zeros past the tensor), swizzled as one copy of it
    would land; each saw a cluster of 2."""
    x, got = _launch(_kernel(), c0=c0, c1=c1, grid=(4,))
    want = _expected(x, c0, c1, ROWS)
    for cta in range(4):
        np.testing.assert_array_equal(got[cta, :-4], want, err_msg=f"CTA {cta}")
        assert got[cta, -4:].view(np.uint32)[0] == 2


def test_without_multicast_each_cta_lacks_the_other_half():
    """The check can fail: copies into the issuing CTA alone leave the other half of the box unwritten there (the
    barrier then expects more bytes than land: the emulator reports the deadlock)."""
    with pytest.raises(EmulatorError, match="deadlock"):
        _launch(_kernel(multicast=False))


def test_a_barrier_waits_on_the_other_ctas_arrival():
    """Without the other CTA's arrival each barrier lacks one: the wait never passes (the remote arrival lands on the
    other CTA's barrier, not the issuer's own)."""
    with pytest.raises(EmulatorError, match="deadlock"):
        _launch(_kernel(remote=False))


def test_the_emulator_refuses_a_grid_of_part_clusters():
    with pytest.raises(EmulatorError, match="whole clusters"):
        _launch(_kernel(), grid=(3,))


def test_cluster_kernel_assembles_and_declares_its_cluster():
    ptx = _kernel()
    assert ".reqnctapercluster 2, 1, 1" in ptx and "multicast::cluster" in ptx and "mapa.shared::cluster" in ptx
    assert not assemble(ptx, "sm_90a")[0].spills
    with pytest.raises(ValueError, match="clusters need sm_90"):
        Module("sm_80").kernel("k", [], cluster=(2, 1, 1))
