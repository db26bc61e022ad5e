"""Canonical tensor names (GGUF's), the HF → canonical mapping, and the shapes a config implies.

Both loaders key their tensors by the GGUF names below; shapes are NumPy order, so a matrix used as
``y = W @ x`` has shape ``(out_dim, in_dim)``.
"""

from __future__ import annotations

import re

from realizar.errors import ModelFormatError
from realizar.models.config import ModelConfig

TOKEN_EMBD = "token_embd.weight"
OUTPUT_NORM = "output_norm.weight"
OUTPUT = "output.weight"

LAYER_WEIGHTS = (
    "attn_norm",
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "attn_q_norm",
    "attn_k_norm",
    "ffn_norm",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
)
# a mixture-of-experts layer's feed-forward instead: the router [experts, hidden] and the experts' stacked
# matrices [experts, ffn, hidden] (gate, up) and [experts, hidden, ffn] (down)
EXPERT_WEIGHTS = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
LAYER_BIASES = ("attn_q", "attn_k", "attn_v")


def layer_name(layer: int, part: str, kind: str = "weight") -> str:
    """``blk.{layer}.{part}.{kind}``, e.g. ``layer_name(3, "attn_q")`` → ``blk.3.attn_q.weight``."""
    return f"blk.{layer}.{part}.{kind}"


# HF (transformers) names → canonical names. ``{n}`` is the layer index.
_HF_LAYER_MAP = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_HF_LAYER_MAP.update({  # mixture-of-experts routers (the experts are stacked by the safetensors loader)
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
})
_HF_GLOBAL_MAP = {
    "model.embed_tokens.weight": TOKEN_EMBD,
    "model.norm.weight": OUTPUT_NORM,
    "lm_head.weight": OUTPUT,
}
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def hf_to_canonical(name: str) -> str | None:
    """The canonical name of an HF tensor name, or ``None`` when it is not one realizar uses."""
    if name in _HF_GLOBAL_MAP:
        return _HF_GLOBAL_MAP[name]
    m = _HF_LAYER_RE.match(name)
    if m and m.group(2) in _HF_LAYER_MAP:
        return f"blk.{int(m.group(1))}.{_HF_LAYER_MAP[m.group(2)]}"
    return None


def canonical_to_hf(name: str) -> str:
    """Inverse of :func:`hf_to_canonical` (``KeyError`` for names with no HF counterpart)."""
    for hf, canon in _HF_GLOBAL_MAP.items():
        if canon == name:
            return hf
    m = re.match(r"^blk\.(\d+)\.(.+)$", name)
    if m:
        for hf, canon in _HF_LAYER_MAP.items():
            if canon == m.group(2):
                return f"model.layers.{m.group(1)}.{hf}"
    raise KeyError(name)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the config requires, with its NumPy shape."""
    c = config
    h, q, kv, ffn = c.hidden_size, c.q_dim, c.kv_dim, c.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        TOKEN_EMBD: (c.vocab_size, h),
        OUTPUT_NORM: (h,),
    }
    if not c.tied_embeddings:
        shapes[OUTPUT] = (c.vocab_size, h)
    for i in range(c.num_layers):
        shapes[layer_name(i, "attn_norm")] = (h,)
        shapes[layer_name(i, "attn_q")] = (q, h)
        shapes[layer_name(i, "attn_k")] = (kv, h)
        shapes[layer_name(i, "attn_v")] = (kv, h)
        shapes[layer_name(i, "attn_output")] = (h, q)
        if c.qkv_bias:
            shapes[layer_name(i, "attn_q", "bias")] = (q,)
            shapes[layer_name(i, "attn_k", "bias")] = (kv,)
            shapes[layer_name(i, "attn_v", "bias")] = (kv,)
        if c.qk_norm:
            shapes[layer_name(i, "attn_q_norm")] = (c.head_dim,)
            shapes[layer_name(i, "attn_k_norm")] = (c.head_dim,)
        shapes[layer_name(i, "ffn_norm")] = (h,)
        if c.is_moe:
            e, fe = c.num_experts, c.expert_ffn_size
            shapes[layer_name(i, "ffn_gate_inp")] = (e, h)
            shapes[layer_name(i, "ffn_gate_exps")] = (e, fe, h)
            shapes[layer_name(i, "ffn_up_exps")] = (e, fe, h)
            shapes[layer_name(i, "ffn_down_exps")] = (e, h, fe)
            continue
        shapes[layer_name(i, "ffn_gate")] = (ffn, h)
        shapes[layer_name(i, "ffn_up")] = (ffn, h)
        shapes[layer_name(i, "ffn_down")] = (h, ffn)
    return shapes


def validate_tensor_shapes(
    config: ModelConfig, shapes: dict[str, tuple[int, ...]], source: str = "model"
) -> None:
    """Raise :class:`ModelFormatError` naming the first required tensor that is missing or whose shape
    differs from what ``config`` implies. ``shapes`` maps names to NumPy shapes."""
    for name, want in expected_shapes(config).items():
        if name not in shapes:
            raise ModelFormatError(f"{source}: missing tensor {name!r} (expected shape {want})")
        got = tuple(shapes[name])
        if got != want:
            raise ModelFormatError(
                f"{source}: tensor {name!r} has shape {got}, expected {want} from the config"
            )
