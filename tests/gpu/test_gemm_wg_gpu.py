"""GPU tests of the warpgroup-MMA batch GEMMs straight from quantized weights (sm_90a): ``GemmWgOps.gemm_wg`` and
its warp-specialized form ``GemmWgOps.gemm_ws`` (the emulator runs their PTX in tests/test_gemm_ws_ptx.py; these
run it on the GPU): every weight type and layout, drawn token counts 1..600 and shapes, every launch shape kind
(gemm_wg: token tiles, row groups, K parts, ring depths; gemm_ws: token tiles, consumer warpgroups, ring depths,
producer sets) and every epilogue, NaN-poisoned outputs, every element against the float64 oracle over the exactly
dequantized weights and the f16 X; the 8B shapes at batched-decode and prefill token counts."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ptx_gen.kernels.gemm import gemm_wg as wg, gemm_ws as ws
from realizar.gpu.gemm_wg import WgConfig, WsConfig, split_room, wg_applies, ws_config
from realizar.gpu.ops import GpuWeight, LayerOps
from tests.helpers import examples
from tests.layer_oracles import epilogue_buffers, random_weight
from tests.test_gemm_q_ptx import CASES, _oracle

pytestmark = pytest.mark.gpu
WG_CASES = [(wt, lay) for wt, lay in CASES if wt != "F32"]
WG_CONFIGS = st.one_of(st.none(), st.builds(WgConfig, st.sampled_from(wg.WG_MTS), st.sampled_from([1, 2]),
                                            st.sampled_from([1, 2, 4]), st.sampled_from([2, 3, 4])))
WS_CONFIGS = st.one_of(st.none(), st.builds(WsConfig, st.sampled_from(ws.WS_MTS), st.sampled_from([1, 2]),
                                            st.sampled_from(ws.WS_STAGES), st.sampled_from([2, 3]), st.booleans(),
                                            st.just(False), st.sampled_from(ws.WS_KPARTS)))
F16DEC_CASES = [("glu-tiles", 28672, 4096, True), ("rows", 4096, 4096, False), ("tiles", 4096, 14336, False)]


@pytest.fixture(scope="module")
def ops(device):
    if device.target.compute_capability != (9, 0):
        pytest.skip(f"gemm_wg and gemm_ws are sm_90a kernels; this device is {device.target}")
    return LayerOps(device)


def _run(ops, kernel, rng, wtype, layout, out_dim, in_dim, m, cfg=None, *, glu=False, bias=False, residual=None,
         out_f16=False):
    raw = random_weight(rng, wtype, out_dim, in_dim)
    w = GpuWeight(data=raw, ggml_type=wtype, shape=(out_dim, in_dim), layout=layout)
    cols = out_dim // 2 if glu else out_dim
    x = ((rng.standard_normal((m, in_dim)) + 0.1) / (64 if out_f16 else 1)).astype(np.float16)
    y, kw, b, r = epilogue_buffers(ops, rng, m, cols, bias=bias, residual=residual, out_f16=out_f16)
    xb = ops.to_device(x)
    if kernel == "gemm_ws" and cfg is None:  # (the policy's launch shape, whose K split needs its room)
        cfg = ws_config(wtype, in_dim, layout, cols, m, ops.sm_count, ops.device.max_shared_per_block_optin, glu=glu)
    room = split_room(cfg, cols, m, glu) if kernel == "gemm_ws" and cfg is not None else (0, 0)
    split = ops.split_space(*room) if room[0] else None  # (K split over two CTAs: their partial sums, counters)
    getattr(ops, kernel)(xb, w, y, m, glu=glu, out_f16=out_f16, config=cfg, **kw, **({"split": split} if split else {}))
    got = y.to_numpy().reshape(m, cols).astype(np.float64)
    ref, scale, tol = _oracle(raw, wtype, out_dim, in_dim, x, glu, b if bias else None,
                              r if residual is not None else None, out_f16)
    assert np.isfinite(got).all(), "unwritten (NaN-poisoned) outputs"
    err = np.abs(got - ref) / (scale + 1e-30)
    assert err.max() < tol, (f"{kernel} {wtype} {layout} {out_dim}x{in_dim} m={m} {cfg}: max relative error "
                             f"{err.max():.2e}")
    if split is not None:
        assert not split.counters.to_numpy().any(), "counters not left at zero"
        split.free()
    for buf in (xb, *kw.values()):
        if buf is not y:
            buf.free()
    y.free()
    w.free()


def _drawn_case(ops, kernel, wtype, layout, data, in_dim, m, cfg, seed):
    """A drawn weight shape and epilogue for ``kernel`` at ``cfg``, run against the oracle."""
    assert wg_applies(ops.device, wtype, layout, in_dim)
    glu = layout == "glu-tiles" or (layout == "rows" and data.draw(st.booleans()))
    out_dim = (2 if glu else 1) * data.draw(st.integers(1, 400))
    epi = "plain" if glu else data.draw(st.sampled_from(["plain", "bias", "residual", "in_place", "f16"]))
    _run(ops, kernel, np.random.default_rng(seed), wtype, layout, out_dim, in_dim, m, cfg, glu=glu,
         bias="bias" in epi, residual={"residual": "buffer", "in_place": "in_place"}.get(epi), out_f16="f16" in epi)


@pytest.mark.parametrize("wtype,layout", WG_CASES)
@settings(max_examples=examples(6), deadline=None)
@given(data=st.data(), m=st.integers(1, 600), cfg=WG_CONFIGS, seed=st.integers(0, 2**32 - 1))
def test_gemm_wg_gpu(ops, wtype, layout, data, m, cfg, seed):
    in_dim = 256 * data.draw(st.integers(1, 12))
    # (a launch shape the kernel refuses: more parts than chunks, registers or shared memory it lacks)
    assume(cfg is None or (in_dim // 256 >= cfg.kparts and (cfg.mt < 256 or cfg.rgroups * cfg.kparts <= 2)
                           and cfg.rgroups * cfg.kparts <= 4
                           and wg.smem_bytes(wtype, in_dim, layout, cfg.mt, cfg.rgroups, cfg.kparts, cfg.stages)
                           <= ops.device.max_shared_per_block_optin))
    _drawn_case(ops, "gemm_wg", wtype, layout, data, in_dim, m, cfg, seed)


def _ws_takes(wtype, in_dim, layout, cfg) -> bool:
    try:
        ws.check_shape(wtype, in_dim, layout, cfg.mt, cfg.rgroups, cfg.stages, cfg.wstages, cfg.kparts)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("wtype,layout", WG_CASES)
@settings(max_examples=examples(6), deadline=None)
@given(data=st.data(), m=st.integers(1, 600), cfg=WS_CONFIGS, seed=st.integers(0, 2**32 - 1))
def test_gemm_ws_gpu(ops, wtype, layout, data, m, cfg, seed):
    in_dim = 256 * data.draw(st.integers(1, 12))
    # (a launch shape the kernel refuses: registers or shared memory it lacks)
    assume(cfg is None or _ws_takes(wtype, in_dim, layout, cfg))
    _drawn_case(ops, "gemm_ws", wtype, layout, data, in_dim, m, cfg, seed)


@pytest.mark.parametrize("kernel", ["gemm_wg", "gemm_ws"])
@pytest.mark.parametrize("wtype,layout,out_dim,in_dim,glu", [
    ("Q4_K", "glu-tiles", 28672, 4096, True), ("Q4_K", "tiles", 6144, 4096, False),
    ("Q4_K", "tiles", 4096, 14336, False), ("Q6_K", "tiles", 4096, 14336, False), ("Q8_0", "tiles", 4096, 4096, False),
])
@pytest.mark.parametrize("m", [33, 128, 192, 256, 512])
def test_gemm_wg_gpu_real_shapes(ops, kernel, wtype, layout, out_dim, in_dim, glu, m):
    _run(ops, kernel, np.random.default_rng(m), wtype, layout, out_dim, in_dim, m, glu=glu, out_f16=glu)


@pytest.mark.parametrize("wtype,layout,out_dim,in_dim,glu,epi", [
    ("Q4_K", "glu-tiles", 28672, 4096, True, "f16"), ("Q4_K", "tiles", 6144, 4096, False, "residual"),
    ("Q6_K", "tiles", 4096, 14336, False, "bias"), ("Q4_K", "rows", 4096, 4096, False, "in_place"),
])
@pytest.mark.parametrize("m,mt,rgroups,stages", [(256, 256, 2, 3), (200, 256, 2, 3), (512, 256, 2, 3), (128, 128, 2, 4),
                                                  (96, 64, 1, 4)])
def test_gemm_ws_gpu_streamk(ops, wtype, layout, out_dim, in_dim, glu, epi, m, mt, rgroups, stages):
    """Stream-K (every tile's chunks of K shared out over one CTA an SM, a tile split between two summed by the later)
    at the 8B shapes, as the policy would take it for gate/up at 160-512 rows and beside it; each epilogue, twice in a
    row (the counters left at zero)."""
    cfg = WsConfig(mt, rgroups, stages, 2, True, wtype == "Q4_K", pfence=2, streamk=True)
    for rep in range(2):
        _run(ops, "gemm_ws", np.random.default_rng(m + rep), wtype, layout, out_dim, in_dim, m, cfg, glu=glu,
             bias=epi == "bias", residual={"residual": "buffer", "in_place": "in_place"}.get(epi), out_f16=glu)


def test_linear_takes_streamk_for_gate_up_at_512_rows(ops):
    """The Linear at a prefill chunk of 512 rows over the 8B fused gate/up weight: the policy's launch is Stream-K, the
    room reserve() sizes takes it, and the SwiGLU output matches the oracle (twice: the counters left at zero)."""
    from realizar.gpu.linear import Linear

    m, out_dim, in_dim = 512, 28672, 4096
    assert ws_config("Q4_K", in_dim, "glu-tiles", out_dim // 2, m, ops.sm_count,
                     ops.device.max_shared_per_block_optin, glu=True).streamk
    rng = np.random.default_rng(5)
    raw = random_weight(rng, "Q4_K", out_dim, in_dim)
    w = GpuWeight(data=raw, ggml_type="Q4_K", shape=(out_dim, in_dim), layout="glu-tiles")
    lin = Linear(ops)
    lin.reserve([w], m)
    for rep in range(2):
        x = ((rng.standard_normal((m, in_dim)) + 0.1) / 64).astype(np.float16)
        xb, y = ops.to_device(x), ops.to_device(np.full((m, out_dim // 2), np.nan, np.float16))
        lin(w, xb, y, m, glu=True, out_f16=True)
        got = y.to_numpy().reshape(m, out_dim // 2).astype(np.float64)
        ref, scale, tol = _oracle(raw, "Q4_K", out_dim, in_dim, x, True, None, None, True)
        assert np.isfinite(got).all(), "unwritten (NaN-poisoned) outputs"
        assert (np.abs(got - ref) / (scale + 1e-30)).max() < tol
        assert not lin.split.counters.to_numpy().any(), "counters not left at zero"
        xb.free()
        y.free()
    lin.free()
    w.free()


@pytest.mark.parametrize("layout,out_dim,in_dim,glu", F16DEC_CASES)
@pytest.mark.parametrize("m", [33, 200, 512])
def test_gemm_ws_gpu_f16_decoding(ops, layout, out_dim, in_dim, glu, m):
    """Q4_K decoded in f16x2 arithmetic, with X by a tensor map, at the 8B shapes (the f16 path's tolerance)."""
    cols = out_dim // 2 if glu else out_dim
    cfg = ws_config("Q4_K", in_dim, layout, cols, m, ops.sm_count, ops.device.max_shared_per_block_optin, glu=glu)
    _run(ops, "gemm_ws", np.random.default_rng(m), "Q4_K", layout, out_dim, in_dim, m,
         WsConfig(cfg.mt, cfg.rgroups, cfg.stages, cfg.wstages, True, True), glu=glu, out_f16=glu)


@pytest.mark.parametrize("wtype,layout,out_dim,in_dim,glu", [
    ("Q4_K", "glu-tiles", 28672, 4096, True), ("Q4_K", "tiles", 4096, 14336, False), ("Q6_K", "tiles", 6144, 4096, False),
])
@pytest.mark.parametrize("m,stages,xtma", [(200, 2, False), (200, 3, False), (512, 3, False), (200, 3, True),
                                          (512, 3, True)])
def test_gemm_ws_gpu_two_consumers_of_256_tokens(ops, wtype, layout, out_dim, in_dim, glu, m, stages, xtma):
    _run(ops, "gemm_ws", np.random.default_rng(m), wtype, layout, out_dim, in_dim, m, WsConfig(256, 2, stages, 2, xtma),
         glu=glu, out_f16=glu)


@pytest.mark.parametrize("wtype,layout,out_dim,in_dim,glu", [
    ("Q4_K", "tiles", 4096, 14336, False), ("Q4_K", "rows", 4096, 4096, False), ("Q6_K", "tiles", 4096, 14336, False),
    ("Q4_K", "glu-tiles", 28672, 4096, True),
])
@pytest.mark.parametrize("m,cfg", [(256, WsConfig(128, 2, 4, 2, True, True, 2)), (512, WsConfig(256, 2, 3, 2, True, True, 2)),
                                   (200, WsConfig(128, 2, 3, 2, False, False, 2)),
                                   (128, WsConfig(128, 2, 4, 2, True, True, 4)), (256, WsConfig(256, 2, 3, 2, True, True, 4)),
                                   (128, WsConfig(128, 1, 7, 2, True, True, 2)), (160, WsConfig(64, 1, 8, 2, True, True, 1)),
                                   (128, WsConfig(128, 1, 4, 2, True, True, 2, 2)), (256, WsConfig(128, 1, 4, 2, True, True, 1, 4)),
                                   (200, WsConfig(64, 1, 6, 2, True, True, 2, 4)), (256, WsConfig(256, 1, 4, 2, True, True, 1, 2)),
                                   (128, WsConfig(64, 2, 4, 2, True, True, 4, 2)),
                                   (256, WsConfig(128, 2, 4, 2, True, True, 2, 1, 2)), (200, WsConfig(128, 1, 5, 2, True, True, 1, 1, 4)),
                                   (256, WsConfig(256, 2, 3, 2, True, True, 1, 1, 2)), (128, WsConfig(64, 1, 3, 2, True, True, 2, 1, 2)),
                                   (128, WsConfig(128, 2, 4, 2, True, True, 4, 1, 2, 2)), (256, WsConfig(128, 2, 4, 2, True, True, 2, 1, 2, 2)),
                                   (200, WsConfig(64, 1, 4, 2, True, True, 2, 1, 2, 2)), (256, WsConfig(256, 2, 3, 2, True, True, 1, 1, 2, 2)),
                                   (128, WsConfig(128, 1, 4, 2, True, True, 1, 1, 2, 2))])
def test_gemm_ws_gpu_k_split_and_deep_rings(ops, wtype, layout, out_dim, in_dim, glu, m, cfg):
    """K split over two CTAs (the policy's WS_SPLIT_K and WS_SPLIT_FIRST candidates: o and down at 128-512 tokens) and
    over four, A/B rings of 7 and 8 stages, two and four producer warpgroups a strip (psplit), producers fencing two
    and four stages at once (pfence), X multicast to cluster pairs (xcast), the residual in place
    (glu: the SwiGLU epilogue to f16), every element against the oracle, the counters left at zero. A shape a config
    does not fit is skipped by name."""
    try:
        ws.check_shape(wtype, in_dim, layout, cfg.mt, cfg.rgroups, cfg.stages, cfg.wstages, cfg.kparts, cfg.psplit,
                   cfg.pfence, cfg.xcast, cfg.xtma)
    except ValueError as exc:
        pytest.skip(f"{cfg} does not fit {wtype} {layout} {in_dim}: {exc}")
    cfg = dataclasses.replace(cfg, f16dec=cfg.f16dec and wtype == "Q4_K")
    _run(ops, "gemm_ws", np.random.default_rng(m + in_dim), wtype, layout, out_dim, in_dim, m, cfg, glu=glu,
         residual=None if glu else "in_place", out_f16=glu)
