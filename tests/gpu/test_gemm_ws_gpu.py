"""GPU tests of ``GemmWgOps.gemm_ws`` (the warp-specialized batch GEMM straight from quantized weights, sm_90a;
the emulator has no ``wgmma``, so these are its oracle tests): every weight type and layout, drawn token counts
1..600 and shapes, every launch shape (token tiles, consumer warpgroups, ring depths) and every epilogue,
NaN-poisoned outputs, every element against the float64 oracle over the exactly dequantized weights and the f16
X; the 8B shapes at batched-decode and prefill token counts."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ptx_gen.kernels.gemm.gemm_ws import WS_MTS, WS_STAGES, smem_bytes
from realizar.gpu.gemm_wg import WsConfig, wg_applies
from realizar.gpu.ops import GpuWeight, LayerOps
from tests.helpers import examples
from tests.layer_oracles import epilogue_buffers, random_weight
from tests.test_gemm_q_ptx import CASES, _oracle

pytestmark = pytest.mark.gpu
WS_CASES = [(wt, lay) for wt, lay in CASES if wt != "F32"]
CONFIGS = st.one_of(st.none(), st.builds(WsConfig, st.sampled_from(WS_MTS), st.sampled_from([1, 2]),
                                         st.sampled_from(WS_STAGES), st.sampled_from([2, 3]), st.sampled_from([1, 2])))


@pytest.fixture(scope="module")
def ops(device):
    if device.target.compute_capability != (9, 0):
        pytest.skip(f"gemm_ws is an sm_90a kernel; this device is {device.target}")
    return LayerOps(device)


def _run(ops, rng, wtype, layout, out_dim, in_dim, m, cfg=None, *, glu=False, bias=False, residual=None,
         out_f16=False):
    raw = random_weight(rng, wtype, out_dim, in_dim)
    w = GpuWeight(data=raw, ggml_type=wtype, shape=(out_dim, in_dim), layout=layout)
    cols = out_dim // 2 if glu else out_dim
    x = ((rng.standard_normal((m, in_dim)) + 0.1) / (64 if out_f16 else 1)).astype(np.float16)
    y, kw, b, r = epilogue_buffers(ops, rng, m, cols, bias=bias, residual=residual, out_f16=out_f16)
    xb = ops.to_device(x)
    ops.gemm_ws(xb, w, y, m, glu=glu, out_f16=out_f16, config=cfg, **kw)
    got = y.to_numpy().reshape(m, cols).astype(np.float64)
    ref, scale, tol = _oracle(raw, wtype, out_dim, in_dim, x, glu, b if bias else None,
                              r if residual is not None else None, out_f16)
    assert np.isfinite(got).all(), "unwritten (NaN-poisoned) outputs"
    err = np.abs(got - ref) / (scale + 1e-30)
    assert err.max() < tol, f"{wtype} {layout} {out_dim}x{in_dim} m={m} {cfg}: max relative error {err.max():.2e}"
    for buf in (xb, *kw.values()):
        if buf is not y:
            buf.free()
    y.free()
    w.free()


@pytest.mark.parametrize("wtype,layout", WS_CASES)
@settings(max_examples=examples(6), deadline=None)
@given(data=st.data(), m=st.integers(1, 600), cfg=CONFIGS, seed=st.integers(0, 2**32 - 1))
def test_gemm_ws_gpu(ops, wtype, layout, data, m, cfg, seed):
    in_dim = 256 * data.draw(st.integers(1, 12))
    # (a launch shape the kernel refuses: registers or shared memory it lacks)
    assume(cfg is None or ((cfg.mt < 256 or cfg.rgroups == 1) and cfg.rgroups * (1 + cfg.psets) <= 4
                           and (cfg.psets == 1 or cfg.stages == 4)
                           and smem_bytes(wtype, in_dim, layout, cfg.mt, cfg.rgroups, cfg.stages, cfg.wstages, cfg.psets)
                           <= ops.device.max_shared_per_block_optin))
    assert wg_applies(ops.device, wtype, layout, in_dim)
    glu = layout == "glu-tiles" or (layout == "rows" and data.draw(st.booleans()))
    out_dim = (2 if glu else 1) * data.draw(st.integers(1, 400))
    epi = "plain" if glu else data.draw(st.sampled_from(["plain", "bias", "residual", "in_place", "f16"]))
    _run(ops, np.random.default_rng(seed), wtype, layout, out_dim, in_dim, m, cfg, glu=glu, bias="bias" in epi,
         residual={"residual": "buffer", "in_place": "in_place"}.get(epi), out_f16="f16" in epi)


@pytest.mark.parametrize("wtype,layout,out_dim,in_dim,glu", [
    ("Q4_K", "glu-tiles", 28672, 4096, True), ("Q4_K", "tiles", 6144, 4096, False),
    ("Q4_K", "tiles", 4096, 14336, False), ("Q6_K", "tiles", 4096, 14336, False), ("Q8_0", "tiles", 4096, 4096, False),
])
@pytest.mark.parametrize("m", [33, 128, 256, 512])
def test_gemm_ws_gpu_real_shapes(ops, wtype, layout, out_dim, in_dim, glu, m):
    _run(ops, np.random.default_rng(m), wtype, layout, out_dim, in_dim, m, glu=glu, out_f16=glu)
