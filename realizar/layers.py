"""Host-side dispatch of the transformer-layer kernels: GEMV/GEMM on GGUF weights, RMSNorm, RoPE,
SwiGLU, residual/bias add, embedding lookup and argmax.

    ops = LayerOps()                                   # per device: kernel memo + argument cache
    w = ops.upload(tensor)                              # a QuantTensor's raw blocks, uploaded once, laid
                                                        # out for the GEMV that will read them
    ops.gemv(w, x_buf, y_buf, residual=h_buf)           # y = W x + h  (y may be h: in place)
    ops.rmsnorm(h_buf, norm_w_buf, y_buf, eps=1e-5)
    ops.rope(q_buf, k_buf, inv_freq_buf, pos_buf, n_q=32, n_kv=8, head_dim=128)
    ops.argmax(logits_buf, out_u32_buf)

Every call validates its arguments (sizes, dtypes, 16-byte alignment) before the GPU is touched and
raises :class:`~realizar.errors.ShapeError` saying what was expected. Buffers are
:class:`~realizar.cuda.GpuBuffer` s or ``(GpuBuffer, element offset)`` pairs. Launch shapes depend
only on the model's dimensions, kernel arguments are packed once per distinct call and reused, and
nothing synchronises or allocates per call (the argmax scratch is allocated at construction), so a
decode step made of these calls can be captured into a CUDA graph and replayed; positions and token
ids that change per step are read from device buffers (``pos`` / ``tokens`` as buffers).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ptx_gen.kernels.gemv import MAX_STATIC_SMEM, shared_bytes, tiles_per_slice
from ptx_gen.kernels.gemv_mma import MMA_TYPES, SOLO_SMEM, tile_major
from ptx_gen.kernels.gemv_mma import layout as mma_layout
from ptx_gen.kernels.gemv_mma import q6k_glu_offsets_fit
from ptx_gen.kernels.quant_layout import WEIGHT_TYPES, check_in_dim, type_info
from ptx_gen.kernels.rmsnorm import MAX_HIDDEN, default_block
from ptx_gen.kernels.rope import inv_freq_table
from realizar import cuda
from realizar.cuda.memory import device_address, is_buffer_arg
from realizar.errors import ShapeError, UnsupportedError

__all__ = ["GemvConfig", "GpuWeight", "LayerOps", "MmaConfig", "gemv_config", "inv_freq_table", "mma_config"]

_ARGMAX_PARTIALS = 1024
# shared-memory sizes (KB) an SM can be configured with (sm_80..sm_90), up to its maximum
_CARVEOUTS_KB = (0, 8, 16, 32, 64, 100, 132, 164, 196, 228)


def _wtype_name(ggml_type: Any) -> str:
    if isinstance(ggml_type, str):
        name = ggml_type
    else:
        from realizar.models.quants import type_name  # needs gguf: only when a type id is given

        name = type_name(int(ggml_type))
    if name not in WEIGHT_TYPES:
        raise UnsupportedError(f"no GPU kernels for weight type {name}; supported: {', '.join(WEIGHT_TYPES)}")
    return name


LAYOUTS = ("rows", "tiles", "glu-tiles")


class GpuWeight:
    """A 2-D weight ``(out_dim, in_dim)`` in GGUF block form on the GPU, uploaded once.

    The allocation is rounded up to a multiple of 16 bytes (the kernels read whole 16-byte vectors).
    Build it from a :class:`~realizar.models.tensor.QuantTensor` or from raw bytes, type and shape.
    ``layout``: "rows" keeps GGUF's rows; "tiles" stores the blocks tile-major for the tensor-core GEMV
    (:func:`ptx_gen.kernels.gemv_mma.tile_major`), "glu-tiles" likewise for the fused gate/up GEMV of a
    [gate; up] weight. Only the tensor-core GEMV reads tile-major weights; :meth:`LayerOps.upload`
    picks the layout the weight's GEMV wants. ``nbytes`` counts the weight's own bytes (not padding).
    """

    def __init__(self, tensor: Any = None, *, data: np.ndarray | None = None, ggml_type: Any = None,
                 shape: Sequence[int] | None = None, name: str = "", layout: str = "rows"):
        if tensor is not None:
            data, ggml_type, shape, name = tensor.data, tensor.ggml_type, tensor.shape, tensor.name
        if data is None or ggml_type is None or shape is None:
            raise ShapeError("GpuWeight needs a QuantTensor or data=, ggml_type= and shape=")
        self.wtype = _wtype_name(ggml_type)
        shape = tuple(int(s) for s in shape)
        if len(shape) != 2 or min(shape) < 1:
            raise ShapeError(f"GpuWeight {name!r}: a weight matrix must be 2-D (out_dim, in_dim), got {shape}")
        self.out_dim, self.in_dim = shape
        try:
            check_in_dim(self.wtype, self.in_dim)
        except ValueError as exc:
            raise ShapeError(f"GpuWeight {name!r}: {exc}") from None
        self.name = name
        info = type_info(self.wtype)
        self.row_bytes = info.row_bytes(self.in_dim)
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        if raw.size != self.row_bytes * self.out_dim:
            raise ShapeError(f"GpuWeight {name!r}: {self.wtype} {shape} needs {self.row_bytes * self.out_dim} "
                             f"bytes, got {raw.size}")
        self.nbytes = raw.size
        if layout not in LAYOUTS:
            raise ShapeError(f"GpuWeight {name!r}: layout must be one of {LAYOUTS}, got {layout!r}")
        if layout != "rows":
            if self.wtype not in MMA_TYPES:
                raise ShapeError(f"GpuWeight {name!r}: only {', '.join(MMA_TYPES)} weights can be stored tile-major, "
                                 f"not {self.wtype}")
            try:
                raw = tile_major(raw, self.wtype, self.out_dim, self.in_dim, glu=layout == "glu-tiles")
            except ValueError as exc:
                raise ShapeError(f"GpuWeight {name!r}: {exc}") from None
        self.layout = layout
        padded = -(-raw.size // 16) * 16
        self.buffer = cuda.GpuBuffer(padded, np.uint8)
        if padded != raw.size:
            self.buffer.fill_bytes(0)
        self.buffer.copy_from_host_at(raw, 0)

    @classmethod
    def concat(cls, tensors: Sequence[Any], name: str = "", layout: str = "rows") -> "GpuWeight":
        """Stack the rows of several tensors of one type and row length (e.g. [gate; up] for the
        fused SwiGLU GEMV, or Q/K/V for one QKV GEMV)."""
        types = {_wtype_name(t.ggml_type) for t in tensors}
        ins = {int(t.shape[-1]) for t in tensors}
        if len(types) != 1 or len(ins) != 1:
            raise ShapeError(f"concat needs one weight type and row length, got {sorted(types)} / {sorted(ins)}")
        data = np.concatenate([np.ascontiguousarray(t.data).reshape(-1).view(np.uint8) for t in tensors])
        out = sum(int(t.shape[0]) for t in tensors)
        return cls(data=data, ggml_type=types.pop(), shape=(out, ins.pop()), name=name or "+".join(t.name for t in tensors),
                   layout=layout)

    @property
    def ptr(self) -> int:
        return self.buffer.ptr

    def free(self) -> None:
        self.buffer.free()

    def __repr__(self) -> str:
        tail = "" if self.layout == "rows" else f", {self.layout}"
        return f"GpuWeight({self.name!r}, {self.wtype}, ({self.out_dim}, {self.in_dim}){tail})"

    def require_rows(self, what: str) -> None:
        """Raise unless the weight keeps GGUF's rows (``what`` reads it that way)."""
        if self.layout != "rows":
            raise ShapeError(f"{what} reads GGUF rows, but GpuWeight {self.name!r} is stored {self.layout} for the "
                             f"tensor-core GEMV; upload it with layout='rows' for this use")


@dataclass(frozen=True)
class GemvConfig:
    rows: int  # output rows per warp (weight rows per warp for the fused gate/up GEMV)
    warps: int  # warps per CTA
    ksplit: int = 1  # warps sharing a row group, each summing one K slice (divides warps)


# a grid of at least this many warps per SM: about one wave of the 24-48 warps a split kernel keeps
# resident (registers, shared memory). More splitting than that only adds per-warp work (setup, the
# partial sums) to kernels whose decode already keeps the SMs' issue slots busy (Q4_K, Q6_K)
TARGET_WARPS_PER_SM = 24


@functools.lru_cache(maxsize=None)  # pure, and asked at every eager GEMV launch (~6 us uncached)
def gemv_config(out_dim: int, sm_count: int = 132, in_dim: int | None = None, wtype: str | None = None) -> GemvConfig:
    """Launch shape of the GEMV of ``out_dim`` weight rows of ``in_dim`` values of ``wtype``.

    Without ``in_dim``/``wtype`` (or for rows too short to split) only rows per warp are chosen by
    ``out_dim``, as before split-K: 4 rows (x loads reused 4 times) for >= 48 rows per SM, 2 for
    >= 16, else 1. With them, K is split (``ksplit`` warps per row group, each one slice) while

    * the grid has fewer than ``TARGET_WARPS_PER_SM`` warps per SM (4096 rows x 2 per warp is only 15
      per SM on 132 SMs: each warp walking a 14336-long row tile after tile is latency bound), or
    * a quantized row would still be walked in several tiles: a one-tile slice (at most
      ``SPLIT_TILE_BYTES`` per row) is copied at once with ``cp.async`` (every load in flight, no
      registers held) rather than tile after tile,

    keeping at least 2 rounds (512 values) per slice. Rows per warp: 4 for >= 48 rows per SM of a
    quantized type when 4-row slices are single tiles that fit the shared memory (Q4_K 14336 x 4096:
    x reused 4 times, 12% fewer instructions than 2 rows), else 2 (1 below 16 rows per SM). Tuned with
    ``tools/bench_gemv.py --sweep``."""
    per_sm = out_dim / sm_count
    legacy = GemvConfig(4 if per_sm >= 48 else 2 if per_sm >= 16 else 1, 4)
    if in_dim is None or wtype is None:
        return legacy
    rounds = -(-in_dim // 256)
    quantized = type_info(wtype).block_values > 1

    def ksplit_for(rows: int) -> int:
        ks = 1
        while ks < 8 and rounds >= 4 * ks and (
                -(-out_dim // rows) * ks < TARGET_WARPS_PER_SM * sm_count
                or (quantized and tiles_per_slice(wtype, in_dim, ks) > 1)):
            ks *= 2
        return ks

    if quantized and per_sm >= 16:  # the large decode shapes: picks measured by bench_gemv --sweep on an H200
        if wtype == "Q6_K":  # 4096x14336: r2 w8 s8 53% (r2 w4 s4 49%); 14336x4096: r4 w4 s4 58% (r4 w4 s2 52%);
            # 128256x4096 (Llama-3-8B's output): r4 w4 s2 86% (r4 w4 s4 77%)
            cfg = (GemvConfig(2, 8, 8) if rounds >= 32 else GemvConfig(4, 4, 2 if per_sm >= Q6K_MANY_ROWS_PER_SM else 4)
                   if rounds >= 16 else None)
        else:  # Q4_K / Q8_0 4096x14336: r4 w4 s2 47% / 68% (r2 w4 s4 37%, r2 w8 s8 60%); 14336x4096: r4 w4 s1
            cfg = GemvConfig(4, 4, 2 if rounds >= 32 else 1)
        if cfg is not None and shared_bytes(wtype, in_dim, cfg.rows, cfg.warps, cfg.ksplit) <= MAX_STATIC_SMEM \
                and (cfg.ksplit == 1 or rounds >= 2 * cfg.ksplit):
            return cfg
    if legacy.rows == 4 and quantized:  # dense rows decode cheaply: 2 rows measured faster (F16 93% vs 85%)
        ks = ksplit_for(4)
        fits = shared_bytes(wtype, in_dim, 4, max(4, ks), ks) <= MAX_STATIC_SMEM
        if ks == 1 or (tiles_per_slice(wtype, in_dim, ks) == 1 and fits):
            return GemvConfig(4, max(4, ks), ks)
    rows = min(legacy.rows, 2)
    ks = ksplit_for(rows)
    return GemvConfig(rows, max(4, ks), ks)


def _max_block_smem(device: Any) -> int:
    """Shared memory one CTA may opt into (227 KB on sm_90, 163 KB on sm_80)."""
    return int(device.max_shared_per_block_optin)


@dataclass(frozen=True)
class MmaConfig:
    """Launch shape of the tensor-core GEMV (:mod:`ptx_gen.kernels.gemv_mma`)."""

    mtiles: int  # warps along the rows of a CTA
    kparts: int  # warps sharing those rows, each one part of K
    stages: int  # cp.async ring depth per warp (units of 256 values)
    tiles: int = 1  # 16-row MMA tiles per warp
    bulk: bool = False  # sm_90: fill the ring with bulk copies (cp.async.bulk + mbarrier)
    solo: bool = False  # shared memory raised so that one CTA holds an SM (see gemv_mma.SOLO_SMEM)


MMA_EXTRA_CTA = 0.1  # the tensor-core GEMV dispatcher's cost of each further CTA on an SM
# Q6_K GEMVs of at least this many rows per SM stay on the SIMT kernel (128256 x 4096: 120 us, 86% of
# the copy bandwidth, vs 127 us for the best tensor-core shape: each warp of the tensor-core kernel
# converts every unit of x it uses, a cost that grows with the rows)
Q6K_MANY_ROWS_PER_SM = 256


@functools.lru_cache(maxsize=None)  # pure, and asked at every eager GEMV launch (~22 us uncached)
def mma_config(out_dim: int, in_dim: int, wtype: str, sm_count: int = 132,
               max_smem: int = 227 * 1024, bulk_ok: bool = False, glu: bool = False) -> MmaConfig | None:
    """The tensor-core GEMV's launch shape for ``out_dim`` rows of ``in_dim`` values, or None where it
    does not apply (types other than Q4_K/Q8_0/Q6_K, rows not a multiple of 256 values, or of 2048 for
    Q6_K) or would keep fewer than half the SMs busy (small GEMVs, where the SIMT kernel's lower
    start-up cost wins).

    Fitted to ``tools/bench_gemv.py --sweep`` on an H200: CTAs of 8 warps and a 2-stage ring; warps of
    32 rows (each unit of x the warp converts serves twice the rows) split K in ``kparts`` so that the
    grid is balanced over the SMs (the busiest SM runs ``ceil(ctas / sm_count)`` CTAs where the mean is
    ``ctas / sm_count``), each CTA beyond the first on an SM costing ``MMA_EXTRA_CTA`` (one CTA
    streaming many units per warp beats several short ones: 14336 x 4096 with 112 CTAs of 2 K parts
    11.9 us, 448 CTAs of 8 parts 13.7 us, 896 CTAs of 16-row warps 13.0 us). Among shapes within 2% of
    the best: 32-row warps, then fewer CTAs per SM. With ``bulk_ok`` (sm_90) warps that stream at most
    two units use bulk copies (4096 x 4096 Q4_K: 4.5 us vs 5.4; on longer rows the small bulk copies
    were slower). ``glu``: the fused gate/up GEMV of ``out_dim`` outputs (2 out_dim weight rows; a
    warp takes 16 outputs' gate and up rows, so 32-row warps only)."""
    if wtype not in MMA_TYPES or in_dim % 256:
        return None
    units = in_dim // 256
    if wtype == "Q6_K" and out_dim >= Q6K_MANY_ROWS_PER_SM * sm_count:
        return None
    if wtype == "Q6_K" and glu and not q6k_glu_offsets_fit(out_dim, in_dim):
        return None
    cands = []
    for tiles, (mtiles, kparts) in itertools.product((2,) if glu else (1, 2), ((1, 8), (2, 4), (4, 2), (8, 1))):
        if units % kparts:
            continue
        try:
            if mma_layout(wtype, in_dim, mtiles, kparts, 2, tiles)["smem"] > max_smem:
                continue
        except ValueError:
            continue
        ctas = -(-out_dim // ((16 if glu else 16 * tiles) * mtiles))
        per_sm = -(-ctas // sm_count)
        score = ctas / sm_count / per_sm * max(0.1, 1 - MMA_EXTRA_CTA * (per_sm - 1))
        cands.append((score, tiles, -per_sm, ctas, MmaConfig(mtiles, kparts, 2, tiles)))
    if not cands:
        return None
    top = max(c[0] for c in cands)
    *_, ctas, best = max((c for c in cands if c[0] >= top - 0.02), key=lambda c: c[1:3])
    if ctas < sm_count // 2:
        return None  # under half the SMs busy: the SIMT kernel is faster (576 x 1536 Q8_0: 2.2 us vs 3.7)
    if bulk_ok and wtype != "Q6_K" and units // best.kparts <= 2:  # (Q6_K blocks are only 2-byte aligned)
        best = dataclasses.replace(best, bulk=True)
    return best


class LayerOps:
    """Launches the layer kernels on one device (kernels loaded once, arguments packed once)."""

    def __init__(self, device: Any = None):
        self.device = device or cuda.current_device()
        self.kernels = cuda.module_cache(self.device)
        self.sm_count = self.device.sm_count
        self._max_smem = _max_block_smem(self.device)
        self._memo: dict[tuple, Any] = {}
        self._args_cache: dict[tuple, Any] = {}
        self._argmax_scratch = cuda.GpuBuffer(_ARGMAX_PARTIALS, np.uint64, device=self.device)

    # ---- plumbing ------------------------------------------------------------------------------------
    def kernel(self, name: str, **shape):
        key = (name, *sorted(shape.items()))
        k = self._memo.get(key)
        if k is None:
            k = self._memo[key] = self.kernels.get(name, **shape)
            if k.meta.get("l1_bytes"):
                self._keep_l1(k)
        return k

    def _keep_l1(self, kern) -> None:
        """Prefer a shared-memory carveout that leaves ``meta["l1_bytes"]`` of L1 (the split GEMV's x
        vector, re-read by every warp). By default the driver sizes shared memory for the highest
        occupancy, which for kernels staging kilobytes per warp can shrink L1 to 28 KB. The preference
        is a percentage of the SM's maximum shared memory; the driver rounds it up to a supported size,
        so the largest supported size that fits is asked for, rounded down."""
        max_smem = self.device.attribute("MAX_SHARED_MEMORY_PER_MULTIPROCESSOR")
        unified = max_smem + 28 * 1024  # L1 + shared per SM: 192 KB (sm_80), 256 KB (sm_90), 128 KB (sm_86/89)
        want = max(kern.meta.get("smem", 0), unified - kern.meta["l1_bytes"])
        sizes = [kb * 1024 for kb in _CARVEOUTS_KB if kb * 1024 <= max_smem]
        fits = [s for s in sizes if s <= want]
        size = fits[-1] if fits and fits[-1] >= kern.meta.get("smem", 0) else next(
            (s for s in sizes if s >= kern.meta.get("smem", 0)), max_smem)
        self.device.set_shared_carveout(kern, max(1, size * 100 // max_smem))

    def _launch(self, kern, grid, values: dict, stream) -> None:
        key = (kern.source.key, tuple(values.items()))
        args = self._args_cache.get(key)
        if args is None:
            args = kern.args(**values)
            if len(self._args_cache) > 8192:
                self._args_cache.clear()
            self._args_cache[key] = args
        cuda.launch(kern, grid, kern.meta["block"], args, shared_bytes=kern.meta.get("dyn_smem", 0), stream=stream)

    @staticmethod
    def _addr(x: Any, count: int, what: str, dtype=np.float32, align: int = 16) -> int:
        return device_address(x, count, what, dtype, align)[0]

    @staticmethod
    def _count(name: str, v: Any, lo: int = 1) -> int:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or int(v) < lo:
            raise ShapeError(f"{name} must be an integer >= {lo}, got {v!r}")
        return int(v)

    # ---- GEMV / GEMM ---------------------------------------------------------------------------------
    def gemv(self, weight: GpuWeight, x: Any, out: Any, bias: Any = None, residual: Any = None,
             stream: Any = None, config: GemvConfig | MmaConfig | None = None) -> None:
        """out = W x (+ bias) (+ residual); ``residual`` may be ``out`` itself (in-place add).

        Q4_K and Q8_0 rows of a multiple of 256 values and Q6_K rows of a multiple of 2048 go to the
        tensor-core kernel (on sm_80+, where it keeps at least half the SMs busy), the rest to the SIMT
        one; ``config`` forces either (a :class:`MmaConfig` or a :class:`GemvConfig`)."""
        cfg = config
        if weight.layout == "glu-tiles":
            raise ShapeError(f"GpuWeight {weight.name!r} is stored for the fused gate/up GEMV: use gemv_glu")
        if cfg is None:
            cfg = self.mma_config(weight.out_dim, weight.in_dim, weight.wtype, layout=weight.layout)
        if cfg is None:
            cfg = gemv_config(weight.out_dim, self.sm_count, weight.in_dim, weight.wtype)
        if not isinstance(cfg, MmaConfig):  # (upload picks tiles only where the tensor-core GEMV runs)
            weight.require_rows("the SIMT GEMV")
        if isinstance(cfg, MmaConfig):
            kern = self._mma_kernel(weight, cfg, bias=bias is not None, residual=residual is not None)
        else:
            kern = self.kernel("gemv", wtype=weight.wtype, in_dim=weight.in_dim, rows=cfg.rows, warps=cfg.warps,
                               bias=bias is not None, residual=residual is not None, ksplit=cfg.ksplit)
        values = {"w": weight.ptr, "x": self._addr(x, weight.in_dim, "x"),
                  "y": self._addr(out, weight.out_dim, "out", align=4)}
        if bias is not None:
            values["bias"] = self._addr(bias, weight.out_dim, "bias", align=4)
        if residual is not None:
            values["residual"] = self._addr(residual, weight.out_dim, "residual", align=4)
        values["out_dim"] = weight.out_dim
        self._launch(kern, -(-weight.out_dim // kern.meta["rows_per_cta"]), values, stream)

    def _mma_kernel(self, weight: GpuWeight, cfg: MmaConfig, **flags):
        return self.kernel("gemv_mma", wtype=weight.wtype, in_dim=weight.in_dim, mtiles=cfg.mtiles, kparts=cfg.kparts,
                           stages=cfg.stages, tiles=cfg.tiles, bulk=cfg.bulk, tiled=weight.layout != "rows",
                           solo=cfg.solo, **flags)

    def mma_config(self, out_dim: int, in_dim: int, wtype: str, glu: bool = False,
                   layout: str = "rows") -> MmaConfig | None:
        """The tensor-core GEMV's launch shape on this device (None: not applicable, or before sm_80) for
        a weight stored in ``layout``. On tile-major weights a launch of at most one CTA per SM asks for
        ``solo`` shared memory (a second CTA of the launch on some SMs while others idle: 4096 x 14336 Q4_K
        12.0 us instead of 9.6), and on sm_90 a warp's stage is one bulk copy where that measured faster
        than cp.async: Q6_K always (14.5 vs 16.2 us at 4096 x 14336), Q4_K with one row tile per CTA
        (4096 x 14336 9.6 vs 9.9; 14336 x 4096, 4 tiles a CTA: 10.4 vs 9.95), Q8_0 with at most two
        units per warp (4096 x 4096 5.9 vs 6.4; 4096 x 14336 15.9 vs 15.5)."""
        cc = self.device.target.compute_capability
        if cc < (8, 0):
            return None
        cfg = mma_config(out_dim, in_dim, wtype, self.sm_count, self._max_smem, bulk_ok=cc >= (9, 0), glu=glu)
        if cfg is None or layout == "rows":
            return cfg
        ctas = -(-out_dim // ((16 if glu else 16 * cfg.tiles) * cfg.mtiles))
        bulk = cc >= (9, 0) and (wtype == "Q6_K" or (wtype == "Q4_K" and cfg.mtiles == 1)
                                 or (wtype == "Q8_0" and in_dim // 256 // cfg.kparts <= 2))
        # (solo only where a CTA may ask for that much: not on sm_86/sm_89, whose limit is 99 KiB)
        return dataclasses.replace(cfg, bulk=bulk, solo=ctas <= self.sm_count and SOLO_SMEM <= self._max_smem)

    def weight_layout(self, out_dim: int, in_dim: int, wtype: str, glu: bool = False) -> str:
        """How a weight should be stored for its decode GEMV on this device: tile-major where the
        tensor-core kernel reads it (``glu``: a [gate; up] weight of 2 ``out_dim`` rows), else GGUF rows.
        Exception: Q4_K rows of at most two units per warp, which the kernel streams with one bulk copy
        per row and unit (4096 x 4096: 4.2 us on rows, 4.5 tile-major, on an H200)."""
        cfg = self.mma_config(out_dim, in_dim, wtype, glu=glu)
        if cfg is None or (wtype == "Q4_K" and cfg.bulk):
            return "rows"
        return "glu-tiles" if glu else "tiles"

    def upload(self, tensors: Any, glu: bool = False, name: str = "") -> GpuWeight:
        """A weight for :meth:`gemv` (or, with ``glu``, [gate; up] for :meth:`gemv_glu`) from one tensor or
        a list to stack (:meth:`GpuWeight.concat`), in the layout its GEMV reads fastest
        (:meth:`weight_layout`). Weights the embedding or the GEMM also read must stay in GGUF rows:
        use ``GpuWeight`` directly."""
        many = isinstance(tensors, (list, tuple))
        first = tensors[0] if many else tensors
        out_dim = sum(int(t.shape[0]) for t in tensors) if many else int(first.shape[0])
        wtype, in_dim = _wtype_name(first.ggml_type), int(first.shape[-1])
        if glu and out_dim % 2:
            raise ShapeError(f"a gate/up weight holds 2 * ffn rows, got {out_dim}")
        layout = "rows"
        if wtype in MMA_TYPES and in_dim % 256 == 0:
            layout = self.weight_layout(out_dim // 2 if glu else out_dim, in_dim, wtype, glu=glu)
        if many:
            return GpuWeight.concat(tensors, name=name, layout=layout)
        return GpuWeight(first, layout=layout) if not name else GpuWeight(
            data=first.data, ggml_type=first.ggml_type, shape=first.shape, name=name, layout=layout)

    def gemv_glu(self, gate_up: GpuWeight, x: Any, out: Any, stream: Any = None,
                 config: GemvConfig | MmaConfig | None = None) -> None:
        """out[i] = silu(gate_i . x) * (up_i . x) with ``gate_up`` = [gate; up] (``GpuWeight.concat``).
        Rows the tensor-core kernel takes (see :meth:`gemv`) run on it."""
        if gate_up.out_dim % 2:
            raise ShapeError(f"gate_up must hold 2 * ffn rows, got {gate_up.out_dim}")
        ffn = gate_up.out_dim // 2
        if gate_up.layout == "tiles":
            raise ShapeError(f"GpuWeight {gate_up.name!r} is stored for a plain GEMV; the fused gate/up GEMV needs "
                             f"layout 'glu-tiles' or 'rows'")
        cfg = config if config is not None else self.mma_config(ffn, gate_up.in_dim, gate_up.wtype, glu=True,
                                                                layout=gate_up.layout)
        if cfg is None:
            cfg = gemv_config(gate_up.out_dim, self.sm_count, gate_up.in_dim, gate_up.wtype)
        if not isinstance(cfg, MmaConfig):
            gate_up.require_rows("the SIMT gate/up GEMV")
        if isinstance(cfg, MmaConfig):
            if gate_up.wtype == "Q6_K" and gate_up.layout == "rows" and not q6k_glu_offsets_fit(ffn, gate_up.in_dim):
                raise ShapeError(f"the tensor-core Q6_K gate/up GEMV cannot address {ffn} x {gate_up.in_dim} "
                                 f"rows (32-bit offsets); leave config unset or use a GemvConfig")
            kern = self._mma_kernel(gate_up, dataclasses.replace(cfg, tiles=2), glu=True)
        else:
            rows = max(2, cfg.rows - cfg.rows % 2)  # weight rows per warp: a gate row and its up row per output
            kern = self.kernel("gemv", wtype=gate_up.wtype, in_dim=gate_up.in_dim, rows=rows, warps=cfg.warps,
                               glu=True, ksplit=cfg.ksplit)
        values = {"w": gate_up.ptr, "x": self._addr(x, gate_up.in_dim, "x"),
                  "y": self._addr(out, ffn, "out", align=4), "out_dim": ffn}
        self._launch(kern, -(-ffn // kern.meta["rows_per_cta"]), values, stream)

    def gemm(self, weight: GpuWeight, x: Any, out: Any, n_tokens: int, bias: Any = None, residual: Any = None,
             stream: Any = None, tokens_per_cta: int = 4, glu: bool = False, config: GemvConfig | None = None) -> None:
        """Prefill: out[t] = W x[t] (+ bias) (+ residual[t]) for t < n_tokens (x: [n_tokens, in_dim],
        out: [n_tokens, out_dim] row-major). With ``glu`` the weight is [gate; up]."""
        weight.require_rows("the GEMM")
        n_tokens = self._count("n_tokens", n_tokens)
        tokens_per_cta = self._count("tokens_per_cta", tokens_per_cta)
        if tokens_per_cta > 8 or (glu and tokens_per_cta > 4):
            raise ShapeError(f"tokens_per_cta must be 1..8 (1..4 with glu), got {tokens_per_cta}")
        out_dim = weight.out_dim // 2 if glu else weight.out_dim
        cfg = config or GemvConfig(2 if glu or tokens_per_cta <= 4 else 1, 4)
        kern = self.kernel("gemm", wtype=weight.wtype, in_dim=weight.in_dim, rows=cfg.rows, warps=cfg.warps,
                           tokens=tokens_per_cta, bias=bias is not None, residual=residual is not None, glu=glu)
        values = {"w": weight.ptr, "x": self._addr(x, n_tokens * weight.in_dim, "x"),
                  "y": self._addr(out, n_tokens * out_dim, "out", align=4)}
        if bias is not None:
            values["bias"] = self._addr(bias, out_dim, "bias", align=4)
        if residual is not None:
            values["residual"] = self._addr(residual, n_tokens * out_dim, "residual", align=4)
        values["out_dim"] = out_dim
        values["n_tokens"] = n_tokens
        grid = (-(-out_dim // kern.meta["rows_per_cta"]), -(-n_tokens // tokens_per_cta))
        self._launch(kern, grid, values, stream)

    # ---- norms and elementwise -----------------------------------------------------------------------
    def rmsnorm(self, x: Any, weight: Any, out: Any, eps: float, hidden: int | None = None, rows: int = 1,
                residual: Any = None, stream: Any = None) -> None:
        """out = rmsnorm(h) * weight per row, h = x, or h = residual + x stored back to ``residual``."""
        rows = self._count("rows", rows)
        if hidden is None:
            buf = weight[0] if isinstance(weight, tuple) else weight
            hidden = buf.count - (weight[1] if isinstance(weight, tuple) else 0)
        hidden = self._count("hidden", hidden)
        if hidden % 4 or hidden > MAX_HIDDEN:
            raise ShapeError(f"hidden must be a multiple of 4 up to {MAX_HIDDEN}, got {hidden}")
        kern = self.kernel("rmsnorm", hidden=hidden, block=default_block(hidden), residual=residual is not None)
        values = {"x": self._addr(x, rows * hidden, "x"), "weight": self._addr(weight, hidden, "weight"),
                  "y": self._addr(out, rows * hidden, "out")}
        if residual is not None:
            values["residual"] = self._addr(residual, rows * hidden, "residual")
        values["eps"] = float(eps)
        self._launch(kern, rows, values, stream)

    def rope(self, q: Any, k: Any, inv_freq: Any, pos: Any, n_q: int, n_kv: int, head_dim: int,
             rot_dim: int | None = None, neox: bool = False, n_tokens: int = 1, stream: Any = None) -> None:
        """Rotate Q [n_tokens, n_q, head_dim] and K [n_tokens, n_kv, head_dim] in place; ``pos`` is the
        first token's position (int: token t at pos + t) or a u32 buffer of one position per token."""
        n_q, n_kv, head_dim = self._count("n_q", n_q), self._count("n_kv", n_kv), self._count("head_dim", head_dim)
        n_tokens = self._count("n_tokens", n_tokens)
        rot_dim = head_dim if rot_dim is None else self._count("rot_dim", rot_dim)
        from_buf = is_buffer_arg(pos)
        kern = self.kernel("rope", head_dim=head_dim, rot_dim=rot_dim, neox=bool(neox), pos_from_buffer=from_buf)
        values = {"q": self._addr(q, n_tokens * n_q * head_dim, "q", align=8),
                  "k": self._addr(k, n_tokens * n_kv * head_dim, "k", align=8),
                  "inv_freq": self._addr(inv_freq, rot_dim // 2, "inv_freq", align=4)}
        if from_buf:
            values["positions"] = self._addr(pos, n_tokens, "pos", np.uint32, align=4)
        else:
            values["pos"] = self._count("pos", pos, lo=0)
        values["n_q"], values["n_kv"] = n_q, n_kv
        grid = (-(-(n_q + n_kv) * (rot_dim // 2) // kern.meta["block"]), n_tokens)
        self._launch(kern, grid, values, stream)

    def rope_kv_append(self, qkv: Any, k_cache: Any, v_cache: Any, inv_freq: Any, pos: Any, n_q: int, n_kv: int,
                       head_dim: int, max_len: int, neox: bool = False, stream: Any = None) -> None:
        """Decode-step fusion: rotate Q in place in ``qkv`` ([q; k; v] of one token), rotate K into
        ``k_cache[:, pos]`` and copy V into ``v_cache[:, pos]`` (caches [n_kv, max_len, head_dim]);
        ``pos`` is a u32 device buffer (or (buffer, index)) so the call can live in a CUDA graph."""
        n_q, n_kv, head_dim = self._count("n_q", n_q), self._count("n_kv", n_kv), self._count("head_dim", head_dim)
        max_len = self._count("max_len", max_len)
        kern = self.kernel("rope_kv_append", head_dim=head_dim, neox=bool(neox))
        cache = n_kv * max_len * head_dim
        values = {"qkv": self._addr(qkv, (n_q + 2 * n_kv) * head_dim, "qkv", align=4),
                  "k_cache": self._addr(k_cache, cache, "k_cache", align=4),
                  "v_cache": self._addr(v_cache, cache, "v_cache", align=4),
                  "inv_freq": self._addr(inv_freq, head_dim // 2, "inv_freq", align=4),
                  "pos_ptr": self._addr(pos, 1, "pos", np.uint32, align=4),
                  "n_q": n_q, "n_kv": n_kv, "max_len": max_len}
        items = (n_q + 2 * n_kv) * (head_dim // 2)
        self._launch(kern, -(-items // kern.meta["block"]), values, stream)

    def _elementwise(self, name: str, values: dict, n: int, stream) -> None:
        vec = 4 if all(v % 16 == 0 for k_, v in values.items() if k_ != "n") else 1
        kern = self.kernel(name, vec=vec)
        self._launch(kern, max(1, -(-n // (kern.meta["block"] * vec))), values, stream)

    def swiglu(self, gate: Any, up: Any, out: Any, n: int, stream: Any = None) -> None:
        """out = silu(gate) * up over n elements (out may alias gate or up)."""
        n = self._count("n", n)
        self._elementwise("swiglu", {"gate": self._addr(gate, n, "gate", align=4), "up": self._addr(up, n, "up", align=4),
                                     "out": self._addr(out, n, "out", align=4), "n": n}, n, stream)

    def residual_add(self, a: Any, b: Any, out: Any, n: int, stream: Any = None) -> None:
        """out = a + b over n elements (out may alias a or b)."""
        n = self._count("n", n)
        self._elementwise("residual_add", {"a": self._addr(a, n, "a", align=4), "b": self._addr(b, n, "b", align=4),
                                           "out": self._addr(out, n, "out", align=4), "n": n}, n, stream)

    def bias_add(self, y: Any, bias: Any, n_cols: int, n_tokens: int = 1, stream: Any = None) -> None:
        """y[t, :] += bias for t < n_tokens."""
        n_cols, n_tokens = self._count("n_cols", n_cols), self._count("n_tokens", n_tokens)
        kern = self.kernel("bias_add")
        values = {"y": self._addr(y, n_cols * n_tokens, "y", align=4), "bias": self._addr(bias, n_cols, "bias", align=4),
                  "n_cols": n_cols}
        self._launch(kern, (-(-n_cols // kern.meta["block"]), n_tokens), values, stream)

    # ---- embedding and argmax ------------------------------------------------------------------------
    def embedding(self, table: GpuWeight, tokens: Any, out: Any, n_tokens: int = 1, stream: Any = None) -> None:
        """out[t] = dequantized row tokens[t] of ``table`` (u32 ids in a device buffer; ids past the
        vocabulary are clamped to the last row)."""
        table.require_rows("the embedding")
        n_tokens = self._count("n_tokens", n_tokens)
        warps = 4 if table.in_dim >= 1024 else 2
        kern = self.kernel("embedding", wtype=table.wtype, hidden=table.in_dim, warps=warps)
        values = {"table": table.ptr, "tokens": self._addr(tokens, n_tokens, "tokens", np.uint32, align=4),
                  "out": self._addr(out, n_tokens * table.in_dim, "out"), "vocab": table.out_dim}
        self._launch(kern, n_tokens, values, stream)

    def argmax(self, x: Any, out: Any, n: int | None = None, stream: Any = None) -> None:
        """out[0] (u32) = argmax of x[0:n] (ties: lowest index; NaN counts as the maximum)."""
        if n is None:
            buf = x[0] if isinstance(x, tuple) else x
            n = buf.count - (x[1] if isinstance(x, tuple) else 0)
        n = self._count("n", n)
        if n >= 1 << 31:
            raise ShapeError(f"argmax handles fewer than 2**31 elements, got {n}")
        part = self.kernel("argmax_partial", block=256)
        final = self.kernel("argmax_final", block=1024)
        p = int(min(_ARGMAX_PARTIALS, max(1, 2 * self.sm_count), -(-n // 256)))
        self._launch(part, p, {"x": self._addr(x, n, "x", align=4), "partials": self._argmax_scratch, "n": n}, stream)
        self._launch(final, 1, {"partials": self._argmax_scratch, "out": self._addr(out, 1, "out", np.uint32, align=4),
                                "n_partials": p}, stream)
