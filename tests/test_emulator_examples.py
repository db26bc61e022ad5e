"""Every catalog kernel runs on the emulator through its example launch (small shapes), with finite
outputs; a few are checked against NumPy."""

from __future__ import annotations

import numpy as np
import pytest

from ptx_gen import catalog
from ptx_gen.emulator import run_example
from ptx_gen.emulator.examples import EXAMPLES

SMALL = {
    "embedding": dict(wtype="Q4_K", hidden=256), "gemv": dict(wtype="Q8_0", in_dim=64),
    "gemm": dict(wtype="F16", in_dim=64, tokens=2), "gemv_mma": dict(wtype="Q8_0", in_dim=256, mtiles=1, kparts=1, stages=2),
    "rmsnorm": dict(hidden=64, block=32, residual=True), "flash_attention": dict(head_dim=32, group=2),
    "flash_decoding": dict(head_dim=32, group=2), "flash_decoding_chunk": dict(head_dim=32, group=2),
    "flash_decoding_reduce": dict(head_dim=32, num_chunks=3), "incremental_attention": dict(head_dim=32, group=2),
    "kv_append": dict(head_dim=32, indirect=True), "rope": dict(head_dim=32, pos_from_buffer=True),
    "rope_kv_append": dict(head_dim=32), "argmax_final": dict(block=128),
    "gemm_wg": dict(in_dim=256, mt=32), "gemm_ws": dict(in_dim=256, mt=64, stages=2, tokens=70),
}


EMULATED = catalog.names()  # (the sm_90a kernels too: the emulator has their wgmma and mbarrier waits)


def test_every_catalog_kernel_has_an_example():
    assert sorted(EXAMPLES) == sorted(EMULATED)


@pytest.mark.parametrize("name", EMULATED)
def test_example_runs_clean(name):
    report = run_example(name, SMALL.get(name, {}), seed=1)
    assert report.ok, report.error
    assert report.outputs and all(out.size for out in report.outputs.values())
    for key, out in report.outputs.items():
        if out.dtype.kind == "f" and key != "part_ml":  # part_ml holds -inf maxima of empty chunks
            assert np.isfinite(out).all(), key
    assert len(report.summary()) == len(report.outputs)


def test_example_outputs_match_numpy():
    from ptx_gen.emulator.examples import _elementwise  # noqa: F401  (the builders draw a then b)

    rng = np.random.default_rng(3)
    a = rng.standard_normal(100).astype(np.float32)
    b = rng.standard_normal(100).astype(np.float32)
    assert np.array_equal(run_example("vector_add", {"n": 100}, seed=3).outputs["out"], a + b)
    sums = run_example("row_sum", {"rows": 2, "cols": 300}, seed=5).outputs["out"]
    x = np.random.default_rng(5).standard_normal(600).astype(np.float32).reshape(2, 300)
    assert np.allclose(sums, x.sum(axis=1, dtype=np.float64), rtol=1e-5)


def test_kernel_shape_and_problem_sizes_are_told_apart():
    report = run_example("vector_add", {"vec": 1, "n": 77})
    assert report.shape == {"vec": 1} and report.outputs["out"].size == 77
    with pytest.raises(ValueError, match="no example launch"):
        run_example("not_a_kernel", {})
