"""Megatron-style tensor-parallel sharding plans over the GGUF tensors of a model.

Each of ``N`` ranks holds a slice of every large matrix, so that a layer needs two all-reduces and
nothing else (Shoeybi et al., "Megatron-LM", 2019)::

    attention:  Q, K, V   split by heads (their output rows)          -> each rank attends its heads
                O         split by its input columns, the same heads  -> partial sums, all-reduce
    FFN:        gate, up  split by output rows (columns of the FFN)   -> each rank its FFN columns
                down      split by its input columns, the same slice  -> partial sums, all-reduce
    LM head:    split by vocabulary rows                              -> all-gather, or argmax per rank

Everything else (embeddings for the lookup, the RMSNorm weights, Q/K norms, ``rope_freqs``) is
replicated. A rank ``r`` of ``N`` owns query heads ``[r*nh/N, (r+1)*nh/N)`` and KV heads
``[r*nkv/N, (r+1)*nkv/N)``: since ``nh/N = group * nkv/N``, the query heads of a GQA group land on
the rank holding their KV head, which is why ``num_kv_heads % N == 0`` is required (and so the KV
cache splits by head as well, with no KV head duplicated).

Quantized weights stay in their GGUF block form and a block is never cut:

* a split along the output rows (Q/K/V, gate/up, LM head) takes whole rows, i.e. a contiguous byte
  range of the tensor, for any type;
* a split along the input (K) axis (O, down) takes a byte range of every row, which must start and end
  on block boundaries: the per-rank width must be a multiple of the type's block size (1 for
  F32/F16/BF16, 32 for Q4_0..Q8_0, 256 for the K-quants). Otherwise :class:`ShapeError` names the
  tensor, its type, the split and the block size.

The vocabulary is split into ``ceil(V / N)`` rows per rank (the last rank may hold fewer), so an
all-gather of equal-sized pieces (what NCCL's all-gather moves) needs only padding of the last piece.
Tied embeddings: ``token_embd.weight`` stays whole on every rank for the lookup and its vocabulary
slice is handed out under the name ``output.weight`` as the rank's LM head.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal, Mapping

import numpy as np

from realizar.errors import ModelFormatError, ShapeError
from realizar.models.config import ModelConfig
from realizar.models.names import OUTPUT, TOKEN_EMBD
from realizar.models.quants import layout, type_name
from realizar.models.tensor import QuantTensor

__all__ = ["Split", "TensorSplit", "ShardingPlan", "make_plan", "slice_rows", "slice_columns", "check_world_size"]

Split = Literal["replicate", "rows", "columns"]

# Which layer tensors split how. Heads: "q" (query heads), "kv" (KV heads); "ffn": FFN columns.
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)\.(weight|bias)$")
_ROW_SPLITS = {"attn_q": "q", "attn_k": "kv", "attn_v": "kv", "ffn_gate": "ffn", "ffn_up": "ffn"}
_COLUMN_SPLITS = {"attn_output": "q", "ffn_down": "ffn"}


@dataclass(frozen=True)
class TensorSplit:
    """How one tensor is cut: ``split`` is ``"rows"`` (the first axis, output rows), ``"columns"``
    (the last axis, the input K) or ``"replicate"``; ``bounds[r]`` is rank ``r``'s ``[start, stop)``
    along that axis (``None`` for a replicated tensor). ``source`` is the tensor of the file the
    slice comes from (``token_embd.weight`` for a tied LM head, else ``name``)."""

    name: str
    source: str
    ggml_type: int
    shape: tuple[int, ...]
    split: Split
    bounds: tuple[tuple[int, int], ...] | None = None

    def shard_shape(self, rank: int) -> tuple[int, ...]:
        if self.bounds is None:
            return self.shape
        a, b = self.bounds[rank]
        if self.split == "rows":
            return (b - a, *self.shape[1:])
        return (*self.shape[:-1], b - a)


def check_world_size(config: ModelConfig, world_size: int) -> None:
    """The head and FFN counts divide by ``world_size``; :class:`ShapeError` saying which does not."""
    n = world_size
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ShapeError(f"tensor parallelism needs a whole number of ranks >= 1, got {n!r}")
    c = config
    what = f"sharding over {n} ranks"
    if c.is_moe and n > 1:
        raise ShapeError(f"{what}: mixture-of-experts models are not sharded (their experts are not split yet)")
    if c.num_heads % n:
        raise ShapeError(f"{what} needs num_heads divisible by {n}; this model has {c.num_heads} query heads")
    if c.num_kv_heads % n:
        raise ShapeError(
            f"{what} needs num_kv_heads divisible by {n} (a GQA group stays on one rank); this model "
            f"has {c.num_kv_heads} KV heads (for {c.num_heads} query heads)"
        )
    if c.intermediate_size % n:
        raise ShapeError(f"{what} needs intermediate_size divisible by {n}; this model has {c.intermediate_size}")
    if c.vocab_size < n:
        raise ShapeError(f"{what} needs a vocabulary of at least {n} tokens; this model has {c.vocab_size}")


def _even(total: int, n: int) -> tuple[tuple[int, int], ...]:
    part = total // n
    return tuple((r * part, (r + 1) * part) for r in range(n))


def _vocab_bounds(vocab: int, n: int) -> tuple[tuple[int, int], ...]:
    per = -(-vocab // n)  # ceil: equal pieces for the all-gather, the last one padded
    bounds = tuple((min(r * per, vocab), min((r + 1) * per, vocab)) for r in range(n))
    if any(b <= a for a, b in bounds):
        raise ShapeError(
            f"a vocabulary of {vocab} split in pieces of {per} leaves a rank of {n} without any row"
        )
    return bounds


def _check_column_split(t: QuantTensor, n: int, width: int) -> None:
    """A split of ``t`` along K into pieces of ``width`` values falls on block boundaries."""
    block = layout(t.ggml_type).block_size
    if width % block:
        raise ShapeError(
            f"tensor {t.name} ({type_name(t.ggml_type)}, shape {tuple(t.shape)}) split over {n} ranks "
            f"along its input dimension gives {width} values per rank, not a multiple of the "
            f"{type_name(t.ggml_type)} block size {block}: a quantized block cannot be cut"
        )


@dataclass(frozen=True)
class ShardingPlan:
    """Where every tensor of a model goes over ``world_size`` ranks (see the module docstring).

    ``heads``, ``kv_heads`` and ``ffn`` give each rank's ``[start, stop)`` of query heads, KV heads and
    FFN columns; ``vocab`` each rank's vocabulary rows; ``tensors`` the split of every tensor by name.
    ``shard(tensors, rank)`` cuts a rank's tensors out of the file's bytes."""

    config: ModelConfig
    world_size: int
    heads: tuple[tuple[int, int], ...]
    kv_heads: tuple[tuple[int, int], ...]
    ffn: tuple[tuple[int, int], ...]
    vocab: tuple[tuple[int, int], ...]
    tensors: Mapping[str, TensorSplit]

    @property
    def vocab_per_rank(self) -> int:
        """Rows of every all-gathered LM-head piece (the last rank's is padded up to it)."""
        return self.vocab[0][1] - self.vocab[0][0]

    def rank_config(self, rank: int) -> ModelConfig:
        """The config one rank computes with: its heads, KV heads and FFN columns (the hidden size and
        the vocabulary are those of the whole model: the embedding is whole, the LM head is sliced)."""
        from dataclasses import replace

        c = self.config
        n = self.world_size
        return replace(c, num_heads=c.num_heads // n, num_kv_heads=c.num_kv_heads // n,
                       intermediate_size=c.intermediate_size // n)

    def shard(self, tensors: Mapping[str, QuantTensor], rank: int) -> dict[str, QuantTensor]:
        """Rank ``rank``'s tensors, keyed as in the file (a tied LM head as ``output.weight``), each a
        :class:`QuantTensor` holding its slice of the raw GGUF bytes (a copy, contiguous)."""
        if not 0 <= rank < self.world_size:
            raise ShapeError(f"rank {rank} is outside 0..{self.world_size - 1}")
        out: dict[str, QuantTensor] = {}
        for name, s in self.tensors.items():
            t = tensors.get(s.source)
            if t is None:
                raise ModelFormatError(f"missing tensor {s.source} (for {name})")
            if tuple(t.shape) != s.shape or int(t.ggml_type) != s.ggml_type:
                raise ShapeError(
                    f"tensor {s.source} is {type_name(t.ggml_type)} {tuple(t.shape)}, but the plan was "
                    f"made for {type_name(s.ggml_type)} {s.shape}"
                )
            if s.split == "replicate":
                out[name] = t
            elif s.split == "rows":
                out[name] = slice_rows(t, *s.bounds[rank], name=name)
            else:
                out[name] = slice_columns(t, *s.bounds[rank], name=name)
        return out


def make_plan(config: ModelConfig, tensors: Mapping[str, QuantTensor], world_size: int) -> ShardingPlan:
    """The sharding plan of a model's ``tensors`` over ``world_size`` ranks.

    Raises :class:`ShapeError` when the heads, KV heads, FFN width or vocabulary do not divide, or when
    a split along K would cut a quantized block (naming the tensor, its type, the split and the block
    size); :class:`ModelFormatError` when a tensor the config implies is missing."""
    check_world_size(config, world_size)
    c, n = config, world_size
    d = c.head_dim
    heads = _even(c.num_heads, n)
    kv_heads = _even(c.num_kv_heads, n)
    ffn = _even(c.intermediate_size, n)
    vocab = _vocab_bounds(c.vocab_size, n)
    # Split bounds in values along the split axis, per group of the tables above.
    by_group = {
        "q": tuple((a * d, b * d) for a, b in heads),
        "kv": tuple((a * d, b * d) for a, b in kv_heads),
        "ffn": ffn,
    }

    plan: dict[str, TensorSplit] = {}
    for name, t in tensors.items():
        shape = tuple(int(s) for s in t.shape)
        m = _LAYER_RE.match(name)
        part = m.group(2) if m else None
        if part in _ROW_SPLITS:
            bounds = by_group[_ROW_SPLITS[part]]
            if shape[0] != bounds[-1][1]:
                raise ShapeError(f"tensor {name} has {shape[0]} rows; its split expects {bounds[-1][1]}")
            if len(shape) == 1 and n > 1:  # a bias: a 1-D F32 row cut along its only axis
                _check_column_split(t, n, bounds[0][1] - bounds[0][0])
            plan[name] = TensorSplit(name, name, int(t.ggml_type), shape, "rows", bounds)
        elif part in _COLUMN_SPLITS:
            bounds = by_group[_COLUMN_SPLITS[part]]
            if shape[-1] != bounds[-1][1]:
                raise ShapeError(f"tensor {name} has {shape[-1]} columns; its split expects {bounds[-1][1]}")
            if n > 1:
                _check_column_split(t, n, bounds[0][1] - bounds[0][0])
            plan[name] = TensorSplit(name, name, int(t.ggml_type), shape, "columns", bounds)
        elif name == OUTPUT:
            plan[name] = TensorSplit(name, name, int(t.ggml_type), shape, "rows", vocab)
        else:  # embeddings for the lookup, norms, q/k norms, rope_freqs: every rank holds them whole
            plan[name] = TensorSplit(name, name, int(t.ggml_type), shape, "replicate")

    if OUTPUT not in plan:  # tied: the LM head is the vocabulary slice of the embedding
        emb = tensors.get(TOKEN_EMBD)
        if emb is None:
            raise ModelFormatError(f"missing tensor {TOKEN_EMBD} (the tied LM head)")
        plan[OUTPUT] = TensorSplit(OUTPUT, TOKEN_EMBD, int(emb.ggml_type), tuple(int(s) for s in emb.shape),
                                   "rows", vocab)
    if plan[OUTPUT].shape[0] != c.vocab_size:
        raise ShapeError(f"the LM head has {plan[OUTPUT].shape[0]} rows; the vocabulary has {c.vocab_size}")
    return ShardingPlan(c, n, heads, kv_heads, ffn, vocab, plan)


# ----------------------------------------------------------------------------------------------
# Slicing raw GGUF bytes
# ----------------------------------------------------------------------------------------------


def _rows_view(t: QuantTensor) -> tuple[np.ndarray, int]:
    """The tensor's bytes as ``[rows, row_bytes]`` and the values per row (the last axis)."""
    lay = layout(t.ggml_type)
    shape = tuple(int(s) for s in t.shape) or (1,)
    k = shape[-1]
    if k % lay.block_size:
        raise ShapeError(f"tensor {t.name} ({lay.name}) has rows of {k} values, not whole blocks of {lay.block_size}")
    rows = math.prod(shape[:-1])
    row_bytes = k // lay.block_size * lay.type_size
    raw = np.asarray(t.data).reshape(-1).view(np.uint8)
    if raw.size != rows * row_bytes:
        raise ShapeError(f"tensor {t.name} ({lay.name} {shape}) needs {rows * row_bytes} bytes, holds {raw.size}")
    return raw.reshape(rows, row_bytes), k


def slice_rows(t: QuantTensor, start: int, stop: int, name: str | None = None) -> QuantTensor:
    """Rows ``[start, stop)`` of the first axis of ``t`` (whole rows: a contiguous byte range).

    A 1-D tensor (a bias, F32) is one row; its "rows" are its values, cut as columns."""
    shape = tuple(int(s) for s in t.shape)
    if len(shape) == 1:
        return slice_columns(t, start, stop, name=name)
    if not 0 <= start < stop <= shape[0]:
        raise ShapeError(f"rows [{start}, {stop}) are outside tensor {t.name} of {shape[0]} rows")
    per_row = math.prod(shape[1:-1])  # rows of blocks per first-axis index (1 for a matrix)
    raw, _ = _rows_view(t)
    data = np.ascontiguousarray(raw[start * per_row : stop * per_row]).reshape(-1)
    return QuantTensor(name or t.name, int(t.ggml_type), (stop - start, *shape[1:]), data)


def slice_columns(t: QuantTensor, start: int, stop: int, name: str | None = None) -> QuantTensor:
    """Values ``[start, stop)`` of the last axis of every row of ``t``: a byte range of each row, which
    must begin and end on a block boundary (:class:`ShapeError` naming the tensor, type and block size)."""
    lay = layout(t.ggml_type)
    shape = tuple(int(s) for s in t.shape) or (1,)
    k = shape[-1]
    if not 0 <= start < stop <= k:
        raise ShapeError(f"columns [{start}, {stop}) are outside tensor {t.name} of {k} columns")
    if start % lay.block_size or stop % lay.block_size:
        raise ShapeError(
            f"tensor {t.name} ({lay.name}): columns [{start}, {stop}) do not fall on the block boundaries "
            f"of {lay.name} (block size {lay.block_size}); a quantized block cannot be cut"
        )
    raw, _ = _rows_view(t)
    b0 = start // lay.block_size * lay.type_size
    b1 = stop // lay.block_size * lay.type_size
    data = np.ascontiguousarray(raw[:, b0:b1]).reshape(-1)
    return QuantTensor(name or t.name, int(t.ggml_type), (*shape[:-1], stop - start), data)
