"""``cp.async.bulk.tensor.2d`` (a tensor map passed by value) in the builder, ptxas and the emulator: a box of a 2-D
f16 tensor lands in shared memory with the 128-byte swizzle (the 16-byte piece ``p`` of row ``r`` at ``p ^ r % 8``),
elements outside the tensor as zeros, completing its bytes on an mbarrier; the emulated map's checks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ptx_gen.builder import Module
from ptx_gen.emulator import Memory, run
from ptx_gen.emulator import tensormap as tm
from ptx_gen.ptxas import assemble
from tests.helpers import examples

BOX_INNER = 64  # f16: 128-byte rows, the swizzle's width


def _kernel(box_outer: int) -> str:
    m = Module("sm_90a")
    k = m.kernel("tile_copy", [("xmap", "tmap"), ("y", "u64"), ("c0", "s32"), ("c1", "s32")], max_threads=128)
    nbytes = BOX_INNER * 2 * box_outer
    tid = k.tid()
    base = k.and_(k.add(k.dynamic_shared(), 1023), -1024 & 0xFFFFFFFF)
    bar = k.add(base, nbytes)
    first = k.setp("eq", tid, 0)
    with k.if_(first):
        k.mbarrier_init(bar, 1)
    k.fence_mbarrier_init()
    k.bar_sync()
    with k.if_(first):
        k.mbarrier_expect_tx(bar, nbytes)
        k.cp_async_bulk_tensor_2d(base, k.param_address("xmap"), k.param("c0"), k.param("c1"), bar)
    k.mbarrier_wait(bar, 0)
    y = k.global_ptr("y")
    with k.loop(tid, nbytes // 4, 128) as i:
        v = k.load("shared", "u32", k.add(base, k.shl(i, 2)))
        k.store("global", "u32", k.add(y, k.mul_wide(i, 4)), v)
    k.ret()
    return m.emit()


def _expected(x: np.ndarray, c0: int, c1: int, box_outer: int) -> np.ndarray:
    """The landed bytes, written out directly: the box (zeros outside x), then each row's pieces swizzled."""
    rows, cols = x.shape
    box = np.zeros((box_outer, BOX_INNER), np.float16)
    for r in range(box_outer):
        for c in range(BOX_INNER):
            if 0 <= c1 + r < rows and 0 <= c0 + c < cols:
                box[r, c] = x[c1 + r, c0 + c]
    raw = box.view(np.uint8).reshape(box_outer, 8, 16)
    out = np.empty_like(raw)
    for r in range(box_outer):
        for p in range(8):
            out[r, p ^ (r % 8)] = raw[r, p]
    return out.reshape(-1)


@settings(max_examples=examples(12), deadline=None)
@given(rows=st.integers(1, 40), chunks=st.integers(1, 3), box_outer=st.sampled_from([8, 16, 24]),
       pad=st.sampled_from([0, 8]), data=st.data())
def test_tensor_copy_lands_the_swizzled_box(rows, chunks, box_outer, pad, data):
    cols = 64 * chunks
    c0 = 64 * data.draw(st.integers(0, chunks - 1)) + data.draw(st.sampled_from([0, 8, 40]))  # (past the end: zeros)
    c1 = data.draw(st.integers(-3, rows + 2))
    rng = np.random.default_rng(rows * 7 + chunks)
    stride = cols + pad  # elements between rows (lda)
    x = (rng.standard_normal((rows, stride)) + 0.5).astype(np.float16)
    mem = Memory()
    xa = mem.alloc_array(x)
    tmap = tm.encode(tm.TensorMap2d(xa, cols, rows, 2 * stride, BOX_INNER, box_outer, 2, 128))
    nbytes = BOX_INNER * 2 * box_outer
    y = mem.alloc_array(np.full(nbytes // 4, 0xFFFFFFFF, np.uint32))
    run(_kernel(box_outer), grid=(1,), block=(128,), params=dict(xmap=tmap, y=y, c0=c0, c1=c1), memory=mem,
        shared_bytes=nbytes + 1024 + 8)
    got = mem.read(y, np.uint8, nbytes)
    np.testing.assert_array_equal(got, _expected(x[:, :cols], c0, c1, box_outer))


def test_tensor_copy_assembles():
    rep = assemble(_kernel(16), "sm_90a")[0]
    assert not rep.spills


def test_emulated_tensor_map_checks():
    ok = tm.TensorMap2d(4096, 64, 8, 128, 64, 8, 2, 128)
    assert tm.decode(tm.encode(ok)) == ok
    with pytest.raises(ValueError, match="16-byte aligned"):
        tm.encode(tm.TensorMap2d(4100, 64, 8, 128, 64, 8, 2, 128))
    with pytest.raises(ValueError, match="row stride"):
        tm.encode(tm.TensorMap2d(4096, 64, 8, 120, 64, 8, 2, 128))
    with pytest.raises(ValueError, match="box dimensions"):
        tm.encode(tm.TensorMap2d(4096, 64, 8, 128, 64, 300, 2, 128))
    with pytest.raises(ValueError, match="128-byte swizzle"):
        tm.encode(tm.TensorMap2d(4096, 64, 8, 128, 32, 8, 2, 128))


def test_a_tensor_map_parameter_is_passed_by_value():
    ptx = _kernel(8)
    assert ".param .align 64 .b8 tile_copy_param_xmap[128]" in ptx and "cvta.param.u64" in ptx
    with pytest.raises(Exception, match="bytes"):  # (a pointer where the map's bytes go)
        run(ptx, grid=(1,), block=(128,), params=dict(xmap=4096, y=0, c0=0, c1=0), memory=Memory(),
            shared_bytes=4096)


def test_kernel_args_carry_a_tensor_map_by_value():
    from ptx_gen.builder import Param
    from ptx_gen.operands import TENSOR_MAP_BYTES
    from ptx_gen.types import ptx_type
    from realizar.cuda.args import KernelArgs
    from realizar.errors import ShapeError

    params = (Param("xmap", ptx_type("b8"), TENSOR_MAP_BYTES, 64), Param("n", ptx_type("u32")))
    raw = bytes(range(128))
    args = KernelArgs(params, raw, 7)
    assert args.get("xmap") == raw and args.get("n") == 7
    dup = args.copy()
    args.set("xmap", bytes(128))
    assert dup.get("xmap") == raw and args.get("xmap") == bytes(128)  # (the copy owns its bytes)
    assert args.snapshot()[:128] == bytes(128) and "xmap=<128 bytes>" in repr(args)
    with pytest.raises(ShapeError, match="128 bytes"):
        args.set("xmap", raw[:64])
    with pytest.raises(ShapeError, match="128 bytes"):
        args.set("xmap", 12345)


def test_tensor_map_encoding_on_the_emulated_device():
    from realizar import cuda
    from realizar.cuda.tensormap import f16_tiles_2d
    from realizar.errors import ShapeError

    dev = cuda.EmulatedDevice(target="sm_90")
    raw = f16_tiles_2d(dev, 4096, 256, 40, 512, 64, 128)
    assert tm.decode(raw) == tm.TensorMap2d(4096, 256, 40, 512, 64, 128, 2, 128)
    with pytest.raises(ShapeError, match="row stride"):
        f16_tiles_2d(dev, 4096, 256, 40, 500, 64, 128)
    with pytest.raises(ShapeError, match="box dimensions"):
        f16_tiles_2d(dev, 4096, 256, 40, 512, 64, 512)


def test_a_launch_frees_its_tensor_map_copy():
    mem = Memory()
    x = mem.alloc_array(np.ones((8, 64), np.float16))
    tmap = tm.encode(tm.TensorMap2d(x, 64, 8, 128, 64, 8, 2, 128))
    y = mem.alloc_array(np.zeros(256, np.uint32))
    before = dict(mem.allocs)
    run(_kernel(8), grid=(1,), block=(128,), params=dict(xmap=tmap, y=y, c0=0, c1=0), memory=mem,
        shared_bytes=1024 + 1024 + 8)
    assert mem.allocs == before
