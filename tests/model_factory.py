"""Tiny random models for tests, made with NumPy only: HF (transformers-layout) checkpoints saved as
safetensors directories, with their byte-level BPE tokenizer. Their conversion to GGUF (the way
llama.cpp's ``convert_hf_to_gguf.py`` does it) lives in :mod:`tests.gguf_factory`. torch and
transformers are needed only by the oracle tests (``@pytest.mark.oracle``), which load a saved
directory back with :func:`load_hf_model` and take logits with :func:`hf_logits`.

Typical use::

    from tests.model_factory import make_hf_model, load_hf_model, hf_logits, KQUANT_DIMS

    hf_dir, tiny = make_hf_model("qwen3", tmp_path, seed=0)                # tiny dims
    hf_dir, tiny = make_hf_model("llama", tmp_path, **KQUANT_DIMS)         # rows divisible by 256
    logits = hf_logits(load_hf_model(hf_dir), ids)                         # oracle tests only

The directory is what transformers' ``save_pretrained`` writes for ``LlamaForCausalLM`` /
``MistralForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` of the same configuration:
the same ``config.json`` and ``generation_config.json`` keys and values, the same parameter names and
shapes in ``model.safetensors`` (or shards plus ``model.safetensors.index.json``), tied models
without ``lm_head.weight``. :func:`read_hf_tensors` reads such a directory back as float32 arrays.

A small byte-level BPE tokenizer (trained deterministically on an inline corpus, exactly
``vocab_size`` tokens, ids 0/1/2 = ``<|endoftext|>``/``<|im_start|>``/``<|im_end|>``) is saved as
``tokenizer.json`` in the HF directory, with a ChatML chat template in ``tokenizer_config.json``.

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
MOE_ARCHS = ("qwen3_moe", "mixtral")  # mixture-of-experts (dims: num_experts, experts_used, expert_ffn)

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
    num_experts=4,
    experts_used=2,
    expert_ffn=32,
    norm_topk_prob=True,
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
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
# The version whose save_pretrained layout config.json reproduces (keys and values, see hf_config).
TRANSFORMERS_LAYOUT = "5.24.0"


def hf_config(arch: str, *, dtype: str = "float32", **dims: Any) -> dict[str, Any]:
    """The ``config.json`` of a tiny ``arch`` model, key for key as transformers 5 writes it for
    ``LlamaConfig`` / ``MistralConfig`` / ``Qwen2Config(use_sliding_window=False)`` /
    ``Qwen3Config(use_sliding_window=False)`` with these dimensions (``rope_parameters`` rather than
    4.x's ``rope_theta``; ``head_dim`` written except for qwen2; Qwen3's head_dim defaults to
    ``2 * hidden / heads`` here so it differs from hidden / heads)."""
    if arch not in ARCHS + MOE_ARCHS:
        raise ValueError(f"unknown arch {arch!r}; one of {ARCHS + MOE_ARCHS}")
    d = _dims(**dims)
    head_dim = d["head_dim"]
    if head_dim is None:
        head_dim = (2 if arch in ("qwen3", "qwen3_moe") else 1) * d["hidden_size"] // d["num_heads"]
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
        "qwen3_moe": ("layer_types", "max_window_layers", "mlp_bias", "pretraining_tp"),
        "mixtral": ("attention_bias", "layer_types", "max_window_layers", "mlp_bias", "pretraining_tp",
                    "use_sliding_window"),
    }[arch]
    if arch == "qwen3_moe":
        cfg.update(decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=d["expert_ffn"],
                   norm_topk_prob=d["norm_topk_prob"], num_local_experts=d["num_experts"],
                   num_experts_per_tok=d["experts_used"], output_router_logits=False, router_aux_loss_coef=0.001)
    elif arch == "mixtral":
        cfg.update(intermediate_size=d["expert_ffn"], num_local_experts=d["num_experts"],
                   num_experts_per_tok=d["experts_used"], output_router_logits=False, router_aux_loss_coef=0.001,
                   router_jitter_noise=0.0)
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
            if k.startswith(("q_norm", "k_norm")) and arch not in ("qwen3", "qwen3_moe"):
                continue
            shapes[p + "self_attn." + k] = shape
        if arch in ("qwen3_moe", "mixtral"):  # (as transformers saves them: one tensor per expert and matrix)
            n_exp = cfg["num_local_experts"]
            fe = cfg.get("moe_intermediate_size") or inter
            block, (g, u, dn) = (("mlp", ("gate_proj", "up_proj", "down_proj")) if arch == "qwen3_moe"
                                 else ("block_sparse_moe", ("w1", "w3", "w2")))
            shapes[p + f"{block}.gate.weight"] = (n_exp, hidden)
            for e in range(n_exp):
                shapes[p + f"{block}.experts.{e}.{g}.weight"] = (fe, hidden)
                shapes[p + f"{block}.experts.{e}.{u}.weight"] = (fe, hidden)
                shapes[p + f"{block}.experts.{e}.{dn}.weight"] = (hidden, fe)
        else:
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
