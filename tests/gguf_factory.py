"""Conversion of the tiny HF models of :mod:`tests.model_factory` to GGUF, the way llama.cpp's
``convert_hf_to_gguf.py`` does it, plus GGUF helpers for tests: :func:`quantize` (K-quants through
libgguf, byte-identical to llama.cpp), :func:`rewrite_gguf` (copies with edits, for malformed-input
tests), :func:`make_gguf_model` (make_hf_model then hf_to_gguf) and :func:`shared_tiny_gguf` (one
tiny llama Q8_0 GGUF per test session).

Typical use::

    from tests.model_factory import make_hf_model, KQUANT_DIMS
    from tests.gguf_factory import hf_to_gguf, make_gguf_model

    hf_dir, tiny = make_hf_model("qwen3", tmp_path, seed=0)
    gguf_path = hf_to_gguf(hf_dir, tmp_path / "m.gguf", "Q8_0")
    gguf_path, hf_dir, tiny = make_gguf_model("llama", tmp_path, "Q4_K", **KQUANT_DIMS)

What the GGUF conversion does (and so what a loader must undo or honour):

* llama / mistral: ``q_proj`` / ``k_proj`` weights (and biases) are permuted per head from HF's
  rotate-half order to interleaved pairs (``LlamaModel.permute`` of llama.cpp), so the GGUF is a
  faithful llama GGUF to be run with "normal" (interleaved) RoPE. Mistral is written with
  ``general.architecture = "llama"`` as llama.cpp does, unless ``gguf_arch="mistral"`` is given.
* qwen2 / qwen3: no permutation ("neox" RoPE).
* 1-D tensors (norms, biases) stay F32; 2-D tensors become ``qtype`` (``embd_qtype`` for
  ``token_embd``). Tied models get no ``output.weight``.
* ``{arch}.attention.key_length`` / ``value_length`` are written from ``head_dim`` (as the converter
  does whenever config.json has one — transformers 5 always writes it).
* The HF directory's tokenizer (see :mod:`tests.model_factory`) is written as ``tokenizer.ggml.*``
  (model "gpt2"), with the ChatML chat template.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from tests.model_factory import (
    BOS_ID,
    CHAT_TEMPLATE,
    EOS_ID,
    make_hf_model,
    make_tokenizer,
    read_hf_tensors,
    tokenizer_tables,
)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: per head, rotate-half row order → interleaved pairs.
    ``w`` has shape (n_head * head_dim, ...) (a weight or a bias)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of :func:`permute_qk` (what transformers does when it reads a llama GGUF)."""
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


# Independent of realizar.models.names on purpose: the loader is tested against this table.
_HF_TO_GGUF_LAYER = {
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
_HF_TO_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


# a mixture-of-experts layer: the router, and each expert's matrices stacked into one [experts, rows, cols] tensor
_HF_TO_GGUF_ROUTER = {"mlp.gate.weight": "ffn_gate_inp.weight", "block_sparse_moe.gate.weight": "ffn_gate_inp.weight"}
_HF_TO_GGUF_EXPERT = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
                      "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def stack_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``tensors`` with each layer's per-expert HF matrices replaced by the stacked GGUF-layout ones, named
    ``model.layers.N.<ffn_*_exps>`` (and the router renamed ``model.layers.N.ffn_gate_inp.weight``), as
    llama.cpp's converter merges them."""
    import re

    out, experts = {}, {}
    for name, x in tensors.items():
        m = re.match(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$", name)
        if m:
            experts.setdefault((int(m.group(1)), _HF_TO_GGUF_EXPERT[m.group(3)]), {})[int(m.group(2))] = x
            continue
        layer = re.match(r"^model\.layers\.(\d+)\.(.+)$", name)
        if layer and layer.group(2) in _HF_TO_GGUF_ROUTER:
            name = f"model.layers.{layer.group(1)}.{_HF_TO_GGUF_ROUTER[layer.group(2)]}"
        out[name] = x
    for (i, kind), per in experts.items():
        out[f"model.layers.{i}.{kind}"] = np.stack([per[e] for e in range(len(per))])
    return out


def gguf_tensor_name(hf_name: str) -> str:
    parts = hf_name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3].startswith("ffn_"):  # (stack_experts')
        return f"blk.{int(parts[2])}.{parts[3]}" + ("" if parts[3].endswith(".weight") else ".weight")
    if hf_name in _HF_TO_GGUF_GLOBAL:
        return _HF_TO_GGUF_GLOBAL[hf_name]
    parts = hf_name.split(".", 3)  # model, layers, N, rest
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _HF_TO_GGUF_LAYER:
        return f"blk.{int(parts[2])}.{_HF_TO_GGUF_LAYER[parts[3]]}"
    raise KeyError(f"no GGUF name for HF tensor {hf_name!r}")


def quantize(x: np.ndarray, qtype) -> tuple[np.ndarray, Any]:
    """Encode float32 rows ``x`` as ``qtype`` (name or GGMLQuantizationType); returns
    ``(array, raw_dtype)`` for ``GGUFWriter.add_tensor``. K-quants are made with libgguf
    (byte-identical to llama.cpp); the others with gguf.quants."""
    import gguf

    T = gguf.GGMLQuantizationType
    qtype = T[qtype] if isinstance(qtype, str) else T(qtype)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if qtype == T.F32:
        return x, None
    if qtype == T.F16:
        return x.astype(np.float16), None
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if x.shape[-1] % block:
        raise ValueError(f"rows of {x.shape[-1]} values cannot be {qtype.name} (block size {block})")
    if qtype in (T.Q4_K, T.Q5_K, T.Q6_K, T.Q2_K, T.Q3_K):
        import libgguf

        return libgguf.quantize_rows(x, int(qtype)), qtype
    return gguf.quants.quantize(x, qtype), qtype


_FILE_TYPES = {
    "F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q8_0": "MOSTLY_Q8_0",
    "Q4_0": "MOSTLY_Q4_0", "Q4_1": "MOSTLY_Q4_1", "Q5_0": "MOSTLY_Q5_0", "Q5_1": "MOSTLY_Q5_1",
    "Q4_K": "MOSTLY_Q4_K_M", "Q5_K": "MOSTLY_Q5_K_M", "Q6_K": "MOSTLY_Q6_K",
}


def _add_tokenizer(w, hf_dir: Path, vocab_size: int) -> None:
    """The HF directory's tokenizer (or a fresh one) as ``tokenizer.ggml.*``, with the chat template."""
    tok_path = hf_dir / "tokenizer.json"
    if tok_path.exists():
        from tokenizers import Tokenizer

        tokens, types, merges = tokenizer_tables(Tokenizer.from_file(str(tok_path)))
    else:
        tokens, types, merges = tokenizer_tables(make_tokenizer(vocab_size))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)


def _tensor_order(hf_name: str) -> tuple:
    """llama.cpp's order: token_embd, the layers in index order, then the rest."""
    g = gguf_tensor_name(hf_name)
    if g.startswith("blk."):
        return (1, int(g.split(".")[1]), g)
    return (0 if g == "token_embd.weight" else 2, 0, g)


def _gguf_tensor(x: np.ndarray, name: str, qtype: str, heads: tuple[int, int] | None):
    """One tensor as the converter writes it: Q/K permuted when ``heads`` = (n_head, n_kv) is given,
    1-D tensors F32, the rest quantized to ``qtype``."""
    part = name.split(".")[-2]
    if heads is not None and part == "attn_q":
        x = permute_qk(x, heads[0])
    elif heads is not None and part == "attn_k":
        x = permute_qk(x, heads[1])
    if x.ndim == 3:  # (stacked experts: quantized row by row, the byte rows shaped back)
        arr, raw = quantize(x.reshape(-1, x.shape[-1]), qtype)
        return arr.reshape(*x.shape[:2], -1), raw
    return quantize(x, "F32" if x.ndim == 1 or part == "ffn_gate_inp" else qtype)


def hf_to_gguf(
    hf_dir: str | Path,
    out_path: str | Path,
    qtype: str = "F32",
    *,
    embd_qtype: str | None = None,
    output_qtype: str | None = None,
    gguf_arch: str | None = None,
    extra_metadata: dict[str, Any] | None = None,
) -> Path:
    """Convert an HF directory made by :func:`make_hf_model` to a GGUF file at ``out_path``
    (see the module docstring for what the conversion does). Returns ``out_path``."""
    import gguf

    hf_dir, out_path = Path(hf_dir), Path(out_path)
    cfg = json.loads((hf_dir / "config.json").read_text())
    model_type = cfg["model_type"]
    if gguf_arch is None:
        gguf_arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe",
                     "mixtral": "llama"}[model_type]
    permute = model_type in ("llama", "mistral", "mixtral")
    n_head = cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads") or n_head
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // n_head
    rope = cfg.get("rope_parameters") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))

    tensors = stack_experts(read_hf_tensors(hf_dir))
    if cfg.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)

    w = gguf.GGUFWriter(str(out_path), arch=gguf_arch)
    w.add_name(f"tiny-{model_type}")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    if cfg.get("head_dim") is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(theta))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_vocab_size(cfg["vocab_size"])
    if "num_local_experts" in cfg:
        w.add_expert_count(cfg["num_local_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if "moe_intermediate_size" in cfg:
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("norm_topk_prob") is False:
            w.add_expert_weights_norm(False)
    w.add_file_type(gguf.LlamaFileType[_FILE_TYPES[qtype]])

    _add_tokenizer(w, hf_dir, cfg["vocab_size"])
    for key, value in (extra_metadata or {}).items():
        w.add_key_value(key, value[0], value[1]) if isinstance(value, tuple) else _add_kv(w, key, value)

    types = {"token_embd.weight": embd_qtype or qtype, "output.weight": output_qtype or qtype}
    heads = (n_head, n_kv) if permute else None
    for hf_name in sorted(tensors, key=_tensor_order):
        name = gguf_tensor_name(hf_name)
        arr, raw = _gguf_tensor(tensors[hf_name], name, types.get(name, qtype), heads)
        w.add_tensor(name, arr, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path


def _add_kv(w, key: str, value: Any) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value) if value >= 0 else w.add_int32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    else:
        w.add_array(key, value)


def make_gguf_model(
    arch: str, tmp_path: str | Path, qtype: str = "F32", seed: int = 0, **kwargs: Any
) -> tuple[Path, Path, Any]:
    """``make_hf_model`` then ``hf_to_gguf``: returns ``(gguf_path, hf_dir, tiny_model)``."""
    conv = {k: kwargs.pop(k) for k in ("embd_qtype", "output_qtype", "gguf_arch") if k in kwargs}
    hf_dir, model = make_hf_model(arch, tmp_path, seed, **kwargs)
    path = hf_to_gguf(hf_dir, Path(tmp_path) / f"{hf_dir.name}-{qtype}.gguf", qtype, **conv)
    return path, hf_dir, model


def rewrite_gguf(
    src: str | Path,
    dst: str | Path,
    *,
    arch: str | None = None,
    drop_tensors: tuple[str, ...] = (),
    replace_tensors: dict[str, tuple[np.ndarray, Any]] | None = None,
    drop_metadata: tuple[str, ...] = (),
    set_metadata: dict[str, Any] | None = None,
    split_max_tensors: int = 0,
) -> Path:
    """Copy a GGUF file with edits (for malformed-input tests): another ``general.architecture``,
    tensors dropped or replaced by ``(array, raw_dtype)`` (raw_dtype None for plain float arrays),
    metadata keys dropped or set (a value, or ``(value, GGUFValueType[, sub_type])``). Reads the source
    with ``gguf.GGUFReader`` so value types are preserved. ``split_max_tensors``: split the copy into parts
    of at most that many tensors, ``DST-0000K-of-0000N.gguf`` as llama.cpp's gguf-split names them (the
    first part's path is returned)."""
    import gguf

    r = gguf.GGUFReader(str(src))
    src_arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch=src_arch if arch is None else arch, split_max_tensors=split_max_tensors)
    set_metadata = dict(set_metadata or {})
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop_metadata:
            continue
        if key in set_metadata:
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), vtype, sub)
    for key, value in set_metadata.items():
        if isinstance(value, tuple):
            w.add_key_value(key, *value)
        else:
            _add_kv(w, key, value)
    replace_tensors = dict(replace_tensors or {})
    for t in r.tensors:
        if t.name in drop_tensors:
            continue
        if t.name in replace_tensors:
            arr, raw = replace_tensors.pop(t.name)
            w.add_tensor(t.name, arr, raw_dtype=raw)
            continue
        data = np.array(t.data)
        raw = None if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) else t.tensor_type
        w.add_tensor(t.name, data, raw_dtype=raw)
    for name, (arr, raw) in replace_tensors.items():  # new tensors
        w.add_tensor(name, arr, raw_dtype=raw)
    w.write_header_to_file(Path(dst))
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    dst = Path(dst)
    parts = sorted(dst.parent.glob(f"{dst.stem}-*-of-*.gguf"))
    return parts[0] if split_max_tensors and parts else dst


def shared_tiny_gguf(tmp_path_factory) -> Path:
    """One tiny random llama Q8_0 GGUF per test session, shared by the CLI and server tests."""
    directory = tmp_path_factory.getbasetemp() / "realizar-tiny-llama"
    found = sorted(directory.glob("*.gguf")) if directory.exists() else []
    if found:
        return found[0]
    directory.mkdir(parents=True, exist_ok=True)
    path, _, _ = make_gguf_model("llama", directory, qtype="Q8_0", seed=0)
    return path
