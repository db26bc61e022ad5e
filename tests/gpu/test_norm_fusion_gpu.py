"""GPU tests of the RMSNorm fused into gemm_ws launches (the emulator runs the same PTX in
tests/test_gemm_ws_norm_ptx.py):

* the output side (``NormOut``) on a residual launch: Y, the norm's f16 input ``Y gamma``, each token's sums of
  squares over the launch's output tiles and its factor ``1 / sqrt(mean(Y^2) + eps)``, every element against
  float64, the 8B O and down shapes at 256 and 512 tokens and drawn ragged ones, parts past the launch's tiles
  untouched, the counters left at zero;
* the input side (``NormIn``) on QKV- and gate/up-like launches: every output against the float64 oracle of the
  scaled products;
* the batched decode step and a prefill with the fusion on against the same runs with the norm kernels
  (``NORM_IN_GEMM`` off): logits within f16 rounding, the same greedy tokens."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from realizar.gpu.gemm_wg import NormIn, NormOut, norm_pad, split_room, ws_config
from realizar.gpu.ops import GpuWeight, LayerOps
from tests.helpers import examples, rel_err
from tests.layer_oracles import dequant, random_weight
from tests.test_gemm_q_ptx import _silu

pytestmark = pytest.mark.gpu
EPS = 1e-5


@pytest.fixture(scope="module")
def ops(device):
    if device.target.compute_capability != (9, 0):
        pytest.skip(f"gemm_ws is an sm_90a kernel; this device is {device.target}")
    return LayerOps(device)


def _split(ops, wtype, layout, cols, m, in_dim, glu=False, **norm):
    cfg = ws_config(wtype, in_dim, layout, cols, m, ops.sm_count, ops.device.max_shared_per_block_optin, glu=glu,
                    **norm)
    room = split_room(cfg, cols, m, glu)
    return ops.split_space(*room) if room[0] else None


def run_norm_out(ops, rng, wtype, layout, out_dim, in_dim, m):
    """A residual launch with NormOut checked against float64; returns (Y, the sums [m, parts])."""
    raw = random_weight(rng, wtype, out_dim, in_dim)
    w = GpuWeight(data=raw, ggml_type=wtype, shape=(out_dim, in_dim), layout=layout)
    x = (rng.standard_normal((m, in_dim)) + 0.1).astype(np.float16)
    res = rng.standard_normal((m, out_dim)).astype(np.float32)
    g = (1 + 0.5 * rng.standard_normal(out_dim)).astype(np.float32)
    parts = ops.norm_parts(w, m)
    stride = norm_pad(parts)
    bufs = [ops.to_device(a) for a in (x, res, g, np.full(m * out_dim, np.nan, np.float16),
                                       np.full(m * stride, np.nan, np.float32), np.full(m * out_dim, np.nan, np.float32),
                                       np.full(m, np.nan, np.float32), np.zeros(-(-m // 64), np.uint32))]
    xb, rb, gb, hb, sb, yb, nb, cb = bufs
    split = _split(ops, wtype, layout, out_dim, m, in_dim, norm_out=True)
    ops.gemm_ws(xb, w, yb, m, residual=rb, split=split, norm_out=NormOut(gb, EPS, hb, sb, stride, nb, cb))
    y = yb.to_numpy().reshape(m, out_dim).astype(np.float64)
    h = hb.to_numpy().reshape(m, out_dim).astype(np.float64)
    ss = sb.to_numpy().reshape(m, stride).astype(np.float64)
    wd = dequant(raw, wtype, out_dim, in_dim).astype(np.float64)
    xs = x.astype(np.float64)
    ref, scale = xs @ wd.T + res, np.abs(xs) @ np.abs(wd).T + np.abs(res)
    assert np.isfinite(y).all() and (np.abs(y - ref) / scale).max() < 2.0 ** -10
    assert np.isfinite(h).all() and np.allclose(h, y * g, rtol=2.0 ** -10, atol=2.0 ** -24)
    assert np.isnan(ss[:, parts:]).all(), "sums written past the launch's tiles"
    cols = -(-out_dim // parts)
    want = np.stack([(y[:, p * cols:(p + 1) * cols] ** 2).sum(1) for p in range(parts)], 1)
    assert np.allclose(ss[:, :parts], want, rtol=1e-5, atol=0)
    r = nb.to_numpy().astype(np.float64)
    assert np.allclose(r, 1 / np.sqrt((y ** 2).mean(1) + EPS), rtol=1e-5), "the tokens' factors"
    assert not cb.to_numpy().any(), "norm counters not left at zero"
    for b in (*bufs, w):
        b.free()
    if split is not None:
        assert not split.counters.to_numpy().any()
        split.free()
    return y, ss[:, :parts]


def run_norm_in(ops, rng, wtype, layout, out_dim, in_dim, m, *, glu=False, bias=False):
    """A launch with NormIn over drawn sums (NaN past nparts), every output against float64."""
    raw = random_weight(rng, wtype, out_dim, in_dim)
    w = GpuWeight(data=raw, ggml_type=wtype, shape=(out_dim, in_dim), layout=layout)
    cols = out_dim // 2 if glu else out_dim
    x = ((rng.standard_normal((m, in_dim)) + 0.1) / (64 if glu else 1)).astype(np.float16)
    inv = (10 ** rng.uniform(-0.6, 0.6, m)).astype(np.float32)  # (factors from 0.25 to 4)
    b = rng.standard_normal(cols).astype(np.float32)
    xb, sb, bb = ops.to_device(x), ops.to_device(inv), ops.to_device(b)
    yb = ops.to_device(np.full(m * cols, np.nan, np.float16 if glu else np.float32))
    split = _split(ops, wtype, layout, cols, m, in_dim, glu, norm_in=True)
    ops.gemm_ws(xb, w, yb, m, glu=glu, out_f16=glu, bias=bb if bias else None, split=split, norm_in=NormIn(sb))
    inv = inv.astype(np.float64)
    wd = dequant(raw, wtype, out_dim, in_dim).astype(np.float64)
    xs = x.astype(np.float64)
    full, scale = (xs @ wd.T) * inv[:, None], (np.abs(xs) @ np.abs(wd).T) * inv[:, None]
    if glu:
        gt, up = full[:, :cols], full[:, cols:]
        ref, scale = _silu(gt) * up, (np.abs(gt) + scale[:, :cols]) * (np.abs(up) + scale[:, cols:])
    else:
        ref, scale = full + (b if bias else 0), scale + (np.abs(b) if bias else 0)
    got = yb.to_numpy().reshape(m, cols).astype(np.float64)
    assert np.isfinite(got).all(), "unwritten outputs"
    assert (np.abs(got - ref) / (scale + 1e-30)).max() < (2.0 ** -9 if glu else 2.0 ** -10)
    for buf in (xb, sb, bb, yb, w):
        buf.free()
    if split is not None:
        split.free()


@pytest.mark.parametrize("m", [256, 512])
@pytest.mark.parametrize("layout,in_dim", [("rows", 4096), ("tiles", 14336)], ids=["o", "down"])
def test_norm_out_8b_shapes(ops, m, layout, in_dim):
    run_norm_out(ops, np.random.default_rng(m + in_dim), "Q4_K", layout, 4096, in_dim, m)


@pytest.mark.parametrize("m", [256, 512])
@pytest.mark.parametrize("layout,out_dim,glu", [("rows", 6144, False), ("glu-tiles", 28672, True)],
                         ids=["qkv", "gate_up"])
def test_norm_in_8b_shapes(ops, m, layout, out_dim, glu):
    run_norm_in(ops, np.random.default_rng(m + out_dim), "Q4_K", layout, out_dim, 4096, m, glu=glu)


@settings(max_examples=examples(12), deadline=None)
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_norm_sides_drawn(ops, data, seed):
    rng = np.random.default_rng(seed)
    wtype, layout = data.draw(st.sampled_from([("Q4_K", "tiles"), ("Q6_K", "rows"), ("Q8_0", "tiles"),
                                               ("Q5_K", "rows")]))
    m = data.draw(st.integers(65, 600))
    in_dim = 256 * data.draw(st.integers(1, 12))
    if data.draw(st.booleans()):
        run_norm_out(ops, rng, wtype, layout, 4 * data.draw(st.integers(16, 1100)), in_dim, m)
    else:
        glu = data.draw(st.booleans())
        run_norm_in(ops, rng, "Q4_K" if glu else wtype, "glu-tiles" if glu else layout,
                    (2 if glu else 1) * 8 * data.draw(st.integers(1, 400)), in_dim, m, glu=glu,
                    bias=not glu and data.draw(st.booleans()))


def test_step_and_prefill_against_the_norm_kernels(tmp_path, monkeypatch):
    """Two 100-row decode steps and a 300-token prefill (gemm_ws launches, the norms fused) against the same with the
    norm kernels: logits within f16 rounding, the same greedy tokens (the second step's rows read the first's K/V)."""
    import realizar.gpu.policy.gemm as gemm_policy
    from realizar.gpu.batch import GpuBatchBackend
    from realizar.gpu.model import GpuModel
    from realizar.models.loader import load_model
    from realizar.sampling import RowSampling
    from tests.gguf_factory import make_gguf_model

    path, _, _ = make_gguf_model("llama", tmp_path, "Q4_K", seed=3, vocab_size=320, hidden_size=512,
                                 intermediate_size=1024, num_heads=4, num_kv_heads=2, num_layers=3,
                                 max_position_embeddings=1024)
    loaded = load_model(path)
    rows, rng = 100, np.random.default_rng(4)
    prompt = [int(t) for t in rng.integers(3, 320, 300)]
    toks = [int(t) for t in rng.integers(3, 320, rows)]
    out = {}
    for fused in (True, False):
        monkeypatch.setattr(gemm_policy, "NORM_IN_GEMM", fused)
        model = GpuModel.from_loaded(loaded, max_len=512, kv_cache=False)
        be = GpuBatchBackend(model, num_blocks=1 + rows * 2 + 12, block_size=32, max_batch=128, max_context=512,
                             f16_weights=False)
        tables = [[1 + 2 * r, 2 + 2 * r] for r in range(rows)]
        first = be.prefill(prompt, 0, list(range(1 + 2 * rows, 1 + 2 * rows + 10)))
        nxt = be.decode(toks, [0] * rows, tables).sample([RowSampling()] * rows)
        step = be.decode([int(t) for t in nxt], [1] * rows, tables)
        out[fused] = (first.logits(0), np.stack([step.logits(r) for r in range(rows)]),
                      step.sample([RowSampling()] * rows))
        be.close()
    (p1, d1, s1), (p0, d0, s0) = out[True], out[False]
    assert rel_err(p1, p0) < 1e-2 and rel_err(d1, d0) < 1e-2
    assert int(np.argmax(p1)) == int(np.argmax(p0))
    assert (np.asarray(s1) == np.asarray(s0)).mean() > 0.97, "greedy tokens of the fused step differ"
