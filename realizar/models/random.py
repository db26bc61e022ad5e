"""Random weights in GGUF block form: single tensors and whole models, for tests, benchmarks and
kernel experiments without a model file.

Any byte pattern is a valid quantized block once its f16 scale fields hold finite numbers, so these
builders draw the codes uniformly and set the scales explicitly. Two flavours:

* :func:`random_weight` — raw bytes with varied scales (values of every magnitude the format can
  express), for numerical comparisons of kernels against :func:`dequant`;
* :func:`random_tensor` / :func:`random_model` — :class:`QuantTensor` objects with small constant
  scales, so a many-layer forward pass stays finite; for speed measurements at real model shapes
  (:data:`BENCH_SHAPES` and :func:`bench_model`: the shapes the benchmark tools share).

Type names are GGML's (``"Q4_K"``, ``"Q8_0"``, ``"F32"``, ...).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from gguf import GGMLQuantizationType

from realizar.models import names
from realizar.models.config import ModelConfig
from realizar.models.quants import LAYOUTS, dequantize
from realizar.models.tensor import QuantTensor

__all__ = ["BENCH_SHAPES", "BenchShape", "DECODE_SHAPES", "MIXES", "bench_model", "dequant", "random_model",
           "random_tensor", "random_weight", "token_read_bytes"]

# f16 fields of each quantized block that must hold finite numbers
_F16_FIELDS = {
    "Q8_0": ("d",), "Q4_0": ("d",), "Q4_1": ("d", "m"), "Q5_0": ("d",), "Q5_1": ("d", "m"),
    "Q4_K": ("d", "dmin"), "Q5_K": ("d", "dmin"), "Q6_K": ("d",),
}  # fmt: skip
_K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


def _type(wtype: str) -> GGMLQuantizationType:
    try:
        return GGMLQuantizationType[wtype]
    except KeyError:
        raise ValueError(f"unknown GGML type {wtype!r}") from None


def _float_bytes(values: np.ndarray, wtype: str) -> np.ndarray:
    """``values`` (float64/float32) encoded as F32, F16 or BF16 (truncated), as flat uint8."""
    f = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    if wtype == "F32":
        return f.view(np.uint8)
    if wtype == "F16":
        return f.astype(np.float16).view(np.uint8)
    return (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)


def random_weight(rng: np.random.Generator, wtype: str, out_dim: int, in_dim: int, scale: float = 1.0) -> np.ndarray:
    """Raw GGUF bytes (flat uint8) of an ``out_dim x in_dim`` matrix of type ``wtype``.

    Float types hold ``scale * N(0, 1)``. Quantized types hold uniform random codes; each f16 scale
    field is ``±U(0.25, 1) * scale / 16`` (``/ 64`` for K-quants, whose sub-block scales multiply it
    again). ``in_dim`` must be a multiple of the type's block size.
    """
    if wtype in ("F32", "F16", "BF16"):
        return _float_bytes(rng.standard_normal((out_dim, in_dim)) * scale, wtype)
    lay = LAYOUTS[_type(wtype)]
    nb = out_dim * in_dim // lay.block_size
    raw = rng.integers(0, 256, size=(nb, lay.type_size), dtype=np.uint8)
    mag = scale / (64.0 if wtype in _K_QUANTS else 16.0)
    for name in _F16_FIELDS[wtype]:
        off = lay.offset(name)
        vals = (rng.uniform(0.25, 1.0, nb) * mag * rng.choice([-1.0, 1.0], nb)).astype(np.float16)
        raw[:, off : off + 2] = vals.view(np.uint8).reshape(nb, 2)
    return raw.reshape(-1)


def dequant(raw: np.ndarray, wtype: str, out_dim: int, in_dim: int) -> np.ndarray:
    """The float32 ``[out_dim, in_dim]`` values of raw GGUF bytes of type ``wtype``."""
    return dequantize(raw, _type(wtype), (out_dim, in_dim))


def random_tensor(rng: np.random.Generator, name: str, wtype: str, shape: tuple[int, ...]) -> QuantTensor:
    """A :class:`QuantTensor` of ``shape`` and type ``wtype``: float types hold ``0.02 * N(0, 1)``;
    quantized types hold uniform random codes with every f16 scale field ``0.002`` (``dmin``
    ``0.001``), which bounds every value by ~8. The last dimension must be a multiple of the type's
    block size."""
    t = _type(wtype)
    n = math.prod(shape)
    if wtype in ("F32", "F16", "BF16"):
        return QuantTensor(name, int(t), tuple(shape), _float_bytes(rng.standard_normal(n) * 0.02, wtype))
    lay = LAYOUTS[t]
    if shape[-1] % lay.block_size:
        raise ValueError(f"{name}: rows of {shape[-1]} values are not whole {wtype} blocks of {lay.block_size}")
    blocks = rng.integers(0, 256, size=n // lay.block_size * lay.type_size, dtype=np.uint8)
    blocks = blocks.reshape(-1, lay.type_size)
    for f in lay.fields:
        if f.dtype == "f16":
            value = np.float16(0.001 if f.name == "dmin" else 0.002)
            blocks[:, f.offset : f.offset + 2] = np.frombuffer(value.tobytes(), np.uint8)
    return QuantTensor(name, int(t), tuple(shape), blocks.reshape(-1))


def random_model(
    config: ModelConfig,
    weight_type: str,
    embedding_type: str | None = None,
    output_type: str | None = None,
    seed: int = 0,
    mix: str | None = None,
) -> dict[str, QuantTensor]:
    """Every tensor ``config`` requires (canonical names, see :func:`names.expected_shapes`), drawn by
    :func:`random_tensor`: the layer matrices of ``weight_type``, ``token_embd`` of
    ``embedding_type`` (default ``weight_type``), ``output`` (untied models only) of ``output_type``
    (default ``weight_type``), norms and biases F32. ``mix`` names a per-tensor recipe of the GGUF
    quantizer that mixes types (:data:`MIXES`: ``"K_M"`` gives ``attn_v`` and ``ffn_down`` of some
    layers :data:`MIXES`' wider type). The result can be passed wherever a loaded model's ``tensors``
    go (the reference model, the GPU model)."""
    rng = np.random.default_rng(seed)
    shapes = names.expected_shapes(config)

    def draw(name: str, wtype: str) -> QuantTensor:
        return random_tensor(rng, name, wtype, shapes[name])

    tensors = {
        names.TOKEN_EMBD: draw(names.TOKEN_EMBD, embedding_type or weight_type),
        names.OUTPUT_NORM: draw(names.OUTPUT_NORM, "F32"),
    }
    if not config.tied_embeddings:
        tensors[names.OUTPUT] = draw(names.OUTPUT, output_type or weight_type)
    ffn = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps") if config.is_moe else ("ffn_gate", "ffn_up", "ffn_down")
    matrices = ("attn_q", "attn_k", "attn_v", "attn_output", *ffn)
    vectors = ("attn_norm", "ffn_norm")
    if config.qk_norm:
        vectors += ("attn_q_norm", "attn_k_norm")
    if mix is not None and mix not in MIXES:
        raise ValueError(f"unknown type mix {mix!r}; known: {', '.join(MIXES)}")
    for i in range(config.num_layers):
        for part in matrices:
            name = names.layer_name(i, part)
            wide = mix is not None and part in ("attn_v", "ffn_down", "ffn_down_exps") and _more_bits(i, config.num_layers)
            tensors[name] = draw(name, MIXES[mix] if wide else weight_type)
        if config.is_moe:  # (the router stays F32, as converters keep it)
            name = names.layer_name(i, "ffn_gate_inp")
            tensors[name] = draw(name, "F32")
        for part in vectors:
            name = names.layer_name(i, part)
            tensors[name] = draw(name, "F32")
        if config.qkv_bias:
            for part in names.LAYER_BIASES:
                name = names.layer_name(i, part, "bias")
                tensors[name] = draw(name, "F32")
    return tensors


# type mixes of the GGUF quantizer's "_M" files: Q4_K_M and Q5_K_M store attn_v and ffn_down in Q6_K in
# the first and last eighth of the layers and every third layer between (the rest in the base type)
MIXES = {"K_M": "Q6_K"}


def _more_bits(layer: int, num_layers: int) -> bool:
    eighth = num_layers // 8
    return layer < eighth or layer >= num_layers - eighth or (layer - eighth) % 3 == 2


class BenchShape(NamedTuple):
    """A real model's shape with random weights: :class:`ModelConfig` keyword arguments and the GGML
    types of the layer matrices, the token embedding and the output matrix (``None``: tied)."""

    config: dict
    weight_type: str
    embedding_type: str
    output_type: str | None
    mix: str | None = None  # a per-tensor type recipe (MIXES)


_LLAMA = dict(architecture="llama", rope_type="normal", rms_norm_eps=1e-5, context_length=8192)

# the model shapes the benchmark tools measure (llama.cpp's figures in ../shared/GUIDE.md use the same)
BENCH_SHAPES = {
    "smollm2-135m": BenchShape(dict(_LLAMA, vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9,
                                    num_kv_heads=3, head_dim=64, intermediate_size=1536, rope_theta=1e5,
                                    tied_embeddings=True), "Q4_1", "Q8_0", None),
    "llama-3.2-1b": BenchShape(dict(_LLAMA, vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32,
                                    num_kv_heads=8, head_dim=64, intermediate_size=8192, rope_theta=5e5,
                                    tied_embeddings=True), "Q4_K", "Q6_K", None),
    "llama-3-8b": BenchShape(dict(_LLAMA, vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                                  num_kv_heads=8, head_dim=128, intermediate_size=14336, rope_theta=5e5,
                                  tied_embeddings=False), "Q4_K", "Q4_K", "Q6_K"),
}  # fmt: skip

# mixture-of-experts shapes (bench_decode --shapes, bench_moe --shape, write_gguf)
MOE_SHAPES = {
    "qwen3-30b-a3b": BenchShape(dict(architecture="qwen3moe", rope_type="neox", rms_norm_eps=1e-6, context_length=8192,
                                     vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4,
                                     head_dim=128, intermediate_size=6144, rope_theta=1e6, tied_embeddings=False,
                                     qk_norm=True, num_experts=128, num_experts_used=8, expert_ffn_size=768),
                                "Q4_K", "Q4_K", "Q6_K"),
    "mixtral-8x7b": BenchShape(dict(_LLAMA, vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                                    head_dim=128, intermediate_size=14336, rope_theta=1e6, tied_embeddings=False,
                                    num_experts=8, num_experts_used=2, expert_ffn_size=14336), "Q4_K", "Q4_K", "Q6_K"),
}  # fmt: skip

# more weight types at the 8B shape (bench_decode): a Q5_K_M-like file and an all-Q4_0 one
DECODE_SHAPES = {
    **BENCH_SHAPES,
    "llama-3-8b-q5_k_m": BenchShape(BENCH_SHAPES["llama-3-8b"].config, "Q5_K", "Q5_K", "Q6_K", "K_M"),
    "llama-3-8b-q4_0": BenchShape(BENCH_SHAPES["llama-3-8b"].config, "Q4_0", "Q4_0", "Q6_K"),
}


def token_read_bytes(config: ModelConfig, tensors: dict[str, QuantTensor]) -> int:
    """Weight bytes one decode step reads: every tensor but the embedding table, plus the whole table
    when the LM head is tied to it; of a mixture of experts' stacked matrices, the chosen experts' share."""
    share = config.num_experts_used / config.num_experts if config.is_moe else 1.0
    total = sum(t.nbytes * (share if n.endswith("_exps.weight") else 1) for n, t in tensors.items()
                if n != names.TOKEN_EMBD)
    total = int(total)
    if config.tied_embeddings:
        total += tensors[names.TOKEN_EMBD].nbytes
    return total


def bench_model(shape: str | BenchShape, seed: int = 0) -> tuple[ModelConfig, dict[str, QuantTensor], int]:
    """``(config, tensors, token_read_bytes)`` of a :data:`DECODE_SHAPES` or :data:`MOE_SHAPES` entry (by name) or of any
    :class:`BenchShape`, with weights drawn by :func:`random_model`."""
    if isinstance(shape, str):
        known = {**DECODE_SHAPES, **MOE_SHAPES}
        if shape not in known:
            raise ValueError(f"unknown benchmark shape {shape!r}; known: {', '.join(known)}")
        shape = known[shape]
    config = ModelConfig(**shape.config)
    tensors = random_model(config, shape.weight_type, shape.embedding_type, shape.output_type, seed=seed,
                           mix=shape.mix)
    return config, tensors, token_read_bytes(config, tensors)
