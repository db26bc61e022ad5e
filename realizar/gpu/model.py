"""The GPU model: a llama-family decoder run entirely on the GPU, one CUDA graph per token.

Weights stay in their GGUF block form on the device; activations, the KV cache and the sampled token
never leave it. A decode step (embedding → per layer [RMSNorm, QKV GEMV, RoPE fused with the KV
append, flash decoding, O GEMV + residual, RMSNorm, gate/up GEMV + SwiGLU, down GEMV + residual] →
final norm → LM head → argmax) is built once into a CUDA graph; afterwards a token costs one async copy
of the step values (token, position, sequence length) and one graph launch. Greedy decoding reads
back 4 bytes.

    model = GpuModel.from_loaded(load_model(path))
    token = model.forward_gpu_resident_to_token_id(token_id, position)

``kv_cache=False`` defers the single-sequence KV cache to first use (:class:`realizar.gpu.batch.GpuBatchBackend`
shares the weights with a paged cache of its own). ``graph`` chooses how the decode graph is built: ``"capture"`` (default) records the step's launches
by stream capture (with programmatic dependent launch edges on sm_90 when ``pdl``); ``"manual"``
builds it node by node from the launches of one eager step (:func:`realizar.cuda.record_graph`),
for drivers or tools where stream capture is not available. Both replay the same kernels with the
same arguments in the same order. ``use_graph=False`` issues every step eagerly.
"""

from __future__ import annotations

import numpy as np

from realizar import cuda
from realizar.errors import ContextOverflowError, InvalidRequestError, ShapeError
from realizar.gpu.kv_cache import KVCache
from realizar.gpu.ops import LayerOps
from realizar.gpu.prefill import PREFILL_CHUNK, PREFILL_MIN_BATCH, BatchedPrefill, batched_prefill_unsupported
from realizar.gpu.weights import GpuWeight
from realizar.models.config import ModelConfig
from realizar.models.rope import rope_inv_freq

__all__ = ["DEFAULT_MAX_LEN", "DeviceLogits", "GRAPH_MODES", "GpuModel"]

DEFAULT_MAX_LEN = 8192
GRAPH_MODES = ("capture", "manual")


def _f32_buffer(ops: LayerOps, tensor) -> cuda.GpuBuffer:
    return ops.to_device(np.ascontiguousarray(tensor.dequantize(), np.float32).reshape(-1))


class _Layer:
    """One transformer block's weights on the device, each laid out for the GEMV that reads it
    (:meth:`LayerOps.upload`: tile-major where the tensor-core GEMV runs)."""

    def __init__(self, tensors: dict, i: int, cfg: ModelConfig, ops: LayerOps):
        t = lambda name: tensors[f"blk.{i}.{name}"]  # noqa: E731
        self.attn_norm = _f32_buffer(ops, t("attn_norm.weight"))
        self.ffn_norm = _f32_buffer(ops, t("ffn_norm.weight"))
        q, k, v = t("attn_q.weight"), t("attn_k.weight"), t("attn_v.weight")
        if q.ggml_type == k.ggml_type == v.ggml_type:
            self.qkv = [ops.upload([q, k, v], name=f"blk.{i}.attn_qkv")]
        else:
            self.qkv = [ops.upload(q), ops.upload(k), ops.upload(v)]
        self.qkv_bias = None
        if cfg.qkv_bias:
            bias = np.concatenate([t(f"attn_{n}.bias").dequantize().reshape(-1) for n in "qkv"]).astype(np.float32)
            self.qkv_bias = ops.to_device(bias)
        self.q_norm = _f32_buffer(ops, t("attn_q_norm.weight")) if cfg.qk_norm else None
        self.k_norm = _f32_buffer(ops, t("attn_k_norm.weight")) if cfg.qk_norm else None
        self.attn_out = ops.upload(t("attn_output.weight"))
        gate, up = t("ffn_gate.weight"), t("ffn_up.weight")
        fused = gate.ggml_type == up.ggml_type
        self.gate_up = ops.upload([gate, up], glu=True, name=f"blk.{i}.ffn_gate_up") if fused else None
        self.gate = None if self.gate_up else ops.upload(gate)
        self.up = None if self.gate_up else ops.upload(up)
        self.down = ops.upload(t("ffn_down.weight"))


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

    def _check_prompt(self, ids) -> list[int]:
        """``ids`` as ints, once they are known to fit after the cached positions and the vocabulary."""
        ids = [int(t) for t in ids]
        if not ids:
            raise InvalidRequestError("prefill needs at least one token")
        if self.position + len(ids) > self.max_len:
            raise ContextOverflowError(
                f"{self.position} cached + {len(ids)} new tokens exceed the KV cache's max_len of {self.max_len}")
        bad = next((t for t in ids if not 0 <= t < self.config.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} outside the vocabulary of {self.config.vocab_size}")
        return ids

    def _prefill_steps(self, ids: list[int]) -> None:
        """The prompt token by token through the decode step."""
        for t in ids:
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
    ``graph``: how the decode graph is built (see the module docstring)."""

    def __init__(self, config: ModelConfig, tensors: dict, max_len: int | None = None, device=None,
                 use_graph: bool = True, pdl: bool = True, graph: str = "capture",
                 prefill_chunk: int | None = PREFILL_CHUNK, prefill_min_batch: int = PREFILL_MIN_BATCH,
                 kv_cache: bool = True):
        if graph not in GRAPH_MODES:
            raise ShapeError(f"graph must be one of {GRAPH_MODES}, got {graph!r}")
        self.config = cfg = config
        self.device = device or cuda.current_device()
        self.max_len = int(min(cfg.context_length, max_len or DEFAULT_MAX_LEN))
        if self.max_len < 1:
            raise ShapeError(f"max_len must be positive, got {self.max_len}")
        self.ops = ops = LayerOps(self.device)
        self._kv: KVCache | None = None
        if kv_cache:
            self.kv  # noqa: B018 - allocated now, so a cache that does not fit fails here
        self.layers = [_Layer(tensors, i, cfg, ops) for i in range(cfg.num_layers)]
        self.embed = GpuWeight(tensors["token_embd.weight"], device=self.device)  # GGUF rows: the embedding reads them
        # (tied: the LM head's GEMV reads the embedding's rows)
        self.lm_head = self.embed if cfg.tied_embeddings or "output.weight" not in tensors else ops.upload(
            tensors["output.weight"])
        self.output_norm = _f32_buffer(ops, tensors["output_norm.weight"])
        ff = tensors.get("rope_freqs.weight")
        freqs = rope_inv_freq(cfg, None if ff is None else ff.dequantize())
        self.inv_freq = ops.to_device(np.asarray(freqs, np.float32))
        # activations
        qkv_n = cfg.q_dim + 2 * cfg.kv_dim
        self.x = ops.buffer(cfg.hidden_size)
        self.h = ops.buffer(cfg.hidden_size)
        self.qkv = ops.buffer(qkv_n)
        self.attn = ops.buffer(cfg.q_dim)
        self.ffn = ops.buffer(cfg.intermediate_size)
        self.ffn_up = None if all(lay.gate_up for lay in self.layers) else ops.buffer(cfg.intermediate_size)
        self.logits = ops.buffer(cfg.vocab_size)
        self.token_out = ops.buffer(1, np.uint32)
        self.step_values = cuda.StepValues(("token", "pos", "seq_len"), device=self.device)
        self.stream = cuda.Stream(self.device)
        self.use_graph = use_graph
        self.graph_mode = graph
        self.pdl = pdl  # programmatic dependent launch between the graph's kernels (sm_90)
        self._graph: cuda.GraphExec | None = None
        self._token_host = cuda.PinnedArray(1, np.uint32, device=self.device)
        self.position = 0
        self.steps = 0
        if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or int(prefill_chunk) < 1):
            raise ShapeError(f"prefill_chunk must be a positive number of tokens or None, got {prefill_chunk!r}")
        self.prefill_chunk = None if prefill_chunk is None else int(min(prefill_chunk, self.max_len))
        self.prefill_min_batch = max(1, int(prefill_min_batch))
        #: why prompts go token by token through the decode graph (None: chunks of prefill_chunk tokens)
        self.batched_prefill_off = "prefill_chunk is None" if prefill_chunk is None else batched_prefill_unsupported(self)
        self._prefill: BatchedPrefill | None = None

    @classmethod
    def from_loaded(cls, loaded, max_len: int | None = None, **kw) -> "GpuModel":
        return cls(loaded.config, loaded.tensors, max_len=max_len, **kw)

    @property
    def context_length(self) -> int:
        return self.max_len

    @property
    def kv(self) -> KVCache:
        """The single sequence's KV cache (``max_len`` positions f32): allocated at construction, or
        on first use after ``kv_cache=False`` or :meth:`release_kv`."""
        if self._kv is None:
            cfg = self.config
            self._kv = KVCache(cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.max_len,
                               ops=self.ops)
        return self._kv

    def release_kv(self) -> None:
        """Free the single-sequence KV cache and the decode graph that reads it (a serving backend
        sharing these weights keeps its own paged cache); the next single-sequence call makes them anew."""
        if self._graph is not None:
            self._graph.close()
            self._graph = None
        if self._prefill is not None:
            self._prefill.free()
            self._prefill = None
        if self._kv is not None:
            self._kv.close()
            self._kv = None
        self.position = 0

    # ---- one decode step, as launches (recorded into the graph once) --------------------------------
    def _step_value(self, name: str):
        return (self.step_values.device, self.step_values.index(name))

    def _issue_step(self) -> None:
        for _ in self._step_phases():
            pass

    def _step_phases(self):
        """Issue one decode step's launches, pausing (``yield``) after each layer's O projection and after
        its down projection: the points where a tensor-parallel rank's hidden state is summed over the
        ranks (:mod:`realizar.parallel.gpu` issues that all-reduce while the generator is paused). Alone,
        :meth:`_issue_step` runs it through: the same launches in the same order."""
        cfg, ops, kv, s = self.config, self.ops, self.kv, self.stream
        eps = cfg.rms_norm_eps
        q_dim, kv_dim, hd = cfg.q_dim, cfg.kv_dim, cfg.head_dim
        ops.embedding(self.embed, self._step_value("token"), self.x, stream=s)
        for i, lay in enumerate(self.layers):
            ops.rmsnorm(self.x, lay.attn_norm, self.h, eps, stream=s)
            if len(lay.qkv) == 1:
                ops.gemv(lay.qkv[0], self.h, self.qkv, bias=lay.qkv_bias, stream=s)
            else:
                for w, off in zip(lay.qkv, (0, q_dim, q_dim + kv_dim)):
                    bias = None if lay.qkv_bias is None else (lay.qkv_bias, off)
                    ops.gemv(w, self.h, (self.qkv, off), bias=bias, stream=s)
            if cfg.qk_norm:  # per-head RMSNorm of Q and K, in place
                ops.rmsnorm((self.qkv, 0), lay.q_norm, (self.qkv, 0), eps, hidden=hd, rows=cfg.num_heads, stream=s)
                ops.rmsnorm((self.qkv, q_dim), lay.k_norm, (self.qkv, q_dim), eps, hidden=hd, rows=cfg.num_kv_heads,
                            stream=s)
            kv.rope_append(i, self.qkv, self.inv_freq, self._step_value("pos"), neox=cfg.rope_type == "neox",
                           stream=s)
            kv.flash_decoding(i, (self.qkv, 0), self.attn, self._step_value("seq_len"), stream=s)
            self._add_projection(lay.attn_out, self.attn, s)
            yield
            ops.rmsnorm(self.x, lay.ffn_norm, self.h, eps, stream=s)
            if lay.gate_up is not None:
                ops.gemv_glu(lay.gate_up, self.h, self.ffn, stream=s)
            else:
                ops.gemv(lay.gate, self.h, self.ffn, stream=s)
                ops.gemv(lay.up, self.h, self.ffn_up, stream=s)
                ops.swiglu(self.ffn, self.ffn_up, self.ffn, cfg.intermediate_size, stream=s)
            self._add_projection(lay.down, self.ffn, s)
            yield
        self._issue_head(s)

    def _add_projection(self, w: GpuWeight, inp: cuda.GpuBuffer, s: cuda.Stream) -> None:
        """x += W · inp (the O and down projections, residual added in the GEMV)."""
        self.ops.gemv(w, inp, self.x, residual=self.x, stream=s)

    def _issue_head(self, s: cuda.Stream) -> None:
        """Final norm, LM head into ``logits``, greedy token into ``token_out``."""
        ops = self.ops
        ops.rmsnorm(self.x, self.output_norm, self.h, self.config.rms_norm_eps, stream=s)
        ops.gemv(self.lm_head, self.h, self.logits, stream=s)
        ops.argmax(self.logits, self.token_out, stream=s)

    def _build_graph(self) -> cuda.GraphExec:
        """Run this step eagerly and build the decode graph from it (by capture or node by node)."""
        with cuda.programmatic_dependent_launch(self.pdl):
            if self.graph_mode == "manual":
                with cuda.record_graph() as rec:  # runs the step while recording its launches
                    self._issue_step()
                return rec.graph.instantiate()
            self._issue_step()  # eager: loads every kernel, so the capture below loads none
            with cuda.capture(self.stream) as cap:
                self._issue_step()
            return cap.graph.instantiate()

    def _run_step(self, token: int, position: int) -> None:
        self.device.make_current()  # the server runs generations on a worker thread
        self._check_step(token, position)
        self.step_values.set(token=token, pos=position, seq_len=position + 1)
        if self._graph is not None:
            self._graph.replay(self.stream, self.step_values)
        else:
            self.step_values.upload(self.stream)
            if self.use_graph:
                self._graph = self._build_graph()
            else:
                with cuda.programmatic_dependent_launch(self.pdl):
                    self._issue_step()
        self.steps += 1

    # ---- Generator interface (with StepDecoder's) -------------------------------------------------------
    def prefill(self, ids) -> DeviceLogits:
        ids = self._check_prompt(ids)
        if self.batched_prefill_off is None and len(ids) >= self.prefill_min_batch:
            self._prefill_batched(ids)
        else:
            self._prefill_steps(ids)
        return DeviceLogits(self)

    def _prefill_batched(self, ids: list[int]) -> None:
        """The prompt (checked) in chunks of ``prefill_chunk`` tokens through every layer at once
        (:mod:`realizar.gpu.prefill`); the logits and greedy token end up where a decode step leaves them."""
        self.device.make_current()
        if self._prefill is None:
            self._prefill = BatchedPrefill(self, self.prefill_chunk)
        c = self.prefill_chunk
        for start in range(0, len(ids), c):
            part = ids[start:start + c]
            self._prefill.run_chunk(part, self.position, last=start + c >= len(ids))
            self.position += len(part)
        self.steps += 1

    def read_token(self) -> int:
        self.device.make_current()
        arr = self._token_host.array
        self.token_out.copy_to_host(arr, stream=self.stream)
        self.stream.synchronize()
        return int(arr[0])

    def read_logits(self) -> np.ndarray:
        self.device.make_current()
        out = np.empty(self.config.vocab_size, np.float32)
        self.stream.synchronize()
        return self.logits.copy_to_host(out)
