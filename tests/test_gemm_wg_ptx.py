"""CPU tests of ``gemm_wg`` (the warpgroup-MMA batch GEMM straight from quantized weights, sm_90a) and its host
side: ptxas for sm_90a without spills over drawn types, layouts, launch shapes and epilogues and at the real
shapes the policy picks; the policy's shapes fit the shared memory and cover every M; the kernel and the host
refuse what they cannot run, and the emulated device's Linear never takes it. Its oracle tests run in the
emulator (``tests/test_gemm_ws_ptx.py``) and on the GPU (``tests/gpu/test_gemm_wg_gpu.py``)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ptx_gen import catalog
from ptx_gen.kernels.gemm.gemm_wg import WG_MTS, check_shape, smem_bytes
from ptx_gen.kernels.gemv.gemv_mma_layout import MMA_TYPES
from ptx_gen.kernels.gemv.quant_layout import WEIGHT_TYPES
from ptx_gen.ptxas import assemble
from realizar import cuda
from realizar.errors import ShapeError
from realizar.gpu.gemm_wg import wg_applies, wg_config
from realizar.gpu.ops import GpuWeight, LayerOps
from tests.helpers import examples
from tests.layer_oracles import random_weight

WG_TYPES = [t for t in WEIGHT_TYPES if t != "F32"]
# (N, K, glu) of Llama-3-8B's and Llama-3.2-1B's layers
REAL = [(6144, 4096, False), (4096, 4096, False), (28672, 4096, True), (4096, 14336, False),
        (3072, 2048, False), (2048, 2048, False), (16384, 2048, True), (2048, 8192, False)]


def _clean(shape: dict) -> None:
    k = catalog.emit("gemm_wg", target="sm_90", **shape)
    assert k.target == "sm_90a" and "wgmma.mma_async" in k.ptx
    rep = assemble(k.ptx, k.target)[0]
    assert not rep.spills, f"{shape} spills: {rep.log}"


@settings(max_examples=examples(12), deadline=None)
@given(data=st.data())
def test_drawn_shapes_assemble_without_spills(data):
    wtype = data.draw(st.sampled_from(WG_TYPES))
    layout = data.draw(st.sampled_from(["rows"] + (["tiles", "glu-tiles"] if wtype in MMA_TYPES else [])))
    glu = layout == "glu-tiles" or (layout == "rows" and data.draw(st.booleans()))
    in_dim = 256 * data.draw(st.integers(1, 24))
    mt = data.draw(st.sampled_from(WG_MTS))
    rg, kp = data.draw(st.sampled_from([(1, 1), (2, 1), (1, 2), (2, 2), (1, 4)]))
    stages = data.draw(st.integers(2, 4))
    try:
        check_shape(wtype, in_dim, layout, mt, rg, kp, stages)
    except ValueError:
        return  # (the refusals are tested below)
    epi = {} if glu else data.draw(st.sampled_from([{}, {"bias": True}, {"residual": True}, {"out_f16": True}]))
    _clean(dict(wtype=wtype, in_dim=in_dim, layout=layout, mt=mt, rgroups=rg, kparts=kp, stages=stages, glu=glu,
                out_f16=glu or epi.get("out_f16", False), **{k: v for k, v in epi.items() if k != "out_f16"}))


@pytest.mark.parametrize("wtype", ["Q4_K", "Q6_K", "Q8_0", "Q5_K"])
def test_policy_shapes_fit_and_assemble(wtype):
    """Every M from 1 to a prefill chunk gets a shape that fits the H200's shared memory; the real layers'
    picks at batched-decode and prefill sizes assemble without spills."""
    seen = set()
    for n, k, glu in REAL:
        layout = "glu-tiles" if glu else "tiles"
        cols = n // 2 if glu else n
        for m in list(range(1, 300)) + [511, 512, 1024, 2048]:
            cfg = wg_config(wtype, k, layout, cols, m, 132, 227 * 1024, glu=glu)
            check_shape(wtype, k, layout, cfg.mt, cfg.rgroups, cfg.kparts, cfg.stages)
            assert smem_bytes(wtype, k, layout, cfg.mt, cfg.rgroups, cfg.kparts, cfg.stages) <= 227 * 1024
            seen.add((k, layout, glu, cfg))
    for k, layout, glu, cfg in sorted(seen, key=str)[:: max(1, len(seen) // 6)]:
        _clean(dict(wtype=wtype, in_dim=k, layout=layout, mt=cfg.mt, rgroups=cfg.rgroups, kparts=cfg.kparts,
                    stages=cfg.stages, glu=glu, out_f16=glu))


def test_bad_shapes_are_refused():
    ok = dict(wtype="Q4_K", in_dim=4096, layout="tiles", mt=128, rgroups=1, kparts=1, stages=2)
    check_shape(**ok)
    for bad, match in [({"wtype": "Q8_0", "in_dim": 4000, "layout": "rows"}, "multiple of 256"), ({"mt": 48}, "mt"),
                       ({"rgroups": 3}, "rgroups"), ({"rgroups": 2, "kparts": 4}, "warpgroups"),
                       ({"mt": 256, "kparts": 4}, "256"), ({"stages": 7}, "stages"),
                       ({"in_dim": 256, "kparts": 2}, "chunk per K part"),
                       ({"wtype": "F32", "layout": "rows", "stages": 6, "kparts": 2}, "shared memory")]:
        with pytest.raises(ValueError, match=match):
            check_shape(**{**ok, **bad})
    with pytest.raises(ValueError, match="unroll"):
        catalog.emit("gemm_wg", target="sm_90", unroll=3)
    with pytest.raises(ValueError, match="glu-tiles"):
        catalog.emit("gemm_wg", target="sm_90", layout="glu-tiles")
    with pytest.raises(ValueError, match="needs sm_90a"):
        catalog.emit("gemm_wg", target="sm_89")


def test_the_emulator_and_other_devices_never_get_it():
    emu = cuda.EmulatedDevice(target="sm_90")
    assert not wg_applies(emu, "Q4_K", "tiles", 4096)  # (kernel-level emulation only, see wg_applies)

    class H200:
        emulated = False
        target = emu.target

    class A100(H200):
        target = cuda.EmulatedDevice(target="sm_80").target

    assert wg_applies(H200, "Q4_K", "tiles", 4096) and wg_applies(H200, "Q8_0", "rows", 2048)
    assert not wg_applies(H200, "Q4_K", "tiles", 576) and not wg_applies(H200, "F32", "rows", 4096)
    assert not wg_applies(A100, "Q4_K", "tiles", 4096)


def test_host_refuses_on_the_emulator():
    import numpy as np

    ops = LayerOps(cuda.EmulatedDevice(target="sm_90"))
    rng = np.random.default_rng(0)
    w = GpuWeight(data=random_weight(rng, "Q4_K", 64, 256), ggml_type="Q4_K", shape=(64, 256), layout="tiles",
                  device=ops.device)
    x, y = ops.buffer(2 * 256, np.float16), ops.buffer(2 * 64)
    with pytest.raises(ShapeError, match="warpgroup GEMM runs on sm_90"):
        ops.gemm_wg(x, w, y, 2)


def test_ws_stages_by_tile_applies_to_its_launch_shapes_only(monkeypatch):
    """WS_STAGES_BY_TILE's depths replace WS_STAGES exactly on launches of its (token tile, warpgroups, K parts), and
    the deeper ring still fits and passes the kernel's shape check; every other launch is unchanged."""
    import realizar.gpu.gemm_wg as host
    from ptx_gen.kernels.gemm import gemm_ws as ws

    shapes = [(6144, 4096, False, "rows"), (4096, 4096, False, "rows"), (28672, 4096, True, "glu-tiles"),
              (4096, 14336, False, "tiles"), (3072, 2048, False, "rows"), (16384, 2048, True, "glu-tiles")]
    monkeypatch.setattr(host, "WS_STAGES_BY_TILE", ())
    before = {(n, k, m): host.ws_config("Q4_K", k, lay, n // 2 if glu else n, m, glu=glu)
              for n, k, glu, lay in shapes for m in (65, 96, 128, 192, 256, 512)}
    monkeypatch.setattr(host, "WS_STAGES_BY_TILE", (((128, 1, 1), (6, 4, 3, 2)),))
    deeper = 0
    for n, k, glu, lay in shapes:
        for m in (65, 96, 128, 192, 256, 512):
            cfg, old = host.ws_config("Q4_K", k, lay, n // 2 if glu else n, m, glu=glu), before[(n, k, m)]
            if (old.mt, old.rgroups, old.kparts) == (128, 1, 1):
                assert cfg == dataclasses.replace(old, stages=6), (n, m, cfg)
                ws.check_shape("Q4_K", k, lay, cfg.mt, cfg.rgroups, cfg.stages, cfg.wstages, cfg.kparts, cfg.psplit,
                               cfg.pfence, cfg.xcast)
                deeper += 1
            else:
                assert cfg == old, (n, m, cfg)
    assert deeper >= 3


def test_streamk_rule_takes_wide_launches_from_its_row_minimum_only(monkeypatch):
    """Stream-K (WS_STREAMK, WS_STREAMK_MIN_ROWS) on the 8B and 1B layers: never below the row minimum (the decode
    steps), the 8B gate/up at 512 rows (448 tiles over 132 SMs), only on launches of K whole without multicast or
    producer split that one CTA an SM runs, each passing the kernel's shape check; none with WS_STREAMK 0."""
    import realizar.gpu.gemm_wg as host
    from ptx_gen.kernels.gemm import gemm_ws as ws

    shapes = [(28672, 4096, True, "glu-tiles"), (6144, 4096, False, "rows"), (4096, 4096, False, "rows"),
              (4096, 14336, False, "tiles"), (3072, 2048, False, "rows"), (16384, 2048, True, "glu-tiles"),
              (2048, 2048, False, "rows"), (2048, 8192, False, "tiles")]
    taken = set()
    for n, k, glu, lay in shapes:
        for m in list(range(65, 600, 13)) + [512, 1024, 2048]:
            cfg = host.ws_config("Q4_K", k, lay, n // 2 if glu else n, m, 132, 227 * 1024, glu=glu)
            if not cfg.streamk:
                continue
            taken.add((n, m))
            assert m >= host.WS_STREAMK_MIN_ROWS and (cfg.kparts, cfg.psplit, cfg.xcast) == (1, 1, 1) and cfg.xtma
            ws.check_shape("Q4_K", k, lay, cfg.mt, cfg.rgroups, cfg.stages, cfg.wstages, cfg.kparts, cfg.psplit,
                           cfg.pfence, cfg.xcast, cfg.xtma, cfg.streamk)
            assert 2 * ws.smem_bytes("Q4_K", k, lay, cfg.mt, cfg.rgroups, cfg.stages, cfg.wstages) > 227 * 1024
    assert (28672, 512) in taken
    monkeypatch.setattr(host, "WS_STREAMK", 0.0)
    assert not any(host.ws_config("Q4_K", k, lay, n // 2 if glu else n, 512, glu=glu).streamk
                   for n, k, glu, lay in shapes)
