"""The tensor-parallel GPU model (realizar.parallel.gpu) on the CPU: N ranks on one EmulatedDevice with
the LocalReducer, running the real kernels on the PTX emulator, against the sharded NumPy model
(ShardedReferenceModel, the same N-way split) and the unsharded ReferenceModel, for tiny models of every
architecture (QKV bias, Q/K norm, tied embeddings, SmolLM2's 9/3 heads at N = 3, K-quants), N = 1..4,
through the captured decode graph and eagerly. Also: N = 1 is bit-identical to the plain GpuModel;
each rank caches only its KV heads; the NCCL reducer's calls (on a fake libnccl); the errors."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from realizar import cuda
from realizar.errors import ContextOverflowError, InvalidRequestError, ShapeError, TensorParallelError
from realizar.gpu.model import GpuModel
from realizar.models.loader import load_model
from realizar.parallel.gpu import LOGIT_SLOT_ALIGN, LocalReducer, NcclReducer, TensorParallelModel
from realizar.parallel.nccl import DataType, Nccl, RedOp
from realizar.parallel.sharding import make_plan
from tests.gguf_factory import make_gguf_model
from tests.parallel_gpu_cases import CASES, DIMS, PROMPT, STEPS, assert_matches, device_run, oracles, rel_err
from tests.helpers import tiered
from tests.test_parallel_nccl import FakeLib

MAX_LEN = 16


def _dev() -> cuda.EmulatedDevice:
    return cuda.EmulatedDevice(sm_count=4)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A two-layer llama Q8_0 of DIMS (8 / 4 heads: splits over 1, 2, 4)."""
    path, _, _ = make_gguf_model("llama", tmp_path_factory.mktemp("tpgpu-llama"), "Q8_0", seed=7, num_layers=2,
                                 **DIMS)
    return load_model(path)


@pytest.fixture(scope="module", params=tiered(CASES, {1}, ids=[c[0] for c in CASES]))
def case(request, tmp_path_factory):
    name, arch, qtype, dims, layers, worlds = request.param
    path, _, _ = make_gguf_model(arch, tmp_path_factory.mktemp(f"tpgpu-{name}"), qtype, seed=7,
                                 num_layers=layers, **dims)
    return load_model(path), worlds


def test_sharded_gpu_model_equals_the_references(case):
    loaded, worlds = case
    for n in worlds:
        ref, sharded = oracles(loaded, n, MAX_LEN)
        assert sharded.tokens == ref.tokens
        tp = TensorParallelModel.from_loaded(loaded, LocalReducer(n, _dev()), max_len=MAX_LEN)
        got = device_run(tp, PROMPT, ref.tokens[:-1])
        assert_matches(got, sharded, f"N={n} vs the sharded reference")
        assert_matches(got, ref, f"N={n} vs the reference")
        assert tp.position == len(PROMPT) + STEPS and len(tp.graphs) == 1
        assert [r.config.num_kv_heads for r in tp.ranks] == [loaded.config.num_kv_heads // n] * n


def test_eager_steps_and_graph_replays_are_bit_identical(llama):
    """One graph holds every rank's kernels and the reducer's: replaying it gives the eager bytes."""
    loaded = llama
    ref, _ = oracles(loaded, 2, MAX_LEN)
    runs = {}
    for use_graph in (False, True):
        tp = TensorParallelModel.from_loaded(loaded, LocalReducer(2, _dev()), max_len=MAX_LEN, use_graph=use_graph)
        runs[use_graph] = device_run(tp, PROMPT, ref.tokens[:-1])
        assert len(tp.graphs) == int(use_graph)
    assert runs[True].tokens == runs[False].tokens == ref.tokens
    assert [x.tobytes() for x in runs[True].logits] == [x.tobytes() for x in runs[False].logits]


def test_one_rank_is_the_plain_gpu_model_bit_for_bit(llama):
    """N = 1: the same launches as GpuModel up to the LM head (nothing to reduce), so the same logits
    bytes; the greedy token comes through the candidate path (argmax_partial, argmax_pack, argmax_final)."""
    loaded = llama
    ref, _ = oracles(loaded, 1, MAX_LEN)
    plain = device_run(GpuModel.from_loaded(loaded, max_len=MAX_LEN, device=_dev(), prefill_chunk=None),
                       PROMPT, ref.tokens[:-1])
    dev = _dev()
    tp = TensorParallelModel.from_loaded(loaded, LocalReducer(1, dev), max_len=MAX_LEN)
    one = device_run(tp, PROMPT, ref.tokens[:-1])
    assert one.tokens == plain.tokens == ref.tokens
    assert [x.tobytes() for x in one.logits] == [x.tobytes() for x in plain.logits]
    names = [r.kernel.name for lane in range(len(tp.graphs.lanes)) for r in tp.graphs.graph("step", lane).graph.records]
    assert not any(n.startswith("residual_add") for n in names)
    assert [n.split("_b")[0] for n in names[-3:]] == ["argmax_partial", "argmax_pack", "argmax_final"]


def test_the_graph_holds_the_all_reduces(llama):
    """N ranks on one stream: one graph, per layer two all-reduces of 2 (N - 1) residual_add launches
    each, N candidates, one final argmax."""
    loaded = llama
    n, layers = 4, loaded.config.num_layers
    tp = TensorParallelModel.from_loaded(loaded, LocalReducer(n, _dev()), max_len=MAX_LEN)
    tp.prefill(PROMPT[:2])
    assert len(tp.graphs) == 1 and len(tp.graphs.lanes) == 1
    assert all(s.prefill_chunk == 0 and s.stream is tp.seqs[0].stream for s in tp.seqs)  # token steps, one stream
    names = [r.kernel.name.split("_b")[0].split("_v")[0] for r in tp.graphs.graph("step").graph.records]
    assert names.count("residual_add") == layers * 2 * 2 * (n - 1)
    assert names.count("argmax_pack") == n and names.count("argmax_final") == 1


def test_each_rank_caches_only_its_kv_heads(llama):
    from realizar.parallel.reference import ShardedReferenceModel

    loaded = llama
    c, n = loaded.config, 4
    tp = TensorParallelModel.from_loaded(loaded, LocalReducer(n, _dev()), max_len=MAX_LEN)
    sref = ShardedReferenceModel.from_loaded(loaded, n, max_len=MAX_LEN)
    tp.prefill(PROMPT), sref.prefill(PROMPT)
    s, nkv, d = len(PROMPT), c.num_kv_heads // n, c.head_dim
    for r, rank in enumerate(tp.ranks):
        for layer in range(c.num_layers):
            # the rank's sequence holds blocks 1.. of its pool, in order: [blocks, KVH, bs, D] -> [KVH, S, D]
            k, v = (p[1:].transpose(1, 0, 2, 3).reshape(nkv, -1, d)[:, :s] for p in rank.kv.pools_to_numpy(layer))
            assert rel_err(k, sref.ranks[r].cache.k[layer][:, :s]) < 1e-5
            assert rel_err(v, sref.ranks[r].cache.v[layer][:, :s]) < 1e-5


def test_generation_api_greedy_and_sampled(tmp_path):
    """The Generator over the split model: greedy text equals the CPU engine's; sampling and logprobs
    read the all-gathered logits."""
    from realizar.engine import load_engine
    from realizar.generation import Generator, SamplingParams

    path, _, _ = make_gguf_model("llama", tmp_path, "Q8_0", seed=3, num_layers=1,
                                 **DIMS)
    cpu = load_engine(path, device="cpu")
    tp = TensorParallelModel.from_loaded(load_model(path), LocalReducer(2, _dev()), max_len=24)
    gen = Generator(tp, cpu.tokenizer, eos_token_ids=cpu.generator.eos_token_ids)
    greedy = SamplingParams(max_tokens=5, temperature=0.0)
    assert gen.generate("hello world", greedy).token_ids == cpu.generate("hello world", greedy).token_ids
    sampled = SamplingParams(max_tokens=4, temperature=0.8, seed=5, logprobs=2)
    a, b = gen.generate("hello", sampled), cpu.generate("hello", sampled)
    assert a.token_ids == b.token_ids


def test_bad_input_and_misuse(llama):
    loaded = llama
    tp = TensorParallelModel.from_loaded(loaded, LocalReducer(2, _dev()), max_len=4)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        tp.prefill([1, 10**6])
    with pytest.raises(InvalidRequestError, match="at least one token"):
        tp.prefill([])
    with pytest.raises(ContextOverflowError, match="max_len of 4"):
        tp.prefill([1, 2, 3, 4, 5])
    assert tp.position == 0 and tp.steps == 0
    out = tp.prefill([1, 2])
    tp.decode(3)
    with pytest.raises(InvalidRequestError, match="overwritten"):
        out.greedy_token()
    tp.decode(4)
    with pytest.raises(ContextOverflowError, match="past the KV cache"):
        tp.decode(5)
    plan = make_plan(loaded.config, loaded.tensors, 4)
    with pytest.raises(ShapeError, match="plan for 4 ranks given to a reducer of 2"):
        TensorParallelModel.from_loaded(loaded, LocalReducer(2, _dev()), plan=plan)
    with pytest.raises(ShapeError, match="num_heads divisible by 3"):
        TensorParallelModel.from_loaded(loaded, LocalReducer(3, _dev()))
    with pytest.raises(ShapeError, match="whole number of ranks"):
        LocalReducer(0, _dev())


def test_local_reducer_sums_and_broadcasts_and_refuses_split_streams():
    dev = _dev()
    red = LocalReducer(3, dev)
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal(40).astype(np.float32) for _ in range(3)]
    bufs = [cuda.GpuBuffer.from_numpy(x, device=dev) for x in xs]
    s = cuda.Stream(dev)
    red.all_reduce(bufs, 40, [s] * 3)
    want = (xs[0] + xs[1]) + xs[2]
    for b in bufs:
        assert b.to_numpy().tobytes() == want.tobytes()
    with pytest.raises(ShapeError, match="one stream"):
        red.all_reduce(bufs, 40, [s, cuda.Stream(dev), s])
    with pytest.raises(ShapeError, match="over 3 ranks got 2 buffers"):
        red.all_reduce(bufs[:2], 40, [s] * 2)
    shared = red.gather_buffers(8, np.uint64)
    assert shared[0] is shared[2] and shared[0].count == 24
    red.all_gather(shared, 8, np.uint64, [s] * 3)  # nothing to move
    with pytest.raises(ShapeError, match="one shared buffer"):
        red.all_gather([shared[0], bufs[1], shared[0]], 8, np.float32, [s] * 3)


def test_nccl_reducer_issues_one_group_of_in_place_collectives():
    """Over a fake libnccl (ctypes callbacks, tests/test_parallel_nccl.py): one communicator per device
    from ncclCommInitAll, each collective of the N ranks inside one group, in place, on each rank's
    stream; the all-gather sends rank r's slot of its own buffer."""
    fake = FakeLib()
    devs = []
    for r in range(2):
        d = _dev()
        d.ordinal = 5 + r
        devs.append(d)
    red = NcclReducer(devs, lib=Nccl(fake, path="fake"))
    assert [c.handle for c in red.comms] == [0x9005, 0x9006] and red.devices == devs
    fake.calls.clear()
    x = [cuda.GpuBuffer(64, device=d) for d in devs]
    streams = [SimpleNamespace(ptr=0xA000 + r) for r in range(2)]  # emulated streams have no address
    red.all_reduce(x, 64, streams)
    g = red.gather_buffers(LOGIT_SLOT_ALIGN, np.float32)
    assert [b.device for b in g] == devs and all(b.count == 2 * LOGIT_SLOT_ALIGN for b in g)
    red.all_gather(g, LOGIT_SLOT_ALIGN, np.float32, streams)
    f32 = int(DataType.ncclFloat32)
    assert fake.calls == [
        ("ncclGroupStart", ()),
        *[("ncclAllReduce", (x[r].ptr, x[r].ptr, 64, f32, int(RedOp.ncclSum), 0x9005 + r, streams[r].ptr))
          for r in range(2)],
        ("ncclGroupEnd", ()),
        ("ncclGroupStart", ()),
        *[("ncclAllGather", (g[r].ptr + r * LOGIT_SLOT_ALIGN * 4, g[r].ptr, LOGIT_SLOT_ALIGN, f32, 0x9005 + r,
                             streams[r].ptr)) for r in range(2)],
        ("ncclGroupEnd", ()),
    ]
    red.close()
    assert [c[0] for c in fake.calls[-2:]] == ["ncclCommDestroy", "ncclCommDestroy"]


def test_load_engine_says_what_is_missing_past_the_gpu_count(tmp_path, monkeypatch):
    """With N GPUs counted: no NCCL library, then NCCL that cannot reach the GPUs (no driver here)."""
    import realizar.parallel as parallel
    from realizar.engine import load_engine
    from realizar.parallel import nccl

    path, _, _ = make_gguf_model("llama", tmp_path, "Q8_0", seed=3, num_layers=1,
                                 **DIMS)
    monkeypatch.setattr(parallel, "visible_gpu_count", lambda: 8)

    def missing():
        raise nccl.NcclUnavailableError("cannot load libnccl.so.2 from nowhere")

    monkeypatch.setattr(nccl, "load", missing)
    with pytest.raises(TensorParallelError, match=r"^tensor parallelism over 2 GPUs: NCCL is not available: cannot load"):
        load_engine(path, tensor_parallel=2)
    if cuda.is_available():
        return  # below: what a machine without a GPU driver says once NCCL loads
    monkeypatch.setattr(nccl, "load", lambda: Nccl(FakeLib(), path="fake"))
    with pytest.raises(TensorParallelError, match="over 4 GPUs: NCCL could not connect them"):
        load_engine(path, device="cuda", tensor_parallel=4)


def test_continuous_batching_refuses_a_split_model(llama):
    from realizar.errors import UnsupportedError
    from realizar.serving import ServingEngine

    tp = TensorParallelModel.from_loaded(llama, LocalReducer(2, _dev()), max_len=8)
    from realizar.engine import Engine

    engine = Engine(config=llama.config, tokenizer=None, generator=None, model=tp, device="cuda", name="tp")
    with pytest.raises(UnsupportedError, match="continuous batching over a model split across 2 GPUs is not built"):
        ServingEngine.from_engine(engine)
