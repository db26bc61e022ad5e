"""CPU tests of the transformer-layer kernels other than the GEMV/GEMM family (embedding, RMSNorm,
RoPE, the elementwise kernels, argmax): every kernel assembles with ptxas for sm_80 and sm_90 over
hypothesis-drawn shapes, bad shapes of every kernel (the GEMV's included) are rejected with a clear
error, and (through the PTX emulator ``ptx_gen.emulator``) every kernel matches its float64 oracle on
small shapes, with memcheck/racecheck-style checks on every access. The GEMV/GEMM kernels are in
tests/test_gemv_ptx.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ptx_gen import catalog
from ptx_gen.kernels.gemv.quant_layout import K_QUANTS, WEIGHT_TYPES
from ptx_gen.kernels.elementwise.rmsnorm import default_block
from ptx_gen.kernels.elementwise.rope import inv_freq_table
from tests.layer_oracles import dequant, random_weight, rmsnorm_oracle, rope_oracle, silu
from ptx_gen.emulator import Memory, run as simt_run
from tests.layer_kernels_ptx_cases import _assemble_all, _in_dims, _pad16
from tests.helpers import examples


# ---------------------------------------------------------------------------------------------
# ptxas over drawn shapes


@settings(max_examples=examples(12), deadline=None)
@given(data=st.data(), wtype=st.sampled_from(WEIGHT_TYPES), warps=st.sampled_from([1, 2, 4]))
def test_embedding_assembles(data, wtype, warps):
    _assemble_all("embedding", wtype=wtype, hidden=data.draw(_in_dims(wtype)), warps=warps)


@settings(max_examples=examples(12), deadline=None)
@given(hidden=st.integers(1, 4096).map(lambda n: 4 * n), residual=st.booleans(), f16=st.booleans())
def test_rmsnorm_assembles(hidden, residual, f16):
    _assemble_all("rmsnorm_f16" if f16 else "rmsnorm", hidden=hidden, block=default_block(hidden), residual=residual)


@settings(max_examples=examples(12), deadline=None)
@given(half=st.integers(1, 128), frac=st.floats(0.1, 1.0), neox=st.booleans(), pb=st.booleans())
def test_rope_assembles(half, frac, neox, pb):
    head_dim = 2 * half
    rot_dim = max(2, int(head_dim * frac) // 2 * 2)
    _assemble_all("rope", head_dim=head_dim, rot_dim=rot_dim, neox=neox, pos_from_buffer=pb)


@pytest.mark.parametrize("name,shape", [("swiglu", {"vec": 4}), ("swiglu", {"vec": 1}), ("swiglu_f16", {"vec": 4}),
                                        ("swiglu_f16", {"vec": 2}), ("swiglu_f16", {"vec": 1}), ("residual_add", {"vec": 4}),
                                        ("bias_add", {}), ("argmax_partial", {"block": 256}),
                                        ("argmax_final", {"block": 1024}),
                                        ("argmax_pack", {"block": 1024}), ("argmax_pack", {"block": 128})])
def test_small_kernels_assemble(name, shape):
    _assemble_all(name, **shape)


# ---------------------------------------------------------------------------------------------
# validation


@pytest.mark.parametrize("wtype,bad", [("Q8_0", 100), ("Q4_0", 48), ("Q4_K", 576), ("Q6_K", 4000), ("Q5_K", 128),
                                       ("F16", 12), ("F32", 3)])
def test_row_length_not_multiple_of_block_rejected(wtype, bad):
    for name in ("gemv", "embedding"):
        kw = {"in_dim": bad} if name == "gemv" else {"hidden": bad}
        with pytest.raises(ValueError, match="multiple"):
            catalog.emit(name, wtype=wtype, **kw)


def test_bad_parameters_rejected():
    with pytest.raises(ValueError, match="unsupported weight type"):
        catalog.emit("gemv", wtype="Q2_K", in_dim=256)
    with pytest.raises(ValueError, match="rows must be"):
        catalog.emit("gemv", wtype="Q8_0", in_dim=256, rows=5)
    with pytest.raises(ValueError, match="glu"):
        catalog.emit("gemv", wtype="Q8_0", in_dim=256, rows=1, glu=True)
    with pytest.raises(ValueError, match="rows \\* tokens"):
        catalog.emit("gemm", wtype="Q8_0", in_dim=256, rows=2, tokens=8)
    with pytest.raises(ValueError, match="ksplit must be one of"):
        catalog.emit("gemv", wtype="Q8_0", in_dim=256, warps=4, ksplit=3)
    with pytest.raises(ValueError, match="ksplit must divide warps"):
        catalog.emit("gemv", wtype="Q8_0", in_dim=256, warps=2, ksplit=4)
    with pytest.raises(ValueError, match="no shape parameter"):
        catalog.emit("gemm", wtype="Q8_0", in_dim=256, ksplit=2)
    with pytest.raises(ValueError, match="hidden"):
        catalog.emit("rmsnorm", hidden=6)
    with pytest.raises(ValueError, match="head_dim"):
        catalog.emit("rope", head_dim=7)


def test_inv_freq_table():
    t = inv_freq_table(128, 500000.0)
    assert t.dtype == np.float32 and t.shape == (64,)
    np.testing.assert_allclose(t, 500000.0 ** (-np.arange(0, 128, 2) / 128), rtol=1e-7)
    lin = inv_freq_table(64, 10000.0, {"type": "linear", "factor": 4.0})
    np.testing.assert_allclose(lin, inv_freq_table(64, 10000.0) / 4, rtol=1e-6)
    l3 = inv_freq_table(128, 500000.0, {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position": 8192})
    assert l3[0] == t[0] and l3[-1] == pytest.approx(t[-1] / 8)


# ---------------------------------------------------------------------------------------------
# emulated runs vs float64 oracles


@settings(max_examples=examples(12), deadline=None)
@given(wtype=st.sampled_from(WEIGHT_TYPES), mult=st.integers(1, 9), warps=st.sampled_from([1, 2, 4]),
       seed=st.integers(0, 2**32 - 1))
def test_embedding_emulated_matches_dequantize(wtype, mult, warps, seed):
    rng = np.random.default_rng(seed)
    hidden = mult * (256 if wtype in K_QUANTS else 64)
    vocab = 5
    raw = random_weight(rng, wtype, vocab, hidden)
    toks = np.array([4, 0, 2, 1000], np.uint32)
    mem = Memory()
    p = dict(table=mem.alloc_array(_pad16(raw)), tokens=mem.alloc_array(toks), out=mem.alloc(4 * hidden * 4), vocab=vocab)
    k = catalog.emit("embedding", wtype=wtype, hidden=hidden, warps=warps)
    simt_run(k.ptx, grid=(4,), block=(k.meta["block"],), params=p, memory=mem)
    out = mem.read(p["out"], np.float32, 4 * hidden).reshape(4, hidden)
    ref = dequant(raw, wtype, vocab, hidden)[np.minimum(toks, vocab - 1)]
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())


@settings(max_examples=examples(10), deadline=None)
@given(hidden=st.sampled_from([64, 576, 896, 4100, 16384]), rows=st.integers(1, 3), residual=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_rmsnorm_emulated(hidden, rows, residual, seed):
    rng = np.random.default_rng(seed)
    blk = default_block(hidden)
    k = catalog.emit("rmsnorm", hidden=hidden, block=blk, residual=residual)
    x = rng.standard_normal((rows, hidden)).astype(np.float32)
    w = rng.standard_normal(hidden).astype(np.float32)
    r = rng.standard_normal((rows, hidden)).astype(np.float32)
    mem = Memory()
    p = dict(x=mem.alloc_array(x), weight=mem.alloc_array(w), y=mem.alloc(x.nbytes), eps=1e-5)
    if residual:
        p["residual"] = mem.alloc_array(r)
    simt_run(k.ptx, grid=(rows,), block=(blk,), params=p, memory=mem)
    y = mem.read(p["y"], np.float32, x.size).reshape(x.shape)
    ref, h = rmsnorm_oracle(x, w, 1e-5, r if residual else None)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    if residual:
        np.testing.assert_array_equal(mem.read(p["residual"], np.float32, x.size).reshape(x.shape), r + x)


def _f16_ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Distance in f16 units in the last place between two f16 arrays (both finite)."""
    def ordered(x):
        bits = np.asarray(x, np.float16).view(np.uint16).astype(np.int32)
        return np.where(bits & 0x8000, -(bits & 0x7FFF), bits)
    return np.abs(ordered(a) - ordered(b))


@settings(max_examples=examples(10), deadline=None)
@given(hidden=st.sampled_from([64, 576, 896, 4100, 16384]), rows=st.integers(1, 5), residual=st.booleans(),
       scale=st.sampled_from([1e-3, 1.0, 50.0]), seed=st.integers(0, 2**32 - 1))
def test_rmsnorm_f16_emulated(hidden, rows, residual, scale, seed):
    """The f16 output is the f32 kernel's result rounded to nearest (within 1 ulp) and within f16
    rounding of the float64 oracle; the residual is written back in f32 as in the f32 kernel."""
    rng = np.random.default_rng(seed)
    blk = default_block(hidden)
    x = rng.standard_normal((rows, hidden)).astype(np.float32)
    w = (rng.standard_normal(hidden) * scale).astype(np.float32)
    r = rng.standard_normal((rows, hidden)).astype(np.float32)
    outs = {}
    for name, dtype in (("rmsnorm", np.float32), ("rmsnorm_f16", np.float16)):
        mem = Memory()
        p = dict(x=mem.alloc_array(x), weight=mem.alloc_array(w), y=mem.alloc_array(np.full(x.shape, np.nan, dtype)),
                 eps=1e-5)
        if residual:
            p["residual"] = mem.alloc_array(r)
        k = catalog.emit(name, hidden=hidden, block=blk, residual=residual)
        simt_run(k.ptx, grid=(rows,), block=(blk,), params=p, memory=mem)
        outs[name] = mem.read(p["y"], dtype, x.size).reshape(x.shape)
        if residual:
            np.testing.assert_array_equal(mem.read(p["residual"], np.float32, x.size).reshape(x.shape), r + x)
    y16 = outs["rmsnorm_f16"]
    assert np.isfinite(y16).all()
    assert _f16_ulps(y16, outs["rmsnorm"].astype(np.float16)).max() <= 1
    ref, _ = rmsnorm_oracle(x, w, 1e-5, r if residual else None)
    err = np.abs(y16.astype(np.float64) - ref)
    assert (err <= 2.0**-11 * np.abs(ref) + 2.0**-24 + 1e-5 * np.abs(ref).max()).all()


def test_layer_ops_rmsnorm_rows_to_f16():
    """LayerOps.rmsnorm(rows=S, out_f16=True) on an emulated device: S rows into a float16 buffer (the
    residual form too); a float32 ``out`` is refused."""
    from realizar import cuda
    from realizar.errors import ShapeError
    from realizar.gpu.ops import LayerOps

    ops = LayerOps(cuda.EmulatedDevice(sm_count=4))
    rng = np.random.default_rng(5)
    rows, hidden = 9, 576
    x = rng.standard_normal((rows, hidden)).astype(np.float32)
    w = rng.standard_normal(hidden).astype(np.float32)
    r = rng.standard_normal((rows, hidden)).astype(np.float32)
    for residual in (None, r):
        out = ops.buffer(rows * hidden, np.float16)
        out.poison()
        res = ops.to_device(residual) if residual is not None else None
        ops.rmsnorm(ops.to_device(x), ops.to_device(w), out, 1e-6, rows=rows, residual=res, out_f16=True)
        ref, h = rmsnorm_oracle(x, w, 1e-6, residual)
        y = out.to_numpy((rows, hidden)).astype(np.float64)
        assert np.isfinite(y).all() and (np.abs(y - ref) <= 2.0**-11 * np.abs(ref) + 1e-5 * np.abs(ref).max()).all()
        if res is not None:
            np.testing.assert_array_equal(res.to_numpy((rows, hidden)), r + x)
    with pytest.raises(ShapeError, match="out must hold float16"):
        ops.rmsnorm(ops.to_device(x), ops.to_device(w), ops.buffer(rows * hidden), 1e-6, rows=rows, out_f16=True)


@settings(max_examples=examples(10), deadline=None)
@given(head_dim=st.sampled_from([64, 80, 96, 128, 256]), partial=st.booleans(), neox=st.booleans(), pb=st.booleans(),
       nq=st.integers(1, 5), nkv=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_rope_emulated(head_dim, partial, neox, pb, nq, nkv, seed):
    rng = np.random.default_rng(seed)
    rot = head_dim // 2 if partial else head_dim
    T = 3
    q = rng.standard_normal((T, nq, head_dim)).astype(np.float32)
    kk = rng.standard_normal((T, nkv, head_dim)).astype(np.float32)
    inv = inv_freq_table(rot, 10000.0)
    positions = rng.integers(0, 200000, T).astype(np.uint32)
    k = catalog.emit("rope", head_dim=head_dim, rot_dim=rot, neox=neox, pos_from_buffer=pb)
    mem = Memory()
    p = dict(q=mem.alloc_array(q), k=mem.alloc_array(kk), inv_freq=mem.alloc_array(inv), n_q=nq, n_kv=nkv)
    if pb:
        p["positions"] = mem.alloc_array(positions)
        pos = positions
    else:
        p["pos"] = int(positions[0])
        pos = positions[0] + np.arange(T)
    simt_run(k.ptx, grid=(-(-(nq + nkv) * (rot // 2) // 128), T), block=(128,), params=p, memory=mem)
    for name, v in (("q", q), ("k", kk)):
        got = mem.read(p[name], np.float32, v.size).reshape(v.shape)
        for t in range(T):
            ang = (np.float32(pos[t]) * inv).astype(np.float64)  # the f32 angle of a float32 reference
            src = v[t].astype(np.float64)
            ref = rope_oracle(src, ang, neox, rot)
            np.testing.assert_allclose(got[t], ref, atol=2e-6 * np.abs(src).max(), err_msg=f"{name}[{t}]")


@settings(max_examples=examples(8), deadline=None)
@given(n=st.integers(1, 3000), vec=st.sampled_from([1, 4]), seed=st.integers(0, 2**32 - 1))
def test_elementwise_emulated(n, vec, seed):
    rng = np.random.default_rng(seed)
    g = (rng.standard_normal(n) * 5).astype(np.float32)
    u = rng.standard_normal(n).astype(np.float32)
    mem = Memory()
    dg, du, do = mem.alloc_array(g), mem.alloc_array(u), mem.alloc(4 * n)
    grid = (-(-n // (256 * vec)),)
    simt_run(catalog.emit("swiglu", vec=vec).ptx, grid=grid, block=(256,), params=dict(gate=dg, up=du, out=do, n=n), memory=mem)
    np.testing.assert_allclose(mem.read(do, np.float32, n), silu(g) * u, rtol=1e-6, atol=1e-7)
    simt_run(catalog.emit("residual_add", vec=vec).ptx, grid=grid, block=(256,), params=dict(a=dg, b=du, out=dg, n=n),
             memory=mem)
    np.testing.assert_array_equal(mem.read(dg, np.float32, n), g + u)
    cols = max(1, n // 3)
    y = rng.standard_normal((3, cols)).astype(np.float32)
    b = rng.standard_normal(cols).astype(np.float32)
    dy = mem.alloc_array(y)
    simt_run(catalog.emit("bias_add").ptx, grid=(-(-cols // 256), 3), block=(256,),
             params=dict(y=dy, bias=mem.alloc_array(b), n_cols=cols), memory=mem)
    np.testing.assert_array_equal(mem.read(dy, np.float32, y.size).reshape(y.shape), y + b)


@settings(max_examples=examples(8), deadline=None)
@given(n=st.integers(1, 3000), vec=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2**32 - 1))
def test_swiglu_f16_emulated(n, vec, seed):
    """silu(gate) * up in f32, written as f16 (nearest even) into a NaN-poisoned buffer: every element
    within one f16 rounding of the float64 oracle, the tail past a multiple of vec included."""
    rng = np.random.default_rng(seed)
    g = (rng.standard_normal(n) * 5).astype(np.float32)
    u = rng.standard_normal(n).astype(np.float32)
    mem = Memory()
    dg, du = mem.alloc_array(g), mem.alloc_array(u)
    do = mem.alloc_array(np.full(n + 1, np.nan, np.float16))  # one past the end stays NaN
    simt_run(catalog.emit("swiglu_f16", vec=vec).ptx, grid=(-(-n // (256 * vec)),), block=(256,),
             params=dict(gate=dg, up=du, out=do, n=n), memory=mem)
    got = mem.read(do, np.float16, n + 1)
    g64, u64 = g.astype(np.float64), u.astype(np.float64)
    ref = g64 / (1.0 + np.exp(-g64)) * u64
    assert np.isnan(got[n]) and not np.isnan(got[:n]).any()
    np.testing.assert_allclose(got[:n].astype(np.float64), ref, rtol=2.0**-10, atol=2.0**-24)


@settings(max_examples=examples(12), deadline=None)
@given(n=st.integers(1, 70000), parts=st.integers(1, 40), mode=st.sampled_from(["plain", "ties", "nan", "zeros", "inf"]),
       seed=st.integers(0, 2**32 - 1))
def test_argmax_emulated_exact(n, parts, mode, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32)
    idx = rng.integers(0, n, 3)
    if mode == "ties":
        x[idx] = x.max() + 1
    elif mode == "nan":
        x[idx] = np.nan
    elif mode == "zeros":
        x[:] = -1.0
        x[idx[0]], x[idx[1]] = -0.0, 0.0
    elif mode == "inf":
        x[idx] = -np.inf
        x[idx[0]] = np.inf
    mem = Memory()
    dx, dp, do = mem.alloc_array(x), mem.alloc(8 * parts), mem.alloc(4)
    simt_run(catalog.emit("argmax_partial", block=256).ptx, grid=(parts,), block=(256,),
             params=dict(x=dx, partials=dp, n=n), memory=mem)
    simt_run(catalog.emit("argmax_final", block=128).ptx, grid=(1,), block=(128,),
             params=dict(partials=dp, out=do, n_partials=parts), memory=mem)
    assert int(mem.read(do, np.uint32, 1)[0]) == int(np.argmax(x))


@settings(max_examples=examples(12), deadline=None)
@given(n=st.integers(2, 20000), ranks=st.integers(1, 5), parts=st.integers(1, 12),
       mode=st.sampled_from(["plain", "ties", "nan", "zeros"]), seed=st.integers(0, 2**32 - 1))
def test_argmax_over_slices_emulated_exact(n, ranks, parts, mode, seed):
    """The tensor-parallel argmax: each slice of x (a rank's vocabulary piece, the last one shorter)
    reduced to a packed candidate with its global index (argmax_partial + argmax_pack), the candidates
    side by side reduced by argmax_final: np.argmax of the whole x, ties across slices included."""
    rng = np.random.default_rng(seed)
    ranks = min(ranks, n)
    x = rng.standard_normal(n).astype(np.float32)
    per = -(-n // ranks)
    bounds = [(min(r * per, n), min((r + 1) * per, n)) for r in range(ranks)]
    bounds = [(a, b) for a, b in bounds if b > a]
    if mode == "ties":  # equal maxima in several slices: the lowest global index must win
        x[[a + (b - a) // 2 for a, b in bounds]] = x.max() + 1
    elif mode == "nan":
        x[rng.integers(0, n, 2)] = np.nan
    elif mode == "zeros":
        x[:] = -1.0
        x[bounds[-1][0]] = 0.0
        x[bounds[0][0]] = -0.0
    mem = Memory()
    dc, do = mem.alloc(8 * len(bounds)), mem.alloc(4)
    for r, (a, b) in enumerate(bounds):
        dx, dp = mem.alloc_array(np.ascontiguousarray(x[a:b])), mem.alloc(8 * parts)
        simt_run(catalog.emit("argmax_partial", block=256).ptx, grid=(parts,), block=(256,),
                 params=dict(x=dx, partials=dp, n=b - a), memory=mem)
        simt_run(catalog.emit("argmax_pack", block=128).ptx, grid=(1,), block=(128,),
                 params=dict(partials=dp, out=dc + 8 * r, n_partials=parts, base=a), memory=mem)
    simt_run(catalog.emit("argmax_final", block=128).ptx, grid=(1,), block=(128,),
             params=dict(partials=dc, out=do, n_partials=len(bounds)), memory=mem)
    assert int(mem.read(do, np.uint32, 1)[0]) == int(np.argmax(x))
