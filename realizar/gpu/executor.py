"""CudaExecutor: NumPy-in/NumPy-out attention over the paged GPU KV cache, for experimenting with the kernels.

    ex = CudaExecutor(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_len=2048)
    out = np.empty((9, 64), np.float32)
    n = ex.flash_attention_cached(layer, q, k, v, out)      # append k/v at the end, attend; numpy in/out
    y = ex.prefill(layer, q_seq, k_seq, v_seq)                # S tokens at once (causal), from the cache
    y = ex.flash_attention_multi_head(q, k, v, causal=True)   # stateless prefill attention

The cache is the serving path's :class:`~realizar.gpu.paged_kv.PagedKVCache` (``ex.cache``) with f32 pools
holding one sequence: one block table ``1 .. n`` shared by every layer, so the kernels measured here are
the ones a decode step or a prefill chunk launches. K and V are stored as given (no RoPE). NumPy arguments
are staged through fixed device buffers with synchronous copies; the device-resident forms take
:class:`~realizar.cuda.GpuBuffer` s (or ``(buffer, element offset)`` pairs) and never synchronise or
allocate, so they can be captured into a CUDA graph (:meth:`flash_decoding_graphed` keeps the graphs):

    ex.append_kv(layer, k_buf, v_buf, position=step_buf, stream=s)     # position read on the device
    ex.flash_decoding(layer, q_buf, out_buf, seq_len=step_buf, stream=s)

Host bookkeeping: :attr:`lengths` holds the valid positions of each layer. Appends with a host position
update it; device-positioned appends cannot, so a caller driving the cache from the device reports the
length with :meth:`set_length`. Wrong dimensions raise :class:`ShapeError`, growth past ``max_len``
:class:`ContextOverflowError`, reading positions a layer does not hold :class:`CacheStateError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from realizar.config import ServingConfig
from realizar.cuda.graph_cache import GraphCache
from realizar.errors import CacheStateError, ContextOverflowError, ShapeError
from realizar.gpu.dispatch import check_int, is_buffer_arg
from realizar.gpu.paged_kv import PagedKVCache, heads_unsupported

__all__ = ["AttentionConfig", "CudaExecutor"]


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
        why = heads_unsupported(self.num_heads, self.num_kv_heads, self.head_dim)
        if why is not None:
            raise ShapeError(why + (" for grouped-query attention" if "multiple" in why else ""))
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

    def check_layer(self, layer: Any) -> int:
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= int(layer) < self.num_layers:
            raise ShapeError(f"layer must be an integer in [0, {self.num_layers}), got {layer!r}")
        return int(layer)


def _host_array(x: Any, shapes: Sequence[tuple[int, ...]], what: str) -> np.ndarray:
    """``x`` as a C-contiguous float32 array of the first of ``shapes`` (any listed shape with the
    same element count is accepted, e.g. ``[H, D]`` or flat ``[H * D]``)."""
    a = np.asarray(x)
    if a.dtype.kind != "f":
        raise ShapeError(f"{what} must be a floating-point array, got dtype {a.dtype}")
    if tuple(a.shape) not in [tuple(s) for s in shapes]:
        raise ShapeError(f"{what} must have shape {' or '.join(str(tuple(s)) for s in shapes)}, got {a.shape}")
    return np.ascontiguousarray(a, dtype=np.float32).reshape(shapes[0])


def _seq_arrays(cfg: AttentionConfig, q: Any, k: Any, v: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Prefill inputs ``q [H, S, D]``, ``k, v [KVH, Sk, D]`` with ``Sk >= S >= 1``."""
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    h, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if q.ndim != 3 or q.shape[0] != h or q.shape[2] != d or q.shape[1] < 1:
        raise ShapeError(f"q must be [num_heads={h}, seq_len >= 1, head_dim={d}], got {q.shape}")
    if k.ndim != 3 or k.shape[0] != kvh or k.shape[2] != d or k.shape[1] < q.shape[1]:
        raise ShapeError(f"k must be [num_kv_heads={kvh}, seq_len >= {q.shape[1]}, head_dim={d}], got {k.shape}")
    if v.shape != k.shape:
        raise ShapeError(f"v must have k's shape {k.shape}, got {v.shape}")
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a.dtype.kind != "f":
            raise ShapeError(f"{name} must be a floating-point array, got dtype {a.dtype}")
    return (np.ascontiguousarray(q, np.float32), np.ascontiguousarray(k, np.float32),
            np.ascontiguousarray(v, np.float32))


def _check_out(out: np.ndarray | None, shape: tuple) -> None:
    if out is not None and (not isinstance(out, np.ndarray) or out.shape != shape or out.dtype != np.float32
                            or not out.flags.c_contiguous):
        raise ShapeError(f"out must be a C-contiguous float32 array of shape {shape}")


class CudaExecutor:
    """Attention over a paged f32 KV cache of one sequence (``num_layers`` layers, room for ``max_len``
    positions) with NumPy or device-resident operands. Tuning keywords go to
    :class:`~realizar.gpu.paged_kv.PagedKVCache`: ``block_size`` (positions per block), ``num_chunks``
    (split-KV chunks per KV head of :meth:`flash_decoding`), ``min_chunk``, ``decode_unroll``,
    ``decode_lanes``."""

    def __init__(self, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int, max_len: int,
                 device: Any = None, *, block_size: int = ServingConfig().block_size, **tuning: Any):
        self.config = cfg = AttentionConfig(num_layers, num_heads, num_kv_heads, head_dim, max_len)
        blocks = -(-cfg.max_len // block_size) if isinstance(block_size, int) and block_size > 0 else 1
        self.cache = cache = PagedKVCache(cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, blocks + 1,
                                          block_size, "f32", device, max_batch=1, **tuning)
        self.ops, self.device = cache.ops, cache.device
        self.table_stride = blocks
        self.table = self.ops.to_device(np.arange(1, blocks + 1, dtype=np.uint32))
        self._iota = self.ops.to_device(np.arange(cfg.max_len + 1, dtype=np.uint32))  # (iota, n): the device u32 n
        # the device-positioned append may be captured into a graph: load its kernel outside any capture
        self.ops.kernel("kv_append", head_dim=cfg.head_dim, indirect=True, block_size=cache.block_size)
        h, d, kvh = cfg.num_heads, cfg.head_dim, cfg.num_kv_heads
        self._q_stage, self._out_stage = self.ops.buffer(h * d), self.ops.buffer(h * d)
        self._k_stage, self._v_stage = self.ops.buffer(kvh * d), self.ops.buffer(kvh * d)
        self._lengths = [0] * cfg.num_layers
        self._graphs: dict[int, tuple[Any, GraphCache]] = {}

    # ---- the cache's layout, knobs and bookkeeping ---------------------------------------------------
    num_layers = property(lambda self: self.config.num_layers)
    num_heads = property(lambda self: self.config.num_heads)
    num_kv_heads = property(lambda self: self.config.num_kv_heads)
    head_dim = property(lambda self: self.config.head_dim)
    max_len = property(lambda self: self.config.max_len)
    block_size = property(lambda self: self.cache.block_size)
    num_chunks = property(lambda self: self.cache.chunks_for(1), doc="Chunks per KV head of flash_decoding.")
    min_chunk = property(lambda self: self.cache.min_chunk_for(1), doc="Fewest positions per chunk.")
    decode_launches = 1  # launches per flash_decoding call: the chunks combine in-kernel

    @property
    def decode_kernel(self):
        """The compiled kernel :meth:`flash_decoding` launches (the paged decode kernel, f32 out)."""
        return self.cache._decode_kernel(False)

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
                raise CacheStateError(f"cannot truncate layer {i} to {length} positions: it holds only "
                                      f"{self._lengths[i]}")
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

    def _check_append(self, layer: int, position: int, count: int) -> None:
        if position + count > self.max_len:
            raise ContextOverflowError(f"layer {layer}: appending {count} position(s) at {position} needs "
                                       f"{position + count} positions but max_len is {self.max_len}")
        if position > self._lengths[layer]:
            raise CacheStateError(f"layer {layer}: position {position} would leave a hole; the layer holds "
                                  f"{self._lengths[layer]} positions (append at <= {self._lengths[layer]})")

    def _check_attend(self, layer: int, seq_len: Any) -> None:
        if self._lengths[layer] == 0:
            raise CacheStateError(f"layer {layer} is uninitialised: it holds no positions yet (append K/V first)")
        if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
            raise ShapeError(f"seq_len must be a positive integer or a u32 GpuBuffer, got {seq_len!r}")
        if seq_len > self._lengths[layer]:
            raise CacheStateError(f"layer {layer} holds {self._lengths[layer]} positions, asked to attend over "
                                  f"{seq_len}")

    def cache_to_numpy(self, layer: int, length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The first ``length`` (default: all valid) positions of a layer's K and V, ``[KVH, length, D]``."""
        layer = self.config.check_layer(layer)
        length = self._lengths[layer] if length is None else length
        out = []
        for pool in self.cache.pools_to_numpy(layer):  # [blocks, KVH, block_size, D]; the table is 1 .. n
            seq = pool[1:].transpose(1, 0, 2, 3).reshape(self.num_kv_heads, -1, self.head_dim)
            out.append(np.ascontiguousarray(seq[:, :length]))
        return out[0], out[1]

    # ---- operands ----------------------------------------------------------------------------------
    def _host_out(self, out: Any) -> np.ndarray:
        h, d = self.config.q_shape
        if not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape not in ((h, d), (h * d,)) \
                or not out.flags.c_contiguous or not out.flags.writeable:
            got = f"{type(out).__name__} {getattr(out, 'shape', '')} {getattr(out, 'dtype', '')}"
            raise ShapeError(f"out must be a writable C-contiguous float32 array of shape ({h}, {d}), got {got}")
        return out

    def _host_kv(self, k: Any, v: Any) -> tuple[np.ndarray, np.ndarray, int]:
        cfg = self.config
        ka, va = np.asarray(k), np.asarray(v)
        if ka.ndim == 3:
            if ka.shape[0] != cfg.num_kv_heads or ka.shape[2] != cfg.head_dim or ka.shape[1] < 1:
                raise ShapeError(f"k must be [num_kv_heads={cfg.num_kv_heads}, S >= 1, head_dim={cfg.head_dim}], "
                                 f"got {ka.shape}")
            if va.shape != ka.shape:
                raise ShapeError(f"v must have k's shape {ka.shape}, got {va.shape}")
            return _host_array(ka, [ka.shape], "k"), _host_array(va, [va.shape], "v"), ka.shape[1]
        kvh, d = cfg.kv_shape
        shapes = [(kvh, d), (kvh * d,), (kvh, 1, d)]
        return _host_array(ka, shapes, "k"), _host_array(va, shapes, "v"), 1

    def _seq_len(self, layer: int, seq_len: Any) -> Any:
        """A device u32 holding the length: the caller's buffer (read on the device) or a slot of the iota."""
        if is_buffer_arg(seq_len):
            self.ops.addr(seq_len, 1, "seq_len", np.uint32, align=4)
            return seq_len
        self._check_attend(layer, seq_len)
        return (self._iota, int(seq_len))

    def _attend(self, layer: int, q: Any, out: Any, seq_len: Any, chunks: int | None, stream: Any) -> None:
        self.cache.decode_attention(layer, q, out, seq_len, self.table, self.table_stride, 1, chunks=chunks,
                                    stream=stream)

    # ---- appends -----------------------------------------------------------------------------------
    def append_kv(self, layer: int, k: Any, v: Any, position: Any = None, *, count: int | None = None,
                  stream=None) -> int:
        """Write K/V of one or more positions into ``layer``'s cache; returns the host-side length.

        ``k``/``v``: numpy ``[KVH, D]`` / ``[KVH, S, D]``, or GpuBuffers (or (buffer, offset)) holding
        ``count`` (default 1) positions laid out ``[KVH, count, D]``. ``position``: ``None`` (append at
        the end), an int (overwrite from there; no holes), or a u32 device buffer (or (buffer, index))
        read on the device — graph-compatible; the host length is then not changed (see
        :meth:`set_length`)."""
        layer = self.config.check_layer(layer)
        device_inputs = is_buffer_arg(k) or is_buffer_arg(v)
        if device_inputs:
            count = 1 if count is None else check_int("count", count)
        else:
            ka, va, count_h = self._host_kv(k, v)
            if count is not None and count != count_h:
                raise ShapeError(f"count {count} does not match the {count_h} positions in k/v")
            count = count_h
        if position is None:
            position = self._lengths[layer]
        if is_buffer_arg(position):
            self.ops.addr(position, 1, "position", np.uint32, align=4)
        else:
            if isinstance(position, bool) or not isinstance(position, (int, np.integer)) or position < 0:
                raise ShapeError(f"position must be a non-negative integer or a u32 GpuBuffer, got {position!r}")
            position = int(position)
            self._check_append(layer, position, count)
        append = lambda kk, vv, s: self.cache.append_kv(layer, kk, vv, count, position, self.table,  # noqa: E731
                                                         self.table_stride, stream=s)
        if device_inputs:
            append(k, v, stream)
        elif count == 1:
            self._k_stage.copy_from_host(ka.reshape(-1))
            self._v_stage.copy_from_host(va.reshape(-1))
            # staged through fixed buffers with synchronous copies: launch on the null stream so the
            # next call's copy cannot overtake this kernel
            append(self._k_stage, self._v_stage, None)
        else:
            kb, vb = self.ops.to_device(ka), self.ops.to_device(va)
            try:
                append(kb, vb, None)
                self.device.synchronize()
            finally:
                kb.free()
                vb.free()
        if not is_buffer_arg(position):
            self._lengths[layer] = max(self._lengths[layer], position + count)
        return self._lengths[layer]

    # ---- attention ---------------------------------------------------------------------------------
    def flash_attention_cached(self, layer: int, q: Any, k: Any, v: Any, out: Any) -> int:
        """Append ``k``, ``v`` (``[KVH, D]``) at the end of ``layer``'s cache and write the attention of
        ``q`` (``[H, D]``) over every position, the new one included, into ``out`` (``[H, D]``).
        Returns the new length. Numpy arrays (synchronous) or GpuBuffers (asynchronous) throughout."""
        cfg = self.config
        layer = cfg.check_layer(layer)
        pos = self._lengths[layer]
        if pos + 1 > cfg.max_len:
            raise ContextOverflowError(
                f"layer {layer} is full: {pos} of max_len {cfg.max_len} positions used, cannot append one more")
        if is_buffer_arg(q):
            self.append_kv(layer, k, v)
            self._attend(layer, q, out, (self._iota, pos + 1), None, None)
            return self._lengths[layer]
        qa = _host_array(q, [cfg.q_shape, (cfg.num_heads * cfg.head_dim,)], "q")
        out_arr = self._host_out(out)
        self.append_kv(layer, k, v)
        self._q_stage.copy_from_host(qa.reshape(-1))
        self._attend(layer, self._q_stage, self._out_stage, (self._iota, pos + 1), None, None)
        self._out_stage.copy_to_host(out_arr.reshape(-1))
        return self._lengths[layer]

    def incremental_attention_gpu(self, layer: int, q: Any, out: Any = None, seq_len: Any = None, *, stream=None):
        """Attention of ``q [H, D]`` over the first ``seq_len`` positions of ``layer`` (default: all it
        holds) in one pass: one block per KV head walks the whole sequence (best for short ones).

        numpy ``q``: returns the output (``out`` optional). GpuBuffer ``q``/``out``: asynchronous on
        ``stream``; ``seq_len`` may then be a u32 device buffer (read on the device)."""
        cfg = self.config
        layer = cfg.check_layer(layer)
        if is_buffer_arg(q):
            self._attend(layer, q, out, self._seq_len(layer, self._lengths[layer] if seq_len is None else seq_len),
                         1, stream)
            return out
        qa = _host_array(q, [cfg.q_shape, (cfg.num_heads * cfg.head_dim,)], "q")
        out_arr = np.empty(cfg.q_shape, np.float32) if out is None else self._host_out(out)
        sl = self._seq_len(layer, self._lengths[layer] if seq_len is None else seq_len)
        self._q_stage.copy_from_host(qa.reshape(-1))
        self._attend(layer, self._q_stage, self._out_stage, sl, 1, None)
        self._out_stage.copy_to_host(out_arr.reshape(-1))
        return out_arr

    def flash_decoding(self, layer: int, q: Any, out: Any, seq_len: Any, *, stream=None) -> None:
        """Split-KV decode attention of ``q`` over the first ``seq_len`` positions of ``layer``: ``q``/``out``
        GpuBuffers (or (buffer, offset)) of ``H * D`` floats, ``seq_len`` an int or a u32 GpuBuffer (or
        (buffer, index)) read on the device (clamped to the table's positions). One launch on ``stream``
        with a fixed shape and cached arguments; no synchronisation, no allocation: safe to capture."""
        layer = self.config.check_layer(layer)
        self._attend(layer, q, out, self._seq_len(layer, seq_len), None, stream)

    def flash_decoding_graphed(self, layer: int, q: Any, out: Any, seq_len: Any, *, stream: Any) -> None:
        """:meth:`flash_decoding` replayed from a CUDA graph kept per (layer, operands): the first call
        runs eagerly and captures, later calls with the same operands launch the graph (change the
        values in the buffers between calls, e.g. the length in ``seq_len``)."""
        layer = self.config.check_layer(layer)
        sl = self._seq_len(layer, seq_len)
        key = (layer, self.ops.addr(q, 1, "q"), self.ops.addr(out, 1, "out"),
               self.ops.addr(sl, 1, "seq_len", np.uint32, align=4))
        lane = self._graphs.get(id(stream))
        if lane is None or lane[0] is not stream:
            lane = self._graphs[id(stream)] = (stream, GraphCache(stream, capacity=64))
        lane[1].run(key, lambda: self._attend(layer, q, out, sl, None, stream))

    def flash_attention_multi_head(self, q: Any, k: Any, v: Any, causal: bool = True, out: np.ndarray | None = None):
        """Prefill attention without the cache: ``q [H, S, D]``, ``k, v [KVH, Sk, D]`` (``Sk >= S``; the
        queries are the last S positions for the causal mask) → ``[H, S, D]`` (numpy)."""
        cfg = self.config
        qa, ka, va = _seq_arrays(cfg, q, k, v)
        s, sk = qa.shape[1], ka.shape[1]
        _check_out(out, qa.shape)
        result = out if out is not None else np.empty(qa.shape, np.float32)
        bufs = [self.ops.to_device(qa), self.ops.to_device(ka), self.ops.to_device(va), self.ops.buffer(qa.size)]
        try:
            qb, kb, vb, ob = bufs
            kern = self.ops.kernel("flash_attention", head_dim=cfg.head_dim, group=cfg.group, causal=bool(causal))
            values = {"q": qb.ptr, "k": kb.ptr, "v": vb.ptr, "out": ob.ptr, "seq_q": s, "seq_k": sk,
                      "q_offset": sk - s, "kv_stride": sk}
            self.ops.launch(kern, (-(-s // kern.meta["block_q"]), cfg.num_heads), values, None, cache=False)
            ob.copy_to_host(result.reshape(-1))
        finally:
            for b in bufs:
                b.free()
        return result

    def prefill(self, layer: int, q: Any, k: Any, v: Any, causal: bool = True, out: np.ndarray | None = None):
        """Append ``k, v [KVH, S, D]`` at the end of ``layer``'s cache, then attend ``q [H, S, D]`` over
        the whole cache in place (earlier positions included; causal by default) → ``[H, S, D]``."""
        cfg = self.config
        layer = cfg.check_layer(layer)
        qa, ka, va = _seq_arrays(cfg, q, k, v)
        s = qa.shape[1]
        if ka.shape[1] != s:
            raise ShapeError(f"prefill takes as many new keys as queries: q has {s}, k has {ka.shape[1]}")
        start = self._lengths[layer]
        self._check_append(layer, start, s)
        _check_out(out, qa.shape)
        self.append_kv(layer, ka, va)
        result = out if out is not None else np.empty(qa.shape, np.float32)
        qb, ob = self.ops.to_device(qa), self.ops.buffer(qa.size)
        try:
            self.cache.prefill_attention_heads(layer, qb, ob, s, start, start + s, self.table, causal)
            ob.copy_to_host(result.reshape(-1))
        finally:
            qb.free()
            ob.free()
        return result

    def prefill_device(self, layer: int, q: Any, out: Any, seq_q: int, q_offset: int, seq_k: int,
                       causal: bool = True, *, out_layout: str = "heads", stream=None) -> None:
        """Device-resident prefill attention from the cache: ``q [H, seq_q, D]`` f32 (query i at position
        ``q_offset + i``) over keys ``[0, seq_k)`` of ``layer``. ``out_layout``: ``"heads"``, ``out [H, seq_q,
        D]`` f32 (SIMT, f32 throughout); ``"tokens-f16"``, ``out [seq_q, H * D]`` f16 token-major from the
        tensor-core kernel a prefill chunk uses."""
        layer = self.config.check_layer(layer)
        self._check_attend(layer, seq_k)
        if out_layout == "heads":
            self.cache.prefill_attention_heads(layer, q, out, seq_q, q_offset, seq_k, self.table, causal,
                                               stream=stream)
        elif out_layout == "tokens-f16":
            self.cache.prefill_attention(layer, q, out, seq_q, q_offset, seq_k, self.table, causal, stream=stream)
        else:
            raise ShapeError(f"out_layout must be 'heads' or 'tokens-f16', got {out_layout!r}")

    def close(self) -> None:
        """Free every device buffer of the executor and its cache."""
        for _, graphs in self._graphs.values():
            graphs.clear()
        self._graphs.clear()
        self.cache.close()
        for b in (self._q_stage, self._out_stage, self._k_stage, self._v_stage, self.table, self._iota):
            b.free()

    def __enter__(self) -> "CudaExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self.config
        return (f"CudaExecutor(layers={c.num_layers}, heads={c.num_heads}/{c.num_kv_heads}, head_dim={c.head_dim}, "
                f"max_len={c.max_len}, block_size={self.block_size}, num_chunks={self.num_chunks})")
