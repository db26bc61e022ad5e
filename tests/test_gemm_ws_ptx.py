"""CPU tests of the warpgroup-MMA GEMMs over quantized weights (sm_90a): ``gemm_ws`` (warp-specialized: producer
warps decode, consumer warpgroups multiply, mbarrier rings) and ``gemm_wg`` run in the PTX emulator (its
``wgmma`` with A from registers or shared memory, its mbarrier waits), over hypothesis-drawn types, layouts,
token counts, shapes, launch shapes and epilogues: every element of the NaN-poisoned output against the float64
oracle over the exactly dequantized weights and the f16 X, nothing past the output written. ptxas for sm_90a
without spills over the grid and drawn shapes. The same oracle runs on the GPU in tests/gpu."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ptx_gen import catalog
from ptx_gen.kernels.gemm import gemm_ws as ws
from ptx_gen.kernels.gemm.qstream import F16DEC_TYPES
from ptx_gen.ptxas import assemble
from tests.helpers import examples
from tests.layer_oracles import random_weight
from tests.test_gemm_q_ptx import CASES, _oracle, run_emulated

WS_CASES = [(wt, lay) for wt, lay in CASES if wt != "F32"]


def _run(name: str, shape: dict, *args, **kw):
    run_emulated(name, shape, *args, max_steps=20_000_000, **kw)


@settings(max_examples=examples(16), deadline=None)
@given(data=st.data(), case=st.sampled_from(WS_CASES), seed=st.integers(0, 2**32 - 1))
def test_gemm_ws_matches_oracle(data, case, seed):
    wtype, layout = case
    in_dim = 256 * data.draw(st.integers(1, 3))
    mt = data.draw(st.sampled_from((64, 128)))
    rgroups = data.draw(st.sampled_from([1, 2]))
    stages = data.draw(st.sampled_from(ws.WS_STAGES))
    wstages = data.draw(st.sampled_from(ws.WS_WSTAGES))
    m = data.draw(st.integers(1, mt + 9))  # (one token tile, sometimes two)
    glu = layout == "glu-tiles" or (layout == "rows" and data.draw(st.booleans()))
    out_dim = (2 if glu else 1) * data.draw(st.integers(1, 40 if glu else 80))
    epi = "plain" if glu else data.draw(st.sampled_from(["plain", "bias", "residual", "in_place", "f16"]))
    xtma = data.draw(st.booleans())
    f16dec = wtype == "Q4_K" and data.draw(st.booleans())
    kparts = data.draw(st.sampled_from([1, 2])) if in_dim // 256 % 2 == 0 else 1
    psplit, pfence = data.draw(st.sampled_from(ws.WS_PSPLIT)), data.draw(st.sampled_from(ws.WS_PFENCE))
    try:  # (a launch shape the kernel refuses: registers, shared memory, producer splits or fence groups it cannot take)
        ws.check_shape(wtype, in_dim, layout, mt, rgroups, stages, wstages, kparts, psplit, pfence)
    except ValueError:
        assume(False)
    _run("gemm_ws", dict(mt=mt, rgroups=rgroups, stages=stages, wstages=wstages, xtma=xtma, f16dec=f16dec,
                         kparts=kparts, psplit=psplit, pfence=pfence), wtype, layout,
         out_dim, in_dim, m, np.random.default_rng(seed), bias="bias" in epi,
         residual={"residual": "buffer", "in_place": "in_place"}.get(epi), out_f16="f16" in epi, glu=glu)


@pytest.mark.parametrize("wtype,layout,glu,stages,ctas,epi", [("Q4_K", "tiles", False, 3, 4, "residual"),
                                                              ("Q6_K", "rows", False, 4, 5, "bias"),
                                                              ("Q4_K", "glu-tiles", True, 3, 4, "f16"),
                                                              ("Q4_K", "rows", False, 2, 4, "in_place")])
def test_gemm_ws_streamk(wtype, layout, glu, stages, ctas, epi):
    """Stream-K: the 6 tiles' (3 row tiles x 2 token tiles) 3 chunks of K each shared out over 4 or 5 CTAs, so that
    CTAs take two units, tiles are split between two CTAs (summed by the later, the counters left at zero) or whole,
    and each unit's stages go into the ring where the last left it (3 stages: a unit's first stage in every slot);
    every element against the oracle, X by a tensor map, each epilogue."""
    _run("gemm_ws", dict(mt=64, stages=stages, xtma=True, f16dec=wtype == "Q4_K", pfence=2 if stages > 2 else 1,
                         streamk=True), wtype, layout, 2 * 96 if glu else 192, 768, 70, np.random.default_rng(13),
         bias=epi == "bias", residual={"residual": "buffer", "in_place": "in_place"}.get(epi), out_f16=glu, glu=glu,
         ctas=ctas)


def test_streamk_refuses_what_it_cannot_take():
    for kw in (dict(kparts=2), dict(psplit=2), dict(xcast=2), dict(xtma=False)):
        args = dict(kparts=1, psplit=1, pfence=1, xcast=1, xtma=True) | kw
        with pytest.raises(ValueError, match="streamk"):
            ws.check_shape("Q4_K", 1024, "tiles", 64, 1, 4, 2, streamk=True, **args)


@pytest.mark.parametrize("layout", ["tiles", "rows"])
@pytest.mark.parametrize("glu", [False, True])
def test_gemm_ws_f16_decoding(layout, glu):
    """Q4_K decoded in f16x2 arithmetic (f16dec): three K chunks, two token tiles, every element against the oracle
    over the exact weights within the f16 path's tolerance."""
    lay = "glu-tiles" if glu and layout == "tiles" else layout
    _run("gemm_ws", dict(mt=64, stages=3, f16dec=True), "Q4_K", lay, 68 if glu else 70, 768, 70,
         np.random.default_rng(9), residual=None if glu else "in_place", out_f16=glu, glu=glu)


@pytest.mark.parametrize("wtype", ["Q4_K", "Q6_K", "Q8_0", "Q5_1"])
def test_gemm_ws_main_types(wtype):
    """Two K chunks, two token tiles (the second ragged), in place residual, every ring slot reused."""
    _run("gemm_ws", dict(mt=64, stages=2), wtype, "tiles", 70, 512, 70, np.random.default_rng(3),
         residual="in_place")


@pytest.mark.parametrize("stages,xtma", [(2, False), (3, False), (3, True)])
@pytest.mark.parametrize("wtype,layout,glu", [("Q4_K", "tiles", False), ("Q6_K", "glu-tiles", True)])
def test_gemm_ws_two_consumers_of_256_tokens(wtype, layout, glu, stages, xtma):
    """mt=256 with two consumer warpgroups: one producer warpgroup whose warps stream two strips each; a ragged
    token tile, a ragged second row tile, three K chunks (12 stages: the 3-stage ring wraps within a chunk)."""
    _run("gemm_ws", dict(mt=256, rgroups=2, stages=stages, xtma=xtma), wtype, layout, 180 if glu else 150, 768, 203,
         np.random.default_rng(5), residual=None if glu else "in_place", out_f16=glu, glu=glu)


@pytest.mark.parametrize("stages,xtma,kparts", [(5, False, 1), (6, True, 2), (8, True, 1), (8, False, 2)])
def test_gemm_ws_rings_deeper_than_a_chunk(stages, xtma, kparts):
    """A/B rings of more stages than a chunk's 4 (the prologue fills stages of the next chunks; none past K where the
    ring is longer than the CTA's part of K), two token tiles, every element against the oracle."""
    in_dim = 256 * (3 if kparts == 1 else 4)  # (3 chunks: a ring of 8 outlasts K; 2 a CTA with the split)
    _run("gemm_ws", dict(mt=64, rgroups=1, stages=stages, wstages=2, xtma=xtma, f16dec=True, kparts=kparts), "Q4_K",
         "tiles", 48, in_dim, 64 + 9, np.random.default_rng(stages), residual="in_place")


@pytest.mark.parametrize("xtma,stages", [(True, 2), (False, 6)])
def test_gemm_ws_k_split_over_four_ctas(xtma, stages):
    """kparts 4: four CTAs a tile sum their quarters of K (4 chunks, 1 each; the last reads the four parts back and adds
    them in the order of z), two token tiles, the residual in place, every element against the oracle, the counters
    left at zero."""
    _run("gemm_ws", dict(mt=64, rgroups=1, stages=stages, xtma=xtma, f16dec=True, kparts=4), "Q4_K", "tiles", 80, 1024,
         70, np.random.default_rng(stages), residual="in_place")


@pytest.mark.parametrize("mt,rgroups,psplit,stages", [(64, 1, 2, 4), (64, 1, 4, 5), (64, 2, 2, 3), (128, 1, 4, 4),
                                                     (256, 1, 2, 3)])
def test_gemm_ws_producers_sharing_a_strip(mt, rgroups, psplit, stages):
    """psplit 2 and 4: as many producer warpgroups a strip, each streaming the whole of K and filling the stages h of
    each chunk with h % psplit its own (rings of 3-5 stages, so that one warp's stages wait on slots another warp
    fills), two consumers with the SwiGLU epilogue, the K split, three or four chunks, a ragged token tile and row tile,
    every element against the oracle."""
    glu = rgroups == 2
    _run("gemm_ws", dict(mt=mt, rgroups=rgroups, stages=stages, wstages=2, xtma=mt != 128, f16dec=True, psplit=psplit,
                         kparts=2 if mt == 64 else 1), "Q4_K", "glu-tiles" if glu else "tiles", 100 if glu else 90,
         1024 if mt == 64 else 768, mt + 5 if mt < 256 else 200, np.random.default_rng(psplit * mt),
         residual=None if glu else "in_place", out_f16=glu, glu=glu)


@pytest.mark.parametrize("mt,rgroups,stages,pfence,kparts", [(64, 1, 3, 2, 1), (64, 2, 5, 4, 2), (128, 1, 4, 2, 1),
                                                            (256, 2, 3, 2, 1)])
def test_gemm_ws_producers_fencing_stages_together(mt, rgroups, stages, pfence, kparts):
    """pfence 2 and 4: a producer stores pfence stages, then fences them once and announces each (rings one stage deeper
    than the group and more, 3 stages: the slots in registers), two consumers, the K split, four chunks, a ragged token and row tile, every element against the
    oracle."""
    glu = rgroups == 2 and mt == 64
    _run("gemm_ws", dict(mt=mt, rgroups=rgroups, stages=stages, wstages=2, xtma=mt != 128, f16dec=True, pfence=pfence,
                         kparts=kparts), "Q4_K", "glu-tiles" if glu else "tiles", 100 if glu else 90, 1024,
         mt + 5 if mt < 256 else 200, np.random.default_rng(pfence * mt + stages),
         residual=None if glu else "in_place", out_f16=glu, glu=glu)


@pytest.mark.parametrize("mt,rgroups,stages,kparts,pfence,rows", [(64, 1, 2, 1, 1, 48), (64, 1, 3, 2, 2, 90),
                                                                 (128, 2, 4, 4, 2, 300), (256, 2, 3, 1, 1, 150)])
def test_gemm_ws_x_multicast_to_a_cluster_pair(mt, rgroups, stages, kparts, pfence, rows):
    """xcast 2: CTAs in pairs along the weight rows, each copying half of every stage's X box into both by TMA
    multicast, each releasing a slot to the other before either copies into it; an odd number of row tiles (the pair's
    second CTA past the weight), K split in two and four (the CTAs that are not last leave through the pair's
    barrier), 2-4 stage rings, two token tiles, every element against the oracle."""
    glu = rgroups == 2 and mt == 256
    _run("gemm_ws", dict(mt=mt, rgroups=rgroups, stages=stages, wstages=2, xtma=True, f16dec=True, kparts=kparts,
                         pfence=pfence, xcast=2), "Q4_K", "glu-tiles" if glu else "tiles", rows, 1024,
         mt + 7 if mt < 256 else 260, np.random.default_rng(mt + rows), residual=None if glu else "in_place",
         out_f16=glu, glu=glu)


@pytest.mark.parametrize("epi", ["in_place", "bias_residual", "f16", "glu"])
def test_gemm_ws_k_split_over_two_ctas(epi):
    """kparts 2: two CTAs a tile sum their halves of K (4 chunks, 2 each; the second CTA adds the first's partial
    sums and runs the epilogue), two row tiles and two token tiles (four counters, each left at zero), every
    epilogue, X copied and by a tensor map, 2-stage and 3-stage rings."""
    glu = epi == "glu"
    _run("gemm_ws", dict(mt=64, rgroups=2 if glu else 1, stages=3 if glu else 2, xtma=epi != "f16", kparts=2),
         "Q4_K" if epi != "bias_residual" else "Q8_0", "glu-tiles" if glu else "tiles", 260 if glu else 150, 1024, 77,
         np.random.default_rng(17), bias=epi == "bias_residual",
         residual={"in_place": "in_place", "bias_residual": "buffer"}.get(epi), out_f16=epi in ("f16", "glu"), glu=glu)


def test_gemm_ws_epilogue_ablation_keeps_the_mmas():
    """The epilogue left out (a diagnostic launch) stays behind a test no launch passes, so that ptxas keeps every
    wgmma whose results it would write: as many HGMMA in the SASS as the whole kernel's (dropping the epilogue outright
    let ptxas drop three quarters of them, and the ablation timed the MMAs too)."""
    from ptx_gen import inspect as ptx_inspect

    try:
        ptx_inspect.find_sass_tool()
    except ptx_inspect.SassToolNotFound as e:
        pytest.skip(str(e))
    shape = dict(wtype="Q4_K", in_dim=1024, layout="glu-tiles", glu=True, out_f16=True, mt=256, rgroups=2, stages=3,
                 xtma=True, f16dec=True, pfence=2)
    count = [sum("HGMMA." in line for line in ptx_inspect.sass("gemm_ws", "sm_90a", **shape, ablate=a).splitlines())
             for a in ("", "epilogue", "mma")]
    assert count[0] == count[1] > count[2], count


@pytest.mark.parametrize("epi", ["bias_residual", "in_place", "f16", "glu"])
def test_gemm_ws_staged_epilogue_rows_by_vectors_and_the_edges(epi):
    """The epilogue's two paths in one launch: Y's rows a multiple of 4 outputs apart (16-byte aligned: whole quads by
    vectors), N two outputs past its last whole quad (that quad one output at a time), tokens past m in the last
    token tile; every output right and nothing written between Y's rows (run_emulated checks both)."""
    glu = epi == "glu"
    cols = 70 if not glu else 38
    _run("gemm_ws", dict(mt=64, rgroups=2 if glu else 1, stages=2, xtma=True), "Q4_K", "glu-tiles" if glu else "tiles",
         2 * cols if glu else cols, 512, 77, np.random.default_rng(23), bias=epi == "bias_residual",
         residual={"in_place": "in_place", "bias_residual": "buffer"}.get(epi), out_f16=epi in ("f16", "glu"), glu=glu,
         ldy=cols + 6)


@pytest.mark.parametrize("shape", [s for s in catalog.spec("gemm_ws").grid])
def test_gemm_ws_grid_assembles_without_spills(shape):
    k = catalog.emit("gemm_ws", target="sm_90", **shape)
    assert k.target == "sm_90a" and "wgmma.mma_async" in k.ptx
    rep = assemble(k.ptx, k.target)[0]
    assert not rep.spills, f"{shape} spills: {rep.log}"


def test_gemm_ws_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="F32"):
        ws.check_shape("F32", 256, "rows", 64, 1, 4, 2)
    with pytest.raises(ValueError, match="mt"):
        ws.check_shape("Q4_K", 256, "tiles", 32, 1, 4, 2)
    with pytest.raises(ValueError, match="rgroups"):
        ws.check_shape("Q4_K", 256, "tiles", 128, 3, 4, 2)
    with pytest.raises(ValueError, match="stages"):
        ws.check_shape("Q4_K", 256, "tiles", 128, 1, 9, 2)
    with pytest.raises(ValueError, match="wstages"):
        ws.check_shape("Q4_K", 256, "tiles", 128, 1, 4, 5)
    with pytest.raises(ValueError, match="shared memory"):
        ws.check_shape("Q4_K", 4096, "tiles", 256, 2, 4, 2)
    with pytest.raises(ValueError, match="kparts"):
        ws.check_shape("Q4_K", 768, "tiles", 128, 1, 4, 2, kparts=2)  # (3 chunks)
    with pytest.raises(ValueError, match="kparts"):
        ws.check_shape("Q4_K", 1024, "tiles", 128, 1, 4, 2, kparts=3)
    with pytest.raises(ValueError, match="kparts"):
        ws.check_shape("Q4_K", 1536, "tiles", 128, 1, 4, 2, kparts=4)  # (6 chunks)
    with pytest.raises(ValueError, match="at most the 3 stages"):  # (a warp's waits would skip an empty phase)
        ws.check_shape("Q4_K", 1024, "tiles", 64, 1, 3, 2, psplit=4)
    with pytest.raises(ValueError, match="accumulators"):  # (768 threads: 80 registers)
        ws.check_shape("Q4_K", 1024, "tiles", 128, 2, 3, 2, psplit=2)
    ws.check_shape("Q4_K", 1024, "tiles", 64, 1, 4, 2, psplit=4)
    with pytest.raises(ValueError, match="pfence"):  # (a producer holding 4 stages of a 4-stage ring waits on itself)
        ws.check_shape("Q4_K", 1024, "tiles", 64, 1, 4, 2, pfence=4)
    with pytest.raises(ValueError, match="pfence"):
        ws.check_shape("Q4_K", 1024, "tiles", 64, 1, 4, 2, psplit=2, pfence=2)
    from ptx_gen.builder import Module

    with pytest.raises(ValueError, match="f16dec"):
        ws.gemm_ws(Module("sm_90a"), "Q6_K", 256, "tiles", mt=64, f16dec=True)


@settings(max_examples=examples(8), deadline=None)
@given(data=st.data(), case=st.sampled_from(WS_CASES), seed=st.integers(0, 2**32 - 1))
def test_gemm_wg_matches_oracle(data, case, seed):
    """gemm_wg: token tiles, row groups (sharing X through named barriers), K parts (summed through shared
    memory), ring depths, unrolls, epilogues."""
    from ptx_gen.kernels.gemm import gemm_wg as wg

    wtype, layout = case
    in_dim = 256 * data.draw(st.integers(1, 3))
    mt, rgroups, kparts = data.draw(st.sampled_from([(32, 1, 1), (64, 1, 1), (64, 1, 2), (32, 1, 4), (32, 2, 1),
                                                     (64, 2, 2)]))
    assume(in_dim // 256 >= kparts)
    stages, unroll = data.draw(st.sampled_from([2, 3])), data.draw(st.sampled_from([1, 2]))
    assume(wg.smem_bytes(wtype, in_dim, layout, mt, rgroups, kparts, stages) <= wg.MAX_DYN_SMEM)
    m = data.draw(st.integers(1, mt + 9))
    glu = layout == "glu-tiles" or (layout == "rows" and data.draw(st.booleans()))
    out_dim = (2 if glu else 1) * data.draw(st.integers(1, 40 if glu else 80))
    epi = "plain" if glu else data.draw(st.sampled_from(["plain", "bias", "residual", "in_place", "f16"]))
    _run("gemm_wg", dict(mt=mt, rgroups=rgroups, kparts=kparts, stages=stages, unroll=unroll), wtype, layout, out_dim,
         in_dim, m, np.random.default_rng(seed), bias="bias" in epi,
         residual={"residual": "buffer", "in_place": "in_place"}.get(epi), out_f16="f16" in epi, glu=glu)


@pytest.mark.parametrize("name,config", [("gemm_ws", None), ("gemm_ws", "two_consumers"), ("gemm_ws", "xtma"),
                                         ("gemm_ws", "xcast"), ("gemm_ws", "streamk"), ("gemm_wg", "one_row_group")])
def test_host_launch_on_the_emulated_device(monkeypatch, name, config):
    """``GemmWgOps.gemm_ws`` / ``gemm_wg`` end to end (operand checks, the policy's or a given launch shape, the
    launch) on the emulated device, which the Linear never hands them (``wg_applies``): allowed here, every
    element against the oracle, a bias and a residual epilogue, two token tiles; X multicast to a pair with the K split
    (the tensor map's boxes of half a token tile); Stream-K's 4 tiles over a device of 3 SMs (its grid, room and
    ``ntiles``)."""
    import realizar.gpu.gemm_wg as host
    from realizar import cuda
    from realizar.gpu.gemm_wg import WgConfig, WsConfig
    from realizar.gpu.ops import GpuWeight, LayerOps
    from tests.layer_oracles import epilogue_buffers

    monkeypatch.setattr(host, "wg_applies", lambda *a: True)
    ops = LayerOps(cuda.EmulatedDevice(target="sm_90", sm_count=3 if config == "streamk" else 132))
    rng = np.random.default_rng(11)
    out_dim, in_dim, m = 72, 512, 70
    raw = random_weight(rng, "Q4_K", out_dim, in_dim)
    w = GpuWeight(data=raw, ggml_type="Q4_K", shape=(out_dim, in_dim), layout="tiles", device=ops.device)
    x = (rng.standard_normal((m, in_dim)) + 0.1).astype(np.float16)
    y, kw, b, r = epilogue_buffers(ops, rng, m, out_dim, bias=True, residual="buffer", out_f16=False)
    cfg = {None: None, "two_consumers": WsConfig(256, 2, 2, 2),
           "xtma": WsConfig(128, 1, 3, 2, xtma=True), "one_row_group": WgConfig(64, 1, 2, 2, 2),
           "xcast": WsConfig(64, 1, 3, 2, True, True, 2, 1, 2, 2),  # (72 rows: 2 row tiles, one pair)
           "streamk": WsConfig(64, 1, 3, 2, True, True, streamk=True)}[config]
    if name == "gemm_ws":  # (the launch shape's K split, the policy's included, needs its room)
        room = host.split_room(cfg or host.ws_config("Q4_K", in_dim, "tiles", out_dim, m, ops.sm_count), out_dim, m)
        kw = {**kw, **({"split": ops.split_space(*room)} if room[0] else {})}
    getattr(ops, name)(ops.to_device(x), w, y, m, config=cfg, **kw)
    got = y.to_numpy().reshape(m, out_dim).astype(np.float64)
    ref, scale, tol = _oracle(raw, "Q4_K", out_dim, in_dim, x, False, b, r, False)
    assert np.isfinite(got).all(), "unwritten (NaN-poisoned) outputs"
    assert (np.abs(got - ref) / scale).max() < tol


@pytest.mark.parametrize("rgroups,kparts,glu", [(2, 1, False), (2, 2, False), (2, 1, True)])
def test_gemm_wg_row_groups(rgroups, kparts, glu):
    """Two row groups sharing the tokens' X (named barriers), with K split in two, and the SwiGLU weight."""
    layout = "glu-tiles" if glu else "tiles"
    _run("gemm_wg", dict(mt=32, rgroups=rgroups, kparts=kparts, stages=2, unroll=2), "Q4_K", layout,
         2 * 90 if glu else 150, 512, 40, np.random.default_rng(5), glu=glu, out_f16=glu,
         residual=None if glu else "in_place")


@pytest.mark.parametrize("split", [0.0, 0.9, "first", "policy"])
@pytest.mark.parametrize("wtype", ["Q4_K", "Q6_K"])
def test_policy_shapes_fit_take_x_by_tma_and_assemble(monkeypatch, wtype, split):
    """ws_config from WS_OVER_WG_ROWS + 1 tokens (where the Linear takes gemm_ws) to a prefill chunk at the 8B and 1B
    layers, with the K split off and on (WS_SPLIT_K), first on every tile (WS_SPLIT_FIRST) and as the policy has
    them: each pick passes check_shape, takes X by a tensor map, decodes in f16x2 exactly where the type has that
    decoder, splits K only where asked (two consumer warpgroups then; WS_SPLIT_FIRST: the largest tile, one of those
    it names); a spread of the picks assembles for sm_90a without spills."""
    import realizar.gpu.gemm_wg as host
    from realizar.gpu.gemm_wg import ws_config
    from realizar.gpu.policy.gemm import WS_OVER_WG_ROWS

    if split == "policy":
        split, tiles = host.WS_SPLIT_K, host.WS_SPLIT_FIRST
    else:
        split, tiles = (0.0, (128, 256)) if split == "first" else (split, ())
    first = bool(tiles)
    monkeypatch.setattr(host, "WS_SPLIT_K", split)
    monkeypatch.setattr(host, "WS_SPLIT_FIRST", tiles)

    seen = set()
    for n, k, glu, layout in [(28672, 4096, True, "glu-tiles"), (6144, 4096, False, "rows"),
                              (4096, 4096, False, "rows"), (4096, 14336, False, "tiles"), (16384, 2048, True, "glu-tiles"),
                              (2048, 8192, False, "tiles")]:
        cols = n // 2 if glu else n
        for m in list(range(WS_OVER_WG_ROWS + 1, 600, 7)) + [1024, 2048]:
            cfg = ws_config(wtype, k, layout, cols, m, 132, 227 * 1024, glu=glu)
            ws.check_shape(wtype, k, layout, cfg.mt, cfg.rgroups, cfg.stages, cfg.wstages, cfg.kparts)
            assert cfg.xtma and cfg.f16dec == (wtype in F16DEC_TYPES), cfg
            assert cfg.kparts == 1 or (split and cfg.rgroups == 2) or (cfg.mt in tiles and cfg.mt == max(
                t for t in (64, 128, 256) if m > host.WS_TILE_FILL * t)) or (
                cfg.mt == 64 and host.WS_SPLIT_SMALL and cfg.kparts == 2), cfg
            seen.add((k, layout, glu, cfg))
    assert any(c.kparts == 2 for *_, c in seen) == bool(split or first or host.WS_SPLIT_SMALL)
    if first:  # down at 128 tokens: a 128-token tile split in two, not 64-token tiles; o (8 chunks a part) only where
        # WS_SPLIT_FIRST_MIN_CHUNKS allows, else 64-token tiles with K in two (WS_SPLIT_SMALL)
        o = ws_config(wtype, 4096, "rows", 4096, 128, 132, 227 * 1024)
        want = (128, 1, 2) if 8 >= host.WS_SPLIT_FIRST_MIN_CHUNKS else (64, 1, 2 if host.WS_SPLIT_SMALL else 1)
        assert (o.mt, o.rgroups, o.kparts) == want, o
        assert ws_config(wtype, 14336, "tiles", 4096, 128, 132, 227 * 1024).mt == 128
        down = ws_config(wtype, 14336, "tiles", 4096, 256, 132, 227 * 1024)
        assert down.kparts == (2 if 256 in tiles or split else 1), down  # (split first on the 256-token tile: the
        # K split of two warpgroups on 128-token tiles does not replace it)
        assert (down.mt, down.rgroups) == ((256, 1) if 256 in tiles else (128, 2 if split else 1)), down
    # (WS_TILE_FILL: 192 tokens on one 256-token tile, not a full and a half-empty 128-token tile)
    assert ws_config(wtype, 4096, "glu-tiles", 14336, 192, 132, 227 * 1024, glu=True).mt == 256
    assert ws_config(wtype, 4096, "glu-tiles", 14336, 128, 132, 227 * 1024, glu=True).mt == 128
    for k, layout, glu, cfg in sorted(seen, key=str)[:: max(1, len(seen) // 4)]:
        kern = catalog.emit("gemm_ws", target="sm_90", wtype=wtype, in_dim=k, layout=layout, mt=cfg.mt,
                            rgroups=cfg.rgroups, stages=cfg.stages, wstages=cfg.wstages, xtma=cfg.xtma,
                            f16dec=cfg.f16dec, glu=glu, out_f16=glu, kparts=cfg.kparts)
        rep = assemble(kern.ptx, kern.target)[0]
        assert not rep.spills, f"{cfg} spills: {rep.log}"


@pytest.mark.parametrize("mode", ["split_k", "first"])
def test_linear_sizes_the_k_split_room_and_launches_it(monkeypatch, mode):
    """The Linear above WS_OVER_WG_ROWS with the policy splitting K (WS_SPLIT_K on: two consumer warpgroups; or
    WS_SPLIT_FIRST: the largest token tile where a smaller one would be taken): reserve sizes its SplitSpace once
    (True: graphs must be rebuilt; then False), the product with the residual in place matches the oracle twice (the
    counters left at zero between launches), and gemm_ws without the room is refused with what it needs."""
    import realizar.gpu.gemm_wg as host
    from realizar import cuda
    from realizar.errors import ShapeError
    from realizar.gpu.linear import Linear
    from realizar.gpu.ops import GpuWeight, LayerOps
    from realizar.gpu.policy.gemm import WS_OVER_WG_ROWS
    from tests.test_gemm_q_ptx import _oracle

    monkeypatch.setattr(host, "wg_applies", lambda *a: True)
    monkeypatch.setattr(host, "WS_TILE_FILL", 1.0)  # (tiles not above m)
    m = max(WS_OVER_WG_ROWS, 128) + 5  # (a 128-token tile, then a ragged one)
    if mode == "split_k":
        monkeypatch.setattr(host, "WS_SPLIT_K", 0.01)
        monkeypatch.setattr(host, "WS_SPLIT_MIN_CHUNKS", 1)
        ops = LayerOps(cuda.EmulatedDevice(target="sm_90", sm_count=2))  # (a launch of 4 CTAs fills it)
        out_dim = 128
    else:  # (8 SMs: 2 CTAs of 128-token tiles, 3 of 64 are too few; split in two, 4)
        monkeypatch.setattr(host, "WS_SPLIT_FIRST", (128,))
        monkeypatch.setattr(host, "WS_SPLIT_FIRST_MIN_CHUNKS", 1)  # (K of 2 chunks)
        ops = LayerOps(cuda.EmulatedDevice(target="sm_90", sm_count=8))
        out_dim = 64
    rng = np.random.default_rng(23)
    in_dim = 512
    raw = random_weight(rng, "Q4_K", out_dim, in_dim)
    w = GpuWeight(data=raw, ggml_type="Q4_K", shape=(out_dim, in_dim), layout="tiles", device=ops.device)
    cfg = host.ws_config("Q4_K", in_dim, "tiles", out_dim, m, ops.sm_count)
    assert cfg.kparts == 2 and (cfg.mt, cfg.rgroups) == ((128, 2) if mode == "split_k" else (128, 1)), cfg
    lin, weights = Linear(ops), (w,)
    assert lin.reserve(weights, m) and not lin.reserve(weights, m) and lin.split is not None
    x = (rng.standard_normal((m, in_dim)) + 0.1).astype(np.float16)
    r = rng.standard_normal((m, out_dim)).astype(np.float32)
    xb, y = ops.to_device(x), ops.to_device(r)
    lin(w, xb, y, m, residual=y)
    ref, scale, tol = _oracle(raw, "Q4_K", out_dim, in_dim, x, False, None, r, False)
    got = y.to_numpy().reshape(m, out_dim).astype(np.float64)
    assert (np.abs(got - ref) / scale).max() < tol
    lin(w, xb, y, m, residual=y)  # (again: y = 2 x W^T + r)
    ref2, scale2, _ = _oracle(raw, "Q4_K", out_dim, in_dim, x, False, None, ref, False)
    assert (np.abs(y.to_numpy().reshape(m, out_dim) - ref2) / scale2).max() < 2 * tol
    assert not lin.split.counters.to_numpy().any()
    with pytest.raises(ShapeError, match="SplitSpace"):
        ops.gemm_ws(xb, w, y, m, residual=y)
    lin.free()


def test_launches_of_no_more_ctas_than_sms_take_an_sm_alone(monkeypatch):
    """WS_SOLE_CTA: a gemm_ws launch of at most sm_count CTAs asks for half an SM's shared memory (two of its CTAs no
    longer fit one SM, whatever runs before it), a larger launch for its own need; the padded launch still matches the
    oracle. Off, every launch asks for its own need."""
    import realizar.gpu.gemm_wg as host
    import realizar.gpu.policy.gemm as policy
    from realizar import cuda
    from realizar.gpu.ops import GpuWeight, LayerOps
    from tests.test_gemm_q_ptx import _oracle

    assert policy.ws_shared_bytes(70_000, 132, 132, 233_472) == 116_736
    assert policy.ws_shared_bytes(130_000, 100, 132, 233_472) == 130_000
    assert policy.ws_shared_bytes(70_000, 133, 132, 233_472) == 70_000
    monkeypatch.setattr(policy, "WS_SOLE_CTA", False)
    assert policy.ws_shared_bytes(70_000, 1, 132, 233_472) == 70_000
    monkeypatch.undo()

    monkeypatch.setattr(host, "wg_applies", lambda *a: True)
    ops = LayerOps(cuda.EmulatedDevice(target="sm_90", sm_count=2))
    rng = np.random.default_rng(31)
    out_dim, in_dim, m = 64, 256, 5
    raw = random_weight(rng, "Q4_K", out_dim, in_dim)
    w = GpuWeight(data=raw, ggml_type="Q4_K", shape=(out_dim, in_dim), layout="tiles", device=ops.device)
    x = (rng.standard_normal((m, in_dim)) + 0.1).astype(np.float16)
    y = ops.to_device(np.full((m, out_dim), np.nan, np.float32))
    with cuda.recording() as launches:
        ops.gemm_ws(ops.to_device(x), w, y, m)
    (rec,) = launches
    assert rec.grid == (1, 1, 1) and rec.kernel.launch.dyn_smem < ops.device.max_shared_per_sm // 2
    assert rec.shared_bytes == ops.device.max_shared_per_sm // 2
    ref, scale, tol = _oracle(raw, "Q4_K", out_dim, in_dim, x, False, None, None, False)
    assert (np.abs(y.to_numpy().reshape(m, out_dim) - ref) / scale).max() < tol


@pytest.mark.parametrize("extra", [0, 30, 200])
def test_x_map_spans_whole_token_tiles_the_buffer_holds(monkeypatch, extra):
    """XTMA_WHOLE_TILES: X's tensor map spans the X buffer's rows up to whole token tiles, so no box reaches past it
    (the hardware fills such rows with zeros, slowly); rows past m are read as they are (NaN here) and reach only
    their own outputs, which are never written: every output of the m tokens matches the oracle and nothing after them
    changes. ``extra``: rows the buffer holds past m (0: the map ends at m; 30: at the buffer's end; 200: at the end of
    the second 64-token tile)."""
    import realizar.gpu.gemm_wg as host
    from realizar import cuda
    from realizar.gpu.ops import GpuWeight, LayerOps

    monkeypatch.setattr(host, "wg_applies", lambda *a: True)
    ops = LayerOps(cuda.EmulatedDevice(target="sm_90"))
    rng = np.random.default_rng(extra)
    m, out_dim, in_dim, mt = 70, 64, 256, 64
    raw = random_weight(rng, "Q4_K", out_dim, in_dim)
    w = GpuWeight(data=raw, ggml_type="Q4_K", shape=(out_dim, in_dim), layout="rows", device=ops.device)
    x = np.full((m + extra, in_dim), np.nan, np.float16)
    x[:m] = rng.standard_normal((m, in_dim)) + 0.1
    xb = ops.to_device(x)
    assert host.GemmWgOps._x_rows(xb, m, in_dim, in_dim, mt) == min(m + extra, 2 * mt)
    monkeypatch.setattr(host, "XTMA_WHOLE_TILES", False)
    assert host.GemmWgOps._x_rows(xb, m, in_dim, in_dim, mt) == m
    monkeypatch.setattr(host, "XTMA_WHOLE_TILES", True)
    sentinel = -12345.0
    y = ops.to_device(np.concatenate([np.full(m * out_dim, np.nan, np.float32), np.full(8 * out_dim, sentinel,
                                                                                         np.float32)]))
    ops.gemm_ws(xb, w, y, m, config=host.WsConfig(mt, 1, 2, 2, True, False, 1))
    got = y.to_numpy()
    ref, scale, tol = _oracle(raw, "Q4_K", out_dim, in_dim, x[:m], False, None, None, False)
    assert (np.abs(got[:m * out_dim].reshape(m, out_dim) - ref) / scale).max() < tol
    assert (got[m * out_dim:] == sentinel).all()


def test_split_rooms_key_on_every_policy_name_ws_config_reads(monkeypatch):
    """The Linear's split rooms are kept by launch policy (tools change it between steps): WS_POLICY names exactly the
    policy globals ws_config reads, and a change of any one of them is a new key."""
    import realizar.gpu.gemm_wg as host

    def names(code):  # (with the comprehensions' own code objects before Python 3.12)
        return set(code.co_names).union(*[names(c) for c in code.co_consts if hasattr(c, "co_names")])

    read = {n for n in names(host.ws_config.__code__) if n.startswith(("WS_", "XTMA_"))}
    assert read == set(host.WS_POLICY), read ^ set(host.WS_POLICY)
    before = host.ws_policy()
    for name in host.WS_POLICY:
        with monkeypatch.context() as mp:
            mp.setattr(host, name, ("changed", name))
            assert host.ws_policy() != before, name
    assert host.ws_policy() == before


def test_policy_with_x_multicast_fits_and_pairs_whole_clusters(monkeypatch):
    """WS_XCAST 2: every ws_config pick at the 8B and 1B layers from WS_OVER_WG_ROWS + 1 tokens to a prefill chunk
    passes check_shape with its multicast (and the shared memory of the pair's release barriers); the launch's row
    tiles (and the K split's room) count whole pairs."""
    import realizar.gpu.gemm_wg as host
    from realizar.gpu.policy.gemm import WS_OVER_WG_ROWS

    monkeypatch.setattr(host, "WS_XCAST", 2)
    for n, k, glu, layout in [(28672, 4096, True, "glu-tiles"), (6144, 4096, False, "rows"),
                              (4096, 14336, False, "tiles"), (16384, 2048, True, "glu-tiles"), (2048, 8192, False, "tiles")]:
        cols = n // 2 if glu else n
        for m in list(range(WS_OVER_WG_ROWS + 1, 600, 13)) + [2048]:
            cfg = host.ws_config("Q4_K", k, layout, cols, m, 132, 227 * 1024, glu=glu)
            assert cfg.xcast == 2, cfg
            ws.check_shape("Q4_K", k, layout, cfg.mt, cfg.rgroups, cfg.stages, cfg.wstages, cfg.kparts, cfg.psplit,
                           cfg.pfence, cfg.xcast, cfg.xtma)
            tiles = host._row_tiles(cfg, cols, glu)
            assert tiles % 2 == 0 and tiles - 2 < -(-cols // ((8 if glu else 16) * 4 * cfg.rgroups)) <= tiles
    odd = dataclasses.replace(host.ws_config("Q4_K", 4096, "tiles", 4096, 256, 132), kparts=2, rgroups=1, mt=128)
    assert host.split_room(odd, 16 * 4 * 63, 256)[1] == 64 * 2  # (63 row tiles: 32 pairs)


@pytest.mark.parametrize("ablate", ["wload", "decode", "mma", "xload", "decode+mma", "fence", "xwait", "epilogue",
                                    "wload+decode+mma+xload+fence+xwait"])
def test_gemm_ws_ablations_run_to_the_end_and_assemble(ablate):
    """The diagnostic launches (parts of the work left out): each runs through every barrier to its end in the emulator
    (no deadlock: the barriers' counts and bytes still meet) and assembles without spills; the whole launch, not
    ablated, still matches the oracle (run_emulated checks it; the ablated one's output is not checked)."""
    shape = dict(mt=64, rgroups=1, stages=3, wstages=2, xtma=True, f16dec=True, kparts=2, pfence=2)
    from ptx_gen.builder import Module
    from ptx_gen.emulator import EmulatorError

    # (an ablated launch's output is wrong: the oracle's check after the run fails, not the emulator during it; a
    # fence or a wait left out only loses an ordering the emulator keeps anyway, and the output stays right there)
    ordering_only = set(ablate.split("+")) <= {"fence", "xwait"}
    run = lambda: _run("gemm_ws", {**shape, "ablate": ablate}, "Q4_K", "tiles", 40, 1024, 70,  # noqa: E731
                       np.random.default_rng(1), residual="in_place")
    if ordering_only:
        run()
    else:
        with pytest.raises(AssertionError, match="max relative error|NaN-poisoned") as exc:
            run()
        assert not isinstance(exc.value, EmulatorError), exc.value
    kern = catalog.emit("gemm_ws", target="sm_90", wtype="Q4_K", in_dim=4096, layout="tiles", residual=True,
                        **{**shape, "mt": 128, "ablate": ablate})
    assert all(f"_no{c}" in kern.entry for c in ablate.split("+")) and not assemble(kern.ptx, kern.target)[0].spills
    with pytest.raises(ValueError, match="ablate"):
        ws.gemm_ws(Module("sm_90a"), "Q4_K", 1024, "tiles", mt=64, xtma=True, ablate="warp")
