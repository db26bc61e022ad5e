"""The decoder's layer program on the GPU, written once: the ops of a transformer layer and of the head.

Every GPU path runs it: a single sequence's decode step and the batched decode step (rows of a step),
a prefill chunk (rows of one prompt), a tensor-parallel rank (its shard, pausing where the hidden
state is summed over the ranks). It says *what* a layer computes; two seams say *how*:

* a :class:`~realizar.gpu.linear.Linear` picks the kernel by row count (the decode GEMV for one row,
  the tensor-core GEMV's columns kernel, the quantized small-M GEMM, the large-batch GEMM), and tells
  whether activations enter it as f32 (one row) or f16;
* an *attention* (:mod:`realizar.gpu.attention`) appends K/V to the paged cache and attends: the rows
  of a decode step, each over its own sequence, or a prefill chunk of one sequence.

Per layer (``x`` the f32 residual stream of ``rows`` rows)::

    h = rmsnorm(x) ; qkv = h W_qkv^T (+ b) ; (q/k norm,) RoPE, K/V -> cache ; a = attention(q)
    x += a W_o^T                                    <- pause: all-reduce point of a tensor-parallel rank
    h = rmsnorm(x) ; f = silu(h W_gate^T) * (h W_up^T) ; x += f W_down^T     <- pause

and the head: final RMSNorm and the LM head of the rows that need logits.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from realizar import cuda
from realizar.errors import ShapeError, UnsupportedError
from realizar.gpu.policy.moe import MOE_GROUPED_MIN_ROWS
from realizar.models.config import ModelConfig
from realizar.models.rope import rope_inv_freq

__all__ = ["Activations", "Decoder", "DecoderWeights", "Inputs", "LayerWeights", "MOE_ON_GPU"]

MOE_ON_GPU = ("mixture-of-experts layers with a number of experts not a multiple of 8 run one row at a time on the "
              "GPU")


def _f32_buffer(ops, tensor) -> cuda.GpuBuffer:
    return ops.to_device(np.ascontiguousarray(tensor.dequantize(), np.float32).reshape(-1))


class LayerWeights:
    """One transformer block's weights on the device, each laid out for the GEMV that reads it
    (:meth:`LayerOps.upload`: tile-major where the tensor-core GEMV runs). Q, K and V of one type are
    one weight, gate and up of one type one fused [gate; up] weight (``gate_up``; else ``gate``, ``up``)."""

    def __init__(self, tensors: dict, i: int, cfg: ModelConfig, ops):
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
        self.router = self.experts_gate_up = self.experts_down = None
        if cfg.is_moe:  # the router (a Linear) and the experts' stacked matrices (read by the expert GEMV)
            from realizar.gpu.moe import ExpertWeights

            self.router = ops.upload(t("ffn_gate_inp.weight"))
            self.experts_gate_up = ExpertWeights([t("ffn_gate_exps.weight"), t("ffn_up_exps.weight")],
                                                 cfg.num_experts, f"blk.{i}.ffn_gate_up_exps", ops.device, glu=True)
            self.experts_down = ExpertWeights([t("ffn_down_exps.weight")], cfg.num_experts, f"blk.{i}.ffn_down_exps",
                                              ops.device)
            self.gate_up = self.gate = self.up = self.down = None
            return
        gate, up = t("ffn_gate.weight"), t("ffn_up.weight")
        fused = gate.ggml_type == up.ggml_type
        self.gate_up = ops.upload([gate, up], glu=True, name=f"blk.{i}.ffn_gate_up") if fused else None
        self.gate = None if fused else ops.upload(gate)
        self.up = None if fused else ops.upload(up)
        self.down = ops.upload(t("ffn_down.weight"))

    def linears(self) -> list:
        """The weights the Linear seam multiplies, fused gate/up first (a mixture of experts: its router)."""
        if self.router is not None:
            return [*self.qkv, self.attn_out, self.router]
        ffn = [self.gate_up] if self.gate_up is not None else [self.gate, self.up]
        return [*self.qkv, self.attn_out, *ffn, self.down]


class DecoderWeights:
    """A model's weights on one device: the layers, the embedding, the final norm, the LM head and the
    RoPE frequencies. Shared by every path that runs the model there (single sequence, serving)."""

    def __init__(self, config: ModelConfig, tensors: dict, ops):
        from realizar.gpu.weights import GpuWeight

        self.config = cfg = config
        self.layers = [LayerWeights(tensors, i, cfg, ops) for i in range(cfg.num_layers)]
        self.embed = GpuWeight(tensors["token_embd.weight"], device=ops.device)  # GGUF rows: the embedding reads them
        # (tied: the LM head's GEMV reads the embedding's rows)
        self.lm_head = self.embed if cfg.tied_embeddings or "output.weight" not in tensors else ops.upload(
            tensors["output.weight"])
        self.output_norm = _f32_buffer(ops, tensors["output_norm.weight"])
        ff = tensors.get("rope_freqs.weight")
        self.inv_freq = ops.to_device(np.asarray(rope_inv_freq(cfg, None if ff is None else ff.dequantize()),
                                                 np.float32))

    @property
    def split_ffn(self) -> bool:
        """Whether some layer keeps gate and up as two weights (types differ)."""
        return any(lay.gate_up is None for lay in self.layers)

    @functools.cached_property
    def layer_linears(self) -> tuple:
        """Every layer weight the Linear seam multiplies."""
        return tuple(w for lay in self.layers for w in lay.linears())

    @functools.cached_property
    def linears(self) -> tuple:
        """Every weight the Linear seam multiplies, the LM head last."""
        return (*self.layer_linears, self.lm_head)


@dataclass
class Inputs:
    """Buffers in the Linear's input type for up to ``rows`` rows: ``h`` the normed rows, ``attn`` the
    attention output, ``ffn`` the SwiGLU output."""

    h: Any
    attn: Any
    ffn: Any

    @classmethod
    def allocate(cls, ops, cfg: ModelConfig, rows: int, dtype) -> "Inputs":
        return cls(h=ops.buffer(rows * cfg.hidden_size, dtype), attn=ops.buffer(rows * cfg.q_dim, dtype),
                   ffn=ops.buffer(rows * cfg.intermediate_size, dtype))

    def free(self) -> None:
        for b in (self.h, self.attn, self.ffn):
            b.free()


@dataclass
class MoeBuffers:
    """Mixture-of-experts scratch for ``rows`` rows: router ``logits [rows, experts]``, the chosen ``ids`` (u32) and
    ``weights [rows, used]``, the chosen experts' SwiGLU outputs ``ffn [rows, used, expert_ffn]`` and outputs ``y [rows,
    used, hidden]``; for more than one row also ``h [rows, hidden]``, the f32 normed input the expert GEMVs read,
    and the grouped GEMM's ``order`` (u32 ``[rows, used]``), ``tiles`` (its records) and f16 ``ffn16``."""

    logits: Any
    ids: Any
    weights: Any
    ffn: Any
    y: Any
    h: Any = None
    order: Any = None
    tiles: Any = None
    ffn16: Any = None

    @classmethod
    def allocate(cls, ops, cfg: ModelConfig, rows: int = 1) -> "MoeBuffers":
        from ptx_gen.kernels.moe.group import TILE_TOKENS, max_tiles

        k = cfg.num_experts_used
        pairs = rows * k
        many = {} if rows == 1 else dict(
            h=ops.buffer(rows * cfg.hidden_size), order=ops.buffer(pairs, np.uint32),
            tiles=ops.buffer(2 * max_tiles(pairs, cfg.num_experts, TILE_TOKENS[0]), np.uint32),  # (the most tiles)
            ffn16=ops.buffer(pairs * cfg.expert_ffn_size, np.float16))
        return cls(ops.buffer(rows * cfg.num_experts), ops.buffer(pairs, np.uint32), ops.buffer(pairs),
                   ops.buffer(pairs * cfg.expert_ffn_size), ops.buffer(pairs * cfg.hidden_size), **many)

    def free(self) -> None:
        for b in (self.logits, self.ids, self.weights, self.ffn, self.y, self.h, self.order, self.tiles, self.ffn16):
            if b is not None:
                b.free()


@dataclass
class Activations:
    """The buffers one run of the program works in, for up to ``rows`` rows. ``x``: the f32 residual
    stream ``[rows, hidden]``; ``qkv``: f32 ``[rows, qkv]``; ``logits``: f32 ``[logit_rows, vocab]``;
    ``f32``: :class:`Inputs` of one row (the decode GEMV's), ``f16``: of ``rows`` rows (the batched
    kernels'), each only where the program runs that many rows; ``gate``/``up``: f32 ``[rows, ffn]``
    scratch of a model with split gate and up (else None)."""

    x: Any
    qkv: Any
    logits: Any
    f32: Inputs | None = None
    f16: Inputs | None = None
    gate: Any = None
    up: Any = None
    moe: Any = None
    moe_rows: Any = None

    @classmethod
    def allocate(cls, ops, cfg: ModelConfig, rows: int, *, one_row: bool, many_rows: bool, split_ffn: bool,
                 logit_rows: int | None = None) -> "Activations":
        """Buffers for up to ``rows`` rows: f32 inputs when the program runs one row (``one_row``), f16
        ones when it runs more (``many_rows``)."""
        ffn = rows * cfg.intermediate_size
        logit_rows = rows if logit_rows is None else logit_rows
        return cls(x=ops.buffer(rows * cfg.hidden_size), qkv=ops.buffer(rows * (cfg.q_dim + 2 * cfg.kv_dim)),
                   logits=ops.buffer(logit_rows * cfg.vocab_size) if logit_rows else None,
                   f32=Inputs.allocate(ops, cfg, 1, np.float32) if one_row else None,
                   f16=Inputs.allocate(ops, cfg, rows, np.float16) if many_rows else None,
                   gate=ops.buffer(ffn) if split_ffn else None, up=ops.buffer(ffn) if split_ffn else None,
                   moe=MoeBuffers.allocate(ops, cfg) if cfg.is_moe and one_row else None,
                   moe_rows=MoeBuffers.allocate(ops, cfg, rows) if cfg.is_moe and many_rows and rows > 1 else None)

    def inputs(self, f16: bool) -> Inputs:
        got = self.f16 if f16 else self.f32
        if got is None:
            raise ShapeError(f"these activations hold no {'f16' if f16 else 'f32'} Linear inputs")
        return got

    def free(self) -> None:
        for b in (self.x, self.qkv, self.logits, self.gate, self.up, self.f32, self.f16, self.moe, self.moe_rows):
            if b is not None:
                b.free()


class Decoder:
    """The layer program over ``weights`` (see the module docstring). ``add_residual=False``: the O and
    down projections write their partial sums without adding x (a tensor-parallel rank other than 0,
    whose sums the all-reduce adds to rank 0's ``x + partial``)."""

    def __init__(self, weights: DecoderWeights, ops, *, add_residual: bool = True):
        self.weights, self.ops, self.config = weights, ops, weights.config
        self.add_residual = add_residual

    def phases(self, acts: Activations, ids: Any, rows: int, linear, attention, stream) -> Iterator[None]:
        """Issue the embedding of ``ids`` (device u32 ``[rows]``) and every layer for ``rows`` rows,
        pausing (``yield``) after each layer's O projection and after its down projection."""
        cfg, ops, w, s = self.config, self.ops, self.weights, stream
        eps, f16 = cfg.rms_norm_eps, linear.f16_input(rows)
        io = acts.inputs(f16)
        qkv_n = cfg.q_dim + 2 * cfg.kv_dim
        residual = acts.x if self.add_residual else None
        ops.embedding(w.embed, ids, acts.x, n_tokens=rows, stream=s)
        for i, lay in enumerate(w.layers):
            ops.rmsnorm(acts.x, lay.attn_norm, io.h, eps, rows=rows, out_f16=f16, stream=s)
            off = 0
            for wt in lay.qkv:
                bias = None if lay.qkv_bias is None else (lay.qkv_bias, off)
                linear(wt, io.h, (acts.qkv, off), rows, ldy=qkv_n, bias=bias, stream=s)
                off += wt.out_dim
            q = attention.append(i, acts.qkv, lay, stream=s)
            attention.attend(i, q, io.attn, out_f16=f16, stream=s)
            linear(lay.attn_out, io.attn, acts.x, rows, residual=residual, stream=s)
            yield
            ops.rmsnorm(acts.x, lay.ffn_norm, io.h, eps, rows=rows, out_f16=f16, stream=s)
            if lay.router is not None:
                self._experts(lay, acts, io, rows, linear, s, eps)
                yield
                continue
            if lay.gate_up is not None:
                linear(lay.gate_up, io.h, io.ffn, rows, glu=True, out_f16=f16, stream=s)
            else:
                linear(lay.gate, io.h, acts.gate, rows, stream=s)
                linear(lay.up, io.h, acts.up, rows, stream=s)
                ops.swiglu(acts.gate, acts.up, io.ffn, rows * cfg.intermediate_size, out_f16=f16, stream=s)
            linear(lay.down, io.ffn, acts.x, rows, residual=residual, stream=s)
            yield

    def _experts(self, lay: LayerWeights, acts: Activations, io: Inputs, rows: int, linear, s, eps: float) -> None:
        """A mixture-of-experts FFN: the router's logits (the Linear), the top-k on the device, the chosen experts'
        SwiGLU and down projections, their weighted sum added to x. A batch of ``MOE_GROUPED_MIN_ROWS`` rows or more
        groups its (row, slot) pairs by expert and runs the grouped GEMM on the f16 normed rows; fewer rows run one
        expert GEMV launch each for every pair (more than one row: on an f32 copy of the normed rows)."""
        cfg, ops = self.config, self.ops
        moe = acts.moe if rows == 1 else acts.moe_rows
        if moe is None:
            raise UnsupportedError(MOE_ON_GPU)
        k, hidden, ffn = cfg.num_experts_used, cfg.hidden_size, cfg.expert_ffn_size
        pairs = rows * k  # (row, slot) pairs, ids [rows, k]
        grouped = (rows >= MOE_GROUPED_MIN_ROWS and linear.f16_input(rows) and lay.experts_gate_up.groupable
                   and lay.experts_down.groupable)
        linear(lay.router, io.h, moe.logits, rows, stream=s)
        ops.moe_route(moe.logits, moe.ids, moe.weights, rows, experts=cfg.num_experts, used=k,
                      norm=cfg.expert_weights_norm, stream=s)
        if grouped:  # the pairs sorted by expert, each expert's tiles of pairs through its weights once
            g = ops.moe_group(moe.ids, moe.order, moe.tiles, pairs, experts=cfg.num_experts, stream=s)
            ops.gemm_experts(lay.experts_gate_up, io.h, moe.ffn16, g, x_group=k, lda=hidden, ldy=ffn, out_f16=True,
                             stream=s)
            ops.gemm_experts(lay.experts_down, moe.ffn16, moe.y, g, lda=ffn, ldy=hidden, stream=s)
        else:  # one GEMV launch each for every pair, each reading the expert its id names
            h = io.h
            if rows > 1:
                ops.rmsnorm(acts.x, lay.ffn_norm, moe.h, eps, rows=rows, stream=s)
                h = moe.h
            ops.gemv_expert(lay.experts_gate_up, h, moe.ffn, moe.ids, pairs, x_group=k, x_stride=hidden,
                            y_stride=ffn, stream=s)
            ops.gemv_expert(lay.experts_down, moe.ffn, moe.y, moe.ids, pairs, x_stride=ffn, y_stride=hidden, stream=s)
        ops.moe_combine(acts.x, moe.y, moe.weights, rows, hidden, used=k, stream=s)

    def issue(self, acts: Activations, ids: Any, rows: int, linear, attention, stream) -> None:
        """Every layer at once (no pauses): :meth:`phases` run through."""
        for _ in self.phases(acts, ids, rows, linear, attention, stream):
            pass

    def head(self, acts: Activations, rows: int, linear, stream, *, first: int = 0, logits: Any = None) -> None:
        """Final RMSNorm of rows ``first .. first + rows - 1`` of x and the LM head into ``logits``
        (default ``acts.logits``; a buffer or (buffer, offset), ``rows`` rows of the vocabulary)."""
        cfg, w = self.config, self.weights
        f16 = linear.f16_input(rows)
        h = acts.inputs(f16).h
        x = acts.x if first == 0 else (acts.x, first * cfg.hidden_size)
        self.ops.rmsnorm(x, w.output_norm, h, cfg.rms_norm_eps, rows=rows, out_f16=f16, stream=stream)
        linear(w.lm_head, h, acts.logits if logits is None else logits, rows, stream=stream)
