"""GPU tests of ``GemmOps.gemm_q`` (the small-M GEMM straight from quantized weights): every weight type and
layout, drawn token counts 1..128 and shapes, every epilogue, NaN-poisoned outputs, every element against
the float64 oracle over the exactly dequantized weights and the f16 X; the 8B shapes at a few M."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from realizar import cuda
from realizar.gpu.ops import GpuWeight, LayerOps
from tests.layer_oracles import epilogue_buffers, random_weight
from tests.test_gemm_q_ptx import CASES, MS, _block, _oracle
from tests.helpers import examples

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ops(device):
    return LayerOps(device)


def _run(ops, rng, wtype, layout, out_dim, in_dim, m, *, glu=False, bias=False, residual=None, out_f16=False):
    raw = random_weight(rng, wtype, out_dim, in_dim)
    w = GpuWeight(data=raw, ggml_type=wtype, shape=(out_dim, in_dim), layout=layout)
    cols = out_dim // 2 if glu else out_dim
    x = ((rng.standard_normal((m, in_dim)) + 0.1) / (64 if out_f16 else 1)).astype(np.float16)
    y, kw, b, r = epilogue_buffers(ops, rng, m, cols, bias=bias, residual=residual, out_f16=out_f16)
    xb = ops.to_device(x)
    ops.gemm_q(xb, w, y, m, glu=glu, out_f16=out_f16, **kw)
    got = y.to_numpy().reshape(m, cols).astype(np.float64)
    ref, scale, tol = _oracle(raw, wtype, out_dim, in_dim, x, glu, b if bias else None,
                              r if residual is not None else None, out_f16)
    assert np.isfinite(got).all(), "unwritten (NaN-poisoned) outputs"
    err = np.abs(got - ref) / (scale + 1e-30)
    assert err.max() < tol, f"{wtype} {layout} {out_dim}x{in_dim} m={m}: max relative error {err.max():.2e}"
    w.free()


@pytest.mark.parametrize("wtype,layout", CASES)
@settings(max_examples=examples(5), deadline=None)
@given(data=st.data(), m=st.sampled_from(MS), seed=st.integers(0, 2**32 - 1))
def test_gemm_q_gpu(ops, wtype, layout, data, m, seed):
    blk = _block(wtype, layout)
    in_dim = blk * data.draw(st.integers(1, max(1, 3072 // blk)))
    glu = layout == "glu-tiles" or (layout == "rows" and data.draw(st.booleans()))  # (the host refuses glu on "tiles")
    out_dim = (2 if glu else 1) * data.draw(st.integers(1, 300))
    epi = "plain" if glu else data.draw(st.sampled_from(["plain", "bias", "residual", "in_place", "f16"]))
    _run(ops, np.random.default_rng(seed), wtype, layout, out_dim, in_dim, m, glu=glu, bias="bias" in epi,
         residual={"residual": "buffer", "in_place": "in_place"}.get(epi), out_f16="f16" in epi)


@pytest.mark.parametrize("wtype,layout,out_dim,in_dim,glu", [
    ("Q4_K", "glu-tiles", 28672, 4096, True), ("Q4_K", "tiles", 6144, 4096, False),
    ("Q6_K", "rows", 4096, 14336, False), ("Q8_0", "tiles", 4096, 4096, False), ("Q4_1", "rows", 3072, 576, True),
])
@pytest.mark.parametrize("m", [1, 8, 64, 128])
def test_gemm_q_gpu_real_shapes(ops, wtype, layout, out_dim, in_dim, glu, m):
    _run(ops, np.random.default_rng(m), wtype, layout, out_dim, in_dim, m, glu=glu)
