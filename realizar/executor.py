"""CudaExecutor: per-layer KV caches on the GPU and the attention operations that use them.

    ex = CudaExecutor(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_len=2048)
    out = np.empty((9, 64), np.float32)
    n = ex.flash_attention_cached(layer, q, k, v, out)      # append k/v at the end, attend; numpy in/out
    y = ex.prefill(layer, q_seq, k_seq, v_seq)                # S tokens at once (causal), from the cache
    y = ex.flash_attention_multi_head(q, k, v, causal=True)   # stateless prefill attention

Device-resident variants take :class:`~realizar.cuda.GpuBuffer` s (optionally ``(buffer, element
offset)`` pairs, e.g. slices of a fused QKV buffer) and never synchronise or allocate:

    ex.append_kv(layer, k_buf, v_buf, position=step_buf, stream=s)     # position read on the device
    ex.flash_decoding(layer, q_buf, out_buf, seq_len=step_buf, stream=s)

so a decode step can be captured once into a CUDA graph and replayed with the position and length
coming from a small device buffer (``cuda.StepValues``). Launch shapes never depend on the length:
flash decoding is one launch on a static grid of ``num_kv_heads x num_chunks`` blocks that splits
whatever the length is evenly over them and combines the chunks in-kernel (the last blocks to finish
do it, counting on a small device buffer they leave at zero; ``decode_fused=False`` selects the
two-launch chunk + reduce form instead). Calls of one executor share its partial buffers: issue them
on one stream (as a decode step does).

Host-side bookkeeping: :attr:`lengths` holds the number of valid positions of each layer. Calls that
append from the host (``flash_attention_cached``, ``prefill``, ``append_kv`` with an int or no
position) update it; device-positioned appends cannot, so a caller driving the cache from the device
reports the length with :meth:`set_length`. Every argument is validated before the GPU is touched:
wrong dimensions raise :class:`ShapeError`, growth past ``max_len`` :class:`ContextOverflowError`,
reading positions a layer does not hold :class:`CacheStateError` — each saying what was expected and
what came.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ptx_gen.kernels.decode_core import (
    DEFAULT_L2_PREFETCH, MAX_HEAD_DIM, chunk_rows, decode_layout, default_decode_warps,
)
from ptx_gen.kernels.flash_decoding import GROUP_CHUNKS, fused_buffer_sizes
from realizar import cuda
from realizar.cuda.memory import device_address, is_buffer_arg
from realizar.errors import CacheStateError, ContextOverflowError, ShapeError

__all__ = ["AttentionConfig", "CudaExecutor", "default_num_chunks"]

_MAX_CHUNKS = 256
_BLOCKS_PER_SM = 4  # flash-decoding blocks (4 warps each) aimed at per SM
_MIN_CHUNK_ROWS = 32  # default fewest rows per chunk
_GROW_STEPS = 2  # single launch: chunks grow to 2 block steps to keep a short sequence in one combine set


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < 1:
        raise ShapeError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class AttentionConfig:
    """The executor's dimensions, validated on construction (no GPU needed)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_len: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "max_len"):
            object.__setattr__(self, name, _positive_int(name, getattr(self, name)))
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

    # ---- host array validation -----------------------------------------------------------------
    def check_layer(self, layer: Any) -> int:
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= int(layer) < self.num_layers:
            raise ShapeError(f"layer must be an integer in [0, {self.num_layers}), got {layer!r}")
        return int(layer)

    def host_array(self, x: Any, shapes: Sequence[tuple[int, ...]], what: str) -> np.ndarray:
        """``x`` as a C-contiguous float32 array of the first of ``shapes`` (any listed shape with the
        same element count is accepted, e.g. ``[H, D]`` or flat ``[H * D]``)."""
        a = np.asarray(x)
        if a.dtype.kind != "f":
            raise ShapeError(f"{what} must be a floating-point array, got dtype {a.dtype}")
        if tuple(a.shape) not in [tuple(s) for s in shapes]:
            raise ShapeError(f"{what} must have shape {' or '.join(str(tuple(s)) for s in shapes)}, got {a.shape}")
        return np.ascontiguousarray(a, dtype=np.float32).reshape(shapes[0])

    def q_array(self, q: Any) -> np.ndarray:
        h, d = self.q_shape
        return self.host_array(q, [(h, d), (h * d,)], "q")

    def kv_array(self, x: Any, what: str) -> np.ndarray:
        kvh, d = self.kv_shape
        return self.host_array(x, [(kvh, d), (kvh * d,), (kvh, 1, d)], what)

    def seq_arrays(self, q: Any, k: Any, v: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Prefill inputs ``q [H, S, D]``, ``k, v [KVH, Sk, D]`` with ``Sk >= S >= 1``."""
        q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
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


def default_num_chunks(sm_count: int, blocks_per_chunk: int, blocks_per_sm: int = _BLOCKS_PER_SM) -> int:
    """Chunks per KV head so that the flash-decoding grid is one full wave: ``blocks_per_sm`` resident
    blocks on every SM (every chunk gets the same rows, so one wave leaves no SM idle; at most 256)."""
    return max(1, min(_MAX_CHUNKS, blocks_per_sm * sm_count // blocks_per_chunk))


class CudaExecutor:
    """Per-layer GPU KV caches ``[num_kv_heads, max_len, head_dim]`` (f32) and attention on them.

    Tuning knobs of flash decoding (defaults are meant to fill an H100/H200; ``tools/bench_attention.py``
    compares variants): ``num_chunks`` (static grid: chunks per KV head; default: one full wave of the
    decode kernel at the occupancy the driver reports, at most 256), ``min_chunk`` (fewest rows per
    chunk; default 32 or one block step if larger), ``grow_rows`` (single launch: chunks grow up to this
    many rows so that a short sequence uses at most 16 chunks, one combine level; default two block
    steps, 0: never), ``decode_fused`` (one launch with the in-kernel combine, default; False: chunk +
    reduce kernels), ``decode_scores`` (``"scatter"``, the default where it applies, or
    ``"butterfly"``; see ``ptx_gen.kernels.decode_core``), ``decode_warps`` (default 8 where the
    block's shared memory stays within 32 KB, else 4), ``decode_unroll`` (rows per lane group loaded per
    step), ``decode_prefetch`` (load step i+1 into registers while computing i) and
    ``decode_l2_prefetch`` (steps of rows requested from the L2 ahead of the loads, sm_90; 0: off).
    """

    def __init__(
        self,
        num_layers: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        device: Any = None,
        *,
        num_chunks: int | None = None,
        min_chunk: int | None = None,
        grow_rows: int | None = None,
        decode_warps: int | None = None,
        decode_unroll: int | None = None,
        decode_prefetch: bool = False,
        decode_fused: bool = True,
        decode_scores: str | None = None,
        decode_l2_prefetch: int = DEFAULT_L2_PREFETCH,
    ):
        cfg = AttentionConfig(num_layers, num_heads, num_kv_heads, head_dim, max_len)
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
            num_chunks = _positive_int("num_chunks", num_chunks)
            if num_chunks > 4096:
                raise ShapeError(f"num_chunks must be at most 4096, got {num_chunks}")
        if min_chunk is not None:
            min_chunk = _positive_int("min_chunk", min_chunk)
            if min_chunk > cfg.max_len:
                raise ShapeError(f"min_chunk ({min_chunk}) must not exceed max_len ({cfg.max_len})")
        if grow_rows is not None and (isinstance(grow_rows, bool) or not isinstance(grow_rows, (int, np.integer))
                                      or not 0 <= grow_rows < 1 << 31):
            raise ShapeError(f"grow_rows must be a non-negative integer, got {grow_rows!r}")
        self.config = cfg
        self._layout = layout
        # ---- the GPU from here on
        self.device = device or cuda.current_device()
        free, _ = self.device.memory_info()
        if cfg.cache_bytes > free:
            raise ShapeError(
                f"the KV caches need {cfg.cache_bytes / 2**30:.2f} GiB ({cfg.num_layers} layers x 2 x "
                f"{cfg.cache_shape} f32) but the device has {free / 2**30:.2f} GiB free: lower max_len"
            )
        self.kernels = cuda.module_cache(self.device)
        self._kernel_memo: dict[tuple, Any] = {}
        # load the graph-path kernels now: a module load inside a stream capture could invalidate it
        decode = self._decode_kernel(True)
        self._kernel("kv_append", head_dim=cfg.head_dim, indirect=True)
        grid_x = cfg.num_kv_heads * layout.subgroups
        self.num_chunks = num_chunks or default_num_chunks(
            self.device.sm_count, grid_x, max(1, self.device.occupancy(decode, layout.threads)))
        if not self.fused:
            self._kernel("flash_decoding_reduce", head_dim=cfg.head_dim, num_chunks=self.num_chunks, indirect=True)
        self.min_chunk = min_chunk or min(max(_MIN_CHUNK_ROWS, layout.rows_per_step), cfg.max_len)
        self.grow_rows = (_GROW_STEPS * layout.rows_per_step if grow_rows is None else int(grow_rows)) \
            if self.fused else 0
        n = cfg.num_kv_heads * cfg.max_len * cfg.head_dim
        self._k: list = []
        self._v: list = []
        for _ in range(cfg.num_layers):
            kb, vb = cuda.GpuBuffer(n, device=self.device), cuda.GpuBuffer(n, device=self.device)
            kb.fill_bytes(0)
            vb.fill_bytes(0)
            self._k.append(kb)
            self._v.append(vb)
        h, d, kvh = cfg.num_heads, cfg.head_dim, cfg.num_kv_heads
        self._counters = None
        if self.fused:
            n_acc, n_ml, n_cnt = fused_buffer_sizes(h, grid_x, self.num_chunks, d)
            # zero between calls: each call leaves it so
            self._counters = cuda.GpuBuffer(n_cnt, np.uint32, device=self.device)
            self._counters.fill_bytes(0)
        else:
            n_acc, n_ml = h * self.num_chunks * d, h * self.num_chunks * 2
        self._part_acc = cuda.GpuBuffer(n_acc, device=self.device)
        self._part_ml = cuda.GpuBuffer(n_ml, device=self.device)
        self._q_stage = cuda.GpuBuffer(h * d, device=self.device)
        self._out_stage = cuda.GpuBuffer(h * d, device=self.device)
        self._k_stage = cuda.GpuBuffer(kvh * d, device=self.device)
        self._v_stage = cuda.GpuBuffer(kvh * d, device=self.device)
        self._lengths = [0] * cfg.num_layers
        self._args_cache: dict[tuple, Any] = {}

    def _decode_kernel(self, indirect: bool):
        """The flash-decoding kernel (fused) or its chunk kernel (two launches)."""
        cfg = self.config
        return self._kernel("flash_decoding" if self.fused else "flash_decoding_chunk", head_dim=cfg.head_dim,
                            group=cfg.group, indirect=indirect, **self._decode_opts)

    @property
    def decode_kernel(self):
        """The compiled kernel that :meth:`flash_decoding` launches with a device seq_len (fused), or its
        chunk kernel (two launches)."""
        return self._decode_kernel(True)

    @property
    def decode_launches(self) -> int:
        """Kernel launches per :meth:`flash_decoding` call (1 fused, 2 otherwise)."""
        return 1 if self.fused else 2

    def _kernel(self, name: str, **shape):
        key = (name, *sorted(shape.items()))
        hit = self._kernel_memo.get(key)
        if hit is None:
            hit = self._kernel_memo[key] = self.kernels.get(name, **shape)
        return hit

    # ---- properties --------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.config.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    @property
    def max_len(self) -> int:
        return self.config.max_len

    @property
    def lengths(self) -> tuple[int, ...]:
        """Valid positions per layer (host bookkeeping)."""
        return tuple(self._lengths)

    def k_cache(self, layer: int):
        """Layer ``layer``'s K cache buffer, ``[num_kv_heads, max_len, head_dim]`` f32."""
        return self._k[self.config.check_layer(layer)]

    def v_cache(self, layer: int):
        return self._v[self.config.check_layer(layer)]

    def cache_to_numpy(self, layer: int, length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The first ``length`` (default: all valid) positions of a layer's K and V, ``[KVH, length, D]``."""
        layer = self.config.check_layer(layer)
        length = self._lengths[layer] if length is None else length
        shape = self.config.cache_shape
        k = self._k[layer].to_numpy(shape)[:, :length].copy()
        v = self._v[layer].to_numpy(shape)[:, :length].copy()
        return k, v

    # ---- cache bookkeeping -------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every position of every layer (the memory is reused, not cleared)."""
        self._lengths = [0] * self.num_layers

    def truncate(self, layer: int | None, length: int) -> None:
        """Keep the first ``length`` positions of ``layer`` (``None``: every layer)."""
        layers = range(self.num_layers) if layer is None else [self.config.check_layer(layer)]
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 0:
            raise ShapeError(f"length must be a non-negative integer, got {length!r}")
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
        layers = range(self.num_layers) if layer is None else [self.config.check_layer(layer)]
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 0:
            raise ShapeError(f"length must be a non-negative integer, got {length!r}")
        if length > self.max_len:
            raise ContextOverflowError(f"length {length} exceeds max_len {self.max_len}")
        for i in layers:
            self._lengths[i] = int(length)

    def _check_append(self, layer: int, position: int, count: int) -> None:
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

    def _check_attend(self, layer: int, seq_len: int) -> None:
        if self._lengths[layer] == 0:
            raise CacheStateError(f"layer {layer} is uninitialised: it holds no positions yet (append K/V first)")
        if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
            raise ShapeError(f"seq_len must be a positive integer, got {seq_len!r}")
        if seq_len > self._lengths[layer]:
            raise CacheStateError(
                f"layer {layer} holds {self._lengths[layer]} positions, asked to attend over {seq_len}"
            )

    # ---- device arguments --------------------------------------------------------------------------
    def _device_arg(self, x: Any, count: int, what: str, dtype=np.float32) -> tuple[int, Any]:
        """(device address, owning buffer) of a GpuBuffer or (GpuBuffer, element offset); f32 operands
        must be 16-byte aligned (the kernels read them as float4)."""
        return device_address(x, count, what, dtype, 16 if np.dtype(dtype) == np.float32 else 1)

    def _args(self, kernel, key: tuple | None, values: dict, buffers: dict):
        """Packed arguments, cached under ``key`` for the fixed-address (graph) paths."""
        if key is not None:
            # the same addresses in new buffers (freed and reallocated) must not reuse stale records
            key = key + tuple(id(b) for b in buffers.values())
            hit = self._args_cache.get(key)
            if hit is not None and all(getattr(b, "alive", True) for b in hit.buffers.values()):
                return hit
        args = kernel.args(**values)
        for name, buf in buffers.items():
            args.buffers[name] = buf
        if key is not None:
            if len(self._args_cache) > 4096:
                self._args_cache.clear()
            self._args_cache[key] = args
        return args

    def _seq_len_value(self, seq_len: Any, what: str = "seq_len") -> tuple[bool, dict, dict]:
        """(indirect, kernel argument, buffers) for an int or a device u32 (GpuBuffer or (buffer, index))."""
        if is_buffer_arg(seq_len):
            addr, buf = self._device_arg(seq_len, 1, what, np.uint32)
            return True, {"seq_len_ptr": addr}, {f"{what}_buffer": buf}
        if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 0:
            raise ShapeError(f"{what} must be a non-negative integer or a u32 GpuBuffer, got {seq_len!r}")
        if seq_len > self.max_len:
            raise ContextOverflowError(f"{what} {seq_len} exceeds max_len {self.max_len}")
        return False, {"seq_len": int(seq_len)}, {}

    # ---- kernels -----------------------------------------------------------------------------------
    def _launch_append(self, layer: int, k_addr: int, v_addr: int, count: int, position: Any, stream, bufs: dict):
        cfg = self.config
        if is_buffer_arg(position):
            paddr, pbuf = self._device_arg(position, 1, "position", np.uint32)
            kern = self._kernel("kv_append", head_dim=cfg.head_dim, indirect=True)
            key = ("append", layer, k_addr, v_addr, count, paddr)
            values = {"pos_ptr": paddr}
            bufs = {**bufs, "position": pbuf}
        else:
            kern = self._kernel("kv_append", head_dim=cfg.head_dim, indirect=False)
            key = None
            values = {"pos": int(position)}
        args = self._args(kern, key, {"k_cache": self._k[layer], "v_cache": self._v[layer], "k_new": k_addr,
                                      "v_new": v_addr, "count": count, "max_len": cfg.max_len, **values}, bufs)
        block = kern.meta["block"]
        grid = (-(-count * (cfg.head_dim // 4) // block), cfg.num_kv_heads)
        cuda.launch(kern, grid, block, args, stream=stream)

    def _launch_flash_decoding(self, layer: int, q_addr: int, out_addr: int, seq: tuple, stream, bufs: dict):
        cfg = self.config
        indirect, sl_values, sl_bufs = seq
        cacheable = indirect
        sl_key = tuple(sl_values.items())
        grid = (cfg.num_kv_heads * self._layout.subgroups, self.num_chunks)
        if self.fused:
            kern = self._decode_kernel(indirect)
            args = self._args(
                kern, ("fd", layer, q_addr, out_addr, sl_key) if cacheable else None,
                {"q": q_addr, "k_cache": self._k[layer], "v_cache": self._v[layer], "out": out_addr,
                 "part_acc": self._part_acc, "part_ml": self._part_ml, "counters": self._counters,
                 "max_len": cfg.max_len, "min_chunk": self.min_chunk, "grow_rows": self.grow_rows, **sl_values},
                {**bufs, **sl_bufs},
            )
            cuda.launch(kern, grid, kern.meta["block"], args, stream=stream)
            return
        chunk = self._decode_kernel(indirect)
        reduce = self._kernel("flash_decoding_reduce", head_dim=cfg.head_dim, num_chunks=self.num_chunks,
                              indirect=indirect)
        cargs = self._args(
            chunk, ("fd_chunk", layer, q_addr, sl_key) if cacheable else None,
            {"q": q_addr, "k_cache": self._k[layer], "v_cache": self._v[layer], "part_acc": self._part_acc,
             "part_ml": self._part_ml, "max_len": cfg.max_len, "min_chunk": self.min_chunk, **sl_values},
            {**bufs, **sl_bufs},
        )
        rargs = self._args(
            reduce, ("fd_reduce", out_addr, sl_key) if cacheable else None,
            {"part_acc": self._part_acc, "part_ml": self._part_ml, "out": out_addr, "max_len": cfg.max_len,
             **sl_values},
            {**bufs, **sl_bufs},
        )
        cuda.launch(chunk, grid, chunk.meta["block"], cargs, stream=stream)
        cuda.launch(reduce, cfg.num_heads, reduce.meta["block"], rargs, stream=stream)

    def _launch_incremental(self, layer: int, q_addr: int, out_addr: int, seq: tuple, stream, bufs: dict):
        cfg = self.config
        indirect, sl_values, sl_bufs = seq
        kern = self._kernel("incremental_attention", head_dim=cfg.head_dim, group=cfg.group, indirect=indirect)
        args = self._args(
            kern, ("incr", layer, q_addr, out_addr, tuple(sl_values.items())) if indirect else None,
            {"q": q_addr, "k_cache": self._k[layer], "v_cache": self._v[layer], "out": out_addr,
             "max_len": cfg.max_len, **sl_values},
            {**bufs, **sl_bufs},
        )
        cuda.launch(kern, cfg.num_kv_heads * kern.meta["subgroups"], kern.meta["block"], args, stream=stream)

    def _launch_prefill(self, q_addr, k_addr, v_addr, out_addr, seq_q, seq_k, q_offset, kv_stride, causal, stream):
        cfg = self.config
        kern = self._kernel("flash_attention", head_dim=cfg.head_dim, group=cfg.group, causal=bool(causal))
        args = kern.args(q=q_addr, k=k_addr, v=v_addr, out=out_addr, seq_q=seq_q, seq_k=seq_k, q_offset=q_offset,
                         kv_stride=kv_stride)
        grid = (-(-seq_q // kern.meta["block_q"]), cfg.num_heads)
        cuda.launch(kern, grid, kern.meta["block"], args, kern.meta["shared_bytes"], stream=stream)

    # ---- public operations ---------------------------------------------------------------------------
    def append_kv(self, layer: int, k: Any, v: Any, position: Any = None, *, stream=None) -> int:
        """Write K/V of one or more positions into ``layer``'s cache; returns the host-side length.

        ``k``/``v``: numpy ``[KVH, D]`` / ``[KVH, S, D]``, or GpuBuffers (or (buffer, offset)) holding
        one position, ``KVH * D`` floats (:meth:`append_kv_count` appends S device-resident positions
        laid out ``[KVH, S, D]``). ``position``: ``None`` (append at the end), an int (overwrite from
        there; no holes), or a u32 device buffer (or (buffer, index)) read on the device —
        graph-compatible; the host length is then not changed (see :meth:`set_length`)."""
        return self.append_kv_count(layer, k, v, None, position, stream=stream)

    def append_kv_count(
        self, layer: int, k: Any, v: Any, count: int | None, position: Any = None, *, stream=None
    ) -> int:
        """:meth:`append_kv` with an explicit number of positions ``count`` (needed for device inputs
        of more than one position)."""
        cfg = self.config
        layer = cfg.check_layer(layer)
        device_inputs = is_buffer_arg(k) or is_buffer_arg(v)
        if device_inputs:
            count = 1 if count is None else _positive_int("count", count)
            n = cfg.num_kv_heads * count * cfg.head_dim
            k_addr, kb = self._device_arg(k, n, "k")
            v_addr, vb = self._device_arg(v, n, "v")
            bufs = {"k_new": kb, "v_new": vb}
        else:
            ka, va = np.asarray(k), np.asarray(v)
            if ka.ndim == 3:
                if ka.shape[0] != cfg.num_kv_heads or ka.shape[2] != cfg.head_dim or ka.shape[1] < 1:
                    raise ShapeError(f"k must be [num_kv_heads={cfg.num_kv_heads}, S >= 1, head_dim={cfg.head_dim}], "
                                     f"got {ka.shape}")
                if va.shape != ka.shape:
                    raise ShapeError(f"v must have k's shape {ka.shape}, got {va.shape}")
                count_h = ka.shape[1]
                ka = cfg.host_array(ka, [ka.shape], "k")
                va = cfg.host_array(va, [va.shape], "v")
            else:
                ka, va = cfg.kv_array(ka, "k"), cfg.kv_array(va, "v")
                count_h = 1
            if count is not None and count != count_h:
                raise ShapeError(f"count {count} does not match the {count_h} positions in k/v")
            count = count_h
        if position is None:
            position = self._lengths[layer]
        if not is_buffer_arg(position):
            if isinstance(position, bool) or not isinstance(position, (int, np.integer)) or position < 0:
                raise ShapeError(f"position must be a non-negative integer or a u32 GpuBuffer, got {position!r}")
            self._check_append(layer, int(position), count)
        if not device_inputs:
            if count == 1:
                self._k_stage.copy_from_host(ka.reshape(-1))
                self._v_stage.copy_from_host(va.reshape(-1))
                # staged through fixed buffers with synchronous copies: launch on the null stream so the
                # next call's copy cannot overtake this kernel
                self._launch_append(layer, self._k_stage.ptr, self._v_stage.ptr, count, position, None, {})
            else:
                dev = self.device
                kb, vb = cuda.GpuBuffer.from_numpy(ka, device=dev), cuda.GpuBuffer.from_numpy(va, device=dev)
                try:
                    self._launch_append(layer, kb.ptr, vb.ptr, count, position, None, {})
                    self.device.synchronize()
                finally:
                    kb.free()
                    vb.free()
        else:
            self._launch_append(layer, k_addr, v_addr, count, position, stream, bufs)
        if not is_buffer_arg(position):
            self._lengths[layer] = max(self._lengths[layer], int(position) + count)
        return self._lengths[layer]

    def flash_attention_cached(self, layer: int, q: Any, k: Any, v: Any, out: Any) -> int:
        """Append ``k``, ``v`` (``[KVH, D]``) at the end of ``layer``'s cache and write the attention of
        ``q`` (``[H, D]``) over every position, the new one included, into ``out`` (``[H, D]``).
        Returns the new length. Numpy arrays (synchronous) or GpuBuffers (asynchronous) throughout."""
        cfg = self.config
        layer = cfg.check_layer(layer)
        pos = self._lengths[layer]
        if pos + 1 > cfg.max_len:
            raise ContextOverflowError(
                f"layer {layer} is full: {pos} of max_len {cfg.max_len} positions used, cannot append one more"
            )
        if is_buffer_arg(q):
            q_addr, qb = self._device_arg(q, cfg.num_heads * cfg.head_dim, "q")
            o_addr, ob = self._device_arg(out, cfg.num_heads * cfg.head_dim, "out")
            self.append_kv(layer, k, v)
            self._launch_flash_decoding(layer, q_addr, o_addr, self._seq_len_value(pos + 1), None,
                                        {"q": qb, "out": ob})
            return self._lengths[layer]
        qa = cfg.q_array(q)
        out_arr = self._host_out(out)
        self.append_kv(layer, k, v)
        self._q_stage.copy_from_host(qa.reshape(-1))
        self._launch_flash_decoding(layer, self._q_stage.ptr, self._out_stage.ptr, self._seq_len_value(pos + 1),
                                    None, {})
        self._out_stage.copy_to_host(out_arr.reshape(-1))
        return self._lengths[layer]

    def _host_out(self, out: Any) -> np.ndarray:
        h, d = self.config.q_shape
        if not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape not in ((h, d), (h * d,)) \
                or not out.flags.c_contiguous or not out.flags.writeable:
            got = f"{type(out).__name__} {getattr(out, 'shape', '')} {getattr(out, 'dtype', '')}"
            raise ShapeError(f"out must be a writable C-contiguous float32 array of shape ({h}, {d}), got {got}")
        return out

    def incremental_attention_gpu(self, layer: int, q: Any, out: Any = None, seq_len: Any = None, *, stream=None):
        """Attention of ``q [H, D]`` over the first ``seq_len`` positions of ``layer`` (default: all it
        holds) with the one-pass kernel (one block per KV head: best for short sequences).

        numpy ``q``: returns the output (``out`` optional). GpuBuffer ``q``/``out``: asynchronous on
        ``stream``; ``seq_len`` may then be a u32 device buffer (read on the device)."""
        cfg = self.config
        layer = cfg.check_layer(layer)
        if is_buffer_arg(q):
            q_addr, qb = self._device_arg(q, cfg.num_heads * cfg.head_dim, "q")
            o_addr, ob = self._device_arg(out, cfg.num_heads * cfg.head_dim, "out")
            if seq_len is None:
                seq_len = self._lengths[layer]
            if not is_buffer_arg(seq_len):
                self._check_attend(layer, seq_len)
            self._launch_incremental(layer, q_addr, o_addr, self._seq_len_value(seq_len), stream, {"q": qb, "out": ob})
            return out
        qa = cfg.q_array(q)
        out_arr = np.empty(cfg.q_shape, np.float32) if out is None else self._host_out(out)
        seq_len = self._lengths[layer] if seq_len is None else seq_len
        self._check_attend(layer, seq_len)
        self._q_stage.copy_from_host(qa.reshape(-1))
        self._launch_incremental(layer, self._q_stage.ptr, self._out_stage.ptr, self._seq_len_value(seq_len), None, {})
        self._out_stage.copy_to_host(out_arr.reshape(-1))
        return out_arr

    def flash_decoding(self, layer: int, q: Any, out: Any, seq_len: Any, *, stream=None) -> None:
        """Split-KV decode attention of ``q`` over the first ``seq_len`` positions of ``layer``.

        Device-resident: ``q``/``out`` are GpuBuffers (or (buffer, offset)) of ``H * D`` floats,
        ``seq_len`` a u32 GpuBuffer (or (buffer, index)) read on the device — or an int. One launch
        (:attr:`decode_launches`) on ``stream`` with a fixed shape and cached arguments; no
        synchronisation, no allocation: safe to capture into a graph. A device-side seq_len is clamped
        to max_len; 0 writes zeros."""
        cfg = self.config
        layer = cfg.check_layer(layer)
        q_addr, qb = self._device_arg(q, cfg.num_heads * cfg.head_dim, "q")
        o_addr, ob = self._device_arg(out, cfg.num_heads * cfg.head_dim, "out")
        if not is_buffer_arg(seq_len):
            self._check_attend(layer, seq_len)
        self._launch_flash_decoding(layer, q_addr, o_addr, self._seq_len_value(seq_len), stream, {"q": qb, "out": ob})

    def flash_attention_multi_head(self, q: Any, k: Any, v: Any, causal: bool = True, out: np.ndarray | None = None):
        """Prefill attention without the cache: ``q [H, S, D]``, ``k, v [KVH, Sk, D]`` (``Sk >= S``; the
        queries are the last S positions for the causal mask) → ``[H, S, D]`` (numpy)."""
        cfg = self.config
        qa, ka, va = cfg.seq_arrays(q, k, v)
        s, sk = qa.shape[1], ka.shape[1]
        if out is not None and (not isinstance(out, np.ndarray) or out.shape != qa.shape or out.dtype != np.float32
                                or not out.flags.c_contiguous):
            raise ShapeError(f"out must be a C-contiguous float32 array of shape {qa.shape}")
        result = out if out is not None else np.empty(qa.shape, np.float32)
        bufs = [cuda.GpuBuffer.from_numpy(a, device=self.device) for a in (qa, ka, va)]
        bufs.append(cuda.GpuBuffer(qa.size, device=self.device))
        try:
            qb, kb, vb, ob = bufs
            self._launch_prefill(qb.ptr, kb.ptr, vb.ptr, ob.ptr, s, sk, sk - s, sk, causal, None)
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
        qa, ka, va = cfg.seq_arrays(q, k, v)
        s = qa.shape[1]
        if ka.shape[1] != s:
            raise ShapeError(f"prefill takes as many new keys as queries: q has {s}, k has {ka.shape[1]}")
        start = self._lengths[layer]
        self._check_append(layer, start, s)
        if out is not None and (not isinstance(out, np.ndarray) or out.shape != qa.shape or out.dtype != np.float32
                                or not out.flags.c_contiguous):
            raise ShapeError(f"out must be a C-contiguous float32 array of shape {qa.shape}")
        self.append_kv(layer, ka, va)
        result = out if out is not None else np.empty(qa.shape, np.float32)
        qb, ob = cuda.GpuBuffer.from_numpy(qa, device=self.device), cuda.GpuBuffer(qa.size, device=self.device)
        try:
            self._launch_prefill(qb.ptr, self._k[layer].ptr, self._v[layer].ptr, ob.ptr, s, start + s, start,
                                 cfg.max_len, causal, None)
            ob.copy_to_host(result.reshape(-1))
        finally:
            qb.free()
            ob.free()
        return result

    def prefill_device(self, layer: int, q: Any, out: Any, seq_q: int, q_offset: int, seq_k: int,
                       causal: bool = True, *, stream=None) -> None:
        """Prefill attention straight from ``layer``'s cache on the device: ``q``/``out`` GpuBuffers
        ``[H, seq_q, D]``; keys ``[0, seq_k)`` of the cache; query i at position ``q_offset + i``."""
        cfg = self.config
        layer = cfg.check_layer(layer)
        seq_q = _positive_int("seq_q", seq_q)
        seq_k = _positive_int("seq_k", seq_k)
        if isinstance(q_offset, bool) or not isinstance(q_offset, (int, np.integer)) or q_offset < 0:
            raise ShapeError(f"q_offset must be a non-negative integer, got {q_offset!r}")
        self._check_attend(layer, seq_k)
        if causal and q_offset + seq_q > seq_k:
            raise ShapeError(f"causal queries at positions {q_offset}..{q_offset + seq_q - 1} need {q_offset + seq_q} "
                             f"keys, seq_k is {seq_k}")
        n = cfg.num_heads * seq_q * cfg.head_dim
        q_addr, _ = self._device_arg(q, n, "q")
        o_addr, _ = self._device_arg(out, n, "out")
        self._launch_prefill(q_addr, self._k[layer].ptr, self._v[layer].ptr, o_addr, seq_q, seq_k, q_offset,
                             cfg.max_len, causal, stream)

    def decode_chunk_rows(self, seq_len: int) -> int:
        """Rows per flash-decoding chunk at ``seq_len`` (what the kernel computes on the device)."""
        return chunk_rows(seq_len, self.num_chunks, self.min_chunk, self.grow_rows, GROUP_CHUNKS)

    def close(self) -> None:
        """Free every device buffer of the executor."""
        for b in [*self._k, *self._v, self._part_acc, self._part_ml, self._counters, self._q_stage,
                  self._out_stage, self._k_stage, self._v_stage]:
            if b is not None:
                b.free()
        self._args_cache.clear()

    def __enter__(self) -> "CudaExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self.config
        return (f"CudaExecutor(layers={c.num_layers}, heads={c.num_heads}/{c.num_kv_heads}, head_dim={c.head_dim}, "
                f"max_len={c.max_len}, num_chunks={self.num_chunks}, fused={self.fused})")
