"""ModelConfig: the architecture-independent description of a decoder-only transformer."""

from __future__ import annotations

from dataclasses import dataclass, field

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass(frozen=True)
class RopeScaling:
    """How a checkpoint stretches RoPE beyond its training context, in one form for both formats.

    ``kind`` is ``"linear"`` (every frequency divided by ``factor``), ``"llama3"`` (Llama 3.1's
    wavelength-dependent blend, using ``low_freq_factor``, ``high_freq_factor`` and
    ``original_context``) or the file's name for a kind realizar does not implement (``"yarn"``, ...),
    which :func:`realizar.models.rope.rope_inv_freq` rejects. HF ``config.json`` spells
    ``original_context`` as ``original_max_position_embeddings``, GGUF metadata as
    ``rope.scaling.original_context_length``.
    """

    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and hyper-parameters of a llama-family model.

    ``rope_type`` is ``"normal"`` for interleaved pairs (x[2i], x[2i+1]) — what llama.cpp uses for
    llama/mistral GGUF files, whose Q/K weights were permuted by the converter — and ``"neox"`` for
    the half-split form (x[i], x[i + d/2]) used by HF checkpoints and by qwen2/qwen3 GGUF files.
    ``rope_scaling`` is ``None`` for plain RoPE; GGUF llama-3 files instead carry per-dimension
    factors in the ``rope_freqs.weight`` tensor (named by ``extra["rope_freqs"]``).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rope_type: str = "neox"
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    context_length: int = 2048
    tied_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads
