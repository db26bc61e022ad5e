"""HF-layout directories: ``config.json`` + ``model.safetensors`` (or shards listed in
``model.safetensors.index.json``), ``tokenizer.json``, ``tokenizer_config.json``.

Each file's header (an 8-byte little-endian length, then JSON naming each tensor's dtype, shape and
byte range) is checked here entry by entry, with messages naming the tensor, and then by the
``safetensors`` package's own parser, which also rejects overlapping byte ranges, gaps between
tensors and bytes past the last one. Each tensor becomes a :class:`QuantTensor` of type
F32/F16/BF16 holding a read-only view of a memory map of its file (no copy; bf16 needs no
conversion since its raw bytes are exactly GGML's BF16). HF names are mapped to the canonical GGUF
names (:mod:`realizar.models.names`). HF checkpoints use rotate-half ("neox") RoPE for every
architecture, so ``rope_type`` is ``"neox"`` and no Q/K permutation is applied.
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import os
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
import safetensors
from gguf import GGMLQuantizationType as T

from realizar.errors import ModelFormatError, RealizarError, UnsupportedError
from realizar.models import names
from realizar.models.chat_template import chat_template_from_hf
from realizar.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from realizar.models.loaded import LoadedModel
from realizar.models.rope import rope_scaling_from_hf
from realizar.models.tensor import QuantTensor

_DTYPES = {"F32": (T.F32, 4), "F16": (T.F16, 2), "BF16": (T.BF16, 2)}
_OTHER_DTYPES = {"F64": 8, "I64": 8, "U64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2, "I8": 1,
                 "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors crate's own limit

_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe",
    "mixtral": "mixtral",
}
_ARCH_CLASSES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "MixtralForCausalLM": "mixtral",
}


def _header(path: Path, buf: mmap.mmap, size: int) -> tuple[dict[str, Any], int]:
    """The header JSON object of a safetensors file and the offset where its data start."""
    (hlen,) = struct.unpack_from("<Q", buf, 0)
    if hlen > MAX_HEADER_BYTES or 8 + hlen > size:
        raise ModelFormatError(f"{path.name}: header length {hlen} does not fit in a file of {size} bytes")
    try:
        header = json.loads(bytes(buf[8 : 8 + hlen]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ModelFormatError(f"{path.name}: header is not valid JSON: {e}") from e
    if not isinstance(header, dict):
        raise ModelFormatError(f"{path.name}: header is not a JSON object")
    return header, 8 + hlen


def _entry(path: Path, name: str, info: Any, data_size: int) -> tuple[int, tuple[int, ...], int, int]:
    """``(ggml_type, shape, begin, end)`` of one header entry, checked against the data size."""
    try:
        dtype = info["dtype"]
        shape = tuple(int(s) for s in info["shape"])
        begin, end = (int(x) for x in info["data_offsets"])
    except (TypeError, KeyError, ValueError) as e:
        raise ModelFormatError(f"{path.name}: bad header entry for {name!r}: {info!r}") from e
    if dtype in _DTYPES:
        ggml_type, itemsize = _DTYPES[dtype]
    elif dtype in _OTHER_DTYPES:
        raise UnsupportedError(f"{path.name}: tensor {name!r} has dtype {dtype}; supported: F32, F16, BF16")
    else:
        raise ModelFormatError(f"{path.name}: tensor {name!r} has unknown dtype {dtype!r}")
    if any(s < 0 for s in shape):
        raise ModelFormatError(f"{path.name}: tensor {name!r} has negative shape {shape}")
    if not 0 <= begin <= end <= data_size or end - begin != math.prod(shape) * itemsize:
        raise ModelFormatError(
            f"{path.name}: tensor {name!r} ({dtype}, shape {shape}) has byte range "
            f"[{begin}, {end}) inconsistent with its size or the file ({data_size} data bytes)"
        )
    return int(ggml_type), shape, begin, end


def _check_layout(path: Path) -> None:
    """The ``safetensors`` package's validation of the whole file: byte ranges that tile the data
    section exactly, in order, with no overlap, gap or trailing bytes."""
    try:
        with safetensors.safe_open(str(path), framework="numpy"):
            pass
    except Exception as e:  # safetensors raises its own SafetensorError (not importable) or OSError
        raise ModelFormatError(f"{path.name}: invalid safetensors file: {e}") from e


def read_safetensors_file(path: Path) -> tuple[dict[str, QuantTensor], dict[str, str]]:
    """Parse one ``.safetensors`` file into ``{hf_name: QuantTensor}`` (views of a memory map) and
    its ``__metadata__``. Tensors of dtypes other than F32/F16/BF16 raise :class:`UnsupportedError`;
    a malformed file raises :class:`ModelFormatError` naming it."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            if size < 8:
                raise ModelFormatError(f"{path.name}: too short for a safetensors file ({size} bytes)")
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise ModelFormatError(f"cannot read {path}: {e}") from e
    header, data_start = _header(path, buf, size)
    meta = header.pop("__metadata__", None) or {}
    entries = {name: _entry(path, name, info, size - data_start) for name, info in header.items()}
    _check_layout(path)
    whole = np.frombuffer(buf, dtype=np.uint8)
    out = {
        name: QuantTensor(name=name, ggml_type=t, shape=shape, data=whole[data_start + begin : data_start + end])
        for name, (t, shape, begin, end) in entries.items()
    }
    return out, meta


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"cannot read {path}: {e}") from e


def _shard_files(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.exists():
        data = _read_json(index)
        wm = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise ModelFormatError(f"{index}: no valid weight_map")
        files = []
        for v in wm.values():
            p = d / v
            if Path(v).is_absolute() or ".." in Path(v).parts:
                raise ModelFormatError(f"{index}: shard path {v!r} leaves the model directory")
            if p not in files:
                files.append(p)
        for p in files:
            if not p.exists():
                raise ModelFormatError(f"{index}: shard {p.name} is missing")
        return files
    single = d / "model.safetensors"
    if single.exists():
        return [single]
    found = sorted(d.glob("*.safetensors"))
    if not found:
        raise ModelFormatError(f"{d}: no model.safetensors, index or *.safetensors file")
    return found


def _get_int(cfg: dict, key: str, default: int | None = None) -> int:
    v = cfg.get(key)
    if v is None:
        if default is None:
            raise ModelFormatError(f"config.json lacks {key!r}")
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ModelFormatError(f"config.json {key!r} = {v!r} is not a positive integer")
    return v


def _token_ids(v: Any) -> list[int]:
    if v is None:
        return []
    if isinstance(v, int) and not isinstance(v, bool):
        return [v]
    if isinstance(v, list):
        return [x for x in v if isinstance(x, int) and not isinstance(x, bool)]
    return []


def config_from_hf(cfg: dict[str, Any], present: set[str]) -> ModelConfig:
    """Build a :class:`ModelConfig` from an HF ``config.json`` dict and the canonical tensor names
    present (which decide tied embeddings, QKV biases and Q/K norms)."""
    arch = _MODEL_TYPES.get(cfg.get("model_type", ""))
    if arch is None:
        for cls in cfg.get("architectures") or []:
            arch = _ARCH_CLASSES.get(cls)
            if arch:
                break
    if arch is None:
        raise UnsupportedError(
            f"unsupported architecture (model_type {cfg.get('model_type')!r}, architectures "
            f"{cfg.get('architectures')!r}); supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    hidden = _get_int(cfg, "hidden_size")
    n_heads = _get_int(cfg, "num_attention_heads")
    n_kv = _get_int(cfg, "num_key_value_heads", n_heads)
    if n_heads % n_kv:
        raise ModelFormatError(f"num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv}")
    if cfg.get("head_dim") is None and hidden % n_heads:
        raise ModelFormatError(f"hidden_size {hidden} is not a multiple of num_attention_heads {n_heads}")
    head_dim = _get_int(cfg, "head_dim", hidden // n_heads)

    # transformers 5 keeps RoPE settings in "rope_parameters"; 4.x in rope_theta + rope_scaling.
    rope = cfg.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        rope = {}
    if "full_attention" in rope and isinstance(rope["full_attention"], dict):
        rope = rope["full_attention"]
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = rope_scaling_from_hf(cfg.get("rope_scaling") or rope)
    extra: dict[str, Any] = {"warnings": []}
    if cfg.get("partial_rotary_factor", 1.0) not in (1, 1.0):
        raise UnsupportedError(f"partial RoPE (partial_rotary_factor {cfg['partial_rotary_factor']})")
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedError(f"hidden_act {cfg['hidden_act']!r} (only silu)")
    if cfg.get("sliding_window") and (arch == "mistral" or cfg.get("use_sliding_window")):
        extra["sliding_window"] = cfg["sliding_window"]

    eos: list[int] = []
    for t in _token_ids(cfg.get("eos_token_id")):
        if t not in eos:
            eos.append(t)
    bos = _token_ids(cfg.get("bos_token_id"))
    pad = _token_ids(cfg.get("pad_token_id"))
    try:
        eps = float(cfg.get("rms_norm_eps", 1e-6))
        theta = float(theta)
    except (TypeError, ValueError) as e:
        raise ModelFormatError(f"config.json: bad rms_norm_eps or rope_theta: {e}") from e

    moe = _hf_experts(cfg, arch)
    return ModelConfig(
        architecture=arch,
        vocab_size=_get_int(cfg, "vocab_size"),
        hidden_size=hidden,
        num_layers=_get_int(cfg, "num_hidden_layers"),
        num_heads=n_heads,
        num_kv_heads=n_kv,
        head_dim=head_dim,
        intermediate_size=_get_int(cfg, "intermediate_size"),
        rope_theta=theta,
        rope_type="neox",
        rope_scaling=scaling,
        rms_norm_eps=eps,
        context_length=_get_int(cfg, "max_position_embeddings", 2048),
        tied_embeddings=names.OUTPUT not in present,
        qkv_bias=names.layer_name(0, "attn_q", "bias") in present,
        qk_norm=names.layer_name(0, "attn_q_norm") in present,
        bos_token_id=bos[0] if bos else None,
        eos_token_ids=tuple(eos),
        pad_token_id=pad[0] if pad else None,
        extra=extra,
        **moe,
    )


def _hf_experts(cfg: dict, arch: str) -> dict:
    """The mixture-of-experts fields of a ``qwen3_moe`` or ``mixtral`` config.json (none for the others):
    every layer sparse (Qwen3-MoE's ``mlp_only_layers`` / ``decoder_sparse_step`` dense layers are refused),
    the chosen probabilities renormalised per ``norm_topk_prob`` (transformers' default False) or always
    (Mixtral)."""
    if arch not in ("qwen3moe", "mixtral"):
        return {}
    n = _get_int(cfg, "num_local_experts", cfg.get("num_experts"))
    used = _get_int(cfg, "num_experts_per_tok")
    if used > n:
        raise ModelFormatError(f"config.json num_experts_per_tok {used} exceeds the {n} experts")
    if arch == "qwen3moe" and (cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1):
        raise UnsupportedError("Qwen3-MoE with dense layers among the sparse ones (mlp_only_layers, "
                               "decoder_sparse_step) is not supported")
    ffn = _get_int(cfg, "moe_intermediate_size") if arch == "qwen3moe" else _get_int(cfg, "intermediate_size")
    return {"num_experts": n, "num_experts_used": used, "expert_ffn_size": ffn,
            "expert_weights_norm": bool(cfg.get("norm_topk_prob", False)) if arch == "qwen3moe" else True}


_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_EXPERT_PARTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
                 "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def _stack_experts(hf: dict[str, QuantTensor]) -> dict[str, QuantTensor]:
    """Each layer's per-expert matrices (``experts.E.gate_proj`` ... / Mixtral's ``w1 w3 w2``) as one stacked
    tensor ``blk.N.ffn_*_exps.weight`` [experts, rows, cols] (their bytes copied together); the rest as they are."""
    parts: dict[tuple[int, str], dict[int, QuantTensor]] = {}
    rest = {}
    for name, t in hf.items():
        m = _EXPERT_RE.match(name)
        if m and m.group(3) in _EXPERT_PARTS:
            parts.setdefault((int(m.group(1)), _EXPERT_PARTS[m.group(3)]), {})[int(m.group(2))] = t
        else:
            rest[name] = t
    for (i, kind), per in parts.items():
        ts = [per.get(e) for e in range(len(per))]
        if any(t is None for t in ts) or len({(t.ggml_type, t.shape) for t in ts}) != 1:
            raise ModelFormatError(f"layer {i}: the experts' {kind} tensors are missing some or differ in type or "
                                   f"shape")
        name = names.layer_name(i, kind)
        rest[name] = QuantTensor(name=name, ggml_type=ts[0].ggml_type, shape=(len(ts), *ts[0].shape),
                                 data=np.concatenate([np.asarray(t.data).reshape(-1) for t in ts]))
    return rest


def _weight_files(d: Path, weights: Path | None) -> list[Path]:
    """The files holding the model's tensors: the directory's (index, ``model.safetensors`` or every
    ``*.safetensors``), or only ``weights`` when given (all shards if an index lists it as one)."""
    if weights is None:
        return _shard_files(d)
    if (d / "model.safetensors.index.json").exists():
        shards = _shard_files(d)
        if weights in shards:
            return shards
    return [weights]


# sentence-transformers' pooling flags (1_Pooling/config.json) -> ModelConfig.pooling
_ST_POOLING = (("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"), ("pooling_mode_cls_token", "cls"))


def pooling_from_sentence_transformers(d: Path, warnings: list[str]) -> str:
    """The embedding pooling a sentence-transformers directory names in ``1_Pooling/config.json`` (see
    :attr:`ModelConfig.pooling`); ``"last"`` without one, or (with a warning) for a mode realizar does not pool by."""
    path = d / "1_Pooling" / "config.json"
    if not path.is_file():
        return "last"
    st = _read_json(path)
    modes = [mode for key, mode in _ST_POOLING if isinstance(st, dict) and st.get(key) is True]
    if len(modes) == 1:
        return modes[0]
    warnings.append(f"{path} names no single pooling realizar supports (last token, mean or cls): embeddings pool "
                    "the last token")
    return "last"


def load_safetensors(directory: str | os.PathLike, weights: str | os.PathLike | None = None) -> LoadedModel:
    """Load an HF-layout directory as a :class:`~realizar.models.loaded.LoadedModel`; ``weights``
    (a ``.safetensors`` file in it) picks that file's tensors, and errors then name it."""
    d = Path(directory)
    wfile = Path(weights) if weights is not None else None
    where = str(wfile) if wfile is not None else str(d)
    cfg_path = d / "config.json"
    if not cfg_path.exists():
        raise ModelFormatError(f"{where}: no config.json in {d}" if wfile is not None else f"{d}: no config.json")
    cfg = _read_json(cfg_path)
    if not isinstance(cfg, dict):
        raise ModelFormatError(f"{cfg_path}: not a JSON object")
    try:
        hf: dict[str, QuantTensor] = {}
        for f in _weight_files(d, wfile):
            tensors, _ = read_safetensors_file(f)
            for k, v in tensors.items():
                if k in hf:
                    raise ModelFormatError(f"{d}: tensor {k!r} appears in more than one shard")
                hf[k] = v
        tensors: dict[str, QuantTensor] = {}
        for hf_name, t in _stack_experts(hf).items():
            canon = names.hf_to_canonical(hf_name)
            key = canon if canon is not None else hf_name
            tensors[key] = QuantTensor(name=key, ggml_type=t.ggml_type, shape=t.shape, data=t.data)
        if cfg.get("tie_word_embeddings") and names.OUTPUT in tensors:
            # transformers ignores lm_head when the embeddings are tied
            del tensors[names.OUTPUT]
        config = config_from_hf(cfg, set(tensors))
        config = dataclasses.replace(config, pooling=pooling_from_sentence_transformers(d, config.extra["warnings"]))
        source = wfile.name if wfile is not None else d.name
        names.validate_tensor_shapes(config, {k: v.shape for k, v in tensors.items()}, source=source)
    except RealizarError:
        raise
    except (ValueError, OverflowError, struct.error, IndexError, KeyError, TypeError) as e:
        raise ModelFormatError(f"{where}: malformed safetensors model: {type(e).__name__}: {e}") from e
    tok = d / "tokenizer.json"
    return LoadedModel(
        config=config,
        tensors=tensors,
        metadata=cfg,
        format="safetensors",
        path=d,
        tokenizer_json=tok if tok.exists() else None,
        chat_template=chat_template_from_hf(d),
    )
