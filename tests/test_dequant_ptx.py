"""CPU tests of ``dequant_f16`` (a GGUF weight expanded to a row-major f16 matrix) and its host op
``LayerOps.dequantize_f16``: the kernel assembles with ptxas for sm_80, sm_89 and sm_90 over drawn shapes
and without spills at the real ones; in the PTX emulator, for every weight type, layout and
interleaving, over drawn shapes, every element of the NaN-poisoned output is bitwise the f16 rounding
(nearest, ties to even) of the float32 reference dequantization (``gguf.quants.dequantize``), and
nothing past the matrix is written; edge values (overflow, zeros, subnormals, the documented double
rounding of Q4_1) come out as the kernel's docstring says; bad shapes raise clear errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ptx_gen import catalog
from ptx_gen.emulator import Memory, run as simt_run
from ptx_gen.kernels.dequant.dequant import DEFAULT_ROUNDS, LAYOUTS, check_shape, total_rounds
from ptx_gen.kernels.gemv.gemv_mma_layout import MMA_TYPES, tile_major
from ptx_gen.kernels.gemv.quant_layout import DENSE, K_QUANTS, WEIGHT_TYPES
from ptx_gen.ptxas import assemble
from realizar import cuda
from realizar.errors import ShapeError
from realizar.gpu.dequant import dequant_warps
from realizar.gpu.ops import GpuWeight, LayerOps
from tests.layer_oracles import dequant, random_weight
from tests.helpers import examples, tiered

TARGETS = ("sm_80", "sm_89", "sm_90")
NAN16 = 0x7E00
CASES = [(wt, lay) for wt in WEIGHT_TYPES for lay in LAYOUTS if lay == "rows" or wt in MMA_TYPES]
REAL_IN = (576, 1536, 2048, 4096, 8192, 14336)


def _block(wtype: str, layout: str) -> int:
    return 256 if wtype in K_QUANTS or layout != "rows" else (8 if wtype in DENSE else 32)


def _rounds(wtype: str, layout: str, warps: int = 1):
    """The valid ``rounds`` values of a type and layout (0: the default) for CTAs of ``warps``."""
    ok = []
    for g in (0, 1, 2, 4, 8, 16):
        try:
            check_shape(wtype, 256, layout, g)
            catalog.emit("dequant_f16", wtype=wtype, in_dim=256, layout=layout, warps=warps, rounds=g)
            ok.append(g)
        except ValueError:
            pass
    return st.sampled_from(ok)


def _assemble(**shape) -> None:
    for tgt in TARGETS:
        k = catalog.emit("dequant_f16", target=tgt, **shape)
        (rep,) = assemble(k.ptx, tgt)
        assert rep.entry == k.entry
        assert not rep.spills, f"dequant_f16 {shape} spills on {tgt}: {rep.log}"


def _reference(raw: np.ndarray, wtype: str, out_dim: int, in_dim: int, interleave: bool) -> np.ndarray:
    """The f16 rounding of the float32 reference values, rows interleaved (gate j, up j) if asked."""
    with np.errstate(over="ignore"):  # (overflow to infinities is the contract)
        ref = dequant(raw, wtype, out_dim, in_dim).astype(np.float16)
    if interleave:
        ref = np.stack([ref[: out_dim // 2], ref[out_dim // 2:]], axis=1).reshape(out_dim, in_dim)
    return ref


def _emulate(raw: np.ndarray, wtype: str, out_dim: int, in_dim: int, layout: str = "rows", interleave: bool = False,
             warps: int = 8, rounds: int = 0) -> np.ndarray:
    """Run the kernel in the emulator on ``raw`` (GGUF rows, laid out as ``layout``); the f16 output bits.
    The output allocation has 64 NaN-poisoned elements past the matrix, checked untouched."""
    data = raw if layout == "rows" else tile_major(raw, wtype, out_dim, in_dim, glu=layout == "glu-tiles")
    data = np.concatenate([data, np.zeros(-data.size % 16, np.uint8)])
    k = catalog.emit("dequant_f16", wtype=wtype, in_dim=in_dim, layout=layout, interleave=interleave, warps=warps,
                     rounds=rounds)
    mem = Memory()
    n = out_dim * in_dim
    p = dict(w=mem.alloc_array(data), out=mem.alloc_array(np.full(n + 64, NAN16, np.uint16)), out_dim=out_dim)
    grid = -(-total_rounds(wtype, in_dim, layout, out_dim) // k.meta["rounds_per_cta"])
    simt_run(k.ptx, grid=(grid,), block=(k.meta["block"],), params=p, memory=mem)
    out = mem.read(p["out"], np.uint16, n + 64)
    assert (out[n:] == NAN16).all(), "written past the matrix"
    return out[:n].reshape(out_dim, in_dim)


def _assert_bitwise(got: np.ndarray, ref: np.ndarray, what: str) -> None:
    bad = np.argwhere(got != ref.view(np.uint16))
    assert bad.size == 0, (f"{what}: {len(bad)} of {got.size} differ, first (row, col) {bad[:4].tolist()}: got "
                           f"{[hex(int(got[tuple(b)])) for b in bad[:4]]}, want "
                           f"{[hex(int(ref.view(np.uint16)[tuple(b)])) for b in bad[:4]]}")


# ---------------------------------------------------------------------------------------------
# ptxas


@settings(max_examples=examples(16), deadline=None)
@given(data=st.data(), case=st.sampled_from(CASES), interleave=st.booleans(), warps=st.sampled_from([1, 2, 4, 8, 16]))
def test_dequant_assembles(data, case, interleave, warps):
    wtype, layout = case
    in_dim = _block(wtype, layout) * data.draw(st.integers(1, 64))
    _assemble(wtype=wtype, in_dim=in_dim, layout=layout, interleave=interleave, warps=warps,
              rounds=data.draw(_rounds(wtype, layout, warps)))


@pytest.mark.parametrize("wtype,layout", tiered(CASES, {0}, unpack=True))
def test_no_spills_at_real_shapes(wtype, layout):
    for i, in_dim in enumerate(d for d in REAL_IN if d % _block(wtype, layout) == 0):
        _assemble(wtype=wtype, in_dim=in_dim, layout=layout, interleave=i % 2 == 1)


# ---------------------------------------------------------------------------------------------
# emulated runs, bitwise against the reference


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("wtype,layout", CASES)
@settings(max_examples=examples(8), deadline=None)
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_dequant_emulated_bitwise(wtype, layout, interleave, data, seed):
    in_dim = _block(wtype, layout) * data.draw(st.integers(1, 6 if layout == "rows" else 3))
    if interleave or layout == "glu-tiles":
        out_dim = 2 * data.draw(st.sampled_from([1, 3, 16, 17]) | st.integers(1, 40))
    else:
        out_dim = data.draw(st.sampled_from([1, 17, 33]) | st.integers(1, 80))
    warps = data.draw(st.sampled_from([1, 2, 8]))
    rounds = data.draw(_rounds(wtype, layout, warps))
    raw = random_weight(np.random.default_rng(seed), wtype, out_dim, in_dim)
    got = _emulate(raw, wtype, out_dim, in_dim, layout, interleave, warps, rounds)
    _assert_bitwise(got, _reference(raw, wtype, out_dim, in_dim, interleave),
                    f"{wtype} {layout} {out_dim}x{in_dim} interleave={interleave} warps={warps} rounds={rounds}")


def test_dense_edge_values():
    """F32/BF16: overflow to infinities (65520 and up), the largest finite f16, ties to even, zeros of both
    signs, f16 subnormals and underflow; F16 copied bit for bit (NaN and infinities included)."""
    edge = np.array([7e4, -7e4, 65519.99, 65520.0, -65504.0, 1 + 2**-11, 1 + 3 * 2**-11, 0.0, -0.0, 2**-24, 2**-25,
                     3 * 2**-26, -2**-20, 1e-30, np.inf, -np.inf], np.float32)
    vals = np.resize(edge, (3, 64)) * np.float32(1)
    for wtype in ("F32", "BF16"):
        raw = (vals if wtype == "F32" else (vals.view(np.uint32) >> 16).astype(np.uint16)).reshape(-1).view(np.uint8)
        got = _emulate(raw, wtype, 3, 64)
        _assert_bitwise(got, _reference(raw, wtype, 3, 64, False), wtype)
    bits = np.random.default_rng(0).integers(0, 2**16, 3 * 64, dtype=np.uint16)  # NaNs and infinities among them
    bits[:4] = [0x7C00, 0xFC00, 0x7E01, 0x8000]
    assert (_emulate(bits.view(np.uint8), "F16", 3, 64) == bits.reshape(3, 64)).all()


def test_quantized_overflow_and_double_rounding():
    """Q8_0 with a large scale overflows to infinities; Q4_1 rounds the float32 value d q + m (as GGUF
    computes it) to f16: where that value is an f16 tie that the exact one is not (d q on a tie, m a
    tiny negative), the result is the tie rounded to even, one f16 step from the exactly rounded value."""
    raw = np.zeros(34 * 4, np.uint8).reshape(4, 34)
    raw[:, :2] = np.array([1024.0], np.float16).view(np.uint8)
    raw[:, 2:] = np.arange(4 * 32).reshape(4, 32).astype(np.int8).view(np.uint8) * 3
    got = _emulate(raw.reshape(-1), "Q8_0", 1, 128)
    ref = _reference(raw.reshape(-1), "Q8_0", 1, 128, False)
    assert np.isinf(ref.astype(np.float32)).sum() > 32
    _assert_bitwise(got, ref, "Q8_0 overflow")
    block = np.zeros(20, np.uint8)
    block[0:2] = np.array([1 + 2**-10], np.float16).view(np.uint8)  # d
    block[2:4] = np.array([0x8001], np.uint16).view(np.uint8)  # m = -2**-24
    block[4:] = 0x33  # every code 3: d q = 3 + 1.5 * 2**-9, midway between two f16 numbers
    got = _emulate(block, "Q4_1", 1, 32).view(np.float16)
    exact = np.float64(3 + 1.5 * 2**-9) - 2**-24
    assert (got == np.float16(3 + 2**-8)).all()  # the f32 value is the tie: rounded to even
    assert np.float16(exact) == np.float16(3 + 2**-9)  # (rounding the exact value once goes down)


# ---------------------------------------------------------------------------------------------
# the host op on the emulated device


@pytest.fixture(scope="module")
def ops():
    return LayerOps(cuda.EmulatedDevice(sm_count=4))


@pytest.mark.parametrize("wtype,layout,out_dim,in_dim,interleave", [
    ("Q4_K", "rows", 6, 512, True), ("Q6_K", "glu-tiles", 34, 256, True), ("Q8_0", "tiles", 33, 256, False),
    ("Q5_1", "rows", 3, 96, False), ("BF16", "rows", 4, 40, True),
])
def test_host_op_emulated(ops, wtype, layout, out_dim, in_dim, interleave):
    raw = random_weight(np.random.default_rng(out_dim), wtype, out_dim, in_dim)
    w = GpuWeight(data=raw, ggml_type=wtype, shape=(out_dim, in_dim), layout=layout, device=ops.device)
    n = out_dim * in_dim
    out = cuda.GpuBuffer(n + 16, np.float16, device=ops.device)
    out.copy_from_host(np.full(n + 16, NAN16, np.uint16).view(np.float16))
    ops.dequantize_f16(w, (out, 8), interleave=interleave)  # at an element offset (16-byte aligned)
    got = out.to_numpy().view(np.uint16)
    assert (got[:8] == NAN16).all() and (got[8 + n:] == NAN16).all()
    _assert_bitwise(got[8:8 + n].reshape(out_dim, in_dim), _reference(raw, wtype, out_dim, in_dim, interleave),
                    f"host op {wtype} {layout}")
    name, grid, block = ops.device.launches[-1][:3]
    warps = dequant_warps(wtype)
    assert name.startswith("dequant_f16") and block[0] == 32 * warps
    assert grid[0] == -(-total_rounds(wtype, in_dim, layout, out_dim) // (warps * DEFAULT_ROUNDS[wtype]))


def test_host_op_errors(ops):
    dev = ops.device
    raw = random_weight(np.random.default_rng(0), "Q8_0", 3, 64)
    w = GpuWeight(data=raw, ggml_type="Q8_0", shape=(3, 64), device=dev)
    out = cuda.GpuBuffer(3 * 64, np.float16, device=dev)
    with pytest.raises(ShapeError, match="even number of rows, got 3"):
        ops.dequantize_f16(w, out, interleave=True)
    with pytest.raises(ShapeError, match="needs 192 elements .* holds 191"):
        ops.dequantize_f16(w, cuda.GpuBuffer(191, np.float16, device=dev))
    with pytest.raises(ShapeError, match="must hold float16, got float32"):
        ops.dequantize_f16(w, cuda.GpuBuffer(192, np.float32, device=dev))
    with pytest.raises(ShapeError, match="16-byte aligned"):
        ops.dequantize_f16(w, (cuda.GpuBuffer(200, np.float16, device=dev), 4))
    with pytest.raises(ShapeError, match="must be a GpuWeight"):
        ops.dequantize_f16(raw, out)
    big = GpuWeight.__new__(GpuWeight)  # (a weight's shape alone: no 8 GiB allocation)
    big.out_dim, big.in_dim, big.wtype, big.layout, big.name = 2**20, 2**12, "Q8_0", "rows", "big"
    with pytest.raises(ShapeError, match="fewer than 4294967296"):
        ops.dequantize_f16(big, out)


def test_kernel_shape_errors():
    emit = lambda **s: catalog.emit("dequant_f16", **s)  # noqa: E731
    with pytest.raises(ValueError, match="layout must be one of"):
        emit(wtype="Q4_K", in_dim=256, layout="cols")
    with pytest.raises(ValueError, match="stored tile-major"):
        emit(wtype="F16", in_dim=256, layout="tiles")
    with pytest.raises(ValueError, match="stored tile-major"):
        emit(wtype="Q8_0", in_dim=576, layout="glu-tiles")
    with pytest.raises(ValueError, match="multiple of the block size"):
        emit(wtype="Q4_K", in_dim=576)
    with pytest.raises(ValueError, match="multiple of 8"):
        emit(wtype="F16", in_dim=12)
    with pytest.raises(ValueError, match="16-byte pieces"):
        emit(wtype="Q6_K", in_dim=256, rounds=4)
    with pytest.raises(ValueError, match="rounds dividing 16"):
        emit(wtype="Q8_0", in_dim=256, layout="tiles", rounds=3)
    with pytest.raises(ValueError, match="rounds must be"):
        emit(wtype="Q8_0", in_dim=256, rounds=32)
    with pytest.raises(ValueError, match="warps must be"):
        emit(wtype="Q8_0", in_dim=256, warps=3)
    with pytest.raises(ValueError, match="bytes of shared memory, more than 49152"):
        emit(wtype="Q5_K", in_dim=256, warps=16, rounds=16)
    with pytest.raises(ValueError, match="at most 4 rounds, got 8"):
        emit(wtype="F32", in_dim=256, rounds=8)
