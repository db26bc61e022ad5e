"""GGUF reading: a bounds-checked parser of the header, metadata → ModelConfig, tensors → QuantTensor.

The header (magic, version, counts, key/value metadata, tensor infos) is parsed here with every
length and count checked against the bytes that remain in the file *before* anything is read or
allocated, so a malformed or hostile file gives a :class:`ModelFormatError` (or
:class:`UnsupportedError`) naming the problem — never an exception from deep inside a library, a
hang, or a huge allocation. Tensor data are not copied: each :class:`QuantTensor` holds a read-only
uint8 view of one memory map of the file.

``gguf.GGUFReader`` is not used on the load path: it builds a NumPy object per token string (slow
on large vocabularies) and raises arbitrary exceptions on garbage. ``tests/test_gguf_loader.py``
checks that this parser agrees with it on every key and tensor.

File layout (GGUF v2/v3, little-endian)::

    magic "GGUF" | version u32 | n_tensors u64 | n_kv u64
    n_kv × (key: string, value_type u32, value)
    n_tensors × (name: string, n_dims u32, ne[n_dims] u64, ggml_type u32, offset u64)
    padding to `general.alignment` (default 32) | tensor data (offsets relative to here)

    string = len u64 + UTF-8 bytes;  array = elem_type u32 + count u64 + elements
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from realizar.errors import ModelFormatError, RealizarError, UnsupportedError
from realizar.models import names
from realizar.models.chat_template import chat_template_from_gguf
from realizar.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from realizar.models.loaded import LoadedModel
from realizar.models.quants import SUPPORTED_TYPES, type_name
from realizar.models.rope import rope_scaling_from_gguf
from realizar.models.tensor import QuantTensor

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_NESTING = 4
MAX_KEY_LEN = 1 << 16

# GGUF metadata value types → (struct format, size). STRING = 8, ARRAY = 9.
_SCALAR_TYPES: dict[int, tuple[str, int]] = {
    0: ("<B", 1),  # UINT8
    1: ("<b", 1),  # INT8
    2: ("<H", 2),  # UINT16
    3: ("<h", 2),  # INT16
    4: ("<I", 4),  # UINT32
    5: ("<i", 4),  # INT32
    6: ("<f", 4),  # FLOAT32
    7: ("<B", 1),  # BOOL
    10: ("<Q", 8),  # UINT64
    11: ("<q", 8),  # INT64
    12: ("<d", 8),  # FLOAT64
}
_NUMPY_TYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
                10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY, _BOOL = 8, 9, 7

# RoPE flavour of each architecture's GGUF (llama.cpp's LLAMA_ROPE_TYPE_NORM vs _NEOX).
ROPE_TYPE_BY_ARCH = {"llama": "normal", "mistral": "normal", "qwen2": "neox", "qwen3": "neox", "qwen3moe": "neox"}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor-info record: ``shape`` in NumPy order (GGUF's ``ne`` reversed), ``offset`` absolute
    in the file, ``nbytes`` the size of its data (``None`` for a type whose size is unknown)."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int | None


@dataclass
class GGUFFile:
    """The parsed structure of a GGUF file: metadata values and tensor infos, plus the file's bytes
    as a read-only uint8 array backed by a memory map."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensor_infos: dict[str, TensorInfo]
    alignment: int
    data_offset: int
    buffer: np.ndarray = field(repr=False)

    def tensor(self, name: str) -> QuantTensor:
        info = self.tensor_infos[name]
        if info.ggml_type not in SUPPORTED_TYPES:
            raise UnsupportedError(
                f"{self.path.name}: tensor {name!r} has unsupported type {type_name(info.ggml_type)}"
            )
        data = self.buffer[info.offset : info.offset + info.nbytes]
        return QuantTensor(name=name, ggml_type=int(info.ggml_type), shape=info.shape, data=data)


class _Reader:
    """Sequential little-endian reads with every size checked against the end of the file."""

    def __init__(self, buf: mmap.mmap | bytes, size: int, what: str):
        self.buf, self.size, self.pos, self.what = buf, size, 0, what

    def fail(self, msg: str) -> ModelFormatError:
        return ModelFormatError(f"{self.what}: {msg} (at byte {self.pos} of {self.size})")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"file truncated: {what} needs {n} bytes, {self.size - self.pos} remain")

    def remaining(self) -> int:
        return self.size - self.pos

    def unpack(self, fmt: str, size: int, what: str):
        self.need(size, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v

    def u32(self, what: str) -> int:
        return self.unpack("<I", 4, what)

    def u64(self, what: str) -> int:
        return self.unpack("<Q", 8, what)

    def raw_string(self, what: str, max_len: int | None = None) -> bytes:
        n = self.u64(f"length of {what}")
        if max_len is not None and n > max_len:
            raise self.fail(f"{what} is {n} bytes long (limit {max_len})")
        self.need(n, what)
        b = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return b

    def string(self, what: str, max_len: int | None = None, strict: bool = False) -> str:
        b = self.raw_string(what, max_len)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            if strict:
                raise self.fail(f"{what} is not valid UTF-8") from None
            return b.decode("utf-8", errors="replace")

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        if vtype in _SCALAR_TYPES:
            fmt, size = _SCALAR_TYPES[vtype]
            v = self.unpack(fmt, size, what)
            return bool(v) if vtype == _BOOL else v
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            if depth >= MAX_ARRAY_NESTING:
                raise self.fail(f"{what}: arrays nested deeper than {MAX_ARRAY_NESTING}")
            etype = self.u32(f"element type of {what}")
            count = self.u64(f"element count of {what}")
            if etype in _SCALAR_TYPES:
                size = _SCALAR_TYPES[etype][1]
                if count > self.remaining() // size:
                    raise self.fail(f"{what}: array of {count} elements does not fit in the file")
                arr = np.frombuffer(self.buf, dtype=_NUMPY_TYPES[etype], count=count, offset=self.pos)
                self.pos += count * size
                return [bool(x) for x in arr] if etype == _BOOL else arr.tolist()
            if etype == _STRING:
                min_size = 8
            elif etype == _ARRAY:
                min_size = 12
            else:
                raise self.fail(f"{what}: invalid array element type {etype}")
            if count > self.remaining() // min_size:
                raise self.fail(f"{what}: array of {count} elements does not fit in the file")
            return [self.value(etype, what, depth + 1) for _ in range(count)]
        raise self.fail(f"{what}: invalid metadata value type {vtype}")


def _open_buffer(path: Path) -> tuple[mmap.mmap | bytes, int]:
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            if size == 0:
                return b"", 0
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), size
    except OSError as e:
        raise ModelFormatError(f"cannot read {path}: {e}") from e


def _check_version(path: Path, version: int) -> None:
    if version in (2, 3):
        return
    if version == 1:
        raise UnsupportedError(f"{path.name}: GGUF version 1 is not supported (only 2 and 3)")
    if version in (0x02000000, 0x03000000):
        raise UnsupportedError(f"{path.name}: big-endian GGUF files are not supported")
    raise ModelFormatError(f"{path.name}: unknown GGUF version {version}")


def _read_metadata(r: _Reader, n_kv: int) -> dict[str, Any]:
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = r.string(f"key of metadata entry {i}", max_len=MAX_KEY_LEN, strict=True)
        if key in metadata:
            raise r.fail(f"duplicate metadata key {key!r}")
        vtype = r.u32(f"value type of {key!r}")
        metadata[key] = r.value(vtype, f"metadata {key!r}")
    return metadata


def _alignment(path: Path, metadata: dict[str, Any]) -> int:
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if (
        not isinstance(alignment, int)
        or isinstance(alignment, bool)
        or alignment <= 0
        or alignment & (alignment - 1)
        or alignment > 1 << 20
    ):
        raise ModelFormatError(f"{path.name}: general.alignment {alignment!r} is not a power of two")
    return alignment


def _read_tensor_records(r: _Reader, n_tensors: int) -> list[tuple[str, list[int], int, int]]:
    """``(name, ne, ggml_type, offset)`` of each tensor-info record, as stored."""
    records = []
    for i in range(n_tensors):
        name = r.string(f"name of tensor {i}", max_len=MAX_KEY_LEN, strict=True)
        n_dims = r.u32(f"dimension count of {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise r.fail(f"tensor {name!r} has {n_dims} dimensions (1..{MAX_DIMS} allowed)")
        ne = [r.u64(f"dimension {d} of {name!r}") for d in range(n_dims)]
        ggml_type = r.u32(f"type of {name!r}")
        offset = r.u64(f"offset of {name!r}")
        records.append((name, ne, ggml_type, offset))
    return records


def _tensor_info(path: Path, record: tuple[str, list[int], int, int], alignment: int,
                 data_offset: int, data_size: int) -> TensorInfo:
    """One record checked against the data section: non-empty, whole blocks, aligned, inside."""
    name, ne, ggml_type, offset = record
    if any(d == 0 for d in ne):
        raise ModelFormatError(f"{path.name}: tensor {name!r} has an empty dimension: ne={ne}")
    n_elems = 1
    for d in ne:
        n_elems *= d
    if n_elems > data_size * 8:  # no supported type uses fewer than 1 bit per value
        raise ModelFormatError(f"{path.name}: tensor {name!r} with ne={ne} cannot fit in {data_size} bytes of data")
    shape = tuple(int(d) for d in reversed(ne))
    nbytes = None
    try:
        qtype = GGMLQuantizationType(ggml_type)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        qtype = None
    if qtype is not None:
        if ne[0] % block_size:
            raise ModelFormatError(
                f"{path.name}: tensor {name!r} of type {qtype.name} has rows of {ne[0]} values, "
                f"not a multiple of the block size {block_size}"
            )
        nbytes = n_elems // block_size * type_size
    if offset % alignment:
        raise ModelFormatError(f"{path.name}: tensor {name!r} offset {offset} is not aligned to {alignment}")
    if nbytes is not None and offset + nbytes > data_size:
        raise ModelFormatError(
            f"{path.name}: file truncated: tensor {name!r} ({type_name(ggml_type)}, shape {shape}) "
            f"needs bytes {offset}..{offset + nbytes} of the data section, which has {data_size}"
        )
    return TensorInfo(name, int(ggml_type), shape, data_offset + offset, nbytes)


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse and validate the structure of the GGUF file at ``path`` (no architecture knowledge)."""
    path = Path(path)
    buf, size = _open_buffer(path)
    r = _Reader(buf, size, path.name)
    if size < 4 or bytes(buf[:4]) != GGUF_MAGIC:
        got = bytes(buf[:4]) if size else b""
        raise ModelFormatError(f"{path.name}: not a GGUF file (magic {got!r}, expected {GGUF_MAGIC!r})")
    r.pos = 4
    version = r.u32("version")
    _check_version(path, version)
    n_tensors = r.u64("tensor count")
    n_kv = r.u64("metadata key/value count")
    # A key/value takes at least 8 (key length) + 4 (type) + 1 bytes, a tensor info at least
    # 8 (name length) + 4 (n_dims) + 8 (one dim) + 4 (type) + 8 (offset).
    if n_kv > r.remaining() // 13:
        raise r.fail(f"metadata count {n_kv} cannot fit in a file of {size} bytes")
    if n_tensors > r.remaining() // 32:
        raise r.fail(f"tensor count {n_tensors} cannot fit in a file of {size} bytes")
    metadata = _read_metadata(r, n_kv)
    alignment = _alignment(path, metadata)
    records = _read_tensor_records(r, n_tensors)

    data_offset = -(-r.pos // alignment) * alignment
    if data_offset > size:
        raise ModelFormatError(f"{path.name}: file truncated before the tensor data (offset {data_offset})")
    infos: dict[str, TensorInfo] = {}
    for record in records:
        if record[0] in infos:
            raise ModelFormatError(f"{path.name}: duplicate tensor name {record[0]!r}")
        infos[record[0]] = _tensor_info(path, record, alignment, data_offset, size - data_offset)
    unsupported = [f"{i.name!r} ({type_name(i.ggml_type)})" for i in infos.values() if i.ggml_type not in SUPPORTED_TYPES]
    if unsupported:
        more = f" and {len(unsupported) - 1} more" if len(unsupported) > 1 else ""
        raise UnsupportedError(
            f"{path.name}: unsupported tensor type in {unsupported[0]}{more}; supported: "
            + ", ".join(GGMLQuantizationType(t).name for t in sorted(SUPPORTED_TYPES))
        )
    buffer = np.frombuffer(buf, dtype=np.uint8) if size else np.zeros(0, np.uint8)
    return GGUFFile(path, version, metadata, infos, alignment, data_offset, buffer)


# -------------------------------------------------------------------------------------------------
# metadata → ModelConfig


def _positive_int(md: dict, key: str, *, default: int | None = None, uniform: bool = True) -> int:
    if key not in md:
        if default is not None:
            return default
        raise ModelFormatError(f"GGUF metadata lacks the required key {key!r}")
    v = md[key]
    if isinstance(v, list) and uniform:
        if not v:
            raise ModelFormatError(f"GGUF metadata {key!r} is an empty array")
        if any(x != v[0] for x in v):
            raise UnsupportedError(f"GGUF metadata {key!r} varies per layer ({v[:8]}...), not supported")
        v = v[0]
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ModelFormatError(f"GGUF metadata {key!r} = {v!r} is not a positive integer")
    if v > 1 << 31:
        raise ModelFormatError(f"GGUF metadata {key!r} = {v} is absurdly large")
    return v


def _float(md: dict, key: str, default: float) -> float:
    v = md.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v):
        raise ModelFormatError(f"GGUF metadata {key!r} = {v!r} is not a finite number")
    return float(v)


def _token_id(md: dict, key: str, vocab: int, warnings: list[str]) -> int | None:
    v = md.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < vocab:
        warnings.append(f"ignored {key}={v!r}: not a token id below the vocabulary size {vocab}")
        return None
    return v


def _special_tokens(md: dict, vocab: int, warnings: list[str]) -> tuple[int | None, tuple[int, ...], int | None]:
    """BOS, end-of-generation ids (EOS, EOT, EOM in that order, without repeats) and padding."""
    bos = _token_id(md, "tokenizer.ggml.bos_token_id", vocab, warnings)
    eos: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        t = _token_id(md, key, vocab, warnings)
        if t is not None and t not in eos:
            eos.append(t)
    return bos, tuple(eos), _token_id(md, "tokenizer.ggml.padding_token_id", vocab, warnings)


def _head_dim(md: dict, p: str, hidden: int, n_heads: int) -> int:
    """The per-head size; keys and values must agree and RoPE must rotate all of it."""
    if p + "attention.key_length" in md:
        head_dim = _positive_int(md, p + "attention.key_length")
    else:
        if hidden % n_heads:
            raise ModelFormatError(f"hidden size {hidden} is not a multiple of the head count {n_heads}")
        head_dim = hidden // n_heads
    v_dim = _positive_int(md, p + "attention.value_length", default=head_dim)
    if v_dim != head_dim:
        raise UnsupportedError(f"value head size {v_dim} differs from key head size {head_dim}")
    rope_dims = _positive_int(md, p + "rope.dimension_count", default=head_dim)
    if rope_dims != head_dim:
        raise UnsupportedError(f"partial RoPE ({rope_dims} of {head_dim} dims) is not supported")
    if head_dim % 2:
        raise ModelFormatError(f"head_dim {head_dim} is odd; RoPE needs pairs")
    return head_dim


def config_from_gguf(md: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]]) -> ModelConfig:
    """Build the :class:`ModelConfig` of a GGUF model from its metadata and tensor shapes."""
    arch = md.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelFormatError("GGUF metadata lacks general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES or arch not in ROPE_TYPE_BY_ARCH:
        raise UnsupportedError(
            f"unsupported architecture {arch!r}; supported: {', '.join(ROPE_TYPE_BY_ARCH)} (Mixtral: 'llama' with "
            f"expert tensors)"
        )
    p = f"{arch}."
    hidden = _positive_int(md, p + "embedding_length")
    n_layers = _positive_int(md, p + "block_count")
    n_heads = _positive_int(md, p + "attention.head_count")
    n_kv = _positive_int(md, p + "attention.head_count_kv", default=n_heads)
    ffn = _positive_int(md, p + "feed_forward_length", default=0 if arch == "qwen3moe" else None)
    ctx = _positive_int(md, p + "context_length", default=2048)
    # Each layer has at least 9 tensors: a layer count beyond that is a lie (and would make the
    # shape tables below huge).
    if n_layers * 9 > len(tensor_shapes):
        raise ModelFormatError(
            f"GGUF metadata {p}block_count = {n_layers}, but the file has only "
            f"{len(tensor_shapes)} tensors"
        )
    if n_heads % n_kv:
        raise ModelFormatError(f"head count {n_heads} is not a multiple of the KV head count {n_kv}")
    head_dim = _head_dim(md, p, hidden, n_heads)

    if names.TOKEN_EMBD not in tensor_shapes:
        raise ModelFormatError(f"missing tensor {names.TOKEN_EMBD!r}")
    embd_shape = tensor_shapes[names.TOKEN_EMBD]
    if len(embd_shape) != 2 or embd_shape[1] != hidden:
        raise ModelFormatError(
            f"tensor {names.TOKEN_EMBD!r} has shape {embd_shape}, expected (vocab, {hidden})"
        )
    vocab = embd_shape[0]
    if p + "vocab_size" in md and _positive_int(md, p + "vocab_size") != vocab:
        raise ModelFormatError(
            f"{p}vocab_size = {md[p + 'vocab_size']} but {names.TOKEN_EMBD} has {vocab} rows"
        )

    warnings: list[str] = []
    bos, eos, pad = _special_tokens(md, vocab, warnings)

    extra: dict[str, Any] = {"warnings": warnings}
    if "tokenizer.ggml.add_bos_token" in md:
        extra["add_bos_token"] = bool(md["tokenizer.ggml.add_bos_token"])
    if "rope_freqs.weight" in tensor_shapes:
        extra["rope_freqs"] = "rope_freqs.weight"  # llama3-style per-dimension frequency factors
    if p + "attention.sliding_window" in md:
        extra["sliding_window"] = md[p + "attention.sliding_window"]

    moe = _experts(md, p, arch, ffn, tensor_shapes)
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=n_layers,
        num_heads=n_heads,
        num_kv_heads=n_kv,
        head_dim=head_dim,
        intermediate_size=ffn,
        rope_theta=_float(md, p + "rope.freq_base", 10000.0),
        rope_type=ROPE_TYPE_BY_ARCH[arch],
        rope_scaling=rope_scaling_from_gguf(md, arch),
        rms_norm_eps=_float(md, p + "attention.layer_norm_rms_epsilon", 1e-5),
        context_length=ctx,
        tied_embeddings=names.OUTPUT not in tensor_shapes,
        qkv_bias=names.layer_name(0, "attn_q", "bias") in tensor_shapes,
        qk_norm=names.layer_name(0, "attn_q_norm") in tensor_shapes,
        bos_token_id=bos,
        eos_token_ids=eos,
        pad_token_id=pad,
        pooling=_pooling(md, p, warnings),
        extra=extra,
        **moe,
    )


# llama.cpp's LLAMA_POOLING_TYPE: 0 none, 1 mean, 2 cls, 3 last, 4 rank
_POOLING = {1: "mean", 2: "cls", 3: "last"}


def _pooling(md: dict, p: str, warnings: list[str]) -> str:
    """The embedding pooling ``{arch}.pooling_type`` names (see :attr:`ModelConfig.pooling`): ``"last"`` when absent,
    0 (none) or a kind realizar does not pool by (with a warning)."""
    value = md.get(p + "pooling_type")
    if value is None:
        return "last"
    kind = int(value) if isinstance(value, (int, np.integer)) and not isinstance(value, bool) else None
    if kind in _POOLING or kind == 0:
        return _POOLING.get(kind, "last")
    warnings.append(f"{p}pooling_type = {value!r} is not mean (1), cls (2) or last (3): embeddings pool the last token")
    return "last"


# llama.cpp's expert gating functions (LLAMA_EXPERT_GATING_FUNC_TYPE): 1 softmax, 2 sigmoid, 3 softmax over the
# chosen experts' logits
_GATING = {1: "softmax", 2: "sigmoid", 3: "softmax of the chosen"}


def _experts(md: dict, p: str, arch: str, ffn: int, tensor_shapes: dict) -> dict:
    """The mixture-of-experts fields of the config: none for a dense model; for ``qwen3moe`` and for a
    ``llama`` file with ``ffn_*_exps`` tensors (Mixtral) the expert counts, the expert FFN length (``{arch}.
    expert_feed_forward_length``, else the dense one) and whether the chosen probabilities are renormalised
    (``{arch}.expert_weights_norm``; both architectures renormalise: Qwen3-MoE's ``norm_topk_prob`` as released,
    Mixtral's softmax over the chosen logits). Routers this reference does not compute are refused."""
    has_exps = names.layer_name(0, "ffn_gate_exps") in tensor_shapes
    if p + "expert_count" not in md and not has_exps:
        if arch == "qwen3moe":
            raise ModelFormatError("a qwen3moe GGUF needs qwen3moe.expert_count and its ffn_*_exps tensors")
        return {}
    n = _positive_int(md, p + "expert_count")
    used = _positive_int(md, p + "expert_used_count")
    if used > n:
        raise ModelFormatError(f"{p}expert_used_count = {used} exceeds {p}expert_count = {n}")
    if md.get(p + "expert_shared_count", 0):
        raise UnsupportedError(f"shared experts ({p}expert_shared_count = {md[p + 'expert_shared_count']}) are not "
                               f"supported")
    gating = md.get(p + "expert_gating_func", 1)
    if gating != 1:
        raise UnsupportedError(f"expert gating {_GATING.get(gating, gating)!r} ({p}expert_gating_func = {gating}) is "
                               f"not supported; realizar computes the softmax router")
    return {"num_experts": n, "num_experts_used": used,
            "expert_ffn_size": _positive_int(md, p + "expert_feed_forward_length", default=ffn),
            "expert_weights_norm": bool(md.get(p + "expert_weights_norm", True))}


def load_gguf(path: str | os.PathLike) -> LoadedModel:
    """Load a GGUF model: validated config, tensors (memory-mapped), metadata, chat template. ``path`` may be any
    part of a model split into several files (:mod:`realizar.models.gguf_split`): all parts are read."""
    from realizar.models.gguf_split import read_gguf_parts

    path = Path(path)
    try:
        parts = read_gguf_parts(path)
        f = parts[0]
        path = f.path
        shapes = {n: i.shape for g in parts for n, i in g.tensor_infos.items()}
        config = config_from_gguf(f.metadata, shapes)
        names.validate_tensor_shapes(config, shapes, source=path.name)
        tensors = {n: g.tensor(n) for g in parts for n in g.tensor_infos}
    except RealizarError:
        raise
    except (ValueError, OverflowError, struct.error, MemoryError, IndexError, KeyError, TypeError) as e:
        raise ModelFormatError(f"{path.name}: malformed GGUF file: {type(e).__name__}: {e}") from e
    return LoadedModel(
        config=config,
        tensors=tensors,
        metadata=f.metadata,
        format="gguf",
        path=path,
        tokenizer_json=None,
        chat_template=chat_template_from_gguf(f.metadata),
    )
