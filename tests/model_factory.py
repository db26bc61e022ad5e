"""Tiny random models for tests, made with NumPy only: HF (transformers-layout) checkpoints saved as
safetensors directories, and their conversion to GGUF the way llama.cpp's ``convert_hf_to_gguf.py``
does it. torch and transformers are needed only by the oracle tests (``@pytest.mark.oracle``), which
load a saved directory back with :func:`load_hf_model` and take logits with :func:`hf_logits`.

Typical use::

    from tests.model_factory import make_hf_model, hf_to_gguf

    hf_dir, tiny = make_hf_model("qwen3", tmp_path, seed=0)                # tiny dims
    gguf_path = hf_to_gguf(hf_dir, tmp_path / "m.gguf", "Q8_0")
    hf_dir, tiny = make_hf_model("llama", tmp_path, **KQUANT_DIMS)         # rows divisible by 256
    gguf_path = hf_to_gguf(hf_dir, tmp_path / "m.gguf", "Q4_K")
    logits = hf_logits(load_hf_model(hf_dir), ids)                         # oracle tests only

The directory is what transformers' ``save_pretrained`` writes for ``LlamaForCausalLM`` /
``MistralForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` of the same configuration:
the same ``config.json`` and ``generation_config.json`` keys and values, the same parameter names and
shapes in ``model.safetensors`` (or shards plus ``model.safetensors.index.json``), tied models
without ``lm_head.weight``.

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
* A small byte-level BPE tokenizer (trained deterministically on an inline corpus, exactly
  ``vocab_size`` tokens, ids 0/1/2 = ``<|endoftext|>``/``<|im_start|>``/``<|im_end|>``) is saved as
  ``tokenizer.json`` in the HF directory and as ``tokenizer.ggml.*`` (model "gpt2") in the GGUF,
  with a ChatML chat template in both.

The weights are drawn from ``np.random.default_rng(seed)`` (std ``init_std``, norms
``1 + 0.2·N(0,1)``, biases ``0.1·N(0,1)``) so activations are far from uniform and an oracle
comparison is meaningful.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

ARCHS = ("llama", "qwen2", "qwen3", "mistral")

# Small enough for fast CPU tests. vocab_size >= 259 (3 special tokens + 256 byte tokens).
DEFAULT_DIMS: dict[str, Any] = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=None,  # None: hidden_size // num_heads
    max_position_embeddings=256,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
# Every matrix row (hidden, q_dim, intermediate) is a multiple of 256, as K-quants need.
KQUANT_DIMS: dict[str, Any] = dict(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS_ID, EOS_ID = 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. The capital of France is Paris.",
    "def main():\n    for i in range(10):\n        print(f'value {i}')\n    return 0\n",
    "Once upon a time, there was a little model that wanted to generate text.",
    "Les élèves étudient à l'école; naïve café — résumé. Grüße aus Köln! ¿Qué tal?",
    "数学 和 计算机 科学; 日本語のテキスト; 한국어 문장; emoji 🙂🚀 and symbols ±∞≠.",
    "    indented line\n\ttabbed line\n\n\nmultiple   spaces   here   ",
    "In 1999, 42 people paid $3.14 each for 7 apples and 0.5 kg of flour.",
    "<html><body><p>Hello, world!</p></body></html> {\"json\": [1, 2, 3], \"ok\": true}",
    "the and of to in is was for on that with as by it at from this be are have",
]
CORPUS = _CORPUS  # also handy as tokenizer test text


def _dims(**overrides: Any) -> dict[str, Any]:
    unknown = set(overrides) - set(DEFAULT_DIMS)
    if unknown:
        raise TypeError(f"unknown model dimensions: {sorted(unknown)}")
    d = {**DEFAULT_DIMS, **overrides}
    if d["vocab_size"] < len(SPECIAL_TOKENS) + 256:
        raise ValueError("vocab_size must be >= 259 (3 special tokens + 256 byte tokens)")
    return d


# ---------------------------------------------------------------------------------------------
# tokenizer


def make_tokenizer(vocab_size: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` of exactly ``vocab_size`` tokens (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    n = tok.get_vocab_size()
    if n < vocab_size:  # the corpus ran out of merges: pad with reserved special tokens
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(vocab_size - n)])
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    return tok


def tokenizer_tables(tok) -> tuple[list[str], list[int], list[str]]:
    """(tokens by id, GGUF token types, merges as "a b") of a tokenizer made by make_tokenizer."""
    data = json.loads(tok.to_str())
    vocab = dict(data["model"]["vocab"])
    for added in data.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    tokens = [""] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    special = {a["content"] for a in data.get("added_tokens", []) if a.get("special")}
    types = [3 if t in special else 1 for t in tokens]  # 3 = CONTROL, 1 = NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return tokens, types, merges


def _save_tokenizer(directory: Path, vocab_size: int) -> None:
    tok = make_tokenizer(vocab_size)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": SPECIAL_TOKENS[BOS_ID],
                "eos_token": SPECIAL_TOKENS[EOS_ID],
                "unk_token": SPECIAL_TOKENS[0],
                "add_bos_token": False,
                "model_max_length": 1 << 20,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=1,
        )
    )


# ---------------------------------------------------------------------------------------------
# HF models (NumPy only; transformers is needed only to load one back as an oracle)

_ARCH_CLASS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# The version whose save_pretrained layout config.json reproduces (keys and values, see hf_config).
TRANSFORMERS_LAYOUT = "5.24.0"


def hf_config(arch: str, *, dtype: str = "float32", **dims: Any) -> dict[str, Any]:
    """The ``config.json`` of a tiny ``arch`` model, key for key as transformers 5 writes it for
    ``LlamaConfig`` / ``MistralConfig`` / ``Qwen2Config(use_sliding_window=False)`` /
    ``Qwen3Config(use_sliding_window=False)`` with these dimensions (``rope_parameters`` rather than
    4.x's ``rope_theta``; ``head_dim`` written except for qwen2; Qwen3's head_dim defaults to
    ``2 * hidden / heads`` here so it differs from hidden / heads)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; one of {ARCHS}")
    d = _dims(**dims)
    head_dim = d["head_dim"]
    if head_dim is None:
        head_dim = (2 if arch == "qwen3" else 1) * d["hidden_size"] // d["num_heads"]
    cfg: dict[str, Any] = {
        "architectures": [_ARCH_CLASS[arch]],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": BOS_ID,
        "dtype": dtype,
        "eos_token_id": EOS_ID,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": d["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": d["intermediate_size"],
        "layer_types": ["full_attention"] * d["num_layers"],
        "max_position_embeddings": d["max_position_embeddings"],
        "max_window_layers": 28,
        "mlp_bias": False,
        "model_type": arch,
        "num_attention_heads": d["num_heads"],
        "num_hidden_layers": d["num_layers"],
        "num_key_value_heads": d["num_kv_heads"],
        "pad_token_id": None,
        "pretraining_tp": 1,
        "rms_norm_eps": d["rms_norm_eps"],
        "rope_parameters": {"rope_theta": float(d["rope_theta"]), "rope_type": "default"},
        "sliding_window": None,
        "tie_word_embeddings": d["tie_word_embeddings"],
        "transformers_version": TRANSFORMERS_LAYOUT,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": d["vocab_size"],
    }
    drop = {
        "llama": ("layer_types", "max_window_layers", "sliding_window", "use_sliding_window"),
        "mistral": ("attention_bias", "layer_types", "max_window_layers", "mlp_bias", "pretraining_tp",
                    "use_sliding_window"),
        "qwen2": ("attention_bias", "head_dim", "mlp_bias", "pretraining_tp"),
        "qwen3": ("mlp_bias", "pretraining_tp"),
    }[arch]
    if arch == "qwen2" and d["head_dim"] is not None:
        drop = tuple(k for k in drop if k != "head_dim")
    for k in drop:
        del cfg[k]
    return cfg


def hf_parameter_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of the ``*ForCausalLM`` model of ``cfg``, in the order of
    ``model.named_parameters()`` (qwen2: q/k/v biases; qwen3: q_norm/k_norm; tied: no lm_head)."""
    arch = cfg["model_type"]
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // n_head
    q_dim, kv_dim = n_head * head_dim, n_kv * head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg["vocab_size"], hidden)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        attn = {
            "q_proj.weight": (q_dim, hidden),
            "q_proj.bias": (q_dim,),
            "k_proj.weight": (kv_dim, hidden),
            "k_proj.bias": (kv_dim,),
            "v_proj.weight": (kv_dim, hidden),
            "v_proj.bias": (kv_dim,),
            "o_proj.weight": (hidden, q_dim),
            "q_norm.weight": (head_dim,),
            "k_norm.weight": (head_dim,),
        }
        for k, shape in attn.items():
            if k.endswith(".bias") and arch != "qwen2":
                continue
            if k.startswith(("q_norm", "k_norm")) and arch != "qwen3":
                continue
            shapes[p + "self_attn." + k] = shape
        shapes[p + "mlp.gate_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (cfg["vocab_size"], hidden)
    return shapes


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 → bfloat16 bit patterns (uint16), round to nearest even (NaN stays a quiet NaN)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.where(nan, (u >> np.uint32(16)) | np.uint32(0x40), rounded).astype(np.uint16)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def round_to_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values of ``x`` stored as ``dtype`` ("float32", "float16", "bfloat16")."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == "float32":
        return x
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        return bf16_to_f32(bf16_bits(x))
    raise ValueError(f"unknown dtype {dtype!r}; float32, float16 or bfloat16")


_ST_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def save_safetensors(tensors: dict[str, np.ndarray], path: str | Path, dtype: str = "float32") -> None:
    """float32 ``tensors`` written as a ``dtype`` safetensors file (metadata ``format: pt`` as
    transformers writes it): f32/f16 by ``safetensors.numpy``, bf16 (which NumPy lacks) as raw bits
    through the package's framework-free ``serialize_file``."""
    import safetensors

    meta = {"format": "pt"}
    if dtype != "bfloat16":
        from safetensors.numpy import save_file

        np_dtype = np.float16 if dtype == "float16" else np.float32
        save_file({k: np.ascontiguousarray(v, dtype=np_dtype) for k, v in tensors.items()}, str(path), meta)
        return
    bits = {k: bf16_bits(v) for k, v in tensors.items()}
    if hasattr(safetensors, "TensorSpec"):  # safetensors >= 0.8
        specs = {
            k: safetensors.TensorSpec(dtype="bfloat16", shape=list(b.shape), data_ptr=b.ctypes.data, data_len=b.nbytes)
            for k, b in bits.items()
        }
    else:
        specs = {k: {"dtype": "bfloat16", "shape": list(b.shape), "data": b.tobytes()} for k, b in bits.items()}
    safetensors.serialize_file(specs, str(path), meta)
    del bits  # the specs point into these buffers until here


def _shard_bytes(size: str | int) -> int:
    """transformers' ``convert_file_size_to_int``: "40KB" = 40 000, "1KiB" = 1024, ints as is."""
    if isinstance(size, int):
        return size
    units = {"GIB": 2**30, "MIB": 2**20, "KIB": 2**10, "GB": 10**9, "MB": 10**6, "KB": 10**3}
    s = size.upper()
    for unit, mult in units.items():
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * mult)
    return int(s)


def _save_weights(out: Path, tensors: dict[str, np.ndarray], dtype: str, max_shard_size: str | int | None) -> None:
    """``model.safetensors``, or shards ``model-0000i-of-0000n.safetensors`` filled greedily in
    parameter order up to ``max_shard_size`` bytes plus ``model.safetensors.index.json``."""
    if max_shard_size is None:
        save_safetensors(tensors, out / "model.safetensors", dtype)
        return
    limit = _shard_bytes(max_shard_size)
    item = 4 if dtype == "float32" else 2
    shards: list[dict[str, np.ndarray]] = [{}]
    used = 0
    for k, v in tensors.items():
        nbytes = v.size * item
        if shards[-1] and used + nbytes > limit:
            shards.append({})
            used = 0
        shards[-1][k] = v
        used += nbytes
    n = len(shards)
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{n:05d}.safetensors"
        save_safetensors(shard, out / fname, dtype)
        weight_map.update({k: fname for k in shard})
    index = {
        "metadata": {
            "total_parameters": int(sum(v.size for v in tensors.values())),
            "total_size": int(sum(v.size for v in tensors.values()) * item),
        },
        "weight_map": dict(sorted(weight_map.items())),
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


@dataclass
class TinyModel:
    """What :func:`make_hf_model` saved: ``config`` (config.json as attributes, so ``config.hidden_size``
    works as on a transformers config), ``config_dict`` and ``tensors`` (HF name -> float32 array,
    rounded to the saved dtype; tied models have no ``lm_head.weight``, as in the file)."""

    directory: Path
    config_dict: dict[str, Any]
    tensors: dict[str, np.ndarray]
    dtype: str

    @property
    def config(self) -> SimpleNamespace:
        return SimpleNamespace(**self.config_dict)


def make_hf_model(
    arch: str,
    tmp_path: str | Path,
    seed: int = 0,
    *,
    dtype: str = "float32",
    init_std: float = 0.1,
    max_shard_size: str | int | None = None,
    name: str | None = None,
    **dims: Any,
) -> tuple[Path, TinyModel]:
    """Build a random tiny ``arch`` model (``dims`` override :data:`DEFAULT_DIMS`) with NumPy, save it
    with its tokenizer as a transformers-layout safetensors directory ``tmp_path / name`` in ``dtype``
    ("float32", "float16", "bfloat16"), optionally sharded, and return ``(directory, TinyModel)``.

    Weights, drawn in parameter order from ``np.random.default_rng(seed)``: norms
    ``1 + 0.2·N(0,1)``, biases ``0.1·N(0,1)``, the rest ``init_std·N(0,1)``. For logits from
    transformers, load the directory with :func:`load_hf_model` (oracle tests only)."""
    if dtype not in _ST_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; one of {tuple(_ST_DTYPES)}")
    cfg = hf_config(arch, dtype=dtype, **dims)
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for pname, shape in hf_parameter_shapes(cfg).items():
        z = rng.standard_normal(shape, dtype=np.float32)
        if pname.endswith("norm.weight"):
            x = 1.0 + 0.2 * z
        elif pname.endswith(".bias"):
            x = 0.1 * z
        else:
            x = init_std * z
        tensors[pname] = round_to_dtype(x.astype(np.float32), dtype)
    out = Path(tmp_path) / (name or f"{arch}-{dtype}-s{seed}")
    out.mkdir(parents=True, exist_ok=True)
    _save_weights(out, tensors, dtype, max_shard_size)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    generation = {
        "_from_model_config": True,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "output_attentions": False,
        "output_hidden_states": False,
        "transformers_version": TRANSFORMERS_LAYOUT,
        "use_cache": True,
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    _save_tokenizer(out, cfg["vocab_size"])
    return out, TinyModel(out, cfg, tensors, dtype)


def load_hf_model(hf_dir: str | Path | TinyModel, **kwargs: Any):
    """The transformers model of a directory made by :func:`make_hf_model` (or of ``gguf_file=`` in
    a directory), float32, eval mode: the independent oracle. Skips the calling test when torch or
    transformers is missing (such tests carry ``@pytest.mark.oracle``)."""
    import pytest

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.disable_progress_bar()
    d = hf_dir.directory if isinstance(hf_dir, TinyModel) else hf_dir
    return transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32, **kwargs).eval()


def hf_logits(model, token_ids) -> np.ndarray:
    """float32 logits (seq, vocab) of a transformers model (see :func:`load_hf_model`) on one
    sequence of token ids."""
    import pytest

    torch = pytest.importorskip("torch")
    with torch.no_grad():
        ids = torch.tensor([list(token_ids)], dtype=torch.long)
        return model(ids).logits[0].float().numpy()


# ---------------------------------------------------------------------------------------------
# HF → GGUF


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


def gguf_tensor_name(hf_name: str) -> str:
    if hf_name in _HF_TO_GGUF_GLOBAL:
        return _HF_TO_GGUF_GLOBAL[hf_name]
    parts = hf_name.split(".", 3)  # model, layers, N, rest
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _HF_TO_GGUF_LAYER:
        return f"blk.{int(parts[2])}.{_HF_TO_GGUF_LAYER[parts[3]]}"
    raise KeyError(f"no GGUF name for HF tensor {hf_name!r}")


def read_hf_tensors(hf_dir: str | Path) -> dict[str, np.ndarray]:
    """All tensors of an HF safetensors directory (single file or sharded) as float32 arrays, read
    with the safetensors package's framework-free ``deserialize`` (bf16 widened in NumPy)."""
    import safetensors

    d = Path(hf_dir)
    index = d / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    kinds = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}
    out = {}
    for f in files:
        for k, info in safetensors.deserialize((d / f).read_bytes()):
            raw = np.frombuffer(bytes(info["data"]), dtype=kinds[info["dtype"]]).reshape(info["shape"])
            out[k] = bf16_to_f32(raw) if info["dtype"] == "BF16" else raw.astype(np.float32)
    return out


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
    return quantize(x, "F32" if x.ndim == 1 else qtype)


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
        gguf_arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[model_type]
    permute = model_type in ("llama", "mistral")
    n_head = cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads") or n_head
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // n_head
    rope = cfg.get("rope_parameters") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))

    tensors = read_hf_tensors(hf_dir)
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
) -> Path:
    """Copy a GGUF file with edits (for malformed-input tests): another ``general.architecture``,
    tensors dropped or replaced by ``(array, raw_dtype)`` (raw_dtype None for plain float arrays),
    metadata keys dropped or set (a value, or ``(value, GGUFValueType[, sub_type])``). Reads the source
    with ``gguf.GGUFReader`` so value types are preserved."""
    import gguf

    r = gguf.GGUFReader(str(src))
    src_arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch=src_arch if arch is None else arch)
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
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(dst)


def shared_tiny_gguf(tmp_path_factory) -> Path:
    """One tiny random llama Q8_0 GGUF per test session, shared by the CLI and server tests."""
    directory = tmp_path_factory.getbasetemp() / "realizar-tiny-llama"
    found = sorted(directory.glob("*.gguf")) if directory.exists() else []
    if found:
        return found[0]
    directory.mkdir(parents=True, exist_ok=True)
    path, _, _ = make_gguf_model("llama", directory, qtype="Q8_0", seed=0)
    return path
