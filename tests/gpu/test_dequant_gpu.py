"""GPU tests of the f16 dequantization through :class:`realizar.gpu.ops.LayerOps`: every weight type and
layout, with and without interleaving, at drawn and real shapes; outputs NaN-poisoned before the
launch and every element compared bitwise with the f16 rounding of the float32 reference values."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ptx_gen.kernels.gemv.gemv_mma import MMA_TYPES
from ptx_gen.kernels.gemv.quant_layout import DENSE, K_QUANTS, WEIGHT_TYPES
from realizar import cuda
from realizar.gpu.ops import GpuWeight, LayerOps
from tests.layer_oracles import dequant, random_weight
from tests.helpers import examples

pytestmark = pytest.mark.gpu

CASES = [(wt, lay) for wt in WEIGHT_TYPES for lay in ("rows", "tiles", "glu-tiles") if lay == "rows" or wt in MMA_TYPES]


@pytest.fixture(scope="module")
def ops(device):
    return LayerOps(device)


def _run(ops, raw, wtype, out_dim, in_dim, layout, interleave) -> None:
    w = GpuWeight(data=raw, ggml_type=wtype, shape=(out_dim, in_dim), layout=layout)
    out = cuda.GpuBuffer(out_dim * in_dim, np.float16)
    out.fill_bytes(0x7E)  # every f16 0x7E7E: a NaN
    ops.dequantize_f16(w, out, interleave=interleave)
    got = out.to_numpy().reshape(out_dim, in_dim)
    ref = dequant(raw, wtype, out_dim, in_dim).astype(np.float16)
    if interleave:
        ref = np.stack([ref[: out_dim // 2], ref[out_dim // 2:]], axis=1).reshape(out_dim, in_dim)
    bad = np.argwhere(got.view(np.uint16) != ref.view(np.uint16))
    assert bad.size == 0, f"{wtype} {layout} {out_dim}x{in_dim} interleave={interleave}: {len(bad)} differ, first " \
                          f"{bad[:4].tolist()}"
    w.free()
    out.free()


@pytest.mark.parametrize("wtype,layout", CASES)
@settings(max_examples=examples(6), deadline=None)
@given(data=st.data(), interleave=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_dequant_f16_gpu(ops, wtype, layout, data, interleave, seed):
    block = 256 if wtype in K_QUANTS or layout != "rows" else (8 if wtype in DENSE else 32)
    in_dim = block * data.draw(st.integers(1, 24))
    half = data.draw(st.integers(1, 200))
    out_dim = 2 * half if (interleave or layout == "glu-tiles") else data.draw(st.integers(1, 400))
    _run(ops, random_weight(np.random.default_rng(seed), wtype, out_dim, in_dim), wtype, out_dim, in_dim, layout,
         interleave)


@pytest.mark.parametrize("wtype,layout,out_dim,in_dim,interleave", [
    ("Q4_K", "glu-tiles", 28672, 4096, True), ("Q4_K", "rows", 4096, 14336, False),
    ("Q6_K", "tiles", 4096, 14336, False), ("Q8_0", "rows", 3072, 576, True), ("F16", "rows", 1536, 576, False),
])
def test_dequant_f16_gpu_real_shapes(ops, wtype, layout, out_dim, in_dim, interleave):
    _run(ops, random_weight(np.random.default_rng(out_dim), wtype, out_dim, in_dim), wtype, out_dim, in_dim, layout,
         interleave)
