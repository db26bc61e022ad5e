"""CudaExecutor: NumPy-in/NumPy-out attention on a GPU KV cache, for experimenting with the kernels.

    ex = CudaExecutor(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_len=2048)
    out = np.empty((9, 64), np.float32)
    n = ex.flash_attention_cached(layer, q, k, v, out)      # append k/v at the end, attend; numpy in/out
    y = ex.prefill(layer, q_seq, k_seq, v_seq)                # S tokens at once (causal), from the cache
    y = ex.flash_attention_multi_head(q, k, v, causal=True)   # stateless prefill attention

A thin facade over :class:`~realizar.gpu.kv_cache.KVCache` (``ex.cache``), which owns the layout, the
appends, the attention kernels, the host bookkeeping (:attr:`lengths`, :meth:`set_length`, ...) and the
flash-decoding tuning knobs (keyword arguments are passed on). NumPy arguments are staged through
fixed device buffers with synchronous copies; the device-resident forms take
:class:`~realizar.cuda.GpuBuffer` s (or ``(buffer, element offset)`` pairs) and never synchronise or
allocate, so they can be captured into a CUDA graph:

    ex.append_kv(layer, k_buf, v_buf, position=step_buf, stream=s)     # position read on the device
    ex.flash_decoding(layer, q_buf, out_buf, seq_len=step_buf, stream=s)
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from realizar.errors import ContextOverflowError, ShapeError
from realizar.gpu.dispatch import check_int, is_buffer_arg
from realizar.gpu.kv_cache import AttentionConfig, KVCache, default_num_chunks

__all__ = ["AttentionConfig", "CudaExecutor", "default_num_chunks"]


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
    """Attention on per-layer GPU KV caches ``[num_kv_heads, max_len, head_dim]`` (f32) with NumPy or
    device-resident operands. Tuning keywords: see :class:`~realizar.gpu.kv_cache.KVCache`."""

    def __init__(self, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int, max_len: int,
                 device: Any = None, **tuning: Any):
        self.cache = cache = KVCache(num_layers, num_heads, num_kv_heads, head_dim, max_len, device, **tuning)
        self.ops, self.device, self.config = cache.ops, cache.device, cache.config
        # the device-positioned append may be captured into a graph: load its kernel outside any capture
        self.ops.kernel("kv_append", head_dim=self.config.head_dim, indirect=True)
        h, d, kvh = self.config.num_heads, self.config.head_dim, self.config.num_kv_heads
        self._q_stage, self._out_stage = self.ops.buffer(h * d), self.ops.buffer(h * d)
        self._k_stage, self._v_stage = self.ops.buffer(kvh * d), self.ops.buffer(kvh * d)

    # ---- the cache's layout, knobs and bookkeeping ---------------------------------------------------
    num_layers = property(lambda self: self.config.num_layers)
    num_heads = property(lambda self: self.config.num_heads)
    num_kv_heads = property(lambda self: self.config.num_kv_heads)
    head_dim = property(lambda self: self.config.head_dim)
    max_len = property(lambda self: self.config.max_len)
    num_chunks = property(lambda self: self.cache.num_chunks)
    min_chunk = property(lambda self: self.cache.min_chunk)
    grow_rows = property(lambda self: self.cache.grow_rows)
    fused = property(lambda self: self.cache.fused)
    decode_kernel = property(lambda self: self.cache.decode_kernel, doc=KVCache.decode_kernel.__doc__)
    decode_launches = property(lambda self: self.cache.decode_launches, doc=KVCache.decode_launches.__doc__)
    lengths = property(lambda self: self.cache.lengths, doc=KVCache.lengths.__doc__)

    def k_cache(self, layer: int):
        return self.cache.k_cache(layer)

    def v_cache(self, layer: int):
        return self.cache.v_cache(layer)

    def reset(self) -> None:
        self.cache.reset()

    def truncate(self, layer: int | None, length: int) -> None:
        self.cache.truncate(layer, length)

    def set_length(self, layer: int | None, length: int) -> None:
        self.cache.set_length(layer, length)

    def cache_to_numpy(self, layer: int, length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The first ``length`` (default: all valid) positions of a layer's K and V, ``[KVH, length, D]``."""
        layer = self.config.check_layer(layer)
        length = self.cache.lengths[layer] if length is None else length
        shape = self.config.cache_shape
        k = self.cache.k_cache(layer).to_numpy(shape)[:, :length].copy()
        v = self.cache.v_cache(layer).to_numpy(shape)[:, :length].copy()
        return k, v

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

    # ---- appends -----------------------------------------------------------------------------------
    def append_kv(self, layer: int, k: Any, v: Any, position: Any = None, *, count: int | None = None,
                  stream=None) -> int:
        """Write K/V of one or more positions into ``layer``'s cache; returns the host-side length.

        ``k``/``v``: numpy ``[KVH, D]`` / ``[KVH, S, D]``, or GpuBuffers (or (buffer, offset)) holding
        ``count`` (default 1) positions laid out ``[KVH, count, D]``. ``position``: ``None`` (append at
        the end), an int (overwrite from there; no holes), or a u32 device buffer (or (buffer, index))
        read on the device — graph-compatible; the host length is then not changed (see
        :meth:`set_length`)."""
        cfg, cache = self.config, self.cache
        layer = cfg.check_layer(layer)
        device_inputs = is_buffer_arg(k) or is_buffer_arg(v)
        if device_inputs:
            count = 1 if count is None else check_int("count", count)
            n = cfg.num_kv_heads * count * cfg.head_dim
            k_addr, kb = self.ops.operand(k, n, "k")
            v_addr, vb = self.ops.operand(v, n, "v")
            bufs = {"k_new": kb, "v_new": vb}
        else:
            ka, va, count_h = self._host_kv(k, v)
            if count is not None and count != count_h:
                raise ShapeError(f"count {count} does not match the {count_h} positions in k/v")
            count = count_h
        if position is None:
            position = cache.lengths[layer]
        if not is_buffer_arg(position):
            if isinstance(position, bool) or not isinstance(position, (int, np.integer)) or position < 0:
                raise ShapeError(f"position must be a non-negative integer or a u32 GpuBuffer, got {position!r}")
            cache.check_append(layer, int(position), count)
        if device_inputs:
            cache.append(layer, k_addr, v_addr, count, position, stream, bufs)
        elif count == 1:
            self._k_stage.copy_from_host(ka.reshape(-1))
            self._v_stage.copy_from_host(va.reshape(-1))
            # staged through fixed buffers with synchronous copies: launch on the null stream so the
            # next call's copy cannot overtake this kernel
            cache.append(layer, self._k_stage.ptr, self._v_stage.ptr, count, position, None, {})
        else:
            kb, vb = self.ops.to_device(ka), self.ops.to_device(va)
            try:
                cache.append(layer, kb.ptr, vb.ptr, count, position, None, {})
                self.device.synchronize()
            finally:
                kb.free()
                vb.free()
        if not is_buffer_arg(position):
            cache.set_length(layer, max(cache.lengths[layer], int(position) + count))
        return cache.lengths[layer]

    # ---- attention ---------------------------------------------------------------------------------
    def flash_attention_cached(self, layer: int, q: Any, k: Any, v: Any, out: Any) -> int:
        """Append ``k``, ``v`` (``[KVH, D]``) at the end of ``layer``'s cache and write the attention of
        ``q`` (``[H, D]``) over every position, the new one included, into ``out`` (``[H, D]``).
        Returns the new length. Numpy arrays (synchronous) or GpuBuffers (asynchronous) throughout."""
        cfg, cache = self.config, self.cache
        layer = cfg.check_layer(layer)
        pos = cache.lengths[layer]
        if pos + 1 > cfg.max_len:
            raise ContextOverflowError(
                f"layer {layer} is full: {pos} of max_len {cfg.max_len} positions used, cannot append one more"
            )
        if is_buffer_arg(q):
            q_addr, o_addr, bufs = cache._qo(q, out)
            self.append_kv(layer, k, v)
            cache.launch_flash_decoding(layer, q_addr, o_addr, cache.seq_len_value(pos + 1), None, bufs)
            return cache.lengths[layer]
        qa = _host_array(q, [cfg.q_shape, (cfg.num_heads * cfg.head_dim,)], "q")
        out_arr = self._host_out(out)
        self.append_kv(layer, k, v)
        self._q_stage.copy_from_host(qa.reshape(-1))
        cache.launch_flash_decoding(layer, self._q_stage.ptr, self._out_stage.ptr, cache.seq_len_value(pos + 1),
                                    None, {})
        self._out_stage.copy_to_host(out_arr.reshape(-1))
        return cache.lengths[layer]

    def incremental_attention_gpu(self, layer: int, q: Any, out: Any = None, seq_len: Any = None, *, stream=None):
        """Attention of ``q [H, D]`` over the first ``seq_len`` positions of ``layer`` (default: all it
        holds) with the one-pass kernel (one block per KV head: best for short sequences).

        numpy ``q``: returns the output (``out`` optional). GpuBuffer ``q``/``out``: asynchronous on
        ``stream``; ``seq_len`` may then be a u32 device buffer (read on the device)."""
        cfg, cache = self.config, self.cache
        layer = cfg.check_layer(layer)
        if is_buffer_arg(q):
            q_addr, o_addr, bufs = cache._qo(q, out)
            if seq_len is None:
                seq_len = cache.lengths[layer]
            if not is_buffer_arg(seq_len):
                cache.check_attend(layer, seq_len)
            cache.incremental_attention(layer, q_addr, o_addr, cache.seq_len_value(seq_len), stream, bufs)
            return out
        qa = _host_array(q, [cfg.q_shape, (cfg.num_heads * cfg.head_dim,)], "q")
        out_arr = np.empty(cfg.q_shape, np.float32) if out is None else self._host_out(out)
        seq_len = cache.lengths[layer] if seq_len is None else seq_len
        cache.check_attend(layer, seq_len)
        self._q_stage.copy_from_host(qa.reshape(-1))
        cache.incremental_attention(layer, self._q_stage.ptr, self._out_stage.ptr, cache.seq_len_value(seq_len),
                                    None, {})
        self._out_stage.copy_to_host(out_arr.reshape(-1))
        return out_arr

    def flash_decoding(self, layer: int, q: Any, out: Any, seq_len: Any, *, stream=None) -> None:
        """Device-resident split-KV decode attention: :meth:`KVCache.flash_decoding`."""
        self.cache.flash_decoding(layer, q, out, seq_len, stream=stream)

    def flash_attention_multi_head(self, q: Any, k: Any, v: Any, causal: bool = True, out: np.ndarray | None = None):
        """Prefill attention without the cache: ``q [H, S, D]``, ``k, v [KVH, Sk, D]`` (``Sk >= S``; the
        queries are the last S positions for the causal mask) → ``[H, S, D]`` (numpy)."""
        qa, ka, va = _seq_arrays(self.config, q, k, v)
        s, sk = qa.shape[1], ka.shape[1]
        _check_out(out, qa.shape)
        result = out if out is not None else np.empty(qa.shape, np.float32)
        bufs = [self.ops.to_device(qa), self.ops.to_device(ka), self.ops.to_device(va), self.ops.buffer(qa.size)]
        try:
            qb, kb, vb, ob = bufs
            self.cache.flash_attention(qb.ptr, kb.ptr, vb.ptr, ob.ptr, s, sk, sk - s, sk, causal, None)
            ob.copy_to_host(result.reshape(-1))
        finally:
            for b in bufs:
                b.free()
        return result

    def prefill(self, layer: int, q: Any, k: Any, v: Any, causal: bool = True, out: np.ndarray | None = None):
        """Append ``k, v [KVH, S, D]`` at the end of ``layer``'s cache, then attend ``q [H, S, D]`` over
        the whole cache in place (earlier positions included; causal by default) → ``[H, S, D]``."""
        cfg, cache = self.config, self.cache
        layer = cfg.check_layer(layer)
        qa, ka, va = _seq_arrays(cfg, q, k, v)
        s = qa.shape[1]
        if ka.shape[1] != s:
            raise ShapeError(f"prefill takes as many new keys as queries: q has {s}, k has {ka.shape[1]}")
        start = cache.lengths[layer]
        cache.check_append(layer, start, s)
        _check_out(out, qa.shape)
        self.append_kv(layer, ka, va)
        result = out if out is not None else np.empty(qa.shape, np.float32)
        qb, ob = self.ops.to_device(qa), self.ops.buffer(qa.size)
        try:
            cache.flash_attention(qb.ptr, cache.k_cache(layer).ptr, cache.v_cache(layer).ptr, ob.ptr, s, start + s,
                                  start, cfg.max_len, causal, None)
            ob.copy_to_host(result.reshape(-1))
        finally:
            qb.free()
            ob.free()
        return result

    def prefill_device(self, layer: int, q: Any, out: Any, seq_q: int, q_offset: int, seq_k: int,
                       causal: bool = True, *, stream=None) -> None:
        """Device-resident prefill attention from the cache: :meth:`KVCache.prefill_attention`."""
        self.cache.prefill_attention(layer, q, out, seq_q, q_offset, seq_k, causal, stream=stream)

    def close(self) -> None:
        """Free every device buffer of the executor and its cache."""
        self.cache.close()
        for b in (self._q_stage, self._out_stage, self._k_stage, self._v_stage):
            b.free()

    def __enter__(self) -> "CudaExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self.config
        return (f"CudaExecutor(layers={c.num_layers}, heads={c.num_heads}/{c.num_kv_heads}, head_dim={c.head_dim}, "
                f"max_len={c.max_len}, num_chunks={self.num_chunks}, fused={self.fused})")
