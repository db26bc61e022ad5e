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
