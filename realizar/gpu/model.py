"""The GPU model: a llama-family decoder run entirely on the GPU, one CUDA graph per token.

Weights stay in their GGUF block form on the device (:class:`~realizar.gpu.decoder.DecoderWeights`);
activations, the KV cache and the sampled token never leave it. A single sequence is the batch of one
of the one GPU inference path (:class:`~realizar.gpu.batch.GpuBatchBackend`: the layer program of
:mod:`realizar.gpu.decoder` over the paged KV cache, one block table bound once). A decode step
(embedding → per layer [RMSNorm, QKV GEMV, RoPE fused with the KV append, paged decode attention, O
GEMV + residual, RMSNorm, gate/up GEMV + SwiGLU, down GEMV + residual] → final norm → LM head → argmax)
is built once into a CUDA graph; afterwards a token costs one async copy of the step values (token,
position, sequence length) and one graph launch. Greedy decoding reads back 4 bytes.

    model = GpuModel.from_loaded(load_model(path))
    token = model.forward_gpu_resident_to_token_id(token_id, position)

``kv_cache=False`` defers the single sequence's cache to first use (a serving backend sharing these
weights keeps a pool of its own). ``graph`` chooses how the decode graph is built: ``"capture"``
(default) records the step's launches by stream capture (with programmatic dependent launch edges on
sm_90 when ``pdl``); ``"manual"`` builds it node by node from the launches of one eager step
(:func:`realizar.cuda.record_graph`), for drivers or tools where stream capture is not available. Both
replay the same kernels with the same arguments in the same order. ``use_graph=False`` issues every
step eagerly. ``kv_dtype``: the cache's element type (default f32: the reference's values).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from realizar import cuda
from realizar.config import DEFAULT_MAX_CONTEXT, ServingConfig
from realizar.errors import ContextOverflowError, InvalidRequestError, ShapeError, UnsupportedError
from realizar.gpu.batch import GpuBatchBackend, token_ids
from realizar.gpu.decoder import DecoderWeights
from realizar.gpu.linear import rows_unsupported
from realizar.gpu.paged_kv import heads_unsupported
from realizar.gpu.ops import LayerOps
from realizar.models.config import ModelConfig

__all__ = ["DEFAULT_MAX_LEN", "DeviceLogits", "GRAPH_MODES", "GpuModel", "StepDecoder"]

_DEFAULTS = ServingConfig()
DEFAULT_MAX_LEN = DEFAULT_MAX_CONTEXT
GRAPH_MODES = ("capture", "manual")


class DeviceLogits:
    """The logits of the last step, still on the GPU. ``np.asarray`` copies them to the host; greedy
    sampling asks for :meth:`greedy_token` instead, which reads only the argmax computed in the graph."""

    def __init__(self, model: "GpuModel"):
        self._model = model
        self._step = model.steps

    def _check_fresh(self) -> None:
        if self._step != self._model.steps:
            raise InvalidRequestError("these logits were overwritten by a later step of the model")

    def greedy_token(self) -> int:
        self._check_fresh()
        return self._model.read_token()

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        self._check_fresh()
        host = self._model.read_logits()
        return host if dtype is None else host.astype(dtype)

    @property
    def shape(self) -> tuple[int]:
        return (self._model.config.vocab_size,)


class StepDecoder:
    """The Generator side that the single-GPU and the split model share, over a subclass's
    ``_run_step(token, position)`` (one decode step, its results left on the device) and its
    ``read_token()``: positions, the checks of a step and of a prompt (all made before any work, so a
    refused request leaves the cache as it was), decoding, and the token-by-token prefill."""

    config: ModelConfig
    max_len: int
    position: int = 0

    def _check_step(self, token: int, position: int) -> None:
        if not 0 <= token < self.config.vocab_size:
            raise InvalidRequestError(f"token id {token} outside the vocabulary of {self.config.vocab_size}")
        if position >= self.max_len:
            raise ContextOverflowError(f"position {position} is past the KV cache's max_len of {self.max_len}")

    def _check_prompt(self, ids) -> np.ndarray:
        """``ids`` as an int64 array, once they are known to fit after the cached positions and the vocabulary."""
        if isinstance(ids, Sequence) and not ids:
            raise InvalidRequestError("prefill needs at least one token")
        ids = token_ids(ids, self.config.vocab_size)
        if self.position + len(ids) > self.max_len:
            raise ContextOverflowError(
                f"{self.position} cached + {len(ids)} new tokens exceed the KV cache's max_len of {self.max_len}")
        return ids

    def _prefill_steps(self, ids) -> None:
        """The prompt token by token through the decode step."""
        for t in ids.tolist():
            self._run_step(t, self.position)
            self.position += 1

    def forward_gpu_resident_to_token_id(self, token: int, position: int) -> int:
        """Run one token at ``position`` and return the greedy next token id (4 bytes read back)."""
        self._run_step(int(token), int(position))
        return self.read_token()

    def reset(self) -> None:
        self.position = 0

    def decode(self, token: int) -> DeviceLogits:
        self._run_step(int(token), self.position)
        self.position += 1
        return DeviceLogits(self)


class GpuModel(StepDecoder):
    """Model object for :class:`realizar.generation.Generator`: ``prefill``, ``decode``, ``reset``,
    ``context_length``; plus :meth:`forward_gpu_resident_to_token_id` for greedy decoding.
    ``graph``: how the decode graph is built (see the module docstring); ``prefill_chunk``: prompt
    tokens through the layers at once (None: prompts token by token through the decode step)."""

    def __init__(self, config: ModelConfig, tensors: dict, max_len: int | None = None, device=None,
                 use_graph: bool = True, pdl: bool = True, graph: str = "capture",
                 prefill_chunk: int | None = _DEFAULTS.prefill_chunk,
                 prefill_min_batch: int = _DEFAULTS.prefill_min_batch, kv_cache: bool = True,
                 kv_dtype: str = "f32", block_size: int = _DEFAULTS.block_size):
        if graph not in GRAPH_MODES:
            raise ShapeError(f"graph must be one of {GRAPH_MODES}, got {graph!r}")
        self.config = cfg = config
        self.device = device or cuda.current_device()
        self.max_len = int(min(cfg.context_length, max_len or DEFAULT_MAX_LEN))
        if self.max_len < 1:
            raise ShapeError(f"max_len must be positive, got {self.max_len}")
        if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or int(prefill_chunk) < 1):
            raise ShapeError(f"prefill_chunk must be a positive number of tokens or None, got {prefill_chunk!r}")
        why = heads_unsupported(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        if why is not None:
            raise UnsupportedError(f"the GPU's paged KV cache cannot hold this model's attention heads: {why}")
        self.ops = ops = LayerOps(self.device)
        self.weights = DecoderWeights(cfg, tensors, ops)
        self.use_graph, self.graph_mode, self.kv_dtype, self.block_size = use_graph, graph, kv_dtype, int(block_size)
        self.pdl = pdl  # programmatic dependent launch between the graph's kernels (sm_90)
        self.prefill_chunk = None if prefill_chunk is None else int(min(prefill_chunk, self.max_len))
        self.prefill_min_batch = max(1, int(prefill_min_batch))
        self._seq = None
        self._stream = None  # the sequence's stream (None: its own)
        self.position = 0
        self.steps = 0
        if kv_cache:
            self.sequence  # noqa: B018 - allocated now, so a cache that does not fit fails here

    @classmethod
    def from_loaded(cls, loaded, max_len: int | None = None, **kw) -> "GpuModel":
        return cls(loaded.config, loaded.tensors, max_len=max_len, **kw)

    # the weights, as the layer program reads them
    layers = property(lambda self: self.weights.layers)
    embed = property(lambda self: self.weights.embed)
    lm_head = property(lambda self: self.weights.lm_head)
    output_norm = property(lambda self: self.weights.output_norm)
    inv_freq = property(lambda self: self.weights.inv_freq)

    @property
    def context_length(self) -> int:
        return self.max_len

    @property
    def sequence(self):
        """The single sequence's backend (a :class:`~realizar.gpu.batch.GpuBatchBackend` of one row, its
        table blocks 1..n bound once): allocated at construction, or on first use after
        ``kv_cache=False`` or :meth:`release_kv`."""
        if self._seq is None:
            blocks = -(-self.max_len // self.block_size)
            seq = self._backend(num_blocks=blocks + 1, block_size=self.block_size, kv_dtype=self.kv_dtype,
                                max_batch=1, max_context=self.max_len, use_graph=self.use_graph,
                                graph=self.graph_mode, prefill_chunk=self.prefill_chunk,
                                f16_weights=False, prefill_min_batch=self.prefill_min_batch, stream=self._stream)
            seq.bind_sequence(range(1, blocks + 1))
            self._seq = seq
        return self._seq

    def _backend(self, **options):
        """The backend the single sequence runs on (a subclass may run the program otherwise)."""
        return GpuBatchBackend(self, **options)

    @property
    def kv(self):
        """The single sequence's :class:`~realizar.gpu.paged_kv.PagedKVCache`."""
        return self.sequence.kv

    @property
    def batched_prefill_off(self) -> str | None:
        """Why prompts go token by token through the decode graph (None: chunks of prefill_chunk tokens)."""
        if self.prefill_chunk is None:
            return "prefill_chunk is None"
        return rows_unsupported(self.device, self.config)

    def release_kv(self) -> None:
        """Free the single sequence's cache and the graphs that read it (a serving backend sharing these
        weights keeps its own pool); the next single-sequence call makes them anew."""
        if self._seq is not None:
            self._seq.close()
            self._seq = None
        self.position = 0
        self.steps += 1  # logits of earlier steps went with the cache

    def _run_step(self, token: int, position: int) -> None:
        self.device.make_current()  # the server runs generations on a worker thread
        self._check_step(token, position)
        self.sequence.step_one(token, position)
        self.steps += 1

    # ---- Generator interface (with StepDecoder's) -------------------------------------------------------
    def prefill(self, ids) -> DeviceLogits:
        ids = self._check_prompt(ids)
        if self.batched_prefill_off is not None or len(ids) < self.prefill_min_batch:
            self._prefill_steps(ids)
        else:
            self.device.make_current()
            self.sequence.prefill(ids, self.position, None)
            self.position += len(ids)
            self.steps += 1
        return DeviceLogits(self)

    def read_token(self) -> int:
        self.device.make_current()
        return int(self.sequence.read_tokens(1)[0])

    def read_logits(self) -> np.ndarray:
        return self.sequence.read_logits(0)
