"""CPU tests of the mixture-of-experts kernels (``moe_route``, ``moe_combine``) in the PTX emulator: hypothesis
draws the expert counts, experts a token, rows, renormalisation and logits (ties included, never all equal), the
outputs are NaN-poisoned and every element is checked against the NumPy reference's router
(:func:`realizar.models.reference.route`, float64) and a float64 weighted sum; bad shapes are refused."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ptx_gen import catalog
from ptx_gen.emulator import Memory, run
from realizar.models.config import ModelConfig
from realizar.models.reference import route
from tests.helpers import examples


def _launch(name: str, shape: dict, grid, block, arrays: dict, scalars: dict, outputs: tuple) -> dict:
    kern = catalog.emit(name, target="sm_90", **shape)
    mem = Memory()
    values = {**scalars}
    addrs = {}
    for p in kern.params:
        if p.name in arrays:
            addrs[p.name] = values[p.name] = mem.alloc_array(arrays[p.name])
    run(kern.ptx, grid, block, values, mem, 0)
    return {o: mem.read(addrs[o], arrays[o].dtype, arrays[o].size).copy() for o in outputs}


@settings(max_examples=examples(25), deadline=None)
@given(experts=st.sampled_from([1, 5, 8, 32, 33, 60, 128, 256]), data=st.data(), rows=st.integers(1, 9),
       norm=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_route_matches_the_reference(experts, data, rows, norm, seed):
    used = data.draw(st.integers(1, min(experts, 8)))
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((rows, experts)).astype(np.float32) * 3
    if data.draw(st.booleans()):  # coarse values: many exact ties, broken towards the lower expert
        logits = np.round(logits).astype(np.float32) + 0.5
    kern = catalog.emit("moe_route", target="sm_90", experts=experts, used=used, norm=norm)
    out = _launch("moe_route", dict(experts=experts, used=used, norm=norm),
                  (-(-rows // kern.meta["rows_per_cta"]),), (kern.meta["block"],),
                  {"logits": logits.reshape(-1), "ids": np.full(rows * used, 0xFFFFFFFF, np.uint32),
                   "weights": np.full(rows * used, np.nan, np.float32)}, {"rows": rows}, ("ids", "weights"))
    c = ModelConfig("qwen3moe", 16, 8, 1, 2, 1, 4, 0, num_experts=experts, num_experts_used=used,
                    expert_ffn_size=4, expert_weights_norm=norm)
    want_ids, want_w = route(logits, c)
    np.testing.assert_array_equal(out["ids"].reshape(rows, used), want_ids)
    np.testing.assert_allclose(out["weights"].reshape(rows, used), want_w, rtol=2e-5, atol=1e-7)


@settings(max_examples=examples(15), deadline=None)
@given(used=st.integers(1, 8), rows=st.integers(1, 4), hidden=st.integers(1, 700), block=st.sampled_from([64, 256]),
       seed=st.integers(0, 2**32 - 1))
def test_combine_adds_the_weighted_experts(used, rows, hidden, block, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, hidden)).astype(np.float32)
    y = rng.standard_normal((rows, used, hidden)).astype(np.float32)
    w = rng.random((rows, used)).astype(np.float32) + 0.01
    out = _launch("moe_combine", dict(used=used, block=block), (-(-hidden // block), rows), (block,),
                  {"x": x.reshape(-1).copy(), "y": y.reshape(-1), "weights": w.reshape(-1)}, {"hidden": hidden},
                  ("x",))
    want = x.astype(np.float64) + np.einsum("rs,rsh->rh", w.astype(np.float64), y.astype(np.float64))
    np.testing.assert_allclose(out["x"].reshape(rows, hidden), want, rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_refused():
    for bad, match in [({"experts": 0}, "experts"), ({"experts": 513}, "experts"), ({"experts": 4, "used": 5}, "used"),
                       ({"experts": 128, "used": 33}, "used")]:
        with pytest.raises(ValueError, match=match):
            catalog.emit("moe_route", target="sm_90", **bad)
    with pytest.raises(ValueError, match="used"):
        catalog.emit("moe_combine", target="sm_90", used=0)
    with pytest.raises(ValueError, match="block"):
        catalog.emit("moe_combine", target="sm_90", block=48)


def test_host_ops_on_the_emulated_device():
    """``LayerOps.moe_route`` / ``moe_combine`` on the emulated device, against the reference's router and the
    float64 sum (the GPU test runs the same on the H200)."""
    from realizar import cuda
    from realizar.gpu.ops import LayerOps

    ops = LayerOps(cuda.EmulatedDevice(target="sm_90"))
    rng = np.random.default_rng(7)
    rows, e, k, h = 3, 60, 4, 130
    logits = rng.standard_normal((rows, e)).astype(np.float32)
    lb, ids, w = ops.to_device(logits.reshape(-1)), ops.buffer(rows * k, np.uint32), ops.buffer(rows * k)
    ops.moe_route(lb, ids, w, rows, experts=e, used=k)
    c = ModelConfig("qwen3moe", 16, 8, 1, 2, 1, 4, 0, num_experts=e, num_experts_used=k, expert_ffn_size=4)
    want_ids, want_w = route(logits, c)
    np.testing.assert_array_equal(ids.to_numpy().reshape(rows, k), want_ids)
    np.testing.assert_allclose(w.to_numpy().reshape(rows, k), want_w, rtol=2e-5)
    x = rng.standard_normal((rows, h)).astype(np.float32)
    y = rng.standard_normal((rows, k, h)).astype(np.float32)
    xb, yb = ops.to_device(x.reshape(-1)), ops.to_device(y.reshape(-1))
    ops.moe_combine(xb, yb, w, rows, h, used=k)
    want = x + np.einsum("rs,rsh->rh", want_w.astype(np.float64), y.astype(np.float64))
    np.testing.assert_allclose(xb.to_numpy().reshape(rows, h), want, rtol=1e-5, atol=1e-5)
    from realizar.errors import ShapeError

    with pytest.raises(ShapeError, match="exceeds"):
        ops.moe_route(lb, ids, w, rows, experts=4, used=5)


@settings(max_examples=examples(20), deadline=None)
@given(wtype=st.sampled_from(["F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_K", "Q4_K", "Q6_K"]), data=st.data(),
       tokens=st.integers(1, 3), experts=st.integers(2, 5), used=st.integers(1, 3), glu=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_expert_rows_gemv_gives_each_row_its_expert(wtype, data, tokens, experts, used, glu, seed):
    """``gemv_expert_rows``: one launch for ``tokens x used`` rows, row i through the expert ``ids[i]`` names, its x
    the token's (``x_group`` rows share one, as a token's chosen experts do) or its own, its y at its stride (gaps
    between rows left alone), against a float64 product with that expert's dequantized rows."""
    from ptx_gen.kernels.gemv.quant_layout import K_QUANTS, type_info
    from tests.layer_kernels_ptx_cases import _pad16
    from tests.layer_oracles import dequant, random_weight, silu

    rng = np.random.default_rng(seed)
    bs = 256 if wtype in K_QUANTS else 32
    in_dim = bs * data.draw(st.integers(1, 3))
    out_dim = data.draw(st.integers(1, 9))
    x_group = data.draw(st.sampled_from([1, used]))
    rows = tokens * used
    warps, ksplit = data.draw(st.sampled_from([(2, 1), (4, 2), (4, 1)]))
    wrows = out_dim * (2 if glu else 1)
    row_bytes = type_info(wtype).row_bytes(in_dim)
    raws = [random_weight(rng, wtype, wrows, in_dim)[: wrows * row_bytes] for _ in range(experts)]
    ids = rng.integers(0, experts, rows).astype(np.uint32)
    ids[::2] = (np.arange(len(ids[::2])) + ids[0]) % experts  # (not all one expert)
    x_stride, y_stride = in_dim + 4, out_dim + 2  # (x rows 16-byte aligned, as the kernel loads them)
    x = rng.standard_normal(-(-rows // x_group) * x_stride).astype(np.float32)
    y = np.full(rows * y_stride, np.nan, np.float32)
    shape = dict(wtype=wtype, in_dim=in_dim, rows=2, warps=warps, glu=glu, ksplit=ksplit)
    kern = catalog.emit("gemv_expert_rows", target="sm_90", **shape)
    got = _launch("gemv_expert_rows", shape, (-(-out_dim // kern.meta["rows_per_cta"]), rows), (kern.meta["block"],),
                  {"w": _pad16(np.concatenate(raws)), "x": x, "y": y, "experts": ids},
                  {"out_dim": out_dim, "expert_bytes": wrows * row_bytes, "x_group": x_group, "x_stride": x_stride,
                   "y_stride": y_stride}, ("y",))["y"].reshape(rows, y_stride)
    for r in range(rows):
        w = dequant(raws[ids[r]], wtype, wrows, in_dim).astype(np.float64)
        xi = r // x_group
        xr = x[xi * x_stride: xi * x_stride + in_dim].astype(np.float64)
        full, scale = w @ xr, np.abs(w) @ np.abs(xr)
        if glu:
            want = silu(full[:out_dim]) * full[out_dim:]
            scale = (np.abs(full[:out_dim]) + scale[:out_dim]) * (np.abs(full[out_dim:]) + scale[out_dim:])
        else:
            want = full
        assert np.isfinite(got[r, :out_dim]).all(), "unwritten (NaN-poisoned) outputs"
        assert (np.abs(got[r, :out_dim] - want) / scale).max() < 2e-6, r
        assert np.isnan(got[r, out_dim:]).all(), "wrote past its row"


@pytest.mark.parametrize("wtype", ["Q4_K", "Q8_0", "Q6_K"])
def test_expert_rows_gemv_assembles_without_spills_at_real_shapes(wtype):
    """Qwen3-30B-A3B's expert shapes (gate/up 2048 -> 2 x 768, down 768 -> 2048) with the dispatcher's
    configurations, on sm_80 / sm_89 / sm_90: no spills."""
    from realizar.gpu.gemv import gemv_config
    from tests.layer_kernels_ptx_cases import _assemble_all

    for out_rows, in_dim, glu in ((2 * 768, 2048, True), (2048, 768, False)):
        cfg = gemv_config(out_rows, 132, in_dim, wtype)
        per_warp = max(2, cfg.rows - cfg.rows % 2) if glu else cfg.rows
        _assemble_all("gemv_expert_rows", wtype=wtype, in_dim=in_dim, rows=per_warp, warps=cfg.warps, glu=glu,
                      ksplit=cfg.ksplit)
