"""The emulator's memory and warp instructions against NumPy, and its checks: memcheck (out of bounds,
misaligned), racecheck (shared hazards without a barrier), barrier and warp-collective divergence.
Each check test fails if the check is removed (the kernel would then run to completion)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from ptx_gen.emulator import EmulatorError, Memory, run
from tests.emulator_ptx import PROLOGUE, kernel, one_op, run_words
from tests.helpers import examples

N = 32
SETTINGS = settings(max_examples=examples(10), deadline=None)
f32 = arrays(np.float32, 4 * N, elements=st.floats(-1e3, 1e3, width=32)).filter(lambda x: x.any())
u32 = arrays(np.uint32, N, elements=st.integers(1, 2**31)).filter(lambda x: x.any())
SMEM = ".shared .align 16 .b8 buf[256];"


@SETTINGS
@given(a=f32)
def test_vector_loads_and_stores(a):
    body = PROLOGUE.replace("mul.wide.u32 %rd3, %r0, 4", "mul.wide.u32 %rd3, %r0, 16") + """
    ld.global.v4.f32 {%f1, %f2, %f3, %f4}, [%rd4];
    st.global.v4.f32 [%rd6], {%f4, %f3, %f2, %f1};
    ret;"""
    mem = Memory()
    pa, po = mem.alloc_array(a), mem.alloc(a.nbytes)
    run(kernel(body), (1,), (N,), {"a": pa, "b": pa, "out": po}, mem)
    assert np.array_equal(mem.read(po, np.float32, a.size), a.reshape(N, 4)[:, ::-1].reshape(-1))


def _reverse_kernel(barrier: str) -> str:
    # shared addresses: %r4 = &buf[tid], %r6 = &buf[31 - tid]
    body = PROLOGUE + f"""
    mov.u32 %r7, buf;
    shl.b32 %r4, %r0, 2;
    add.u32 %r4, %r7, %r4;
    st.shared.b32 [%r4], %r1;
    {barrier}
    sub.u32 %r5, 31, %r0;
    shl.b32 %r5, %r5, 2;
    add.u32 %r6, %r7, %r5;
    ld.shared.b32 %r3, [%r6];
    st.global.b32 [%rd6], %r3;
    ret;"""
    return kernel(body, shared=SMEM)


@SETTINGS
@given(a=u32)
def test_shared_memory_with_a_barrier(a):
    assert np.array_equal(run_words(_reverse_kernel("bar.sync 0;"), a, a), a[::-1])


def test_racecheck_reports_a_shared_read_after_write_without_barrier():
    a = np.arange(1, N + 1, dtype=np.uint32)
    with pytest.raises(EmulatorError, match=r"shared-memory race \(read after write\)"):
        run_words(_reverse_kernel(""), a, a)
    # the same kernel with racecheck off runs (and is only right by the emulator's lockstep luck)
    run_words(_reverse_kernel(""), a, a, racecheck=False)


def test_racecheck_reports_two_threads_writing_one_byte():
    body = PROLOGUE + "    mov.u32 %r7, buf;\n    st.shared.b32 [%r7], %r1;\n    mov.b32 %r3, %r1;\n" \
        "    st.global.b32 [%rd6], %r3;\n    ret;"
    a = np.arange(1, N + 1, dtype=np.uint32)
    with pytest.raises(EmulatorError, match="one byte written by several threads"):
        run_words(kernel(body, shared=SMEM), a, a)


def test_memcheck_out_of_bounds_global_read():
    a = np.arange(1, N + 1, dtype=np.uint32)
    with pytest.raises(EmulatorError, match="out-of-bounds global access of 4 bytes"):
        run_words(one_op("    mov.b32 %r3, %r1;"), a, a, threads=N + 1)


def test_memcheck_misaligned_global_access():
    body = PROLOGUE + "    add.s64 %rd7, %rd4, 2;\n    ld.global.b32 %r3, [%rd7];\n    st.global.b32 [%rd6], %r3;\n    ret;"
    a = np.arange(1, N + 1, dtype=np.uint32)
    with pytest.raises(EmulatorError, match="misaligned 4-byte global access"):
        run_words(kernel(body), a, a)


def test_memcheck_out_of_bounds_shared_access():
    body = PROLOGUE + "    mov.u32 %r7, buf;\n    shl.b32 %r4, %r0, 4;\n    add.u32 %r4, %r7, %r4;\n" \
        "    ld.shared.b32 %r3, [%r4];\n    st.global.b32 [%rd6], %r3;\n    ret;"
    a = np.arange(1, N + 1, dtype=np.uint32)
    with pytest.raises(EmulatorError, match="out-of-bounds shared access"):
        run_words(kernel(body, shared=SMEM), a, a)


def test_barrier_reached_by_part_of_the_block():
    body = PROLOGUE + """
    setp.lt.u32 %p1, %r0, 16;
    @%p1 bra SKIP;
    bar.sync 0;
SKIP:
    mov.b32 %r3, %r1;
    st.global.b32 [%rd6], %r3;
    ret;"""
    a = np.arange(1, N + 1, dtype=np.uint32)
    with pytest.raises(EmulatorError, match="bar.sync reached by only part of block 0"):
        run_words(kernel(body), a, a)


def test_shuffle_in_a_divergent_warp_is_reported():
    body = PROLOGUE + """
    mov.b32 %r3, %r1;
    setp.lt.u32 %p1, %r0, 8;
    @%p1 shfl.sync.bfly.b32 %r3, %r1, 1, 31, 0xffffffff;
    st.global.b32 [%rd6], %r3;
    ret;"""
    a = np.arange(1, N + 1, dtype=np.uint32)
    with pytest.raises(EmulatorError, match="reached by 8 of 32 lanes"):
        run_words(kernel(body), a, a)


def test_unwritten_register_and_unknown_instruction():
    a = np.arange(1, N + 1, dtype=np.uint32)
    with pytest.raises(EmulatorError, match="register %r9 read before it was ever written"):
        run_words(one_op("    add.u32 %r3, %r1, %r9;"), a, a)
    with pytest.raises(EmulatorError, match="not implemented by the emulator: popc.b32"):
        run_words(one_op("    popc.b32 %r3, %r1;"), a, a)


@SETTINGS
@given(a=u32, lane=st.integers(0, 31), delta=st.integers(1, 31))
def test_shuffles(a, lane, delta):
    idx = np.arange(N)
    shfl = "    shfl.sync.{} %r3, %r1, {}, {}, 0xffffffff;"
    assert np.array_equal(run_words(one_op(shfl.format("bfly.b32", delta, 31)), a, a), a[idx ^ delta])
    down = np.where(idx + delta <= 31, idx + delta, idx)
    assert np.array_equal(run_words(one_op(shfl.format("down.b32", delta, 31)), a, a), a[down])
    up = np.where(idx - delta >= 0, idx - delta, idx)
    assert np.array_equal(run_words(one_op(shfl.format("up.b32", delta, 0)), a, a), a[up])
    assert np.array_equal(run_words(one_op(shfl.format("idx.b32", lane, 31)), a, a), np.full(N, a[lane]))


@SETTINGS
@given(a=u32)
def test_warp_reductions(a):
    s = a.view(np.int32)
    got = run_words(one_op("    redux.sync.add.s32 %r3, %r1, 0xffffffff;"), s, s)
    assert np.array_equal(got, np.full(N, np.sum(s.astype(np.int64)) & 0xFFFFFFFF, np.uint64).astype(np.uint32).view(np.int32))
    got = run_words(one_op("    redux.sync.max.u32 %r3, %r1, 0xffffffff;"), a, a)
    assert np.array_equal(got, np.full(N, a.max()))


@SETTINGS
@given(a=u32)
def test_atomics_return_the_old_value_and_accumulate(a):
    """Every thread adds its word to out[0] (and takes the max into out[1]); atom returns old values."""
    body = PROLOGUE + """
    atom.global.add.u32 %r3, [%rd2], %r1;
    add.s64 %rd7, %rd2, 4;
    red.global.max.u32 [%rd7], %r1;
    st.global.b32 [%rd5], %r3;
    ret;"""
    mem = Memory()
    pa, pb = mem.alloc_array(a), mem.alloc(4 * N)
    po = mem.alloc_array(np.zeros(2, np.uint32))
    run(kernel(body), (1,), (N,), {"a": pa, "b": pb, "out": po}, mem)
    total = int(a.astype(np.uint64).sum() & 0xFFFFFFFF)
    assert mem.read(po, np.uint32, 2).tolist() == [total, int(a.max())]
    old = mem.read(pb, np.uint32, N)
    assert np.array_equal(old, (np.cumsum(a.astype(np.uint64)) - a & np.uint64(0xFFFFFFFF)).astype(np.uint32))


@SETTINGS
@given(bound=st.integers(1, 40))
def test_atom_inc_wraps_at_its_operand(bound):
    """``atom.global.inc.u32 [c], b``: each thread in lane order takes the old value and leaves ``old >= b ? 0 : old + 1``
    (a counter of b + 1 arrivals that resets itself)."""
    body = PROLOGUE + f"""
    atom.global.inc.u32 %r3, [%rd2], {bound};
    st.global.b32 [%rd5], %r3;
    ret;"""
    mem = Memory()
    pa, pb, counter = mem.alloc_array(np.zeros(N, np.uint32)), mem.alloc(4 * N), mem.alloc_array(np.zeros(1, np.uint32))
    run(kernel(body), (1,), (N,), {"a": pa, "b": pb, "out": counter}, mem)
    assert mem.read(pb, np.uint32, N).tolist() == [i % (bound + 1) for i in range(N)]
    assert mem.read(counter, np.uint32, 1).tolist() == [N % (bound + 1)]


def _cp_async_kernel(wait: str) -> str:
    body = PROLOGUE.replace("mul.wide.u32 %rd3, %r0, 4", "mul.wide.u32 %rd3, %r0, 16") + f"""
    mov.u32 %r7, buf;
    shl.b32 %r4, %r0, 4;
    add.u32 %r4, %r7, %r4;
    cp.async.cg.shared.global [%r4], [%rd4], 16;
    {wait}
    ld.shared.v4.b32 {{%r10, %r11, %r12, %r13}}, [%r4];
    st.global.v4.b32 [%rd6], {{%r10, %r11, %r12, %r13}};
    ret;"""
    return kernel(body, shared=".shared .align 16 .b8 buf[256];")


def test_cp_async_lands_at_wait_all_and_not_before():
    a = np.arange(1, 4 * 16 + 1, dtype=np.uint32)
    mem = Memory()
    pa, po = mem.alloc_array(a), mem.alloc(a.nbytes)
    run(_cp_async_kernel("cp.async.wait_all;"), (1,), (16,), {"a": pa, "b": pa, "out": po}, mem)
    assert np.array_equal(mem.read(po, np.uint32, a.size), a)
    with pytest.raises(EmulatorError, match="cp.async to it has not landed"):
        run(_cp_async_kernel(""), (1,), (16,), {"a": pa, "b": pa, "out": po}, mem)
