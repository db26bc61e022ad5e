"""Batched decode on the CPU: :class:`~realizar.gpu.batch.GpuBatchBackend` on an ``EmulatedDevice`` running
the real PTX (paged RoPE + append, paged flash decoding of rows of different lengths, the batched
linear layers, paged prefill) against the NumPy reference model run one sequence at a time.

Sequences with shuffled, non-contiguous block tables join and leave the batch at different steps
(batch sizes 1, 2, 3 — padded to the 4-row bucket — and back); every row's logits must be those of
the same sequence alone within f16 rounding, and greedy tokens identical. A sequence whose first
blocks are another's (a prefix-cache hit) prefills only the rest and continues like the whole prompt."""

from __future__ import annotations

import numpy as np
import pytest

from realizar import cuda
from realizar.errors import ContextOverflowError, InvalidRequestError, ShapeError
from realizar.gpu.batch import GpuBatchBackend, bucket_for
from realizar.gpu.model import GpuModel
from realizar.models.loader import load_model
from realizar.models.reference import ReferenceModel
from realizar.sampling import RowSampling
from tests.gguf_factory import make_gguf_model
from tests.helpers import rel_err as _rel_err, tiered

TINY = dict(vocab_size=320, hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2)  # head_dim 32
CASES = [("llama", "Q8_0"), ("qwen3", "Q4_1"), ("qwen2", "Q4_0")]
BLOCK = 16
MAX_LEN = 64
RTOL = 1e-2  # f16 activations and weights in the GEMMs: max |batched - ref| / max |ref|


@pytest.fixture(scope="module", params=tiered(CASES, {0}, ids=lambda c: f"{c[0]}-{c[1]}"))
def loaded(request, tmp_path_factory):
    arch, qtype = request.param
    path, _, _ = make_gguf_model(arch, tmp_path_factory.mktemp(f"b-{arch}-{qtype}"), qtype, seed=5, num_layers=1,
                                 **TINY)
    return load_model(path)


def _backend(loaded, **kw) -> GpuBatchBackend:
    model = GpuModel.from_loaded(loaded, max_len=MAX_LEN, device=cuda.EmulatedDevice(sm_count=4), kv_cache=False)
    kw = {"num_blocks": 24, "block_size": BLOCK, "kv_dtype": "f32", "max_batch": 4, "max_context": MAX_LEN,
          "prefill_chunk": 8, **kw}
    return GpuBatchBackend(model, **kw)


class _Alone:
    """One sequence through the reference model, step by step."""

    def __init__(self, loaded, prompt):
        self.ref = ReferenceModel.from_loaded(loaded, max_len=MAX_LEN)
        self.logits = self.ref.prefill(prompt)
        self.position = len(prompt)

    def step(self, token):
        self.logits = self.ref.decode(token)
        self.position += 1


def test_bucket_for():
    assert [bucket_for(n, 64) for n in (1, 2, 3, 5, 9, 33, 64)] == [1, 2, 4, 8, 16, 48, 64]
    assert bucket_for(100, 100) == 100


@pytest.mark.parametrize("ring", [0, 3])
def test_rows_joining_and_leaving_match_alone(loaded, ring, monkeypatch):
    """(``ring``: the decode attention's K/V through a ring of bulk copies of that many stages, or loads into
    registers)"""
    import realizar.gpu.paged_kv as paged_kv

    monkeypatch.setattr(paged_kv, "DECODE_RING_STAGES", ring)
    monkeypatch.setattr(paged_kv, "DECODE_RING_MIN_HEAD_DIM", 0)
    rng = np.random.default_rng(7)
    be = _backend(loaded)
    assert be.kv.decode_ring == ring
    blocks = [int(b) for b in rng.permutation(np.arange(1, be.num_blocks))]  # shuffled, never block 0
    prompts = {"a": 5, "b": 19, "c": 33}
    seqs, tables = {}, {}
    for name, n in prompts.items():
        tables[name] = [blocks.pop() for _ in range(-(-(n + 8) // BLOCK))]
    # a and b start; c joins after 2 steps; a leaves after 4; c decodes alone at the end
    schedule = [("a", "b"), ("a", "b"), ("a", "b", "c"), ("a", "b", "c"), ("b", "c"), ("c",)]
    pending = {}
    for step, names in enumerate(schedule):
        for name in names:
            if name not in seqs:
                prompt = [int(t) for t in rng.integers(3, 320, prompts[name])]
                seqs[name] = _Alone(loaded, prompt)
                out = be.prefill(prompt, 0, tables[name])
                assert _rel_err(out.logits(0), seqs[name].logits) < RTOL, name
                pending[name] = int(np.argmax(out.logits(0)))
                assert pending[name] == int(np.argmax(seqs[name].logits))
        rows = list(names)
        out = be.decode([pending[n] for n in rows], [seqs[n].position for n in rows], [tables[n] for n in rows])
        sampled = out.sample([RowSampling()] * len(rows))  # runs the step's graph, the sampler included
        for r, name in enumerate(rows):
            seqs[name].step(pending[name])
            got = out.logits(r)
            assert _rel_err(got, seqs[name].logits) < RTOL, (step, name)
            assert int(sampled[r]) == int(np.argmax(got)), (step, name)
            pending[name] = int(np.argmax(got))
            assert pending[name] == int(np.argmax(seqs[name].logits)), (step, name)


def test_prefix_blocks_shared(loaded):
    """Sequence 2 reuses sequence 1's first two full blocks and prefills only its own tail."""
    rng = np.random.default_rng(3)
    be = _backend(loaded)
    prefix = [int(t) for t in rng.integers(3, 320, 2 * BLOCK)]
    one = prefix + [int(t) for t in rng.integers(3, 320, 5)]
    two = prefix + [int(t) for t in rng.integers(3, 320, 9)]
    t1 = [3, 7, 11]
    t2 = [3, 7, 12]  # blocks 3 and 7 shared
    be.prefill(one, 0, t1)
    out = be.prefill(two[2 * BLOCK:], 2 * BLOCK, t2)
    alone = _Alone(loaded, two)
    assert _rel_err(out.logits(0), alone.logits) < RTOL
    tok = int(np.argmax(out.logits(0)))
    assert tok == int(np.argmax(alone.logits))
    out = be.decode([tok], [len(two)], [t2])
    alone.step(tok)
    assert _rel_err(out.logits(0), alone.logits) < RTOL


def test_bad_inputs(loaded):
    be = _backend(loaded)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        be.prefill([1, 320], 0, [1])
    with pytest.raises(ShapeError, match="block id"):
        be.prefill([1, 2], 0, [24])
    with pytest.raises(ShapeError, match="blocks"):
        be.prefill(list(range(1, BLOCK + 2)), 0, [1])
    with pytest.raises(ContextOverflowError):
        be.decode([1], [MAX_LEN], [[1] * (MAX_LEN // BLOCK)])
    with pytest.raises(ShapeError, match="rows"):
        be.decode([1] * 5, [0] * 5, [[1]] * 5)
    with pytest.raises(ShapeError, match="kv_dtype"):
        _backend(loaded, kv_dtype="int4")
    out = be.prefill([5, 6, 7], 0, [2])
    be.decode([1], [3], [[2]])
    with pytest.raises(InvalidRequestError, match="overwritten"):
        out.logits(0)


def test_one_row_greedy_and_sampled_steps(loaded):
    """A greedy single row ends its step in the argmax, a sampled one in the sampler: two variants of
    bucket 1's graph, each drawing what the NumPy mirror draws from the same logits."""
    from realizar.sampling import sample_rows

    rng = np.random.default_rng(11)
    be = _backend(loaded)
    prompt = [int(t) for t in rng.integers(3, 320, 6)]
    table = [5, 9]
    tok = int(np.argmax(be.prefill(prompt, 0, table).logits(0)))
    hot = RowSampling(temperature=1.5, top_k=40, seed=1234, step=0)
    for i, spec in enumerate([RowSampling(), hot, RowSampling(), RowSampling(temperature=1.5, top_k=40, seed=1234,
                                                                             step=1)]):
        out = be.decode([tok], [len(prompt) + i], [table])
        got = int(out.sample([spec])[0])
        logits = out.logits(0)
        assert got == int(sample_rows(logits[None, :], [spec])[0]), (i, spec)
        if spec.temperature == 0:
            assert got == int(np.argmax(logits))
        tok = got
    assert set(be.graphs.keys()) == {(1, True, False), (1, False, False)}


@pytest.mark.full
@pytest.mark.parametrize("qtype,settings", [("Q4_K", (8, 0)), ("Q5_0", (8,))])
def test_linear_layers_on_gemv_columns_kernel(qtype, settings, tmp_path):
    """Rows of 256 values: the batched step's linear layers run the tensor-core GEMV's columns kernel
    (gemv_cols) for 2..8 rows; logits match each sequence alone, and (Q4_K) the step with
    gemv_cols_rows=0, which runs gemm_q everywhere, within f16 rounding."""
    dims = dict(vocab_size=320, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2)
    path, _, _ = make_gguf_model("llama", tmp_path, qtype, seed=11, num_layers=1, **dims)
    loaded = load_model(path)
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(3, 320, n)] for n in (6, 11, 3)]
    logits = {}
    for cols_rows in settings:
        be = _backend(loaded, gemv_cols_rows=cols_rows)
        tables = [[1 + 3 * i, 2 + 3 * i, 3 + 3 * i] for i in range(3)]
        alone = [_Alone(loaded, p) for p in prompts]
        toks = [int(np.argmax(be.prefill(p, 0, t).logits(0))) for p, t in zip(prompts, tables)]
        before = len(be.device.launches)
        out = be.decode(toks, [len(p) for p in prompts], tables)
        got = [out.logits(r) for r in range(3)]
        launches = be.device.launches[before:]
        used = [ln for ln in launches if ln[0] == "gemv_mma" and "ldx" in ln[4]]  # (the columns kernel's parameter)
        assert bool(used) == (cols_rows > 0), [ln[0] for ln in launches]
        for r, a in enumerate(alone):
            a.step(toks[r])
            assert _rel_err(got[r], a.logits) < RTOL, (cols_rows, r)
        logits[cols_rows] = got
    for a, b in zip(logits[8], logits.get(0, logits[8])):
        assert _rel_err(a, b) < RTOL
    with pytest.raises(ShapeError, match="gemv_cols_rows"):
        _backend(loaded, gemv_cols_rows=9)


def test_split_gate_and_up_types_batched(tmp_path):
    """Gate and up weights of different types (no fused [gate; up] weight): the batched path runs them as
    two linear layers and the f16 SwiGLU, prefill and decode rows matching the reference alone."""
    from tests.gguf_factory import rewrite_gguf

    path, _, _ = make_gguf_model("llama", tmp_path, "Q8_0", seed=9, num_layers=1, **TINY)
    up = load_model(path).tensors["blk.0.ffn_up.weight"].dequantize().astype(np.float32)
    split = rewrite_gguf(path, tmp_path / "split.gguf", replace_tensors={"blk.0.ffn_up.weight": (up, None)})
    loaded = load_model(split)
    assert loaded.tensors["blk.0.ffn_gate.weight"].ggml_type != loaded.tensors["blk.0.ffn_up.weight"].ggml_type
    be = _backend(loaded)
    assert be.weights.split_ffn and be.batched_off is None
    rng = np.random.default_rng(4)
    prompts = [[int(t) for t in rng.integers(3, 320, n)] for n in (9, 17, 12)]
    tables = [[1, 2], [3, 4], [5, 6]]
    alone = [_Alone(loaded, p) for p in prompts]
    toks = []
    for p, t, a in zip(prompts, tables, alone):
        out = be.prefill(p, 0, t)
        assert _rel_err(out.logits(0), a.logits) < RTOL
        toks.append(int(np.argmax(a.logits)))
    for _ in range(2):
        out = be.decode(toks, [a.position for a in alone], tables)
        for r, (tok, a) in enumerate(zip(toks, alone)):
            a.step(tok)
            assert _rel_err(out.logits(r), a.logits) < RTOL, r
        toks = [int(np.argmax(a.logits)) for a in alone]


def test_a_prompt_as_rows_of_a_decode_step(loaded):
    """The serving scheduler's prompt rows: one decode step whose rows are a running sequence's next token and
    a new prompt's tokens 0..n-1 (every row through the prompt's one block table, its K/V written by the same
    step); row i's logits are the reference's after prompt[:i + 1] (causal within the step), and the prompt's
    sequence then decodes from its last row's token like one prefilled alone."""
    rng = np.random.default_rng(11)
    be = _backend(loaded, max_batch=8)
    running = [int(t) for t in rng.integers(3, 320, 9)]
    prompt = [int(t) for t in rng.integers(3, 320, 7)]
    t_run, t_new = [5, 2, 9], [14, 3, 20]
    first = be.prefill(running, 0, t_run)
    tok = int(np.argmax(first.logits(0)))
    alone_run = _Alone(loaded, running)
    out = be.decode([tok] + prompt, [len(running)] + list(range(len(prompt))), [t_run] + [t_new] * len(prompt))
    sampled = out.sample([RowSampling()] * (1 + len(prompt)))
    alone_run.step(tok)
    assert _rel_err(out.logits(0), alone_run.logits) < RTOL
    for i in range(len(prompt)):
        ref = ReferenceModel.from_loaded(loaded, max_len=MAX_LEN).prefill(prompt[: i + 1])
        assert _rel_err(out.logits(1 + i), ref) < RTOL, i
        assert int(sampled[1 + i]) == int(np.argmax(ref)), i
    alone_new = _Alone(loaded, prompt)
    nxt = int(sampled[-1])
    for _ in range(3):  # the prompt's sequence continues from its rows' K/V
        out = be.decode([nxt], [alone_new.position], [t_new])
        alone_new.step(nxt)
        assert _rel_err(out.logits(0), alone_new.logits) < RTOL
        nxt = int(np.argmax(out.logits(0)))
