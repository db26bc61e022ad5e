"""ModelConfig: the architecture-independent description of a decoder-only transformer."""

from __future__ import annotations

from dataclasses import dataclass, field

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "qwen3moe", "mixtral")

# how an embedding is pooled from a sequence's final-norm hidden rows (ModelConfig.pooling): the last token's row
# (decoder embedders such as Qwen3-Embedding), the mean of every row, or the first token's ("cls")
POOLING_MODES = ("last", "mean", "cls")


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

    Mixture-of-experts models (Qwen3-MoE, Mixtral) have ``num_experts`` > 0: each layer's feed-forward is a
    router (``num_experts`` logits, softmax) choosing ``num_experts_used`` experts per token, SwiGLU FFNs of
    ``expert_ffn_size`` each, summed with the chosen probabilities (renormalised to sum to 1 when
    ``expert_weights_norm``).

    ``pooling`` (one of :data:`POOLING_MODES`) is how ``/v1/embeddings`` pools a sequence's hidden rows: from a
    GGUF's ``{arch}.pooling_type`` (llama.cpp's numbers: 1 mean, 2 cls, 3 last) or a sentence-transformers
    directory's ``1_Pooling/config.json``; ``"last"`` when the file says nothing.
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
    num_experts: int = 0
    num_experts_used: int = 0
    expert_ffn_size: int = 0
    expert_weights_norm: bool = True
    pooling: str = "last"
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def parameter_counts(self) -> tuple[int, int]:
        """(all parameters, those one token's forward pass reads: the chosen experts' only)."""
        h, q, kv = self.hidden_size, self.q_dim, self.kv_dim
        attn = h * (2 * q + 2 * kv) + 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        embd = self.vocab_size * h * (1 if self.tied_embeddings else 2) + h
        if self.is_moe:
            expert = 3 * h * self.expert_ffn_size
            ffn_all, ffn_active = self.num_experts * (expert + h), self.num_experts_used * expert + self.num_experts * h
        else:
            ffn_all = ffn_active = 3 * h * self.intermediate_size
        return embd + self.num_layers * (attn + ffn_all), embd + self.num_layers * (attn + ffn_active)

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads
