"""The sharded NumPy forward (realizar.parallel.reference) against the unsharded ReferenceModel, on tiny
GGUF models of every architecture the factories make (llama, qwen2 with QKV bias, qwen3 with Q/K norms,
mistral, a tied llama) in several quantizations (Q4_K with 256-wide rows included), for N = 1, 2, 4:
the logits of every prompt position, prefill continuing after cached tokens, greedy decode, each rank's
KV heads, and the simulated collectives (all-reduce, all-gather with padding, distributed argmax).

Tolerance: N = 1 must be bit-identical (the same float32 products in the same order). For N > 1 the
only difference is where float32 sums are split — the O and down products are summed per rank and then
across ranks — so max |sharded - reference| / max |reference| must stay below RTOL = 1e-5 (about 80
float32 ulps of the largest logit; observed ~1e-6)."""

from __future__ import annotations

import numpy as np
import pytest

from realizar.errors import InvalidRequestError, ShapeError
from realizar.models.loader import load_model
from realizar.models.reference import ReferenceModel
from realizar.parallel.reference import ShardedReferenceModel, all_gather, all_reduce, distributed_argmax
from tests.gguf_factory import make_gguf_model
from tests.helpers import rel_err

RTOL = 1e-5
MAX_LEN = 40
# 8 query / 4 KV heads so that N = 4 keeps whole GQA groups; q_dim and the FFN width split into whole
# 32-value blocks at N = 4 (128 / 4 = 32, 256 / 4 = 64).
DIMS = dict(vocab_size=322, hidden_size=128, intermediate_size=256, num_heads=8, num_kv_heads=4, head_dim=16)
# K-quants: every split along K must be whole 256-value super-blocks at N = 4: q_dim = 8 * 128 = 1024,
# FFN 1024 (and rows of 256 = the hidden size).
KDIMS = dict(vocab_size=320, hidden_size=256, intermediate_size=1024, num_heads=8, num_kv_heads=4, head_dim=128)
CASES = [
    ("llama", "Q8_0", DIMS),
    ("qwen2", "Q4_0", DIMS),  # QKV biases, cut with their heads
    ("qwen3", "Q4_1", DIMS),  # Q/K norms, replicated
    ("mistral", "F16", DIMS),
    ("llama", "Q5_0", dict(DIMS, tie_word_embeddings=True)),  # the LM head is the embedding's slice
    ("llama", "Q4_K", KDIMS),
    ("qwen2", "Q6_K", KDIMS),
]
PROMPT = [5, 17, 42, 99, 7, 3, 250, 64, 12]
STEPS = 4


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1]}{'-tied' if 'tie_word_embeddings' in c[2] else ''}")
def loaded(request, tmp_path_factory):
    arch, qtype, dims = request.param
    path, _, _ = make_gguf_model(arch, tmp_path_factory.mktemp(f"tp-{arch}-{qtype}"), qtype, seed=7,
                                 num_layers=2, **dims)
    return load_model(path)


def _greedy(model, logits, n: int) -> tuple[list[int], list[np.ndarray]]:
    toks, seen = [], [np.asarray(logits)]
    for _ in range(n):
        toks.append(int(np.argmax(seen[-1])))
        seen.append(np.asarray(model.decode(toks[-1])))
    return toks, seen


@pytest.mark.parametrize("n", [1, 2, 4])
def test_sharded_forward_equals_the_reference(loaded, n):
    ref = ReferenceModel.from_loaded(loaded, max_len=MAX_LEN)
    tp = ShardedReferenceModel.from_loaded(loaded, n, max_len=MAX_LEN)
    want, got = ref.prefill(PROMPT, all_logits=True), tp.prefill(PROMPT, all_logits=True)
    assert got.shape == want.shape == (len(PROMPT), loaded.config.vocab_size)
    if n == 1:
        assert np.array_equal(got, want)
    assert rel_err(got, want) < RTOL
    # Greedy decode: the same tokens, and logits within RTOL at every step.
    ref.reset(), tp.reset()
    ref_toks, ref_logits = _greedy(ref, ref.prefill(PROMPT), STEPS)
    tp_toks, tp_logits = _greedy(tp, tp.prefill(PROMPT), STEPS)
    assert tp_toks == ref_toks
    assert max(rel_err(g, w) for g, w in zip(tp_logits, ref_logits)) < RTOL
    assert tp.position == ref.position == len(PROMPT) + STEPS
    # The distributed argmax over the ranks' vocabulary pieces is the argmax of the gathered logits.
    assert tp.greedy_token() == int(np.argmax(tp_logits[-1]))


@pytest.mark.parametrize("n", [2, 4])
def test_each_rank_caches_only_its_kv_heads(loaded, n):
    c = loaded.config
    ref = ReferenceModel.from_loaded(loaded, max_len=MAX_LEN)
    tp = ShardedReferenceModel.from_loaded(loaded, n, max_len=MAX_LEN)
    ref.prefill(PROMPT), tp.prefill(PROMPT)
    s = len(PROMPT)
    for r, (k0, k1) in enumerate(tp.plan.kv_heads):
        cache = tp.ranks[r].cache
        assert cache.num_kv_heads == c.num_kv_heads // n == k1 - k0
        for layer in range(c.num_layers):
            assert rel_err(cache.k[layer][:, :s], ref.cache.k[layer][k0:k1, :s]) < RTOL
            assert rel_err(cache.v[layer][:, :s], ref.cache.v[layer][k0:k1, :s]) < RTOL


def test_prefill_continues_after_cached_tokens(loaded):
    """A second prompt after a first and a decode step attends over every rank's cached heads."""
    ref = ReferenceModel.from_loaded(loaded, max_len=MAX_LEN)
    tp = ShardedReferenceModel.from_loaded(loaded, 4, max_len=MAX_LEN)
    first, second = PROMPT[:4], PROMPT[4:]
    t = int(np.argmax(ref.prefill(first)))
    assert int(np.argmax(tp.prefill(first))) == t
    ref.decode(t), tp.decode(t)
    assert rel_err(tp.prefill(second, all_logits=True), ref.prefill(second, all_logits=True)) < RTOL


def test_bad_input_is_refused_before_any_rank_runs(loaded):
    tp = ShardedReferenceModel.from_loaded(loaded, 2, max_len=MAX_LEN)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        tp.prefill([1, 10**6])
    with pytest.raises(InvalidRequestError, match="at least one token"):
        tp.prefill([])
    assert tp.position == 0 and all(r.cache.length == 0 for r in tp.ranks)


# -- the simulated collectives --------------------------------------------------------------------


def test_distributed_argmax_is_numpys_argmax_with_ties():
    rng = np.random.default_rng(0)
    bounds = [(0, 4), (4, 8), (8, 10)]
    for trial in range(200):
        logits = rng.integers(-3, 4, size=10).astype(np.float32)  # small integers: many ties
        pieces = [logits[a:b] for a, b in bounds]
        assert distributed_argmax(pieces, bounds) == int(np.argmax(logits)), logits
    with pytest.raises(ShapeError, match="3 logit pieces for 2"):
        distributed_argmax(pieces, bounds[:2])
    with pytest.raises(ShapeError, match=r"vocabulary rows \[8, 10\)"):
        distributed_argmax([pieces[0], pieces[1], np.zeros(3, np.float32)], bounds)


def test_all_gather_pads_equal_pieces_and_all_reduce_sums():
    pieces = [np.arange(3.0), np.arange(3.0, 6.0), np.arange(6.0, 7.0)]  # 7 values in pieces of 3
    assert np.array_equal(all_gather(pieces, 3, 7), np.arange(7.0))
    two_rows = [np.stack([p, p + 100]) for p in pieces]
    assert np.array_equal(all_gather(two_rows, 3, 7)[1], np.arange(7.0) + 100)
    with pytest.raises(ShapeError, match="contributes 3 values to an all-gather of 2"):
        all_gather(pieces, 2, 7)
    parts = [np.full((2, 3), float(r), np.float32) for r in range(4)]
    out = all_reduce(parts)
    assert out.dtype == np.float32 and np.array_equal(out, np.full((2, 3), 6.0)) and out is not parts[0]
    with pytest.raises(ShapeError, match="all-reduce"):
        all_reduce([np.zeros(2), np.zeros(3)])
