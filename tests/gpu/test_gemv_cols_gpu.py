"""GPU tests of ``GemvOps.gemv_cols`` (the tensor-core GEMV over up to 8 columns of x): every tensor-core
type in the layout upload picks at real row lengths, drawn column counts and epilogues (bias, residual in
place, the fused gate/up GEMV with f16 out), f16 or f32 x at a padded stride, NaN-poisoned outputs and the
padding between columns, every element against the float64 oracle."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ptx_gen.kernels.gemv.gemv_mma import MMA_TYPES
from realizar.gpu.ops import GpuWeight, LayerOps
from tests.layer_oracles import check_gemv_cols, random_weight
from tests.helpers import examples

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ops(device):
    return LayerOps(device)


def _check(ops, rng, wtype, out_dim, in_dim, cols, epi, xh):
    glu = epi == "glu"
    rows = 2 * out_dim if glu else out_dim
    raw = random_weight(rng, wtype, rows, in_dim)
    layout = ops.weight_layout(out_dim, in_dim, wtype, glu=glu)
    w = GpuWeight(data=raw, ggml_type=wtype, shape=(rows, in_dim), layout=layout, device=ops.device)
    ldx, ldy = in_dim + 4, out_dim + 1
    # (f16 outputs: x scaled down so that silu(g) u stays within f16's range)
    x = ((rng.standard_normal((cols, ldx)) + 0.1) / (64 if glu else 1)).astype(np.float16 if xh else np.float32)
    ytype = np.float16 if glu else np.float32
    res = rng.standard_normal((cols, ldy)).astype(np.float32)
    y0 = res.copy() if epi == "residual" else np.full((cols, ldy), np.nan, np.float32)
    y = ops.to_device(y0.astype(ytype))
    b = rng.standard_normal(out_dim).astype(np.float32)
    kw = {"bias": ops.to_device(b)} if epi == "bias" else {"residual": y} if epi == "residual" else {}
    ops.gemv_cols(w, ops.to_device(x), y, cols, ldx=ldx, ldy=ldy, glu=glu, xh=xh, out_f16=glu, **kw)
    check_gemv_cols(y.to_numpy().reshape(cols, ldy), raw, wtype, out_dim, in_dim, x, glu=glu,
                    bias=b if epi == "bias" else None, residual=res if epi == "residual" else None, out_f16=glu,
                    padding_nan=epi != "residual", what=epi)


@settings(max_examples=examples(30), deadline=None)
@given(wtype=st.sampled_from(MMA_TYPES), cols=st.integers(1, 8), in_dim=st.sampled_from([2048, 4096]),
       out_dim=st.integers(64, 2000), epi=st.sampled_from(["none", "bias", "residual", "glu"]), xh=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_gemv_cols_gpu_matches_oracle(ops, wtype, cols, in_dim, out_dim, epi, xh, seed):
    rng = np.random.default_rng(seed)
    if ops.mma_cols_config(out_dim, in_dim, wtype, 1, glu=epi == "glu",
                           layout=ops.weight_layout(out_dim, in_dim, wtype, glu=epi == "glu")) is None:
        out_dim = 4096  # (too few rows for the tensor-core GEMV: a shape it takes)
    _check(ops, rng, wtype, out_dim, in_dim, cols, epi, xh)


@pytest.mark.parametrize("wtype", MMA_TYPES)
def test_gemv_cols_gpu_8b_row_lengths(ops, wtype):
    """The 8B layer's row lengths and epilogues (qkv with bias, down with the residual in place, the fused
    gate/up GEMV) at 8 columns of f16 x, as the batched decode step runs them (fewer rows: the oracle's
    float64 weights)."""
    rng = np.random.default_rng(1)
    for out_dim, in_dim, epi in ((1536, 4096, "bias"), (2304, 14336, "residual"), (2048, 4096, "glu")):
        if wtype == "Q6_K" and epi == "glu":
            continue
        _check(ops, rng, wtype, out_dim, in_dim, 8, epi, True)
