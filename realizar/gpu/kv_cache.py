"""KVCache: the per-layer GPU KV caches, the only code that knows their layout, the appends that
write them and the attention reads over them.

Layout: per layer one K and one V buffer ``[num_kv_heads, max_len, head_dim]`` f32, zero-filled.

    cache = KVCache(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_len=2048, ops=ops)
    cache.rope_append(layer, qkv_buf, inv_freq_buf, pos=step_pos)    # decode: RoPE fused with the append
    cache.flash_decoding(layer, (qkv_buf, 0), out_buf, seq_len=step_len, stream=s)
    cache.prefill_attention(layer, q_buf, out_buf, seq_q, q_offset, seq_k)
    # batched prefill of S tokens at positions pos0..: (qk-norm,) RoPE, Q out, K/V into the cache, then
    # causal attention over the cache with the output token-major in f16 for the O projection
    cache.rope_append_rows(layer, qkv_rows, inv_freq_buf, pos0, S, q_heads)
    cache.prefill_attention(layer, q_heads, attn_f16, S, pos0, pos0 + S, out_layout="tokens-f16")

Decode calls take positions and lengths from a small device buffer (``cuda.StepValues``), have launch
shapes independent of the length and never synchronise or allocate, so a decode step can be captured
once into a CUDA graph and replayed. Flash decoding is one launch on a static grid of
``num_kv_heads x num_chunks`` blocks that splits whatever the length is evenly over them and combines
the chunks in-kernel (the last blocks to finish do it, counting on a small device buffer they leave
at zero; ``decode_fused=False`` selects the two-launch chunk + reduce form). Calls of one cache share
its partial buffers: issue them on one stream (as a decode step does).

Host bookkeeping: :attr:`lengths` holds the valid positions of each layer. Appends with a host
position update it; device-positioned appends cannot, so a caller driving the cache from the device
reports the length with :meth:`set_length`. Wrong dimensions raise :class:`ShapeError`, growth past
``max_len`` :class:`ContextOverflowError`, reading positions a layer does not hold
:class:`CacheStateError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ptx_gen.kernels.attention.decode_core import DEFAULT_L2_PREFETCH, MAX_HEAD_DIM, decode_layout, default_decode_warps
from ptx_gen.kernels.attention.flash_attention_mma import HEAD_DIMS as MMA_HEAD_DIMS
from ptx_gen.kernels.attention.flash_decoding import fused_buffer_sizes
from realizar.errors import CacheStateError, ContextOverflowError, ShapeError
from realizar.gpu.dispatch import Dispatcher, check_int, is_buffer_arg

__all__ = ["AttentionConfig", "KVCache", "default_num_chunks"]

_MAX_CHUNKS = 256
_BLOCKS_PER_SM = 4  # flash-decoding blocks (4 warps each) aimed at per SM
_MIN_CHUNK_ROWS = 32  # default fewest rows per chunk
_GROW_STEPS = 2  # single launch: chunks grow to 2 block steps to keep a short sequence in one combine set
_OUT_LAYOUTS = ("heads", "tokens-f16")  # prefill attention outputs: [H, S, D] f32 or [S, H * D] f16


@dataclass(frozen=True)
class AttentionConfig:
    """The cache's dimensions, validated on construction (no GPU needed)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_len: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "max_len"):
            object.__setattr__(self, name, check_int(name, getattr(self, name)))
        if self.num_heads % self.num_kv_heads:
            raise ShapeError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads}) "
                f"for grouped-query attention"
            )
        if self.head_dim % 8 or self.head_dim > MAX_HEAD_DIM:
            raise ShapeError(
                f"head_dim must be a multiple of 8 up to {MAX_HEAD_DIM} (e.g. 32, 48, 64, 80, 96, 128, 256), "
                f"got {self.head_dim}"
            )
        if self.max_len >= 1 << 31:
            raise ShapeError(f"max_len must be below 2**31 positions, got {self.max_len}")

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def q_shape(self) -> tuple[int, int]:
        return (self.num_heads, self.head_dim)

    @property
    def kv_shape(self) -> tuple[int, int]:
        return (self.num_kv_heads, self.head_dim)

    @property
    def cache_shape(self) -> tuple[int, int, int]:
        """One layer's K (or V) cache: ``[num_kv_heads, max_len, head_dim]``."""
        return (self.num_kv_heads, self.max_len, self.head_dim)

    @property
    def cache_bytes(self) -> int:
        """All layers, K and V."""
        return 2 * self.num_layers * self.num_kv_heads * self.max_len * self.head_dim * 4

    def check_layer(self, layer: Any) -> int:
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= int(layer) < self.num_layers:
            raise ShapeError(f"layer must be an integer in [0, {self.num_layers}), got {layer!r}")
        return int(layer)


def default_num_chunks(sm_count: int, blocks_per_chunk: int, blocks_per_sm: int = _BLOCKS_PER_SM) -> int:
    """Chunks per KV head so that the flash-decoding grid is one full wave: ``blocks_per_sm`` resident
    blocks on every SM (every chunk gets the same rows, so one wave leaves no SM idle; at most 256)."""
    return max(1, min(_MAX_CHUNKS, blocks_per_sm * sm_count // blocks_per_chunk))


class KVCache:
    """Per-layer KV caches ``[num_kv_heads, max_len, head_dim]`` (f32) on one device, their appends and
    the attention kernels that read them.

    Tuning knobs of flash decoding (``tools/bench_attention.py`` compares variants): ``num_chunks``
    (static grid: chunks per KV head; default: one full wave of the decode kernel at the occupancy the
    device reports, at most 256), ``min_chunk`` (fewest rows per chunk; default 32 or one block step if
    larger), ``grow_rows`` (single launch: chunks grow up to this many rows so that a short sequence
    uses at most 16 chunks, one combine level; default two block steps, 0: never), ``decode_fused`` (one
    launch with the in-kernel combine, default; False: chunk + reduce kernels), ``decode_scores``
    (``"scatter"``, the default where it applies, or ``"butterfly"``; see
    ``ptx_gen.kernels.decode_core``), ``decode_warps`` (default 8 where the block's shared memory stays
    within 32 KB, else 4), ``decode_unroll`` (rows per lane group loaded per step), ``decode_prefetch``
    (load step i+1 into registers while computing i) and ``decode_l2_prefetch`` (steps of rows
    requested from the L2 ahead of the loads, sm_90; 0: off). ``use_tensor_cores``: token-major f16
    prefill attention on tensor cores where it applies (:attr:`tensor_core_attention`; False: the f32
    SIMT kernel). ``ops``: the dispatcher to launch with
    (shared with the model's other ops); default: a new one on ``device``.
    """

    def __init__(self, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int, max_len: int,
                 device: Any = None, *, ops: Dispatcher | None = None, num_chunks: int | None = None,
                 min_chunk: int | None = None, grow_rows: int | None = None, decode_warps: int | None = None,
                 decode_unroll: int | None = None, decode_prefetch: bool = False, decode_fused: bool = True,
                 decode_scores: str | None = None, decode_l2_prefetch: int = DEFAULT_L2_PREFETCH,
                 use_tensor_cores: bool = True):
        cfg = AttentionConfig(num_layers, num_heads, num_kv_heads, head_dim, max_len)
        self.use_tensor_cores = bool(use_tensor_cores)
        try:
            if decode_warps is None:
                decode_warps = default_decode_warps(cfg.head_dim, cfg.group)
            layout = decode_layout(cfg.head_dim, cfg.group, None, decode_warps, decode_unroll, decode_prefetch,
                                   decode_scores, decode_l2_prefetch)
        except ValueError as exc:
            raise ShapeError(f"flash-decoding tuning: {exc}") from None
        self._decode_opts = {"warps": layout.warps, "unroll": layout.unroll, "prefetch": layout.prefetch,
                             "scores": "scatter" if layout.scatter else "butterfly",
                             "l2_prefetch": layout.l2_prefetch}
        self.fused = bool(decode_fused)
        if num_chunks is not None:
            num_chunks = check_int("num_chunks", num_chunks)
            if num_chunks > 4096:
                raise ShapeError(f"num_chunks must be at most 4096, got {num_chunks}")
        if min_chunk is not None:
            min_chunk = check_int("min_chunk", min_chunk)
            if min_chunk > cfg.max_len:
                raise ShapeError(f"min_chunk ({min_chunk}) must not exceed max_len ({cfg.max_len})")
        if grow_rows is not None and (isinstance(grow_rows, bool) or not isinstance(grow_rows, (int, np.integer))
                                      or not 0 <= grow_rows < 1 << 31):
            raise ShapeError(f"grow_rows must be a non-negative integer, got {grow_rows!r}")
        self.config = cfg
        self._layout = layout
        # ---- the GPU from here on
        self.ops = ops if ops is not None else Dispatcher(device)
        self.device = self.ops.device
        free, _ = self.device.memory_info()
        if cfg.cache_bytes > free:
            raise ShapeError(
                f"the KV caches need {cfg.cache_bytes / 2**30:.2f} GiB ({cfg.num_layers} layers x 2 x "
                f"{cfg.cache_shape} f32) but the device has {free / 2**30:.2f} GiB free: lower max_len"
            )
        # load the decode kernels now: a module load inside a stream capture could invalidate it
        decode = self._decode_kernel(True)
        grid_x = cfg.num_kv_heads * layout.subgroups
        self.num_chunks = num_chunks or default_num_chunks(
            self.device.sm_count, grid_x, max(1, int(self.device.occupancy(decode, layout.threads))))
        if not self.fused:
            self.ops.kernel("flash_decoding_reduce", head_dim=cfg.head_dim, num_chunks=self.num_chunks, indirect=True)
        self.min_chunk = min_chunk or min(max(_MIN_CHUNK_ROWS, layout.rows_per_step), cfg.max_len)
        self.grow_rows = (_GROW_STEPS * layout.rows_per_step if grow_rows is None else int(grow_rows)) \
            if self.fused else 0
        n = cfg.num_kv_heads * cfg.max_len * cfg.head_dim
        self._k: list = []
        self._v: list = []
        for _ in range(cfg.num_layers):
            self._k.append(self.ops.buffer(n, zero=True))
            self._v.append(self.ops.buffer(n, zero=True))
        h, d = cfg.num_heads, cfg.head_dim
        self._counters = None
        if self.fused:
            n_acc, n_ml, n_cnt = fused_buffer_sizes(h, grid_x, self.num_chunks, d)
            self._counters = self.ops.buffer(n_cnt, np.uint32, zero=True)  # zero between calls: each leaves it so
        else:
            n_acc, n_ml = h * self.num_chunks * d, h * self.num_chunks * 2
        self._part_acc = self.ops.buffer(n_acc)
        self._part_ml = self.ops.buffer(n_ml)
        self._lengths = [0] * cfg.num_layers

    # ---- layout ------------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def max_len(self) -> int:
        return self.config.max_len

    def k_cache(self, layer: int):
        """Layer ``layer``'s K cache buffer, ``[num_kv_heads, max_len, head_dim]`` f32."""
        return self._k[self.config.check_layer(layer)]

    def v_cache(self, layer: int):
        return self._v[self.config.check_layer(layer)]

    def _decode_kernel(self, indirect: bool):
        """The flash-decoding kernel (fused) or its chunk kernel (two launches)."""
        cfg = self.config
        return self.ops.kernel("flash_decoding" if self.fused else "flash_decoding_chunk", head_dim=cfg.head_dim,
                               group=cfg.group, indirect=indirect, **self._decode_opts)

    @property
    def decode_kernel(self):
        """The compiled kernel :meth:`flash_decoding` launches with a device seq_len (fused), or its
        chunk kernel (two launches)."""
        return self._decode_kernel(True)

    @property
    def decode_launches(self) -> int:
        """Kernel launches per :meth:`flash_decoding` call (1 fused, 2 otherwise)."""
        return 1 if self.fused else 2

    # ---- host bookkeeping --------------------------------------------------------------------------
    @property
    def lengths(self) -> tuple[int, ...]:
        """Valid positions per layer (host bookkeeping)."""
        return tuple(self._lengths)

    def reset(self) -> None:
        """Forget every position of every layer (the memory is reused, not cleared)."""
        self._lengths = [0] * self.num_layers

    def _layers(self, layer: int | None, length: Any) -> range | list[int]:
        layers = range(self.num_layers) if layer is None else [self.config.check_layer(layer)]
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 0:
            raise ShapeError(f"length must be a non-negative integer, got {length!r}")
        return layers

    def truncate(self, layer: int | None, length: int) -> None:
        """Keep the first ``length`` positions of ``layer`` (``None``: every layer)."""
        layers = self._layers(layer, length)
        for i in layers:
            if length > self._lengths[i]:
                raise CacheStateError(
                    f"cannot truncate layer {i} to {length} positions: it holds only {self._lengths[i]}"
                )
        for i in layers:
            self._lengths[i] = int(length)

    def set_length(self, layer: int | None, length: int) -> None:
        """Record that ``layer`` (``None``: every layer) holds ``length`` valid positions — for callers
        that write the cache on the device (graph replays with a device-side position)."""
        layers = self._layers(layer, length)
        if length > self.max_len:
            raise ContextOverflowError(f"length {length} exceeds max_len {self.max_len}")
        for i in layers:
            self._lengths[i] = int(length)

    def check_append(self, layer: int, position: int, count: int) -> None:
        if position + count > self.max_len:
            raise ContextOverflowError(
                f"layer {layer}: appending {count} position(s) at {position} needs {position + count} "
                f"positions but max_len is {self.max_len}"
            )
        if position > self._lengths[layer]:
            raise CacheStateError(
                f"layer {layer}: position {position} would leave a hole; the layer holds {self._lengths[layer]} "
                f"positions (append at <= {self._lengths[layer]})"
            )

    def check_attend(self, layer: int, seq_len: int) -> None:
        if self._lengths[layer] == 0:
            raise CacheStateError(f"layer {layer} is uninitialised: it holds no positions yet (append K/V first)")
        if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
            raise ShapeError(f"seq_len must be a positive integer, got {seq_len!r}")
        if seq_len > self._lengths[layer]:
            raise CacheStateError(
                f"layer {layer} holds {self._lengths[layer]} positions, asked to attend over {seq_len}"
            )

    def seq_len_value(self, seq_len: Any, what: str = "seq_len") -> tuple[bool, dict, dict]:
        """(indirect, kernel argument, buffers) for an int or a device u32 (GpuBuffer or (buffer, index))."""
        if is_buffer_arg(seq_len):
            addr, buf = self.ops.operand(seq_len, 1, what, np.uint32, align=1)
            return True, {"seq_len_ptr": addr}, {f"{what}_buffer": buf}
        if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 0:
            raise ShapeError(f"{what} must be a non-negative integer or a u32 GpuBuffer, got {seq_len!r}")
        if seq_len > self.max_len:
            raise ContextOverflowError(f"{what} {seq_len} exceeds max_len {self.max_len}")
        return False, {"seq_len": int(seq_len)}, {}

    def _qo(self, q: Any, out: Any, n: int | None = None) -> tuple[int, int, dict]:
        n = self.config.num_heads * self.config.head_dim if n is None else n
        q_addr, qb = self.ops.operand(q, n, "q")
        o_addr, ob = self.ops.operand(out, n, "out")
        return q_addr, o_addr, {"q": qb, "out": ob}

    # ---- appends -----------------------------------------------------------------------------------
    def rope_append(self, layer: int, qkv: Any, inv_freq: Any, pos: Any, neox: bool = False,
                    stream: Any = None) -> None:
        """Decode-step fusion: rotate Q in place in ``qkv`` ([q; k; v] of one token), rotate K into
        ``k_cache[:, pos]`` and copy V into ``v_cache[:, pos]`` of ``layer``; ``pos`` is a u32 device
        buffer (or (buffer, index)) so the call can live in a CUDA graph (the host length is not
        changed: see :meth:`set_length`)."""
        cfg, ops = self.config, self.ops
        layer = cfg.check_layer(layer)
        n_q, n_kv, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        kern = ops.kernel("rope_kv_append", head_dim=head_dim, neox=bool(neox))
        values = {"qkv": ops.addr(qkv, (n_q + 2 * n_kv) * head_dim, "qkv", align=4),
                  "k_cache": self._k[layer].ptr, "v_cache": self._v[layer].ptr,
                  "inv_freq": ops.addr(inv_freq, head_dim // 2, "inv_freq", align=4),
                  "pos_ptr": ops.addr(pos, 1, "pos", np.uint32, align=4),
                  "n_q": n_q, "n_kv": n_kv, "max_len": cfg.max_len}
        items = (n_q + 2 * n_kv) * (head_dim // 2)
        ops.launch(kern, -(-items // kern.meta["block"]), values, stream)

    def rope_append_rows(self, layer: int, qkv: Any, inv_freq: Any, pos0: int, count: int, q_out: Any, *,
                         neox: bool = False, q_norm: Any = None, k_norm: Any = None, eps: float = 1e-6,
                         stream: Any = None) -> None:
        """Batched prefill form of :meth:`rope_append` for ``count`` tokens at positions ``pos0 ..
        pos0 + count - 1`` of ``layer``: ``qkv`` ([count, (H + 2 KVH) * D] f32, rows [q; k; v], only
        read) -> optional per-head RMSNorm of Q and K (``q_norm``/``k_norm``: [D] f32 weights, both or
        neither; ``eps``), RoPE of Q into ``q_out`` ([H, count, D] f32, the query layout of
        :meth:`prefill_attention`) and of K into the cache, V copied into the cache. Buffers are
        GpuBuffers or (buffer, offset). The host length becomes at least ``pos0 + count``;
        ContextOverflowError past max_len, CacheStateError for a position that would leave a hole."""
        cfg, ops = self.config, self.ops
        layer = cfg.check_layer(layer)
        pos0, count = check_int("pos0", pos0, lo=0), check_int("count", count)
        if (q_norm is None) != (k_norm is None):
            raise ShapeError("q_norm and k_norm go together: pass both weights (qk-norm models) or neither")
        self.check_append(layer, pos0, count)
        n_q, n_kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qk_norm = q_norm is not None
        kern = ops.kernel("rope_append_rows", head_dim=d, neox=bool(neox), qk_norm=qk_norm)
        values = {"qkv": ops.addr(qkv, count * (n_q + 2 * n_kv) * d, "qkv", align=8),
                  "q_out": ops.addr(q_out, n_q * count * d, "q_out", align=8),
                  "k_cache": self._k[layer].ptr, "v_cache": self._v[layer].ptr,
                  "inv_freq": ops.addr(inv_freq, d // 2, "inv_freq", align=4)}
        if qk_norm:
            values["q_norm"] = ops.addr(q_norm, d, "q_norm", align=8)
            values["k_norm"] = ops.addr(k_norm, d, "k_norm", align=8)
            values["eps"] = float(eps)
        values.update(pos0=pos0, count=count, n_q=n_q, n_kv=n_kv, max_len=cfg.max_len)
        grid = (count, -(-(n_q + 2 * n_kv) // kern.meta["warps"]))
        ops.launch(kern, grid, values, stream, cache=False)
        self._lengths[layer] = max(self._lengths[layer], pos0 + count)

    def append(self, layer: int, k_addr: int, v_addr: int, count: int, position: Any, stream: Any = None,
               buffers: dict | None = None) -> None:
        """Copy ``count`` positions of K and V (device addresses, ``[num_kv_heads, count, head_dim]``)
        into ``layer`` at ``position``: an int (checked by the caller) or a u32 device buffer (or
        (buffer, index)) read on the device, graph-compatible. The host length is not changed."""
        cfg, ops = self.config, self.ops
        values = {"k_cache": self._k[layer], "v_cache": self._v[layer], "k_new": k_addr, "v_new": v_addr,
                  "count": count, "max_len": cfg.max_len}
        buffers = dict(buffers or {})
        if is_buffer_arg(position):
            paddr, buffers["position"] = ops.operand(position, 1, "position", np.uint32, align=1)
            kern = ops.kernel("kv_append", head_dim=cfg.head_dim, indirect=True)
            values["pos_ptr"] = paddr
        else:
            kern = ops.kernel("kv_append", head_dim=cfg.head_dim, indirect=False)
            values["pos"] = int(position)
        grid = (-(-count * (cfg.head_dim // 4) // kern.meta["block"]), cfg.num_kv_heads)
        ops.launch(kern, grid, values, stream, buffers=buffers, cache=is_buffer_arg(position))

    # ---- attention reads ---------------------------------------------------------------------------
    def flash_decoding(self, layer: int, q: Any, out: Any, seq_len: Any, *, stream: Any = None) -> None:
        """Split-KV decode attention of ``q`` over the first ``seq_len`` positions of ``layer``.

        ``q``/``out`` are GpuBuffers (or (buffer, offset)) of ``H * D`` floats, ``seq_len`` a u32 GpuBuffer
        (or (buffer, index)) read on the device — or an int. :attr:`decode_launches` launches on
        ``stream`` with a fixed shape and cached arguments; no synchronisation, no allocation: safe to
        capture into a graph. A device-side seq_len is clamped to max_len; 0 writes zeros."""
        layer = self.config.check_layer(layer)
        q_addr, o_addr, bufs = self._qo(q, out)
        if not is_buffer_arg(seq_len):
            self.check_attend(layer, seq_len)
        self.launch_flash_decoding(layer, q_addr, o_addr, self.seq_len_value(seq_len), stream, bufs)

    def launch_flash_decoding(self, layer: int, q_addr: int, out_addr: int, seq: tuple, stream, bufs: dict):
        """Flash decoding from checked operands (``seq`` from :meth:`seq_len_value`)."""
        cfg, ops = self.config, self.ops
        indirect, sl_values, sl_bufs = seq
        bufs = {**bufs, **sl_bufs}
        grid = (cfg.num_kv_heads * self._layout.subgroups, self.num_chunks)
        common = {"q": q_addr, "k_cache": self._k[layer], "v_cache": self._v[layer]}
        if self.fused:
            values = {**common, "out": out_addr, "part_acc": self._part_acc, "part_ml": self._part_ml,
                      "counters": self._counters, "max_len": cfg.max_len, "min_chunk": self.min_chunk,
                      "grow_rows": self.grow_rows, **sl_values}
            ops.launch(self._decode_kernel(indirect), grid, values, stream, buffers=bufs, cache=indirect)
            return
        reduce = ops.kernel("flash_decoding_reduce", head_dim=cfg.head_dim, num_chunks=self.num_chunks,
                            indirect=indirect)
        cvalues = {**common, "part_acc": self._part_acc, "part_ml": self._part_ml, "max_len": cfg.max_len,
                   "min_chunk": self.min_chunk, **sl_values}
        rvalues = {"part_acc": self._part_acc, "part_ml": self._part_ml, "out": out_addr, "max_len": cfg.max_len,
                   **sl_values}
        ops.launch(self._decode_kernel(indirect), grid, cvalues, stream, buffers=bufs, cache=indirect)
        ops.launch(reduce, cfg.num_heads, rvalues, stream, buffers=bufs, cache=indirect)

    def incremental_attention(self, layer: int, q_addr: int, out_addr: int, seq: tuple, stream, bufs: dict):
        """The one-pass decode attention (one block per KV head: short sequences) from checked operands."""
        cfg, ops = self.config, self.ops
        indirect, sl_values, sl_bufs = seq
        kern = ops.kernel("incremental_attention", head_dim=cfg.head_dim, group=cfg.group, indirect=indirect)
        values = {"q": q_addr, "k_cache": self._k[layer], "v_cache": self._v[layer], "out": out_addr,
                  "max_len": cfg.max_len, **sl_values}
        ops.launch(kern, cfg.num_kv_heads * kern.meta["subgroups"], values, stream, buffers={**bufs, **sl_bufs},
                   cache=indirect)

    def flash_attention(self, q_addr: int, k_addr: int, v_addr: int, out_addr: int, seq_q: int, seq_k: int,
                        q_offset: int, kv_stride: int, causal: bool, stream: Any = None,
                        out_tokens_f16: bool = False) -> None:
        """Prefill attention of ``q [H, seq_q, D]`` over keys ``[KVH, seq_k, D]`` laid out with a row
        stride of ``kv_stride`` positions (the cache's ``max_len``, or ``seq_k`` for packed inputs);
        the output is ``[H, seq_q, D]`` f32, or with ``out_tokens_f16`` ``[seq_q, H * D]`` f16."""
        cfg = self.config
        values = {"q": q_addr, "k": k_addr, "v": v_addr, "out": out_addr, "seq_q": seq_q, "seq_k": seq_k,
                  "q_offset": q_offset, "kv_stride": kv_stride}
        if out_tokens_f16 and self.tensor_core_attention:
            kern = self.ops.kernel("flash_attention_mma", head_dim=cfg.head_dim, group=cfg.group, causal=bool(causal))
            values["num_heads"] = cfg.num_heads
        else:
            name = "flash_attention_tokens_f16" if out_tokens_f16 else "flash_attention"
            kern = self.ops.kernel(name, head_dim=cfg.head_dim, group=cfg.group, causal=bool(causal))
        self.ops.launch(kern, (-(-seq_q // kern.meta["block_q"]), cfg.num_heads), values, stream, cache=False)

    @property
    def tensor_core_attention(self) -> bool:
        """Whether token-major f16 prefill attention runs on tensor cores (``flash_attention_mma``:
        sm_80+, head_dim a multiple of 16 up to 128); otherwise the f32 SIMT kernel computes it."""
        return (self.ops.device.target.compute_capability >= (8, 0) and self.config.head_dim in MMA_HEAD_DIMS
                and self.use_tensor_cores)

    def prefill_attention(self, layer: int, q: Any, out: Any, seq_q: int, q_offset: int, seq_k: int,
                          causal: bool = True, *, out_layout: str = "heads", stream: Any = None) -> None:
        """Prefill attention straight from ``layer``'s cache: ``q`` a GpuBuffer ``[H, seq_q, D]`` f32;
        keys ``[0, seq_k)`` of the cache; query i at position ``q_offset + i``. ``out_layout``:
        ``"heads"``, ``out`` ``[H, seq_q, D]`` f32; ``"tokens-f16"``, ``out`` ``[seq_q, H * D]`` f16
        (token-major, values rounded to nearest even: the A operand of the output projection's GEMM)."""
        if out_layout not in _OUT_LAYOUTS:
            raise ShapeError(f"out_layout must be one of {_OUT_LAYOUTS}, got {out_layout!r}")
        cfg = self.config
        layer = cfg.check_layer(layer)
        seq_q, seq_k = check_int("seq_q", seq_q), check_int("seq_k", seq_k)
        q_offset = check_int("q_offset", q_offset, lo=0)
        self.check_attend(layer, seq_k)
        if causal and q_offset + seq_q > seq_k:
            raise ShapeError(f"causal queries at positions {q_offset}..{q_offset + seq_q - 1} need {q_offset + seq_q} "
                             f"keys, seq_k is {seq_k}")
        n = cfg.num_heads * seq_q * cfg.head_dim
        tokens_f16 = out_layout == "tokens-f16"
        if tokens_f16:
            q_addr = self.ops.addr(q, n, "q")
            o_addr = self.ops.addr(out, n, "out", np.float16)
        else:
            q_addr, o_addr, _ = self._qo(q, out, n)
        self.flash_attention(q_addr, self._k[layer].ptr, self._v[layer].ptr, o_addr, seq_q, seq_k, q_offset,
                             cfg.max_len, causal, stream, out_tokens_f16=tokens_f16)

    def close(self) -> None:
        """Free every device buffer of the cache."""
        for b in [*self._k, *self._v, self._part_acc, self._part_ml, self._counters]:
            if b is not None:
                b.free()

    def __repr__(self) -> str:
        c = self.config
        return (f"KVCache(layers={c.num_layers}, heads={c.num_heads}/{c.num_kv_heads}, head_dim={c.head_dim}, "
                f"max_len={c.max_len}, num_chunks={self.num_chunks}, fused={self.fused})")
