"""The device sampling kernel on the GPU at a real vocabulary (128,256): every row of B = 1..128 equals
the NumPy mirror (top-p cuts within rounding aside), a captured graph replays new specs, and the time of
one launch for B = 1 and B = 64 (printed; run with -s)."""

from __future__ import annotations

import numpy as np
import pytest

from realizar import cuda
from realizar.cuda.bench import median_us
from realizar.cuda.graph import capture
from realizar.gpu.sampling import SPEC_WORDS, SampleOps, pack_specs
from realizar.sampling import RowSampling, sample_rows, top_p_margin

pytestmark = pytest.mark.gpu

V = 128_256
BOUNDARY = 1e-5


@pytest.fixture(scope="module")
def ops(device):
    return SampleOps(device)


def _logits(rng, b: int) -> np.ndarray:
    """LLM-like rows: a broad normal body plus a few strong candidates (never zero)."""
    x = rng.standard_normal((b, V)) * 2.0
    for r in range(b):
        x[r, rng.choice(V, 8, replace=False)] += rng.uniform(6, 14, 8)
    return np.where(x == 0, 0.5, x).astype(np.float32)


def _specs(rng, b: int) -> list[RowSampling]:
    kinds = [dict(), dict(temperature=1.0), dict(temperature=0.7, top_k=50), dict(temperature=0.8, top_p=0.9),
             dict(temperature=1.2, top_k=40, top_p=0.95), dict(temperature=0.6, top_k=5000),
             dict(temperature=2.0, top_p=0.5), dict(temperature=1.0, top_k=1)]
    return [RowSampling(**kinds[(r + int(rng.integers(8))) % 8], seed=int(rng.integers(2**63)),
                        step=int(rng.integers(2**31))) for r in range(b)]


def _run(ops, x, specs) -> np.ndarray:
    b = x.shape[0]
    xb, sb = cuda.GpuBuffer.from_numpy(x), cuda.GpuBuffer.from_numpy(pack_specs(specs))
    out = cuda.GpuBuffer.from_numpy(np.full(b, 0xFFFFFFFF, np.uint32))
    ops.sample_rows(xb, sb, out, b, V)
    return out.copy_to_host(np.empty(b, np.uint32)).astype(np.int64)


def _check(x, specs, got) -> int:
    want = sample_rows(x, specs)
    boundary = 0
    for r, s in enumerate(specs):
        if got[r] != want[r]:
            assert top_p_margin(x[r], s) < BOUNDARY, (r, s, got[r], want[r])
            boundary += 1
    return boundary


@pytest.mark.parametrize("b", [1, 3, 64, 128])
def test_matches_mirror_at_real_vocab(ops, b):
    rng = np.random.default_rng(b)
    x, specs = _logits(rng, b), _specs(rng, b)
    assert _check(x, specs, _run(ops, x, specs)) <= max(1, b // 32)


def test_graph_replays_new_specs_and_timing(ops, device):
    stream = cuda.Stream(device)
    rng = np.random.default_rng(99)
    for b in (1, 64):
        x = _logits(rng, b)
        xb = cuda.GpuBuffer.from_numpy(x)
        sb = cuda.GpuBuffer(b * SPEC_WORDS, np.uint32)
        out = cuda.GpuBuffer(b, np.uint32)
        specs = _specs(rng, b)
        sb.copy_from_host(pack_specs(specs).reshape(-1))
        ops.sample_rows(xb, sb, out, b, V, stream=stream)  # loads the module before the capture
        stream.synchronize()
        with capture(stream) as cap:
            ops.sample_rows(xb, sb, out, b, V, stream=stream)
        exe = cap.graph.instantiate()
        for step in range(3):  # new seeds/steps/settings each replay, same graph
            specs = _specs(rng, b)
            sb.copy_from_host(pack_specs(specs).reshape(-1))
            out.copy_from_host(np.full(b, 0xFFFFFFFF, np.uint32))
            exe.replay(stream)
            stream.synchronize()
            _check(x, specs, out.copy_to_host(np.empty(b, np.uint32)).astype(np.int64))
        for name, spec in [("greedy", RowSampling()), ("temperature", RowSampling(1.0, seed=1)),
                           ("top_k=50", RowSampling(0.8, top_k=50, seed=2)), ("top_p=0.9", RowSampling(0.8, top_p=0.9, seed=3)),
                           ("top_k=50,top_p=0.9", RowSampling(0.8, top_k=50, top_p=0.9, seed=4))]:
            sb.copy_from_host(pack_specs([spec] * b).reshape(-1))
            us = median_us(lambda: [exe.replay(stream) for _ in range(20)], stream, calls=20, reps=7)
            print(f"sample_rows V={V} B={b} {name}: {us:.1f} us")
