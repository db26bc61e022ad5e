"""Sharding plans (realizar.parallel.sharding): byte slicing of GGUF blocks against dequantize-then-slice,
the shards of every tensor reassembling the file's bytes, the shapes each rank gets, and the shape errors
(heads, GQA groups, FFN, vocabulary, K splits that would cut a block) with their messages."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from realizar.errors import ModelFormatError, ShapeError
from realizar.models.config import ModelConfig
from realizar.models.names import expected_shapes
from realizar.models.quants import layout, tensor_nbytes
from realizar.models.tensor import QuantTensor
from realizar.parallel.sharding import check_world_size, make_plan, slice_columns, slice_rows
from tests.gguf_factory import quantize

from gguf import GGMLQuantizationType as T

TYPES = ["F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]


def _tensor(name: str, qtype: str, rows: int, cols: int, seed: int = 0) -> QuantTensor:
    x = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    arr, _ = quantize(x, qtype)
    data = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    return QuantTensor(name, int(T[qtype]), (rows, cols), data)


def _model_tensors(c: ModelConfig, qtype: str = "F32", with_data: bool = False) -> dict[str, QuantTensor]:
    """QuantTensors of the shapes ``c`` implies: 2-D ones of ``qtype``, 1-D ones F32. Without data the
    arrays are empty (a plan reads only names, shapes and types)."""
    out = {}
    for name, shape in expected_shapes(c).items():
        t = int(T.F32) if len(shape) == 1 else int(T[qtype])
        data = np.zeros(tensor_nbytes(t, shape) if with_data else 0, np.uint8)
        out[name] = QuantTensor(name, t, shape, data)
    return out


def _config(**kw) -> ModelConfig:
    base = dict(architecture="llama", vocab_size=320, hidden_size=128, num_layers=2, num_heads=8,
                num_kv_heads=4, head_dim=16, intermediate_size=256)
    return ModelConfig(**{**base, **kw})


# -- slicing raw blocks -------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", TYPES)
def test_row_and_column_slices_dequantize_to_the_slices_of_the_whole(qtype):
    """The bytes cut per shard decode to exactly the values of the whole tensor's slice."""
    block = layout(T[qtype]).block_size
    cols = 4 * max(block, 32)
    t = _tensor("w", qtype, 12, cols, seed=1)
    full = t.dequantize()
    r = slice_rows(t, 3, 9)
    assert r.shape == (6, cols) and np.array_equal(r.dequantize(), full[3:9])
    a, b = max(block, 32), 3 * max(block, 32)
    c = slice_columns(t, a, b)
    assert c.shape == (12, b - a) and np.array_equal(c.dequantize(), full[:, a:b])
    assert c.data.flags.c_contiguous and c.nbytes == tensor_nbytes(t.ggml_type, c.shape)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K", "Q6_K"])
def test_a_column_split_inside_a_block_is_refused(qtype):
    block = layout(T[qtype]).block_size
    t = _tensor("blk.0.ffn_down.weight", qtype, 4, 2 * block)
    with pytest.raises(ShapeError, match=rf"blk\.0\.ffn_down\.weight \({qtype}\).*block size {block}"):
        slice_columns(t, block // 2, 2 * block)
    with pytest.raises(ShapeError, match="outside"):
        slice_rows(t, 2, 9)


def test_a_bias_is_cut_by_value():
    b = QuantTensor("blk.0.attn_q.bias", int(T.F32), (8,), np.arange(8, dtype=np.float32).view(np.uint8))
    assert np.array_equal(slice_rows(b, 2, 6).dequantize(), [2, 3, 4, 5])


# -- plans ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 4])
def test_every_rank_gets_its_heads_ffn_columns_and_vocabulary(n):
    c = _config(vocab_size=321, qkv_bias=True)
    plan = make_plan(c, _model_tensors(c, "Q8_0"), n)
    H, D = c.hidden_size, c.head_dim
    per_vocab = math.ceil(321 / n)
    for r in range(n):
        s = {name: t.shard_shape(r) for name, t in plan.tensors.items()}
        assert s["blk.1.attn_q.weight"] == (c.num_heads // n * D, H)
        assert s["blk.1.attn_k.weight"] == s["blk.1.attn_v.weight"] == (c.num_kv_heads // n * D, H)
        assert s["blk.1.attn_k.bias"] == (c.num_kv_heads // n * D,)
        assert s["blk.1.attn_output.weight"] == (H, c.q_dim // n)
        assert s["blk.1.ffn_gate.weight"] == s["blk.1.ffn_up.weight"] == (c.intermediate_size // n, H)
        assert s["blk.1.ffn_down.weight"] == (H, c.intermediate_size // n)
        assert s["blk.1.attn_norm.weight"] == (H,) and s["token_embd.weight"] == (321, H)
        assert s["output.weight"] == (min(per_vocab, 321 - r * per_vocab), H)
        rc = plan.rank_config(r)
        assert (rc.num_heads, rc.num_kv_heads, rc.intermediate_size) == (8 // n, 4 // n, 256 // n)
    # Query heads of a GQA group sit on the rank of their KV head.
    g = c.group_size
    for (h0, h1), (k0, k1) in zip(plan.heads, plan.kv_heads):
        assert {h // g for h in range(h0, h1)} == set(range(k0, k1))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q6_K"])
def test_shards_reassemble_the_file_bytes(qtype):
    """Rows of every rank concatenated, or each row's column pieces side by side, are the whole tensor."""
    big = qtype.endswith("_K")
    c = _config(hidden_size=256, head_dim=128 if big else 32, intermediate_size=1024 if big else 256,
                qkv_bias=True)
    tensors = _model_tensors(c, qtype, with_data=True)
    rng = np.random.default_rng(0)
    for t in tensors.values():
        t.data[:] = rng.integers(0, 256, t.data.size, dtype=np.uint8)  # any bytes: slicing must not care
    n = 4
    plan = make_plan(c, tensors, n)
    shards = [plan.shard(tensors, r) for r in range(n)]
    for name, s in plan.tensors.items():
        whole = tensors[s.source]
        pieces = [sh[name] for sh in shards]
        if s.split == "replicate":
            assert all(p is whole for p in pieces)
            continue
        rows = whole.shape[0] if len(whole.shape) == 2 else 1
        if s.split == "rows":
            got = np.concatenate([p.data for p in pieces])
        else:
            got = np.concatenate([p.data.reshape(rows, -1) for p in pieces], axis=1).reshape(-1)
        assert np.array_equal(got, whole.data), name


def test_a_tied_lm_head_is_the_vocabulary_slice_of_the_embedding():
    c = _config(tied_embeddings=True)
    tensors = _model_tensors(c, "Q8_0", with_data=True)
    tensors["token_embd.weight"].data[:] = np.arange(tensors["token_embd.weight"].data.size) % 251
    plan = make_plan(c, tensors, 2)
    assert "output.weight" not in tensors and plan.tensors["output.weight"].source == "token_embd.weight"
    head = plan.shard(tensors, 1)["output.weight"]
    row = tensors["token_embd.weight"].data.size // c.vocab_size
    assert head.shape == (160, c.hidden_size)
    assert np.array_equal(head.data, tensors["token_embd.weight"].data[160 * row :])


# -- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, n, message",
    [
        (dict(num_heads=9, num_kv_heads=3), 2, "num_heads divisible by 2; this model has 9 query heads"),
        (dict(num_heads=8, num_kv_heads=2), 4, "num_kv_heads divisible by 4 .*GQA.* has 2 KV heads"),
        (dict(intermediate_size=250), 4, "intermediate_size divisible by 4; this model has 250"),
        (dict(vocab_size=3), 4, "vocabulary of at least 4 tokens"),
        (dict(vocab_size=5), 4, "vocabulary of 5 split in pieces of 2 leaves a rank of 4 without any row"),
        ({}, 0, "whole number of ranks >= 1, got 0"),
    ],
)
def test_unshardable_models_raise_shape_errors(kw, n, message):
    c = _config(**kw)
    with pytest.raises(ShapeError, match=message):
        make_plan(c, _model_tensors(c), n)


def test_a_k_quant_split_that_cuts_a_block_names_tensor_type_split_and_block():
    """q_dim 256 of Q4_K over 2 ranks: O would be cut at 128 values, inside a 256-value super-block."""
    c = _config(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=512)
    tensors = _model_tensors(c, "Q4_K")
    with pytest.raises(ShapeError, match=r"blk\.0\.attn_output\.weight \(Q4_K, shape \(256, 256\)\) split "
                                         r"over 2 ranks .* 128 values per rank.* block size 256"):
        make_plan(c, tensors, 2)
    # The FFN alone: down's 512 columns over 4 ranks give 128 per rank.
    c4 = _config(hidden_size=256, num_heads=8, num_kv_heads=4, head_dim=128, intermediate_size=512)
    with pytest.raises(ShapeError, match=r"blk\.0\.ffn_down\.weight \(Q4_K.*128 values per rank.*256"):
        make_plan(c4, _model_tensors(c4, "Q4_K"), 4)
    # Row splits never cut blocks: Q/K/V and gate/up rows are whole, whatever the split.
    assert make_plan(c, tensors, 1).world_size == 1


def test_shard_checks_its_inputs():
    c = _config()
    tensors = _model_tensors(c, "Q8_0", with_data=True)
    plan = make_plan(c, tensors, 2)
    with pytest.raises(ShapeError, match="rank 2 is outside 0..1"):
        plan.shard(tensors, 2)
    other = dict(tensors)
    other["blk.0.attn_q.weight"] = replace(tensors["blk.0.attn_q.weight"], ggml_type=int(T.F16))
    with pytest.raises(ShapeError, match=r"blk\.0\.attn_q\.weight is F16 .* made for Q8_0"):
        plan.shard(other, 0)
    del other["blk.0.attn_q.weight"]
    with pytest.raises(ModelFormatError, match="missing tensor blk.0.attn_q.weight"):
        plan.shard(other, 0)


# -- real model shapes (names, shapes and types only) -------------------------------------------


@pytest.mark.parametrize(
    "name, dims, good, bad",
    [
        ("Llama-3-8B Q4_K", dict(vocab_size=128256, hidden_size=4096, num_layers=1, num_heads=32,
                                 num_kv_heads=8, head_dim=128, intermediate_size=14336), (1, 2, 4, 8), (3,)),
        ("Llama-3-70B Q4_K", dict(vocab_size=128256, hidden_size=8192, num_layers=1, num_heads=64,
                                  num_kv_heads=8, head_dim=128, intermediate_size=28672), (1, 2, 4, 8), (16,)),
        ("SmolLM2-135M Q4_1", dict(vocab_size=49152, hidden_size=576, num_layers=1, num_heads=9,
                                   num_kv_heads=3, head_dim=64, intermediate_size=1536), (1, 3), (2, 4)),
    ],
)
def test_which_real_models_shard_over_how_many_gpus(name, dims, good, bad):
    """Llama-3 8B/70B Q4_K split over 2, 4 and 8 GPUs (not 3: 32 heads; not 16: 8 KV heads);
    SmolLM2-135M (9 heads, 3 KV heads) over 3 only (576/3 = 192 columns of O per rank: whole Q4_1 blocks)."""
    c = _config(**dims)
    tensors = _model_tensors(c, name.split()[-1])
    for n in good:
        assert make_plan(c, tensors, n).world_size == n
    for n in bad:
        with pytest.raises(ShapeError):
            make_plan(c, tensors, n)
    check_world_size(c, good[-1])
