"""``--tensor-parallel N`` on ``generate`` and ``serve``, and ``load_engine(tensor_parallel=N)``.

N = 1 runs as without the option (the same greedy text). N > 1 fails with one line and no traceback
saying what is missing, checked in this order: a GPU device, a model that shards over N, N visible
GPUs, NCCL's library; ``serve`` then refuses (continuous batching over a split model is not built).
The split model itself is tested in tests/test_parallel_gpu_emulated.py and tests/gpu/. The subprocess runs hide every GPU
(``CUDA_VISIBLE_DEVICES=""``) so that the GPU count is 0 on any machine; the in-process tests set the
count to reach each later check."""

from __future__ import annotations

import pytest

from realizar.engine import load_engine
from realizar.errors import InvalidRequestError, TensorParallelError
from tests.test_cli import PROMPT, assert_clean_error, run

NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The shared tiny llama (4 query / 2 KV heads, hidden 64, FFN 128, Q8_0): shards over 2 (32-value
    O and down columns per rank: whole Q8_0 blocks), not over 3 (heads) nor 4 (KV heads)."""
    from tests.gguf_factory import shared_tiny_gguf

    return shared_tiny_gguf(tmp_path_factory)


def test_generate_with_one_gpu_worth_of_parallelism_is_the_plain_run(tiny):
    args = ("generate", "-m", str(tiny), "-d", "cpu", "-n", "6", "--no-stats", PROMPT)
    plain, tp1 = run(*args), run(*args[:-1], "--tensor-parallel", "1", PROMPT)
    assert plain.returncode == tp1.returncode == 0, (plain.stderr, tp1.stderr)
    assert tp1.stdout == plain.stdout and tp1.stdout.strip()


@pytest.mark.parametrize(
    "extra, match",
    [
        (("--tensor-parallel", "2"),
         r"^realizar: error: tensor parallelism over 2 GPUs needs 2 visible GPUs; this machine has 0$"),
        (("--tensor-parallel", "4"),
         r"^realizar: error: tensor parallelism over 4 GPUs: sharding over 4 ranks needs num_kv_heads "
         r"divisible by 4 \(a GQA group stays on one rank\); this model has 2 KV heads \(for 4 query heads\)$"),
        (("--tensor-parallel", "3"), r"tensor parallelism over 3 GPUs: .*num_heads divisible by 3; this model has 4"),
        (("--tensor-parallel", "2", "-d", "cpu"), r"tensor parallelism over 2 GPUs runs on GPUs, not on device 'cpu'$"),
    ],
)
def test_generate_says_what_tensor_parallelism_is_missing(tiny, extra, match):
    p = run("generate", "-m", str(tiny), *extra, PROMPT, env=NO_GPU)
    assert_clean_error(p, 1, match)
    assert p.stdout == ""


def test_serve_refuses_before_listening(tiny):
    p = run("serve", "-m", str(tiny), "--port", "0", "--tensor-parallel", "2", env=NO_GPU, timeout=120)
    assert_clean_error(p, 1, r"needs 2 visible GPUs; this machine has 0$")


def test_usage_errors_of_the_option(tiny):
    p = run("generate", "-m", str(tiny), "--tensor-parallel", "0", PROMPT)
    assert p.returncode == 2 and "--tensor-parallel: expected an integer > 0, got 0" in p.stderr


# -- the Python API ----------------------------------------------------------------------------------


def test_load_engine_checks_in_order(tiny, monkeypatch):
    import realizar.parallel as parallel
    from realizar.parallel import nccl

    def no_nccl():
        raise nccl.NcclUnavailableError("cannot load libnccl.so.2 from nowhere")

    monkeypatch.setattr(nccl, "load", no_nccl)
    monkeypatch.setattr(parallel, "visible_gpu_count", lambda: 1)
    with pytest.raises(TensorParallelError, match="over 2 GPUs needs 2 visible GPUs; this machine has 1"):
        load_engine(tiny, tensor_parallel=2)
    with pytest.raises(TensorParallelError, match="num_kv_heads divisible by 4"):  # sharding before the count
        load_engine(tiny, tensor_parallel=4)
    monkeypatch.setattr(parallel, "visible_gpu_count", lambda: 8)
    with pytest.raises(TensorParallelError, match="over 2 GPUs: NCCL is not available: cannot load libnccl.so.2"):
        load_engine(tiny, device="cuda", tensor_parallel=2)
    with pytest.raises(TensorParallelError, match="not on device 'emulate'"):
        load_engine(tiny, device="emulate", tensor_parallel=2)


def test_serve_refuses_a_split_model_after_the_checks(tiny, monkeypatch):
    import argparse

    import realizar.parallel as parallel
    from realizar.cli.serve import _refuse_tensor_parallel

    args = argparse.Namespace(model=str(tiny), device="auto", tensor_parallel=2)
    monkeypatch.setattr(parallel, "visible_gpu_count", lambda: 1)
    with pytest.raises(TensorParallelError, match="needs 2 visible GPUs; this machine has 1"):
        _refuse_tensor_parallel(args)
    monkeypatch.setattr(parallel, "visible_gpu_count", lambda: 2)
    with pytest.raises(TensorParallelError, match=r"^serve --tensor-parallel 2: continuous batching over a model "
                                                  r"split across GPUs is not built yet"):
        _refuse_tensor_parallel(args)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_load_engine_refuses_a_bad_rank_count(tiny, bad):
    with pytest.raises(InvalidRequestError, match="tensor_parallel must be an integer >= 1"):
        load_engine(tiny, tensor_parallel=bad)


def test_visible_gpu_count_is_zero_without_a_gpu():
    from realizar import cuda
    from realizar.parallel import visible_gpu_count

    if cuda.is_available():
        pytest.skip("a GPU is visible here; the count is checked against the driver on the GPU machine")
    assert visible_gpu_count() == 0
