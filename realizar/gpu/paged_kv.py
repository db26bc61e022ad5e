"""PagedKVCache: per-layer paged K/V pools shared by many sequences, the appends that write them through
block tables and the attention reads over them.

Layout (one layer, K and V alike): ``[num_blocks, num_kv_heads, block_size, head_dim]`` of ``kv_dtype``
(``f32``, ``f16``, ``bf16``: numpy float32 / float16 / uint16 bit patterns; ``q8_0``: int8 codes, plus
scales ``[num_blocks, num_kv_heads, block_size, head_dim / 32]`` float16 in their own buffers, see
:func:`quantize_q8_0`; head_dim a multiple of 32). A sequence owns a block table
(u32 block ids); its position ``p`` lives in block ``table[p // block_size]``, row ``p % block_size``.
Block 0 is the null block: padding rows of a batch point their tables at it (the allocator, elsewhere,
never hands it out). Zero-filled on construction.

    cache = PagedKVCache(layers, 32, 8, 128, num_blocks=4096, block_size=32, kv_dtype="f16", max_batch=64)
    # decode step of B rows (positions, lengths and tables in device u32 buffers: graph-capturable)
    cache.append_decode(layer, qkv, inv_freq, positions, tables, table_stride, B)
    cache.decode_attention(layer, qkv, out, seq_lens, tables, table_stride, B, out_f16=True)
    # prefill chunk of one sequence at positions pos0 .. pos0 + S - 1
    cache.append_rows(layer, qkv_rows, inv_freq, pos0, S, q_heads, table)
    cache.prefill_attention(layer, q_heads, attn_f16, S, pos0, pos0 + S, table)

Decode calls never synchronise or allocate and their launch shapes depend only on ``rows`` (the split of
each sequence into chunks happens on the device from its length), so a decode step can be captured into
a CUDA graph per batch size. Calls of one cache share its partial buffers: issue them on one stream.
Wrong dimensions raise :class:`ShapeError`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ptx_gen.kernels.attention.flash_attention_mma import HEAD_DIMS as MMA_HEAD_DIMS
from ptx_gen.kernels.attention.paged_decode import HEAD_DIMS as DECODE_HEAD_DIMS
from ptx_gen.kernels.attention.paged_decode import MAX_GROUP, WARPS as DECODE_WARPS, buffer_sizes, lanes_per_row
from ptx_gen.kernels.attention.paged_decode_ring import RING_DTYPES, RING_STAGES, ring_bytes, scatter_applies
from ptx_gen.kernels.kv.paged_kv import BLOCK_SIZES, KV_DTYPES, QK
from realizar.errors import ShapeError
from realizar.gpu.dispatch import Dispatcher, check_int
from realizar.models.kv_formats import block_bytes, dequantize_q8_0, quantize_q8_0, round_bf16, row_bytes
from realizar.config import ServingConfig

__all__ = ["PagedKVCache", "KV_NUMPY_DTYPES", "decode_chunks", "heads_unsupported", "decode_min_chunk", "decode_tiling",
           "default_decode_ring", "kv_bytes_per_row", "quantize_q8_0", "dequantize_q8_0"]

_DEFAULTS = ServingConfig()

KV_NUMPY_DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16, "q8_0": np.int8}
_MAX_CHUNKS = 64
_BLOCKS_PER_SM = 4  # decode blocks (4 warps) resident per SM aimed at
_WAVES = 4  # a batch of short sequences fills about one wave; a lone long one is spread over this many
_MIN_CHUNKS = 4  # even a full batch splits a long sequence over at least this many chunks
# fewest positions per chunk (docs/performance.md, serving): a launch whose (row, KV head) pairs do not fill
# the SMs once (one stream served alone, a few) splits into chunks of one 32-position block, so each pair's
# short sequence is spread over more blocks instead of a serial loop in a few; a fuller launch keeps
# 64-position chunks, fewer partial results to combine; a launch whose pairs fill the _BLOCKS_PER_SM blocks of every
# SM alone keeps a sequence of up to 256 positions in one chunk, no partial results at all (H200, 8B batched decode
# at 128 and 256 rows, 192 positions: 1.4x the attention, 1.07x the step; docs/results/bench_attention_batched_h200.md)
_MIN_CHUNK_FEW, _MIN_CHUNK_MANY, _MIN_CHUNK_FULL = 32, 64, 256


def heads_unsupported(num_heads: int, num_kv_heads: int, head_dim: int) -> str | None:
    """Why the paged cache's kernels cannot take these attention heads (None: they can)."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        return f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
    if num_heads // num_kv_heads > MAX_GROUP:
        return f"GQA group (num_heads / num_kv_heads) must be at most {MAX_GROUP}, got {num_heads // num_kv_heads}"
    if head_dim not in DECODE_HEAD_DIMS:
        return f"head_dim must be one of {DECODE_HEAD_DIMS}, got {head_dim}"
    return None


def decode_chunks(rows: int, num_kv_heads: int, sm_count: int) -> int:
    """Chunks per (row, KV head) of a decode launch of ``rows`` rows: enough blocks for ``_WAVES`` waves
    when every chunk is active, at least ``_MIN_CHUNKS`` (a long sequence beside short ones still
    spreads), at most 64. Inactive chunks (short sequences) return at once."""
    want = -(-_WAVES * _BLOCKS_PER_SM * sm_count // (rows * num_kv_heads))
    return max(_MIN_CHUNKS, min(_MAX_CHUNKS, want))


def decode_min_chunk(rows: int, num_kv_heads: int, sm_count: int) -> int:
    """Fewest positions per chunk of a decode launch of ``rows`` rows (see _MIN_CHUNK_FEW)."""
    pairs = rows * num_kv_heads
    if pairs < sm_count:
        return _MIN_CHUNK_FEW
    return _MIN_CHUNK_MANY if pairs < _BLOCKS_PER_SM * sm_count else _MIN_CHUNK_FULL


def decode_tiling(head_dim: int, group: int) -> tuple[int, int]:
    """Default (lanes per K/V row, unroll) of the decode kernel. Head_dim 128 with a GQA group up to 8: 16
    lanes (8 values each, 16-byte f16 loads, half the shuffles and softmax updates per row of 32 lanes) and
    4 rows per lane group in flight (docs/performance.md, serving: faster at long contexts and large
    batches, the same at one row). Elsewhere the kernel's own choice with unroll 2."""
    if head_dim == 128 and group <= 8:
        return 16, 4
    return 0, 2


# the decode kernel's K/V through a ring of this many stages in shared memory, filled by bulk copies (sm_90; f32, f16,
# bf16 pools; 0: loads into registers), its rows per lane group per step there, and the head sizes it is the default
# for (at head_dim 64 the register pass is as fast or faster on the 1B step: docs/performance.md, attention)
DECODE_RING_STAGES = 2
DECODE_RING_UNROLL = 2
DECODE_RING_MIN_HEAD_DIM = 128
# the ring's scores reduce-scattered over the lane group, each lane running one head's softmax, where the shape takes it
# (paged_decode_ring.scatter_applies) instead of every dot reduced on its own and every head's softmax on every lane
# (H200, 8B heads, 256 rows x 192 / 256 positions: 61.8 / 76.2 against 66.9 / 83.4 µs; the 8B step 1.014x / 1.009x at
# B = 128 / 256: docs/performance.md, attention)
DECODE_RING_SCATTER = True


def default_decode_ring(target, kv_dtype: str, head_dim: int, group: int, block_size: int, unroll: int, lanes: int,
                max_shared: int) -> int:
    """Default ring stages of the decode kernel: ``DECODE_RING_STAGES`` where the target has bulk copies, the head size
    is at least ``DECODE_RING_MIN_HEAD_DIM``, the pool's type is one the ring takes and its shared memory fits
    ``max_shared`` bytes a block; else 0."""
    stages = DECODE_RING_STAGES
    if (not stages or target.compute_capability < (9, 0) or head_dim < DECODE_RING_MIN_HEAD_DIM
            or kv_dtype not in RING_DTYPES):
        return 0
    return stages if _ring_bytes(stages, head_dim, group, block_size, kv_dtype, unroll, lanes) <= max_shared else 0


def _ring_bytes(stages: int, head_dim: int, group: int, block_size: int, kv_dtype: str, unroll: int, lanes: int) -> int:
    step = DECODE_WARPS * (32 // (lanes or lanes_per_row(head_dim))) * unroll
    return ring_bytes(stages, head_dim, group, block_size, kv_dtype, step, DECODE_WARPS)


kv_bytes_per_row = row_bytes  # bytes of one head row (one position of one KV head, K or V) in a pool


def _table_arg(x: Any) -> bool:
    return (isinstance(x, tuple) and len(x) == 2 and hasattr(x[0], "ptr")) or hasattr(x, "ptr")


class PagedKVCache:
    """Paged K/V pools for ``num_layers`` layers on one device, the batched decode append and attention,
    and the prefill append and tensor-core attention through one block table.

    ``max_batch``: most rows of a decode launch (sizes the partial buffers); ``num_chunks``: fixed chunks
    per (row, KV head) of a decode launch (default :func:`decode_chunks`, by rows); ``min_chunk``: fewest
    positions per chunk (default :func:`decode_min_chunk`, by rows; rounded up to whole blocks on the device); ``decode_unroll``: rows per
    lane group per step of the decode kernel (1, 2 or 4); ``decode_lanes``: lanes reading one K/V row in the
decode kernel (0: the kernel's default, 32 at head_dim 128; or 4, 8, 16, 32 dividing head_dim / 4); both
None: :func:`decode_tiling`; ``decode_prefetch``: the decode kernel loads each step's block ids during the step
before (built, not yet timed: off); ``decode_ring``: stages of the ring of bulk copies that brings the decode kernel its
K/V rows (sm_90; 0: loads into registers; None: :func:`decode_ring`, and with a ring and no ``decode_unroll``,
``DECODE_RING_UNROLL``); ``decode_scatter``: the ring's scores reduce-scattered (None: ``DECODE_RING_SCATTER`` where
the shape takes it). ``ops``: the dispatcher to launch with."""

    def __init__(self, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int = _DEFAULTS.block_size, kv_dtype: str = "f16", device: Any = None, *, ops: Dispatcher | None = None,
                 max_batch: int = _DEFAULTS.max_batch, num_chunks: int | None = None, min_chunk: int | None = None,
                 decode_unroll: int | None = None, decode_lanes: int | None = None, decode_prefetch: bool = False,
                 decode_ring: int | None = None, decode_scatter: bool | None = None):
        self.num_layers = check_int("num_layers", num_layers)
        self.num_heads = check_int("num_heads", num_heads)
        self.num_kv_heads = check_int("num_kv_heads", num_kv_heads)
        self.head_dim = check_int("head_dim", head_dim)
        self.num_blocks = check_int("num_blocks", num_blocks, lo=2)
        self.max_batch = check_int("max_batch", max_batch)
        self.min_chunk = None if min_chunk is None else check_int("min_chunk", min_chunk)
        if self.num_heads % self.num_kv_heads:
            raise ShapeError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.group = self.num_heads // self.num_kv_heads
        if self.group > MAX_GROUP:
            raise ShapeError(f"GQA group (num_heads / num_kv_heads) must be at most {MAX_GROUP}, got {self.group}")
        if self.head_dim not in DECODE_HEAD_DIMS:
            raise ShapeError(f"head_dim must be one of {DECODE_HEAD_DIMS}, got {head_dim}")
        if block_size not in BLOCK_SIZES:
            raise ShapeError(f"block_size must be one of {BLOCK_SIZES}, got {block_size!r}")
        if kv_dtype not in KV_DTYPES:
            raise ShapeError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
        if kv_dtype == "q8_0" and self.head_dim % QK:
            raise ShapeError(f"a q8_0 pool needs head_dim a multiple of {QK}, got {head_dim}")
        self.ops = ops if ops is not None else Dispatcher(device)
        self.device = self.ops.device
        auto_lanes, auto_unroll = decode_tiling(self.head_dim, self.group)
        decode_lanes = auto_lanes if decode_lanes is None else decode_lanes
        if decode_lanes not in (0, 4, 8, 16, 32) or (decode_lanes and self.head_dim % (4 * decode_lanes)):
            raise ShapeError(f"decode_lanes must be 0 or 4, 8, 16, 32 dividing head_dim / 4 ({self.head_dim // 4}), "
                             f"got {decode_lanes!r}")
        max_shared = self.device.attribute("MAX_SHARED_MEMORY_PER_BLOCK_OPTIN")
        if decode_ring is None:
            ring_unroll = DECODE_RING_UNROLL if decode_unroll is None else decode_unroll
            decode_ring = 0 if decode_prefetch or ring_unroll not in (1, 2, 4) else default_decode_ring(
                self.device.target, kv_dtype, self.head_dim, self.group, block_size, ring_unroll, decode_lanes,
                max_shared)
            auto_unroll = ring_unroll if decode_ring else auto_unroll
        decode_unroll = auto_unroll if decode_unroll is None else decode_unroll
        if decode_unroll not in (1, 2, 4):
            raise ShapeError(f"decode_unroll must be 1, 2 or 4, got {decode_unroll!r}")
        if decode_ring and (decode_ring not in RING_STAGES or kv_dtype not in RING_DTYPES or decode_prefetch
                            or self.device.target.compute_capability < (9, 0)
                            or max_shared < _ring_bytes(decode_ring, self.head_dim, self.group, block_size, kv_dtype,
                                                        decode_unroll, decode_lanes)):
            raise ShapeError(f"decode_ring must be 0 or one of {RING_STAGES} on sm_90 or newer, with an f32, f16 or "
                             f"bf16 pool, without decode_prefetch and within {max_shared} bytes of shared memory, got "
                             f"{decode_ring!r} ({kv_dtype} pool, {self.device.target.sm}, prefetch "
                             f"{bool(decode_prefetch)})")
        self.decode_ring = int(decode_ring)
        self.decode_lanes = int(decode_lanes)
        row_lanes = decode_lanes or lanes_per_row(self.head_dim)
        takes = bool(decode_ring) and scatter_applies(self.head_dim, self.group, row_lanes, decode_unroll)
        if decode_scatter and not takes:
            raise ShapeError(f"decode_scatter needs the ring, a power-of-two GQA group whose heads x decode_unroll fit "
                             f"the lanes of a row and lanes of whole 4-value pieces; got ring {decode_ring}, group "
                             f"{self.group}, unroll {decode_unroll}, {row_lanes} lanes a row at head_dim "
                             f"{self.head_dim}")
        self.decode_scatter = takes and (DECODE_RING_SCATTER if decode_scatter is None else bool(decode_scatter))
        self.decode_prefetch = bool(decode_prefetch)
        if num_chunks is not None:
            num_chunks = check_int("num_chunks", num_chunks)
            if num_chunks > 1024:
                raise ShapeError(f"num_chunks must be at most 1024, got {num_chunks}")
        self.block_size, self.kv_dtype, self.decode_unroll = int(block_size), kv_dtype, int(decode_unroll)
        self._fixed_chunks = num_chunks
        n = self.num_blocks * self.num_kv_heads * self.block_size * self.head_dim
        dt = KV_NUMPY_DTYPES[kv_dtype]
        need = self.num_blocks * self.block_bytes
        free, _ = self.device.memory_info()
        if need > free:
            raise ShapeError(f"the KV pools need {need / 2**30:.2f} GiB but the device has {free / 2**30:.2f} GiB "
                             f"free: lower num_blocks")
        self._k = [self.ops.buffer(n, dt, zero=True) for _ in range(self.num_layers)]
        self._v = [self.ops.buffer(n, dt, zero=True) for _ in range(self.num_layers)]
        ns = n // QK if kv_dtype == "q8_0" else 0
        self._ks = [self.ops.buffer(ns, np.float16, zero=True) for _ in range(self.num_layers)] if ns else []
        self._vs = [self.ops.buffer(ns, np.float16, zero=True) for _ in range(self.num_layers)] if ns else []
        worst = max(range(1, self.max_batch + 1), key=lambda r: r * self.chunks_for(r))
        n_acc, n_ml, _ = buffer_sizes(worst, self.num_heads, self.num_kv_heads, self.chunks_for(worst), self.head_dim)
        self._part_acc = self.ops.buffer(n_acc)
        self._part_ml = self.ops.buffer(n_ml)
        self._counters = self.ops.buffer(self.max_batch * self.num_kv_heads, np.uint32, zero=True)
        self._decode_kernel(False)  # load now: a module load inside a stream capture could invalidate it
        self._decode_kernel(True)

    # ---- layout ------------------------------------------------------------------------------------
    @property
    def pool_shape(self) -> tuple[int, int, int, int]:
        return (self.num_blocks, self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def scales_shape(self) -> tuple[int, int, int, int]:
        """Shape of a q8_0 scales pool (float16)."""
        return (self.num_blocks, self.num_kv_heads, self.block_size, self.head_dim // QK)

    @property
    def block_bytes(self) -> int:
        """Device bytes one block takes over all layers, K and V (q8_0: codes and scales): what a memory
        budget divides by to get num_blocks."""
        return block_bytes(self, self.block_size, self.kv_dtype)

    def k_pool(self, layer: int):
        """K pool of ``layer`` (q8_0: the int8 codes; scales in :meth:`k_scales`)."""
        return self._k[self._layer(layer)]

    def v_pool(self, layer: int):
        return self._v[self._layer(layer)]

    def k_scales(self, layer: int):
        """float16 scales pool of ``layer``'s K (q8_0 only)."""
        return self._scales(self._ks, layer)

    def v_scales(self, layer: int):
        return self._scales(self._vs, layer)

    def _scales(self, bufs: list, layer: int):
        if self.kv_dtype != "q8_0":
            raise ShapeError(f"only a q8_0 pool has scales, this one is {self.kv_dtype}")
        return bufs[self._layer(layer)]

    def pools_to_numpy(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """(K, V) of ``layer`` as float32 ``pool_shape`` arrays, q8_0 dequantised (synchronous; tests and
        debugging)."""
        out = []
        for buf, sc in ((self.k_pool(layer), self._ks), (self.v_pool(layer), self._vs)):
            raw = buf.copy_to_host().reshape(self.pool_shape)
            if self.kv_dtype == "bf16":
                raw = (raw.astype(np.uint32) << 16).view(np.float32)
            elif self.kv_dtype == "q8_0":
                raw = dequantize_q8_0(raw, sc[self._layer(layer)].copy_to_host().reshape(self.scales_shape))
            out.append(raw.astype(np.float32))
        return out[0], out[1]

    def pools_from_numpy(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store float ``pool_shape`` arrays into ``layer``'s pools, converted as the append kernels would
        (f16/bf16: nearest even; q8_0: :func:`quantize_q8_0`; synchronous; tests and debugging)."""
        for x, buf, sc in ((k, self.k_pool(layer), self._ks), (v, self.v_pool(layer), self._vs)):
            x = np.asarray(x, np.float32)
            if x.shape != self.pool_shape:
                raise ShapeError(f"pool arrays must be {self.pool_shape}, got {x.shape}")
            if self.kv_dtype == "q8_0":
                codes, scales = quantize_q8_0(x)
                buf.copy_from_host(codes.reshape(-1))
                sc[self._layer(layer)].copy_from_host(scales.reshape(-1))
                continue
            if self.kv_dtype == "bf16":
                x = round_bf16(x)
            buf.copy_from_host(np.ascontiguousarray(x.astype(KV_NUMPY_DTYPES[self.kv_dtype])).reshape(-1))

    def _pool_values(self, layer: int) -> dict:
        values = {"k_pool": self._k[layer].ptr, "v_pool": self._v[layer].ptr}
        if self.kv_dtype == "q8_0":
            values.update(k_scales=self._ks[layer].ptr, v_scales=self._vs[layer].ptr)
        return values

    def min_chunk_for(self, rows: int) -> int:
        """Fewest positions per chunk of a decode launch of ``rows`` rows."""
        return self.min_chunk or decode_min_chunk(rows, self.num_kv_heads, self.device.sm_count)

    def chunks_for(self, rows: int) -> int:
        """Chunks per (row, KV head) of a decode launch of ``rows`` rows."""
        return self._fixed_chunks or decode_chunks(rows, self.num_kv_heads, self.device.sm_count)

    def _layer(self, layer: Any) -> int:
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= int(layer) < self.num_layers:
            raise ShapeError(f"layer must be an integer in [0, {self.num_layers}), got {layer!r}")
        return int(layer)

    def _rows(self, rows: Any) -> int:
        rows = check_int("rows", rows)
        if rows > self.max_batch:
            raise ShapeError(f"rows ({rows}) must not exceed max_batch ({self.max_batch})")
        return rows

    def _norms(self, q_norm, k_norm, eps, values: dict) -> bool:
        if (q_norm is None) != (k_norm is None):
            raise ShapeError("q_norm and k_norm go together: pass both weights (qk-norm models) or neither")
        if q_norm is None:
            return False
        d = self.head_dim
        values["q_norm"] = self.ops.addr(q_norm, d, "q_norm", align=8)
        values["k_norm"] = self.ops.addr(k_norm, d, "k_norm", align=8)
        return True

    def _decode_kernel(self, out_f16: bool):
        return self.ops.kernel("paged_decode_attention", head_dim=self.head_dim, group=self.group,
                               block_size=self.block_size, kv_dtype=self.kv_dtype, out_f16=bool(out_f16),
                               unroll=self.decode_unroll, lanes=self.decode_lanes, prefetch=self.decode_prefetch,
                               ring=self.decode_ring, scatter=self.decode_scatter)

    # ---- decode ------------------------------------------------------------------------------------
    def append_decode(self, layer: int, qkv: Any, inv_freq: Any, positions: Any, block_tables: Any,
                      table_stride: int, rows: int, q_norm: Any = None, k_norm: Any = None, eps: float = 1e-6,
                      neox: bool = False, *, stream: Any = None) -> None:
        """Decode step of ``rows`` sequences: ``qkv [rows, (H + 2 KVH) * D]`` f32, row b at position
        ``positions[b]`` (device u32[rows]); (optional qk-norm,) RoPE of Q in place, K rotated and V written
        into ``layer``'s pools through block table row b (device u32 ``[rows, table_stride]``). A position
        whose block index is >= table_stride writes nothing. Graph-capturable."""
        layer, rows = self._layer(layer), self._rows(rows)
        table_stride = check_int("table_stride", table_stride)
        ops, h, kvh, d = self.ops, self.num_heads, self.num_kv_heads, self.head_dim
        values = {"qkv": ops.addr(qkv, rows * (h + 2 * kvh) * d, "qkv", align=8),
                  **self._pool_values(layer),
                  "inv_freq": ops.addr(inv_freq, d // 2, "inv_freq", align=4),
                  "positions": ops.addr(positions, rows, "positions", np.uint32, align=4),
                  "block_tables": ops.addr(block_tables, rows * table_stride, "block_tables", np.uint32, align=4)}
        qk = self._norms(q_norm, k_norm, eps, values)
        values.update(table_stride=table_stride, n_q=h, n_kv=kvh)
        if qk:
            values["eps"] = float(eps)
        kern = ops.kernel("paged_append_decode", head_dim=d, block_size=self.block_size, kv_dtype=self.kv_dtype,
                          neox=bool(neox), qk_norm=qk)
        ops.launch(kern, (rows, -(-(h + 2 * kvh) // kern.meta["warps"])), values, stream)

    def decode_attention(self, layer: int, q: Any, out: Any, seq_lens: Any, block_tables: Any, table_stride: int,
                         rows: int, out_f16: bool = False, *, q_stride: int | None = None, chunks: int | None = None,
                         stream: Any = None) -> None:
        """Split-KV attention of ``rows`` query rows (``q``: f32 rows of ``H * D`` values ``q_stride`` floats
        apart; default ``H * D``, packed; ``(H + 2 KVH) * D`` reads Q in place from the qkv rows that
        :meth:`append_decode` rotated) each over its own length
        ``seq_lens[b]`` (device u32[rows], clamped to table_stride * block_size) through block table row b
        (device u32 ``[rows, table_stride]``) of ``layer``. ``out``: ``[rows, H * D]`` f32, or f16 with
        ``out_f16``. One launch on grid (rows * KVH, ``chunks``: default chunks_for(rows); 1 is the one-pass form, a
        block per (row, KV head)); graph-capturable. ``seq_lens`` must
        not be written by the kernels just before this launch (it is read before the kernel's grid-dependency
        wait on sm_90; the decode step copies it from the host)."""
        layer, rows = self._layer(layer), self._rows(rows)
        table_stride = check_int("table_stride", table_stride)
        ops, n = self.ops, rows * self.num_heads * self.head_dim
        q_stride = n // rows if q_stride is None else check_int("q_stride", q_stride)
        if q_stride < n // rows or q_stride % 4:
            raise ShapeError(f"q_stride must be a multiple of 4 of at least H * D = {n // rows}, got {q_stride}")
        values = {"q": ops.addr(q, (rows - 1) * q_stride + n // rows, "q"), **self._pool_values(layer),
                  "out": ops.addr(out, n, "out", np.float16 if out_f16 else np.float32,
                                  align=8 if out_f16 else 16),
                  "part_acc": self._part_acc.ptr, "part_ml": self._part_ml.ptr, "counters": self._counters.ptr,
                  "seq_lens": ops.addr(seq_lens, rows, "seq_lens", np.uint32, align=4),
                  "block_tables": ops.addr(block_tables, rows * table_stride, "block_tables", np.uint32, align=4),
                  "table_stride": table_stride, "n_kv": self.num_kv_heads, "min_chunk": self.min_chunk_for(rows),
                  "q_stride": q_stride}
        kern = self._decode_kernel(out_f16)
        chunks = self.chunks_for(rows) if chunks is None else min(check_int("chunks", chunks), self.chunks_for(rows))
        ops.launch(kern, (rows * self.num_kv_heads, chunks), values, stream)

    # ---- prefill -----------------------------------------------------------------------------------
    def _table(self, block_table: Any, entries: int) -> int:
        if not _table_arg(block_table):
            raise ShapeError(f"block_table must be a u32 GpuBuffer or (buffer, offset), got {type(block_table).__name__}")
        return self.ops.addr(block_table, entries, "block_table", np.uint32, align=4)

    def _f32_only(self, what: str) -> None:
        if self.kv_dtype != "f32":
            raise ShapeError(f"{what} takes an f32 pool, this one is {self.kv_dtype}")

    def append_kv(self, layer: int, k_new: Any, v_new: Any, count: int, position: Any, block_table: Any,
                  table_stride: int, *, stream: Any = None) -> None:
        """K and V of ``count`` positions as given (no RoPE; ``k_new``/``v_new`` device f32 ``[KVH, count, D]``)
        into ``layer``'s f32 pools at ``position ..`` through ``block_table`` (``table_stride`` entries;
        positions past it write nothing). ``position``: an int, or a device u32 (GpuBuffer or (buffer,
        index)) read on the device, graph-capturable."""
        self._f32_only("append_kv")
        layer, count = self._layer(layer), check_int("count", count)
        table_stride = check_int("table_stride", table_stride)
        ops, kvh, d = self.ops, self.num_kv_heads, self.head_dim
        indirect = _table_arg(position)
        values = {**self._pool_values(layer), "k_new": ops.addr(k_new, kvh * count * d, "k"),
                  "v_new": ops.addr(v_new, kvh * count * d, "v"), "count": count,
                  "block_table": self._table(block_table, table_stride), "table_stride": table_stride, "n_kv": kvh}
        if indirect:
            values["pos_ptr"] = ops.addr(position, 1, "position", np.uint32, align=4)
        else:
            values["pos"] = check_int("position", position, lo=0)
        kern = ops.kernel("kv_append", head_dim=d, indirect=indirect, block_size=self.block_size)
        ops.launch(kern, (-(-count * (d // 4) // kern.meta["block"]), kvh), values, stream, cache=indirect)

    def _prefill_span(self, layer: Any, seq_q: Any, q_offset: Any, seq_k: Any, causal: bool) -> tuple[int, ...]:
        """(layer, seq_q, q_offset, seq_k) of a prefill attention call, checked (causal queries need their keys)."""
        layer = self._layer(layer)
        seq_q, seq_k = check_int("seq_q", seq_q), check_int("seq_k", seq_k)
        q_offset = check_int("q_offset", q_offset, lo=0)
        if causal and q_offset + seq_q > seq_k:
            raise ShapeError(f"causal queries at positions {q_offset}..{q_offset + seq_q - 1} need "
                             f"{q_offset + seq_q} keys, seq_k is {seq_k}")
        return layer, seq_q, q_offset, seq_k

    def prefill_attention_heads(self, layer: int, q: Any, out: Any, seq_q: int, q_offset: int, seq_k: int,
                                block_table: Any, causal: bool = True, *, stream: Any = None) -> None:
        """f32 (SIMT) attention of ``q [H, seq_q, D]`` (query i at position ``q_offset + i``) over keys ``[0,
        seq_k)`` of ``layer``'s f32 pools through ``block_table``; ``out [H, seq_q, D]`` f32 — the exact form of
        :meth:`prefill_attention` (whose inputs enter tensor cores as f16)."""
        self._f32_only("prefill_attention_heads")
        layer, seq_q, q_offset, seq_k = self._prefill_span(layer, seq_q, q_offset, seq_k, causal)
        ops, h, d = self.ops, self.num_heads, self.head_dim
        n = h * seq_q * d
        values = {"q": ops.addr(q, n, "q"), "k": self._k[layer].ptr, "v": self._v[layer].ptr,
                  "out": ops.addr(out, n, "out"), "seq_q": seq_q, "seq_k": seq_k, "q_offset": q_offset,
                  "n_kv": self.num_kv_heads, "block_table": self._table(block_table, -(-seq_k // self.block_size))}
        kern = ops.kernel("flash_attention", head_dim=d, group=self.group, causal=bool(causal),
                          block_size=self.block_size)
        ops.launch(kern, (-(-seq_q // kern.meta["block_q"]), h), values, stream, cache=False)

    def append_rows(self, layer: int, qkv_rows: Any, inv_freq: Any, pos0: int, count: int, q_out: Any,
                    block_table: Any, *, neox: bool = False, q_norm: Any = None, k_norm: Any = None,
                    eps: float = 1e-6, stream: Any = None) -> None:
        """Prefill chunk of one sequence: ``count`` tokens at positions ``pos0 ..``; ``qkv_rows [count,
        (H + 2 KVH) * D]`` f32 (only read) -> (optional qk-norm,) RoPE of Q into ``q_out [H, count, D]`` f32
        (the query layout of :meth:`prefill_attention`), K rotated and V into ``layer``'s pools through
        ``block_table`` (u32 GpuBuffer or (buffer, offset) with at least ceil((pos0 + count) / block_size)
        entries)."""
        layer = self._layer(layer)
        pos0, count = check_int("pos0", pos0, lo=0), check_int("count", count)
        ops, h, kvh, d = self.ops, self.num_heads, self.num_kv_heads, self.head_dim
        entries = -(-(pos0 + count) // self.block_size)
        values = {"qkv": ops.addr(qkv_rows, count * (h + 2 * kvh) * d, "qkv_rows", align=8),
                  "q_out": ops.addr(q_out, h * count * d, "q_out", align=8),
                  **self._pool_values(layer),
                  "inv_freq": ops.addr(inv_freq, d // 2, "inv_freq", align=4),
                  "block_table": self._table(block_table, entries)}
        qk = self._norms(q_norm, k_norm, eps, values)
        values.update(pos0=pos0, count=count, table_stride=entries, n_q=h, n_kv=kvh)
        if qk:
            values["eps"] = float(eps)
        kern = ops.kernel("paged_append_rows", head_dim=d, block_size=self.block_size, kv_dtype=self.kv_dtype,
                          neox=bool(neox), qk_norm=qk)
        ops.launch(kern, (count, -(-(h + 2 * kvh) // kern.meta["warps"])), values, stream, cache=False)

    def prefill_attention(self, layer: int, q: Any, out_f16: Any, seq_q: int, q_offset: int, seq_k: int,
                          block_table: Any, causal: bool = True, *, stream: Any = None) -> None:
        """Tensor-core attention of ``q [H, seq_q, D]`` f32 (query i at position ``q_offset + i``) over keys
        ``[0, seq_k)`` of ``layer`` read through ``block_table``; ``out_f16 [seq_q, H * D]`` f16 token-major
        (the O projection's A operand). sm_80+ and head_dim in the tensor-core kernel's set."""
        layer, seq_q, q_offset, seq_k = self._prefill_span(layer, seq_q, q_offset, seq_k, causal)
        if self.head_dim not in MMA_HEAD_DIMS:
            raise ShapeError(f"paged prefill attention takes head_dim in {MMA_HEAD_DIMS}, got {self.head_dim}")
        ops, h, d = self.ops, self.num_heads, self.head_dim
        n = h * seq_q * d
        values = {"q": ops.addr(q, n, "q"), **self._pool_values(layer),
                  "block_table": self._table(block_table, -(-seq_k // self.block_size)),
                  "out": ops.addr(out_f16, n, "out_f16", np.float16),
                  "seq_q": seq_q, "seq_k": seq_k, "q_offset": q_offset, "num_heads": h, "n_kv": self.num_kv_heads}
        kern = ops.kernel("paged_prefill_attention", head_dim=d, group=self.group, causal=bool(causal),
                          block_size=self.block_size, kv_dtype=self.kv_dtype)
        ops.launch(kern, (-(-seq_q // kern.meta["block_q"]), h), values, stream, cache=False)

    def close(self) -> None:
        for b in [*self._k, *self._v, *self._ks, *self._vs, self._part_acc, self._part_ml, self._counters]:
            b.free()

    def __repr__(self) -> str:
        return (f"PagedKVCache(layers={self.num_layers}, heads={self.num_heads}/{self.num_kv_heads}, "
                f"head_dim={self.head_dim}, blocks={self.num_blocks}x{self.block_size}, kv={self.kv_dtype})")
