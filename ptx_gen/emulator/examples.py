"""Example launches of every catalog kernel on random inputs, for running a kernel on the emulator
without a GPU (``realizar ptx run KERNEL --emulate``) and for testing the emulator on every family.

A builder ``fn(kernel, sizes, rng) -> Example`` gets the emitted kernel (its ``meta`` holds the launch
hints) and the problem sizes that are not kernel shape parameters (``n``, ``tokens``, ``seq_len``...,
each with a small default), and returns the parameters (NumPy arrays become device buffers, other
values scalars), the grid, block and dynamic shared memory, and which buffers are outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ptx_gen import catalog
from ptx_gen.emulator.machine import run
from ptx_gen.emulator.memory import EmulatorError, Memory


@dataclass
class Example:
    params: dict  # parameter name -> np.ndarray (a buffer) or int/float
    grid: tuple
    block: tuple
    outputs: tuple[str, ...]
    shared_bytes: int = 0


@dataclass
class Report:
    """What :func:`run_example` saw: the launch, the output buffers, or the emulator's error."""

    kernel: str
    shape: dict
    grid: tuple
    block: tuple
    shared_bytes: int
    outputs: dict[str, np.ndarray] = field(default_factory=dict)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def summary(self) -> list[str]:
        """One line per output buffer (or the error)."""
        if self.error is not None:
            return [f"emulator error: {self.error}"]
        lines = []
        for name, a in self.outputs.items():
            f = a.astype(np.float64)
            finite = np.isfinite(f)
            stats = (f"min {f[finite].min():.6g} max {f[finite].max():.6g} mean {f[finite].mean():.6g}"
                     if finite.any() else "no finite values")
            lines.append(f"{name}: {a.size} x {a.dtype}, {stats}, {int((~finite).sum())} non-finite, "
                         f"first {np.array2string(a.reshape(-1)[:4], precision=4, separator=' ')}")
        return lines


Builder = Callable[[object, dict, np.random.Generator], Example]
EXAMPLES: dict[str, Builder] = {}


def example(*names: str) -> Callable[[Builder], Builder]:
    def register(fn: Builder) -> Builder:
        for name in names:
            EXAMPLES[name] = fn
        return fn

    return register


def _f32(rng, *shape, scale=1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _weights(rng, wtype: str, rows: int, in_dim: int) -> np.ndarray:
    """``rows`` GGUF rows of random weights (as bytes, padded to 16); quantized blocks get random codes
    and finite scales."""
    from ptx_gen.kernels.gemv.quant_layout import type_info

    if wtype in ("F32", "F16"):
        raw = _f32(rng, rows * in_dim).astype(np.float32 if wtype == "F32" else np.float16).view(np.uint8)
    elif wtype == "BF16":
        raw = (_f32(rng, rows * in_dim).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    else:
        raw = rng.integers(0, 256, rows * type_info(wtype).row_bytes(in_dim), dtype=np.uint8)
        raw[1::2] &= 0x3B  # every 16-bit word a finite, modest f16: scales stay finite
    return np.concatenate([raw, np.zeros(-raw.size % 16, np.uint8)])


def _elementwise(out: str, inputs: tuple[str, ...], out_dtype=np.float32) -> Builder:
    def build(k, sizes, rng) -> Example:
        n = sizes.get("n", 1000)
        params = {name: _f32(rng, n) for name in inputs}
        params.update({out: np.full(n, np.nan, out_dtype), "n": n})
        per_cta = k.meta["block"] * k.meta.get("per_thread", 1)
        return Example(params, (_cdiv(n, per_cta),), (k.meta["block"],), (out,))

    return build


example("vector_add", "residual_add")(_elementwise("out", ("a", "b")))
example("swiglu")(_elementwise("out", ("gate", "up")))
example("swiglu_f16")(_elementwise("out", ("gate", "up"), np.float16))


@example("axpy")
def _axpy(k, sizes, rng) -> Example:
    n = sizes.get("n", 1000)
    per_cta = k.meta["block"] * k.meta.get("per_thread", 1)
    return Example({"x": _f32(rng, n), "y": _f32(rng, n), "alpha": 1.5, "n": n}, (_cdiv(n, per_cta),),
                   (k.meta["block"],), ("y",))


@example("bias_add")
def _bias_add(k, sizes, rng) -> Example:
    cols, tokens = sizes.get("n_cols", 300), sizes.get("tokens", 2)
    return Example({"y": _f32(rng, tokens * cols), "bias": _f32(rng, cols), "n_cols": cols},
                   (_cdiv(cols, 256), tokens), (256,), ("y",))


@example("row_sum")
def _row_sum(k, sizes, rng) -> Example:
    rows, cols = sizes.get("rows", 3), sizes.get("cols", 500)
    return Example({"x": _f32(rng, rows * cols), "out": np.full(rows, np.nan, np.float32), "cols": cols},
                   (rows,), (k.meta["block"],), ("out",))


@example("copy_row_indirect")
def _copy_row(k, sizes, rng) -> Example:
    rows, cols = sizes.get("rows", 4), sizes.get("cols", 64)
    return Example({"src": _f32(rng, cols), "dst": _f32(rng, rows * cols), "row_ptr": np.array([rows - 1], np.uint32),
                    "rows": rows, "cols": cols}, (_cdiv(cols, k.meta["block"]),), (k.meta["block"],), ("dst",))


@example("stream_read")
def _stream_read(k, sizes, rng) -> Example:
    n16, grid = sizes.get("n16", 512), sizes.get("grid", 2)
    src = rng.integers(0, 2**32, n16 * 4, dtype=np.uint32)
    return Example({"src": src, "n16": n16, "out": np.zeros(grid * k.meta["block"], np.uint32)}, (grid,),
                   (k.meta["block"],), ("out",))


@example("argmax_partial")
def _argmax_partial(k, sizes, rng) -> Example:
    n, parts = sizes.get("n", 5000), sizes.get("partials", 4)
    return Example({"x": _f32(rng, n), "partials": np.zeros(parts, np.uint64), "n": n}, (parts,),
                   (k.meta["block"],), ("partials",))


@example("argmax_final")
def _argmax_final(k, sizes, rng) -> Example:
    parts = sizes.get("partials", 40)
    vals = _f32(rng, parts)
    key = vals.view(np.uint32).astype(np.uint64)  # an order-preserving packing of (value, index)
    key = np.where(vals >= 0, key | (1 << 31), ~key & 0xFFFFFFFF)
    partials = (key << np.uint64(32)) | rng.integers(0, 2**20, parts).astype(np.uint64)
    return Example({"partials": partials.astype(np.uint64), "out": np.zeros(1, np.uint64), "n_partials": parts},
                   (1,), (k.meta["block"],), ("out",))


@example("argmax_pack")
def _argmax_pack(k, sizes, rng) -> Example:
    ex = _argmax_final(k, sizes, rng)
    ex.params["partials"] = ex.params["partials"] | np.uint64(1 << 30)  # low words >= base: no borrow
    ex.params["base"] = sizes.get("base", 1000)
    return ex


@example("rmsnorm", "rmsnorm_f16")
def _rmsnorm(k, sizes, rng) -> Example:
    hidden, rows = k.shape_dict["hidden"], sizes.get("rows", 2)
    y_type = np.float16 if k.name == "rmsnorm_f16" else np.float32
    params = {"x": _f32(rng, rows * hidden), "weight": _f32(rng, hidden), "y": np.full(rows * hidden, np.nan, y_type),
              "eps": 1e-5}
    outputs = ("y",)
    if "residual" in {p.name for p in k.params}:
        params["residual"] = _f32(rng, rows * hidden)
        outputs = ("y", "residual")
    return Example(params, (rows,), (k.meta["block"],), outputs)


def _optional(k, params: dict, rng, **arrays) -> None:
    """Add the optional parameters (bias, residual...) the kernel has."""
    names = {p.name for p in k.params}
    params.update({name: fn() for name, fn in arrays.items() if name in names})


@example("gemv", "gemm", "gemv_mma")
def _gemv(k, sizes, rng) -> Example:
    shape = k.shape_dict
    in_dim, glu = shape["in_dim"], shape.get("glu", False)
    out_dim, tokens = sizes.get("out_dim", 32), (sizes.get("tokens", 3) if k.name == "gemm" else 1)
    rows = out_dim * (2 if glu else 1)
    params = {"w": _weights(rng, shape["wtype"], rows, in_dim), "x": _f32(rng, tokens * in_dim),
              "y": np.full(tokens * out_dim, np.nan, np.float32), "out_dim": out_dim}
    _optional(k, params, rng, bias=lambda: _f32(rng, out_dim), residual=lambda: _f32(rng, tokens * out_dim))
    grid = (_cdiv(out_dim, k.meta["rows_per_cta"]),)
    if k.name == "gemm":
        params["n_tokens"] = tokens
        grid += (_cdiv(tokens, k.meta["tokens_per_cta"]),)
    return Example(params, grid, (k.meta["block"],), ("y",), k.meta.get("dyn_smem", 0))


@example("dequant_f16")
def _dequant_f16(k, sizes, rng) -> Example:
    from ptx_gen.kernels.dequant.dequant import total_rounds
    from ptx_gen.kernels.gemv.gemv_mma_layout import tile_major

    shape = k.shape_dict
    wtype, in_dim, layout = shape["wtype"], shape["in_dim"], shape["layout"]
    out_dim = sizes.get("out_dim", 34)
    raw = _weights(rng, wtype, out_dim, in_dim)
    if layout != "rows":
        from ptx_gen.kernels.gemv.quant_layout import type_info

        raw = tile_major(raw[:out_dim * type_info(wtype).row_bytes(in_dim)], wtype, out_dim, in_dim,
                         glu=layout == "glu-tiles")
        raw = np.concatenate([raw, np.zeros(-raw.size % 16, np.uint8)])
    params = {"w": raw, "out": np.full(out_dim * in_dim, np.nan, np.float16), "out_dim": out_dim}
    grid = (_cdiv(total_rounds(wtype, in_dim, layout, out_dim), k.meta["rounds_per_cta"]),)
    return Example(params, grid, (k.meta["block"],), ("out",))


@example("gemm_f16")
def _gemm_f16(k, sizes, rng) -> Example:
    shape = k.shape_dict
    m, n, kdim = sizes.get("m", 37), sizes.get("n", 70), sizes.get("k", 72)
    cols = n // 2 if shape["glu"] else n
    out = np.float16 if shape["out_f16"] else np.float32
    params = {"x": _f32(rng, m * kdim).astype(np.float16), "w": _f32(rng, n * kdim).astype(np.float16),
              "y": np.full(m * cols, np.nan, out)}
    _optional(k, params, rng, bias=lambda: _f32(rng, n), residual=lambda: _f32(rng, m * cols))
    params.update(m=m, n=n, k=kdim, lda=kdim, ldy=cols)
    grid = (_cdiv(m, k.meta["bm"]), _cdiv(n, k.meta["bn"]))
    return Example(params, grid, (k.meta["block"],), ("y",), k.meta["dyn_smem"])


@example("embedding")
def _embedding(k, sizes, rng) -> Example:
    shape = k.shape_dict
    vocab, tokens, hidden = sizes.get("vocab", 10), sizes.get("tokens", 3), shape["hidden"]
    params = {"table": _weights(rng, shape["wtype"], vocab, hidden),
              "tokens": rng.integers(0, vocab, tokens).astype(np.uint32),
              "out": np.full(tokens * hidden, np.nan, np.float32), "vocab": vocab}
    return Example(params, (tokens,), (k.meta["block"],), ("out",))


@example("rope")
def _rope(k, sizes, rng) -> Example:
    shape = k.shape_dict
    d = shape["head_dim"]
    n_q, n_kv, tokens = sizes.get("n_q", 4), sizes.get("n_kv", 2), sizes.get("tokens", 2)
    pairs = k.meta["pairs_per_head"]
    params = {"q": _f32(rng, tokens * n_q * d), "k": _f32(rng, tokens * n_kv * d),
              "inv_freq": (10000.0 ** (-np.arange(pairs) / pairs)).astype(np.float32), "n_q": n_q, "n_kv": n_kv}
    if "positions" in {p.name for p in k.params}:
        params["positions"] = rng.integers(0, 100, tokens).astype(np.uint32)
    else:
        params["pos"] = sizes.get("pos", 7)
    return Example(params, (_cdiv((n_q + n_kv) * pairs, 128), tokens), (k.meta["block"],), ("q", "k"))


@example("rope_kv_append")
def _rope_kv_append(k, sizes, rng) -> Example:
    d = k.shape_dict["head_dim"]
    n_q, n_kv, max_len = sizes.get("n_q", 4), sizes.get("n_kv", 2), sizes.get("max_len", 8)
    params = {"qkv": _f32(rng, (n_q + 2 * n_kv) * d), "k_cache": np.zeros(n_kv * max_len * d, np.float32),
              "v_cache": np.zeros(n_kv * max_len * d, np.float32),
              "inv_freq": (10000.0 ** (-np.arange(d // 2) / (d // 2))).astype(np.float32),
              "pos_ptr": np.array([sizes.get("pos", 3)], np.uint32), "n_q": n_q, "n_kv": n_kv, "max_len": max_len}
    return Example(params, (_cdiv((n_q + 2 * n_kv) * d // 2, 128),), (k.meta["block"],), ("qkv", "k_cache", "v_cache"))


@example("rope_append_rows")
def _rope_append_rows(k, sizes, rng) -> Example:
    shape = k.shape_dict
    d = shape["head_dim"]
    n_q, n_kv, max_len = sizes.get("n_q", 4), sizes.get("n_kv", 2), sizes.get("max_len", 8)
    count, pos0 = sizes.get("count", 3), sizes.get("pos0", 2)
    rows = n_q + 2 * n_kv
    params = {"qkv": _f32(rng, count * rows * d), "q_out": np.full(n_q * count * d, np.nan, np.float32),
              "k_cache": np.zeros(n_kv * max_len * d, np.float32), "v_cache": np.zeros(n_kv * max_len * d, np.float32),
              "inv_freq": (10000.0 ** (-np.arange(d // 2) / (d // 2))).astype(np.float32)}
    if shape["qk_norm"]:
        params.update(q_norm=_f32(rng, d), k_norm=_f32(rng, d), eps=1e-6)
    params.update(pos0=pos0, count=count, n_q=n_q, n_kv=n_kv, max_len=max_len)
    grid = (count, _cdiv(rows, k.meta["warps"]))
    return Example(params, grid, (k.meta["block"],), ("q_out", "k_cache", "v_cache"))


@example("kv_append")
def _kv_append(k, sizes, rng) -> Example:
    d = k.shape_dict["head_dim"]
    kvh, count, max_len, pos = sizes.get("n_kv", 2), sizes.get("count", 3), sizes.get("max_len", 8), sizes.get("pos", 2)
    params = {"k_cache": np.zeros(kvh * max_len * d, np.float32), "v_cache": np.zeros(kvh * max_len * d, np.float32),
              "k_new": _f32(rng, kvh * count * d), "v_new": _f32(rng, kvh * count * d), "count": count,
              "max_len": max_len}
    names = {p.name for p in k.params}
    params.update({"pos_ptr": np.array([pos], np.uint32)} if "pos_ptr" in names else {"pos": pos})
    return Example(params, (_cdiv(count * d // 4, k.meta["block"]), kvh), (k.meta["block"],), ("k_cache", "v_cache"))


def _decode_inputs(k, sizes, rng) -> tuple[dict, int, int, int]:
    """q and the caches of a decode kernel, the seq_len parameter (by value or pointer); (params, heads, d, kvh)."""
    shape = k.shape_dict
    d, group = shape["head_dim"], shape.get("group", 1)
    kvh, max_len = sizes.get("n_kv", 2), sizes.get("max_len", 40)
    h = kvh * group
    params = {"q": _f32(rng, h * d, scale=3.0), "k_cache": _f32(rng, kvh * max_len * d),
              "v_cache": _f32(rng, kvh * max_len * d), "max_len": max_len}
    seq_len = sizes.get("seq_len", 37)
    names = {p.name for p in k.params}
    params.update({"seq_len_ptr": np.array([seq_len], np.uint32)} if "seq_len_ptr" in names else {"seq_len": seq_len})
    return params, h, d, kvh


@example("incremental_attention")
def _incremental(k, sizes, rng) -> Example:
    params, h, d, kvh = _decode_inputs(k, sizes, rng)
    params["out"] = np.full(h * d, np.nan, np.float32)
    return Example(params, (kvh * k.meta["subgroups"],), (k.meta["block"],), ("out",))


@example("flash_decoding_chunk")
def _decode_chunk(k, sizes, rng) -> Example:
    params, h, d, kvh = _decode_inputs(k, sizes, rng)
    nch = sizes.get("num_chunks", 3)
    params.update(part_acc=np.full(h * nch * d, np.nan, np.float32), part_ml=np.full(h * nch * 2, np.nan, np.float32),
                  min_chunk=k.meta["quantum"])
    return Example(params, (kvh * k.meta["subgroups"], nch), (k.meta["block"],), ("part_acc", "part_ml"))


@example("flash_decoding")
def _decode_fused(k, sizes, rng) -> Example:
    from ptx_gen.kernels.attention.flash_decoding import fused_buffer_sizes

    params, h, d, kvh = _decode_inputs(k, sizes, rng)
    nch, gx = sizes.get("num_chunks", 3), kvh * k.meta["subgroups"]
    n_acc, n_ml, n_cnt = fused_buffer_sizes(h, gx, nch, d)
    params.update(out=np.full(h * d, np.nan, np.float32), part_acc=np.full(n_acc, np.nan, np.float32),
                  part_ml=np.full(n_ml, np.nan, np.float32), counters=np.zeros(n_cnt, np.uint32),
                  min_chunk=k.meta["quantum"], grow_rows=0)
    return Example(params, (gx, nch), (k.meta["block"],), ("out", "counters"))


@example("flash_decoding_reduce")
def _decode_reduce(k, sizes, rng) -> Example:
    shape = k.shape_dict
    d, nch, h, max_len = shape["head_dim"], shape["num_chunks"], sizes.get("heads", 2), sizes.get("max_len", 40)
    ml = np.stack([_f32(rng, h * nch), np.abs(_f32(rng, h * nch)) + 0.5], axis=1)  # (running max, sum) per chunk
    params = {"part_acc": _f32(rng, h * nch * d), "part_ml": ml.astype(np.float32).reshape(-1),
              "out": np.full(h * d, np.nan, np.float32), "max_len": max_len}
    seq_len = sizes.get("seq_len", 37)
    names = {p.name for p in k.params}
    params.update({"seq_len_ptr": np.array([seq_len], np.uint32)} if "seq_len_ptr" in names else {"seq_len": seq_len})
    return Example(params, (h,), (k.meta["block"],), ("out",))


@example("flash_attention", "flash_attention_tokens_f16", "flash_attention_mma")
def _flash_attention(k, sizes, rng) -> Example:
    shape = k.shape_dict
    d, group = shape["head_dim"], shape.get("group", 1)
    kvh, seq_q, seq_k = sizes.get("n_kv", 1), sizes.get("seq_q", 5), sizes.get("seq_k", 9)
    h = kvh * group
    out_type = np.float16 if k.name in ("flash_attention_tokens_f16", "flash_attention_mma") else np.float32
    params = {"q": _f32(rng, h * seq_q * d, scale=2.0), "k": _f32(rng, kvh * seq_k * d), "v": _f32(rng, kvh * seq_k * d),
              "out": np.full(h * seq_q * d, np.nan, out_type), "seq_q": seq_q, "seq_k": seq_k,
              "q_offset": seq_k - seq_q, "kv_stride": seq_k}
    if k.name == "flash_attention_mma":
        params["num_heads"] = h
    return Example(params, (_cdiv(seq_q, k.meta["block_q"]), h), (k.meta["block"],), ("out",),
                   k.launch.dyn_smem)


@example("gemm_q", "gemm_wg", "gemm_ws")
def _gemm_q(k, sizes, rng) -> Example:
    from ptx_gen.kernels.gemv.gemv_mma_layout import tile_major
    from ptx_gen.kernels.gemv.quant_layout import type_info

    shape = k.shape_dict
    wtype, in_dim, layout, glu = shape["wtype"], shape["in_dim"], shape["layout"], shape["glu"]
    cols, m = sizes.get("out_dim", 20), sizes.get("tokens", 3)
    if k.name.startswith("gemm_q"):  # (one token tile)
        m = min(m, k.meta["mt"])
    n = 2 * cols if glu else cols  # weight rows ([gate; up] with glu)
    raw = _weights(rng, wtype, n, in_dim)
    if layout != "rows":
        raw = tile_major(raw[:n * type_info(wtype).row_bytes(in_dim)], wtype, n, in_dim, glu=layout == "glu-tiles")
        raw = np.concatenate([raw, np.zeros(-raw.size % 16, np.uint8)])
    out = np.float16 if shape["out_f16"] else np.float32
    params = {"w": raw, "x": _f32(rng, m * in_dim, scale=1e-3).astype(np.float16),  # (f16 outputs stay finite)
              "y": np.full(m * cols, np.nan, out)}
    _optional(k, params, rng, bias=lambda: _f32(rng, cols), residual=lambda: _f32(rng, m * cols))
    params.update(m=m, n=n, lda=in_dim, ldy=cols)
    grid = (_cdiv(cols, k.meta["rows_per_cta"]), _cdiv(m, k.meta["mt"]))
    return Example(params, grid, (k.meta["block"],), ("y",), k.meta["dyn_smem"])


@example("quantize_x8")
def _quantize_x8(k, sizes, rng) -> Example:
    shape = k.shape_dict
    in_dim, m = shape["in_dim"], sizes.get("tokens", 3)
    x = _f32(rng, m * in_dim)
    params = {"x": x.astype(np.float16) if shape["xh"] else x, "q": np.zeros(m * in_dim, np.int8),
              "s": np.zeros(m * (in_dim // 256) * 32, np.uint8), "lda": in_dim, "ldq": in_dim}
    return Example(params, (_cdiv(in_dim // 256, k.meta["units_per_cta"]), m), (k.meta["block"],), ("q", "s"))


@example("gemm_x8")
def _gemm_x8(k, sizes, rng) -> Example:
    from ptx_gen.kernels.gemm.x8 import quantize_x8_ref, records
    from ptx_gen.kernels.gemv.gemv_mma_layout import tile_major
    from ptx_gen.kernels.gemv.quant_layout import type_info

    shape = k.shape_dict
    wtype, in_dim, glu = shape["wtype"], shape["in_dim"], shape["glu"]
    cols, m = sizes.get("out_dim", 20), sizes.get("tokens", 3)
    n = 2 * cols if glu else cols  # weight rows ([gate; up] with glu)
    raw = _weights(rng, wtype, n, in_dim)
    raw = tile_major(raw[:n * type_info(wtype).row_bytes(in_dim)], wtype, n, in_dim, glu=glu)
    codes, d, sums = quantize_x8_ref(_f32(rng, m * in_dim, scale=1e-3).reshape(m, in_dim))
    out = np.float16 if shape["out_f16"] else np.float32
    params = {"w": np.concatenate([raw, np.zeros(-raw.size % 16, np.uint8)]), "xq": codes.reshape(-1),
              "xs": records(d, sums).reshape(-1), "y": np.full(m * cols, np.nan, out)}
    _optional(k, params, rng, bias=lambda: _f32(rng, cols), residual=lambda: _f32(rng, m * cols))
    params.update(m=m, n=n, ldq=in_dim, ldy=cols)
    grid = (_cdiv(m, k.meta["tokens_per_cta"]), _cdiv(cols, k.meta["rows_per_cta"]))
    return Example(params, grid, (k.meta["block"],), ("y",), k.meta["dyn_smem"])


def _paged_pools(kv_dtype: str, num_blocks: int, n_kv: int, block_size: int, d: int, rng,
                 empty: bool = False) -> dict:
    """k_pool, v_pool (+ k_scales, v_scales for q8_0) of ``num_blocks`` blocks (layout of
    :mod:`ptx_gen.kernels.kv.paged_kv`): random finite contents, or zeros with ``empty``."""
    n = num_blocks * n_kv * block_size * d
    pools = {}
    for name in ("k", "v"):
        if kv_dtype == "q8_0":
            codes = np.zeros(n, np.int8) if empty else rng.integers(-127, 128, n).astype(np.int8)
            scales = np.zeros(n // 32, np.float16) if empty else (np.abs(_f32(rng, n // 32)) * 0.02 + 1e-3)
            pools.update({f"{name}_pool": codes, f"{name}_scales": scales.astype(np.float16)})
            continue
        x = np.zeros(n, np.float32) if empty else _f32(rng, n)
        if kv_dtype == "f16":
            x = x.astype(np.float16)
        elif kv_dtype == "bf16":
            x = (x.view(np.uint32) >> 16).astype(np.uint16)
        pools[f"{name}_pool"] = x
    return pools


def _pool_outputs(kv_dtype: str) -> tuple[str, ...]:
    return ("k_pool", "v_pool") + (("k_scales", "v_scales") if kv_dtype == "q8_0" else ())


def _block_tables(rng, rows: int, stride: int) -> tuple[np.ndarray, int]:
    """``rows`` block tables of ``stride`` distinct real blocks (>= 1; block 0 is the null block), and
    the pool's block count."""
    num_blocks = 1 + rows * stride
    return (rng.permutation(num_blocks - 1) + 1).astype(np.uint32), num_blocks


def _inv_freq(d: int) -> np.ndarray:
    return (10000.0 ** (-np.arange(d // 2) / (d // 2))).astype(np.float32)


@example("paged_append_decode")
def _paged_append_decode(k, sizes, rng) -> Example:
    shape = k.shape_dict
    d, bs, kv = shape["head_dim"], shape["block_size"], shape["kv_dtype"]
    n_q, n_kv, rows = sizes.get("n_q", 4), sizes.get("n_kv", 2), sizes.get("rows", 3)
    stride = sizes.get("table_stride", 2)
    positions = rng.integers(0, stride * bs, rows).astype(np.uint32)
    tables, num_blocks = _block_tables(rng, rows, stride)
    n_rows = n_q + 2 * n_kv
    params = {"qkv": _f32(rng, rows * n_rows * d), **_paged_pools(kv, num_blocks, n_kv, bs, d, rng, empty=True),
              "inv_freq": _inv_freq(d), "positions": positions, "block_tables": tables}
    if shape["qk_norm"]:
        params.update(q_norm=_f32(rng, d), k_norm=_f32(rng, d), eps=1e-6)
    params.update(table_stride=stride, n_q=n_q, n_kv=n_kv)
    return Example(params, (rows, _cdiv(n_rows, k.meta["warps"])), (k.meta["block"],), ("qkv",) + _pool_outputs(kv))


@example("paged_append_rows")
def _paged_append_rows(k, sizes, rng) -> Example:
    shape = k.shape_dict
    d, bs, kv = shape["head_dim"], shape["block_size"], shape["kv_dtype"]
    n_q, n_kv = sizes.get("n_q", 4), sizes.get("n_kv", 2)
    count, pos0 = sizes.get("count", 3), sizes.get("pos0", bs - 1)  # (the chunk crosses a block boundary)
    stride = _cdiv(pos0 + count, bs)
    table, num_blocks = _block_tables(rng, 1, stride)
    n_rows = n_q + 2 * n_kv
    params = {"qkv": _f32(rng, count * n_rows * d), "q_out": np.full(n_q * count * d, np.nan, np.float32),
              **_paged_pools(kv, num_blocks, n_kv, bs, d, rng, empty=True), "inv_freq": _inv_freq(d),
              "block_table": table}
    if shape["qk_norm"]:
        params.update(q_norm=_f32(rng, d), k_norm=_f32(rng, d), eps=1e-6)
    params.update(pos0=pos0, count=count, table_stride=stride, n_q=n_q, n_kv=n_kv)
    return Example(params, (count, _cdiv(n_rows, k.meta["warps"])), (k.meta["block"],),
                   ("q_out",) + _pool_outputs(kv))


@example("paged_decode_attention")
def _paged_decode(k, sizes, rng) -> Example:
    from ptx_gen.kernels.attention.paged_decode import buffer_sizes

    shape = k.shape_dict
    d, group, bs, kv = shape["head_dim"], shape["group"], shape["block_size"], shape["kv_dtype"]
    n_kv, nch = sizes.get("n_kv", 1), sizes.get("num_chunks", 2)
    lens = np.array(sizes.get("seq_lens", (bs + 5, 2 * bs + 3)), np.uint32)  # one and several chunks
    rows, h = lens.size, n_kv * group
    stride = _cdiv(int(lens.max()), bs)
    tables, num_blocks = _block_tables(rng, rows, stride)
    n_acc, n_ml, n_cnt = buffer_sizes(rows, h, n_kv, nch, d)
    out = np.float16 if shape["out_f16"] else np.float32
    params = {"q": _f32(rng, rows * h * d, scale=3.0), **_paged_pools(kv, num_blocks, n_kv, bs, d, rng),
              "out": np.full(rows * h * d, np.nan, out), "part_acc": np.full(n_acc, np.nan, np.float32),
              "part_ml": np.full(n_ml, np.nan, np.float32), "counters": np.zeros(n_cnt, np.uint32),
              "seq_lens": lens, "block_tables": tables, "table_stride": stride, "n_kv": n_kv,
              "min_chunk": sizes.get("min_chunk", bs), "q_stride": h * d}
    return Example(params, (rows * n_kv, nch), (k.meta["block"],), ("out", "counters"))


@example("paged_prefill_attention")
def _paged_prefill(k, sizes, rng) -> Example:
    shape = k.shape_dict
    d, group, bs, kv = shape["head_dim"], shape["group"], shape["block_size"], shape["kv_dtype"]
    n_kv, seq_q, seq_k = sizes.get("n_kv", 1), sizes.get("seq_q", 5), sizes.get("seq_k", bs + 4)
    h = n_kv * group
    stride = _cdiv(seq_k, bs)
    table, num_blocks = _block_tables(rng, 1, stride)
    params = {"q": _f32(rng, h * seq_q * d, scale=2.0), **_paged_pools(kv, num_blocks, n_kv, bs, d, rng),
              "block_table": table, "out": np.full(seq_q * h * d, np.nan, np.float16), "seq_q": seq_q,
              "seq_k": seq_k, "q_offset": seq_k - seq_q, "num_heads": h, "n_kv": n_kv}
    return Example(params, (_cdiv(seq_q, k.meta["block_q"]), h), (k.meta["block"],), ("out",), k.meta["dyn_smem"])


def run_example(name: str, shape: dict, target: str = "sm_90", seed: int = 0, racecheck: bool = True) -> Report:
    """Emit kernel ``name`` (the kernel's shape parameters from ``shape``; the other keys are problem
    sizes for its example), run it on the emulator on random inputs, and report the outputs or the
    error the emulator raised (memcheck, racecheck, barrier divergence, ...)."""
    if name not in EXAMPLES:
        arch = catalog.spec(name).arch if name in catalog.names() else None
        if arch:
            raise ValueError(f"kernel {name!r} is {arch}-only (instructions the emulator does not model): it runs "
                             f"and is tested on the GPU")
        raise ValueError(f"no example launch for kernel {name!r}; have {sorted(EXAMPLES)}")
    spec = catalog.spec(name)
    kernel_shape = {key: v for key, v in shape.items() if key in spec.shape_params}
    sizes = {key: v for key, v in shape.items() if key not in spec.shape_params}
    kern = catalog.emit(name, target=target, **kernel_shape)
    ex = EXAMPLES[name](kern, sizes, np.random.default_rng(seed))
    report = Report(name, kern.shape_dict, ex.grid, ex.block, ex.shared_bytes)
    mem = Memory()
    addrs, values = {}, {}
    for p in kern.params:
        value = ex.params[p.name]
        if isinstance(value, np.ndarray):
            addrs[p.name] = mem.alloc_array(value)
            values[p.name] = addrs[p.name]
        else:
            values[p.name] = value
    try:
        run(kern.ptx, ex.grid, ex.block, values, mem, ex.shared_bytes, racecheck=racecheck)
    except EmulatorError as exc:
        report.error = str(exc)
        return report
    for out in ex.outputs:
        a = ex.params[out]
        report.outputs[out] = mem.read(addrs[out], a.dtype, a.size).copy()
    return report

from ptx_gen.emulator import examples_moe, examples_sampling  # noqa: E402,F401  (register their examples)
