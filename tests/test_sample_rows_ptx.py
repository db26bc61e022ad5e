"""The device sampling kernel ``sample_rows`` run in the PTX emulator against its NumPy mirror
``realizar.sampling.sample_rows`` (bit-identical draws except at a top-p cut within rounding), ptxas
without spills, the draw statistics, and the host call ``SampleOps.sample_rows`` / ``pack_specs``."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ptx_gen import catalog
from ptx_gen.emulator import Memory, run as simt_run
from ptx_gen.ptxas import assemble
from realizar import cuda
from realizar.errors import InvalidRequestError, ShapeError
from realizar.gpu.sampling import SPEC_WORDS, SampleOps, pack_specs
from realizar.sampling import RowSampling, sample_rows, top_p_margin
from tests.helpers import examples

BOUNDARY = 1e-5  # top-p cuts closer than this (relative mass) may go either way between f32 and f64 sums


@pytest.mark.parametrize("target", ["sm_80", "sm_89", "sm_90"])
@pytest.mark.parametrize("block", [256, 512, 1024])
def test_assembles_without_spills(target, block):
    # the vocabulary (32,000 .. 262,144) is a run-time parameter: one binary a block size serves all
    kern = catalog.emit("sample_rows", block=block, target=target)
    (report,) = assemble(kern.ptx, target)
    assert not report.spills, report.log


def _emulate(x: np.ndarray, specs, block: int = 64, ld: int | None = None) -> np.ndarray:
    b, v = x.shape
    ld = ld or v
    rows = np.full((b, ld), np.nan, np.float32)  # padding past the vocabulary is NaN: never read
    rows[:, :v] = x
    kern = catalog.emit("sample_rows", block=block)
    mem = Memory()
    out = mem.alloc_array(np.full(b, 0xFFFFFFFF, np.uint32))
    params = dict(logits=mem.alloc_array(rows), ld=ld, specs=mem.alloc_array(pack_specs(specs)), out=out, vocab=v)
    simt_run(kern.ptx, grid=(b,), block=(block,), params=params, memory=mem)
    return mem.read(out, np.uint32, b).astype(np.int64)


def _check(x: np.ndarray, specs, got: np.ndarray) -> None:
    want = sample_rows(x, specs)
    for r, s in enumerate(specs):
        if got[r] == want[r]:
            continue
        assert top_p_margin(x[r], s) < BOUNDARY, (r, s, got[r], want[r])
        # a boundary row: the kernel's token must still be one the top-k cut keeps
        z = x[r] * (np.float32(1) / np.float32(s.temperature))
        assert z[got[r]] >= np.sort(z)[::-1][min(len(z), max(1, s.top_k or len(z))) - 1], (r, s)


specs = st.builds(
    RowSampling,
    temperature=st.one_of(st.just(0.0), st.floats(0.05, 4.0)),
    top_k=st.one_of(st.just(0), st.integers(1, 40), st.integers(250, 400)),
    top_p=st.one_of(st.just(1.0), st.floats(0.05, 1.0, exclude_min=True)),
    seed=st.integers(0, 2**64 - 1),
    step=st.integers(0, 2**32 - 1),
)


@given(st.integers(1, 4), st.integers(1, 300), st.floats(0.1, 10.0), st.integers(0, 3), st.data(),
       st.integers(0, 2**32 - 1))
@settings(max_examples=examples(40), deadline=None)
def test_kernel_matches_mirror(b, v, scale, pad, data, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((b, v)) * scale
    x = np.where(x == 0, 0.25, x).astype(np.float32)  # never zero
    if v > 3 and data.draw(st.booleans()):  # repeated values, the maximum among them
        x[:, rng.choice(v, 3, replace=False)] = x.max(axis=1, keepdims=True)
    if v > 2 and data.draw(st.booleans()):  # masked tokens
        x[:, rng.choice(v, v // 3, replace=False)] = -np.inf
        x[:, 0] = np.where(np.isfinite(x).any(axis=1), x[:, 0], 1.0)
    row_specs = [data.draw(specs) for _ in range(b)]
    _check(x, row_specs, _emulate(x, row_specs, ld=v + pad))


def test_greedy_ties_take_the_lowest_index():
    x = np.array([[1.0, 3.0, -2.0, 3.0, 3.0], [-np.inf, -1.0, -1.0, -5.0, -1.0], [2.0] * 5,
                  [-3.0, -3.0, -3.0, -3.0, 7.5]], np.float32)
    assert _emulate(x, [RowSampling()] * 4).tolist() == [1, 1, 0, 4]
    # ties spread over the threads and loop iterations of a large row
    y = np.random.default_rng(3).standard_normal((2, 1000)).astype(np.float32)
    y[0, [700, 65, 999]] = 9.0
    y[1, [3, 64, 128]] = 9.0
    assert _emulate(y, [RowSampling(), RowSampling()]).tolist() == [65, 3]


def test_larger_rows_and_blocks():
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((3, 2500)) * 4).astype(np.float32)
    s = [RowSampling(1.0, seed=1, step=2), RowSampling(0.7, top_k=600, top_p=0.95, seed=3), RowSampling(1.5, top_k=2400, seed=4)]
    _check(x, s, _emulate(x, s, block=256))


def test_draws_follow_softmax():
    probs = np.array([0.1, 0.2, 0.3, 0.4])
    n = 1500
    x = np.tile(np.log(probs).astype(np.float32), (n, 1))
    s = [RowSampling(1.0, seed=17 * i + 5, step=i % 7) for i in range(n)]
    got = _emulate(x, s)
    assert got.tolist() == sample_rows(x, s).tolist()
    counts = np.bincount(got, minlength=4)
    chi2 = ((counts - n * probs) ** 2 / (n * probs)).sum()
    assert chi2 < 16.3, counts  # 3 degrees of freedom, p = 0.001


def test_host_call_on_emulated_device():
    dev = cuda.EmulatedDevice()
    ops = SampleOps(dev)
    rng = np.random.default_rng(2)
    b, v, ld = 3, 150, 160
    x = rng.standard_normal((b, ld)).astype(np.float32)
    specs = [RowSampling(), RowSampling(0.9, top_k=20, top_p=0.8, seed=2**63 + 1, step=4), RowSampling(2.0, seed=6)]
    xb = ops.to_device(x)
    sb = ops.to_device(pack_specs(specs))
    out = ops.to_device(np.full(b, 0xFFFFFFFF, np.uint32))
    ops.sample_rows(xb, sb, out, b, v, ld=ld)
    got = out.copy_to_host(np.empty(b, np.uint32))
    assert got.tolist() == sample_rows(x[:, :v], specs).tolist()
    with pytest.raises(ShapeError, match="ld >= vocab"):
        ops.sample_rows(xb, sb, out, b, v, ld=v - 1)
    with pytest.raises(ShapeError):
        ops.sample_rows(xb, sb, out, b + 1, ld)  # more rows than the buffers hold
    with pytest.raises(ShapeError):
        ops.sample_rows(xb, sb, out, 0, v)


def test_pack_specs_layout():
    p = pack_specs([RowSampling(0.5, 7, 0.25, seed=(5 << 32) | 9, step=3)])
    assert p.shape == (1, SPEC_WORDS) and p.dtype == np.uint32
    assert p[0].tolist() == [np.float32(0.5).view(np.uint32), 7, np.float32(0.25).view(np.uint32), 9, 5, 3, 0, 0]
    staging = np.full((4, SPEC_WORDS), 77, np.uint32)
    pack_specs([RowSampling()], out=staging)
    assert staging[0].tolist() == [0, 0, np.float32(1.0).view(np.uint32), 0, 0, 0, 0, 0]
    assert staging[1].tolist() == [77] * SPEC_WORDS
    with pytest.raises(ShapeError):
        pack_specs([RowSampling()] * 5, out=staging)
    with pytest.raises(InvalidRequestError):
        pack_specs([{"temperature": 1.0}])
    with pytest.raises(InvalidRequestError):  # (one object for every row: packed once, checked the same)
        pack_specs([{"temperature": 1.0}] * 3)
    one = RowSampling(0.8, 3, 0.5, seed=11, step=4)
    assert np.array_equal(pack_specs([one] * 6), pack_specs([RowSampling(0.8, 3, 0.5, seed=11, step=4) for _ in range(6)]))
    # float32 rounding as numpy rounds, and integral floats / ints where RowSampling accepts them
    rows = pack_specs([RowSampling(0.7, 5.0, 0.9, seed=3.0, step=2), RowSampling(2, 1, 1, seed=2**64 - 1)])
    assert rows[0].tolist() == [np.float32(0.7).view(np.uint32), 5, np.float32(0.9).view(np.uint32), 3, 0, 2, 0, 0]
    assert rows[1].tolist() == [np.float32(2).view(np.uint32), 1, np.float32(1).view(np.uint32), 2**32 - 1,
                                2**32 - 1, 0, 0, 0]


def test_filters_over_many_seeds():
    """Flat logits, many seeds: a cut one token too loose or too tight shows up as a wrong draw."""
    rng = np.random.default_rng(8)
    v, n = 60, 480
    x = np.tile((rng.standard_normal(v) * 0.3).astype(np.float32), (n, 1))
    cuts = [(3, 1.0), (10, 1.0), (0, 0.3), (0, 0.7), (12, 0.5), (1, 1.0), (59, 0.9), (0, 0.999)]
    s = [RowSampling(1.0, top_k=cuts[i % 8][0], top_p=cuts[i % 8][1], seed=i, step=3) for i in range(n)]
    got = _emulate(x, s)
    _check(x, s, got)
    order = np.argsort(-x[0], kind="stable")
    for j, (top_k, _) in enumerate(cuts[:2]):
        assert set(got[j::8].tolist()) == set(order[:top_k].tolist())
