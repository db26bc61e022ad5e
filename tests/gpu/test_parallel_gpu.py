"""The tensor-parallel GPU model (realizar.parallel.gpu) on GPUs.

One GPU (any machine with a GPU):

* LocalReducer: N = 1, 2, 3, 4 ranks on the one GPU (one stream, one captured graph), tiny models of
  every architecture (tests/parallel_gpu_cases.py) and one at larger shapes (hidden 2048, FFN 8192): logits against ShardedReferenceModel, ReferenceModel and
  the plain GpuModel within the GPU model tests' tolerance, the same greedy tokens.
* NCCL with one rank (a one-rank communicator): the split model equals the plain GpuModel bit for bit,
  the NCCL calls issued inside the captured decode graph (where a one-rank in-place collective adds
  no node: NCCL 2.28 leaves such a graph at exactly realizar's kernels).

Several GPUs (skipped below 2 visible GPUs; not yet run: no multi-GPU machine has been lent): the model
over NCCL at N = 2 (and 4) gives the single-GPU greedy tokens, and load_engine(tensor_parallel=N)
generates the single-GPU text."""

from __future__ import annotations

import numpy as np
import pytest

from realizar import cuda
from realizar.gpu.model import GpuModel
from realizar.models.loader import load_model
from realizar.parallel import nccl, visible_gpu_count
from realizar.parallel.gpu import LocalReducer, NcclReducer, TensorParallelModel
from tests.gguf_factory import make_gguf_model
from tests.parallel_gpu_cases import CASES, DIMS, PROMPT, STEPS, assert_matches, device_run, oracles

pytestmark = pytest.mark.gpu

MAX_LEN = 32
# 16 query / 8 KV heads, FFN 8192, hidden 2048 (the GPU model tests' tile-major case): at N = 2 each
# rank's QKV has 2048 rows, gate/up 2 x 4096, O and down K = 1024 / 4096, the LM head 4224 rows.
TILE_DIMS = dict(vocab_size=8448, hidden_size=2048, intermediate_size=8192, num_heads=16, num_kv_heads=8)


@pytest.fixture(scope="module")
def gpu():
    if not cuda.is_available():
        pytest.skip(f"no GPU: {cuda.unavailable_reason()}")
    return cuda.Device(0)


@pytest.fixture(scope="module")
def lib():
    try:
        return nccl.load()
    except nccl.NcclUnavailableError as e:
        pytest.skip(str(e))


def _plain(loaded, feed, max_len=MAX_LEN):
    return device_run(GpuModel.from_loaded(loaded, max_len=max_len, prefill_chunk=None), PROMPT, feed)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_local_ranks_on_one_gpu_equal_the_references(gpu, tmp_path, case):
    name, arch, qtype, dims, layers, worlds = case
    path, _, _ = make_gguf_model(arch, tmp_path, qtype, seed=7, num_layers=layers, **dims)
    loaded = load_model(path)
    for n in worlds:
        ref, sharded = oracles(loaded, n, MAX_LEN)
        plain = _plain(loaded, ref.tokens[:-1])
        assert plain.tokens == ref.tokens, f"{name}: the plain GPU model's tokens"
        for use_graph in (True, False) if name == CASES[0][0] else (True,):  # (eager = graph: CPU-tested)
            tp = TensorParallelModel.from_loaded(loaded, LocalReducer(n, gpu), max_len=MAX_LEN, use_graph=use_graph)
            got = device_run(tp, PROMPT, ref.tokens[:-1])
            what = f"{name} N={n} {'graph' if use_graph else 'eager'}"
            assert_matches(got, sharded, what + " vs the sharded reference")
            assert_matches(got, ref, what + " vs the reference")
            assert_matches(got, plain, what + " vs the plain GPU model")
            if n == 1:  # nothing to reduce: the plain model's launches up to the head
                assert [x.tobytes() for x in got.logits] == [x.tobytes() for x in plain.logits], what


@pytest.mark.parametrize("n", [2, 4])
def test_local_ranks_at_larger_shapes(gpu, tmp_path, n):
    """Hidden 2048, FFN 8192, 16 / 8 heads, vocabulary 8448 (Q4_K): the rank's matrices at the sizes
    where the GEMV choice depends on the shape (which GEMV kernels ran is printed)."""
    path, _, _ = make_gguf_model("llama", tmp_path, "Q4_K", seed=13, num_layers=1, **TILE_DIMS)
    loaded = load_model(path)
    ref, sharded = oracles(loaded, n, MAX_LEN, steps=4)
    tp = TensorParallelModel.from_loaded(loaded, LocalReducer(n, gpu), max_len=MAX_LEN)
    got = device_run(tp, PROMPT, ref.tokens[:-1])
    assert_matches(got, sharded, f"N={n} vs the sharded reference")
    assert_matches(got, ref, f"N={n} vs the reference")
    gemvs = sorted({"_".join(r.kernel.name.split("_")[:2])
                    for r in tp.graphs.graph("step").graph.records if r.kernel.name.startswith("gemv")})
    layouts = sorted({w.layout for r in tp.ranks for w in (*r.layers[0].qkv, r.layers[0].attn_out, r.layers[0].down,
                                                          r.layers[0].gate_up, r.lm_head) if w is not None})
    print(f"\nN={n}: GEMV kernels {gemvs}, weight layouts {layouts}")


def test_nccl_one_rank_equals_the_plain_model_with_nccl_in_the_graph(gpu, lib, tmp_path):
    path, _, _ = make_gguf_model("qwen2", tmp_path, "Q8_0", seed=5, num_layers=2, **DIMS)
    loaded = load_model(path)
    ref, _ = oracles(loaded, 1, MAX_LEN)
    plain = _plain(loaded, ref.tokens[:-1])
    reducer = NcclReducer([0], lib=lib)
    try:
        assert [(c.count, c.device, c.rank) for c in reducer.comms] == [(1, 0, 0)]
        tp = TensorParallelModel.from_loaded(loaded, reducer, max_len=MAX_LEN)
        got = device_run(tp, PROMPT, ref.tokens[:-1])
        assert got.tokens == plain.tokens == ref.tokens
        assert [x.tobytes() for x in got.logits] == [x.tobytes() for x in plain.logits]
        assert len(tp.graphs.lanes) == 1
        graph = tp.graphs.graph("step").graph
        # the graph holds our kernels and whatever NCCL put in it for its calls (a one-rank in-place
        # collective may be nothing at all): reported, not assumed
        print(f"\nNCCL {lib.version()} one-rank decode graph: {graph.node_count()} nodes, {graph.num_kernels} "
              f"of them realizar kernels")
        assert graph.node_count() >= graph.num_kernels
    finally:
        reducer.close()


# -- several GPUs ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpus():
    n = visible_gpu_count()
    if n < 2:
        pytest.skip(f"needs 2 visible GPUs, {n} here")
    return n


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_nccl_ranks_give_the_single_gpu_tokens(gpus, lib, tmp_path, case, n):
    name, arch, qtype, dims, layers, worlds = case
    if n not in worlds:
        pytest.skip(f"{name} is not split over {n} in the cases")
    if n > gpus:
        pytest.skip(f"needs {n} GPUs, {gpus} here")
    path, _, _ = make_gguf_model(arch, tmp_path, qtype, seed=7, num_layers=layers, **dims)
    loaded = load_model(path)
    ref, sharded = oracles(loaded, n, MAX_LEN)
    plain = _plain(loaded, ref.tokens[:-1])
    reducer, tp = NcclReducer(list(range(n)), lib=lib), None
    try:
        tp = TensorParallelModel.from_loaded(loaded, reducer, max_len=MAX_LEN)
        assert [r.device.ordinal for r in tp.ranks] == list(range(n))
        got = device_run(tp, PROMPT, ref.tokens[:-1])
        assert_matches(got, plain, f"{name} N={n} over NCCL vs one GPU")
        assert_matches(got, sharded, f"{name} N={n} over NCCL vs the sharded reference")
        assert len(tp.graphs.lanes) == n
    finally:  # (the graphs that captured NCCL calls go before the communicators: NCCL waits for them)
        tp.close() if tp is not None else reducer.close()


def test_engine_generates_the_single_gpu_text(gpus, lib, tmp_path):
    from realizar.engine import load_engine
    from realizar.generation import SamplingParams

    path, _, _ = make_gguf_model("llama", tmp_path, "Q8_0", seed=3, num_layers=2, **DIMS)
    params = SamplingParams(max_tokens=16, temperature=0.0)
    one = load_engine(path, device="cuda").generate("hello world", params)
    split = load_engine(path, device="cuda", tensor_parallel=2)
    assert split.device == "cuda" and split.model.world_size == 2
    got = split.generate("hello world", params)
    assert got.token_ids == one.token_ids and got.text == one.text
    split.model.close()
