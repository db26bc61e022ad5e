"""The batched decode step's attention alone: ``PagedKVCache.decode_attention`` of B rows (one query token each) over
contexts of L positions in a paged f16 cache, Llama-3-8B's heads (32 query heads, 8 KV heads, head_dim 128, blocks
of 32 positions), timed as GPU time (20 calls replayed from a CUDA graph, median of 7), beside torch's
``scaled_dot_product_attention`` over the same K/V laid out contiguously (f16, ``enable_gqa``) in the same run.

    python tools/bench_attention_batched.py [--batches 64,128,256] [--lengths 128,192,256,512] [--sweep]

Each row: µs per call, the K/V bytes read (B L KVH D x 2 x 2) over that time, its share of the copy bandwidth
(``--copy-tbs``, H200: 4.0 TB/s read + written), torch's µs and the ratio (above 1: ours is faster), the largest error
of our output against a float64 oracle over the same f16 K/V, relative to its largest value. ``--sweep`` times decode
tilings (16 or 32 lanes a row, 2 or 4 rows a lane group takes per step), chunk counts (the default, 1, 2) and the
block-id prefetch (``pp``) beside the default and reports the best (8 lanes and unroll 1 lost everywhere in the sweep
of 2026-11-30). ``--rings 2,3,4`` times the ring of bulk copies (``decode_ring``) at those depths (``--scatter``: each
also with its scores reduce-scattered, ``decode_scatter``). Every swept
variant's output is checked against the oracle too (above 1e-3 of the largest value: WRONG, never the best).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from realizar import cuda  # noqa: E402
from realizar.cuda.bench import graph_median_us  # noqa: E402
from realizar.gpu.paged_kv import PagedKVCache  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 32


def oracle(q, k, v) -> np.ndarray:
    """float64 attention of one query token a row: q [B, H, D], k / v [B, KVH, L, D] (query head h reads KV head
    h // (H / KVH))."""
    b, h, d = q.shape
    kk = np.repeat(k.astype(np.float64), h // k.shape[1], axis=1)
    vv = np.repeat(v.astype(np.float64), h // k.shape[1], axis=1)
    s = np.einsum("bhd,bhld->bhl", q.astype(np.float64), kk) / np.sqrt(d)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhl,bhld->bhd", p / p.sum(-1, keepdims=True), vv)


def _torch_us(q, k, v) -> float | None:
    """torch's SDPA µs (CUDA events, median of 7 x 20 calls), or None without torch on a GPU."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    tq = torch.from_numpy(q.astype(np.float16)).cuda()[:, :, None, :]  # [B, H, 1, D]
    tk, tv = torch.from_numpy(k).cuda(), torch.from_numpy(v).cuda()  # [B, KVH, L, D]
    F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)
    times = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(20):
            F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / 20)
    return float(np.median(times))


def case(dev, b: int, length: int, seed: int, **knobs) -> tuple[float, np.ndarray, dict]:
    """(µs per call, the output [B, H, D], the host inputs) of ``decode_attention`` over B rows of ``length``
    positions, the cache built with ``knobs`` (PagedKVCache's decode_unroll / decode_lanes / num_chunks); the data
    drawn from ``seed``, so every variant of a case reads the same q, K and V."""
    rng = np.random.default_rng(seed)
    per = -(-length // BLOCK)
    cache = PagedKVCache(1, HEADS, KV_HEADS, HEAD_DIM, 1 + b * per, BLOCK, "f16", dev, max_batch=b, **knobs)
    ops, stream = cache.ops, cuda.Stream(dev)
    # block r * per + 1 .. of row r; the pools [blocks, KVH, BLOCK, D]
    k = rng.standard_normal((b, KV_HEADS, per * BLOCK, HEAD_DIM)).astype(np.float16)
    v = rng.standard_normal((b, KV_HEADS, per * BLOCK, HEAD_DIM)).astype(np.float16)
    pool_k = np.zeros((1 + b * per, KV_HEADS, BLOCK, HEAD_DIM), np.float16)
    pool_v = np.zeros_like(pool_k)
    pool_k[1:] = k.reshape(b, KV_HEADS, per, BLOCK, HEAD_DIM).transpose(0, 2, 1, 3, 4).reshape(-1, KV_HEADS, BLOCK,
                                                                                                HEAD_DIM)
    pool_v[1:] = v.reshape(b, KV_HEADS, per, BLOCK, HEAD_DIM).transpose(0, 2, 1, 3, 4).reshape(-1, KV_HEADS, BLOCK,
                                                                                                HEAD_DIM)
    cache.pools_from_numpy(0, pool_k.astype(np.float32), pool_v.astype(np.float32))
    q = rng.standard_normal((b, HEADS, HEAD_DIM)).astype(np.float32)
    tables = (1 + np.arange(b * per, dtype=np.uint32)).reshape(b, per)
    dq, dl, dt = ops.to_device(q.reshape(-1)), ops.to_device(np.full(b, length, np.uint32)), ops.to_device(tables)
    out = ops.buffer(b * HEADS * HEAD_DIM)
    calls = [lambda: cache.decode_attention(0, dq, out, dl, dt, per, b, stream=stream) for _ in range(20)]
    us = graph_median_us(calls, stream)[0]
    stream.synchronize()
    got = out.to_numpy().reshape(b, HEADS, HEAD_DIM)
    for buf in (dq, dl, dt, out):
        buf.free()
    cache.close()
    return us, got, {"q": q, "k": k[:, :, :length], "v": v[:, :, :length]}


def _variants(sweep: bool, rings: str, scatter: bool = False) -> list[tuple[str, dict]]:
    """(tag, PagedKVCache knobs) of each timed variant: with ``sweep`` the register pass's tilings, chunk counts and
    block-id prefetch (``ring`` 0); with ``rings`` (stages, comma-separated) the ring of bulk copies at 2 and 4 rows
    a lane group per step, with ``scatter`` each also with its scores reduce-scattered (``sc``)."""
    out = []
    if sweep:
        for unroll, lanes, chunks, pf in itertools.product((2, 4), (16, 32), (None, 1, 2), (False, True)):
            out.append((f"u{unroll} t{lanes} c{chunks}{' pp' if pf else ''}",
                        dict(decode_unroll=unroll, decode_lanes=lanes, num_chunks=chunks, decode_prefetch=pf,
                             decode_ring=0)))
    for stages, unroll, sc in itertools.product([int(x) for x in rings.split(",") if x], (2, 4),
                                                (False, True) if scatter else (False,)):
        out.append((f"ring {stages} u{unroll} t16{' sc' if sc else ''}",
                    dict(decode_unroll=unroll, decode_lanes=16, decode_ring=stages, decode_scatter=sc)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="64,128,256")
    ap.add_argument("--lengths", default="128,192,256,512")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--rings", default="", help="also time the ring of bulk copies at these stages (e.g. 2,3,4)")
    ap.add_argument("--scatter", action="store_true", help="--rings: each ring also with its scores reduce-scattered")
    ap.add_argument("--copy-tbs", type=float, default=4.0, help="the device's copy bandwidth, TB/s (H200: 4.0)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    dev = cuda.current_device()
    lines = [f"# Batched decode attention — {dev.name}, {datetime.date.today()}", "",
             f"Command: `python tools/bench_attention_batched.py {' '.join(sys.argv[1:] if argv is None else argv)}`",
             "", f"{HEADS} query heads, {KV_HEADS} KV heads, head_dim {HEAD_DIM}, f16 K/V in blocks of {BLOCK}; µs per "
             "call from graph replays; torch: SDPA over contiguous f16 K/V (enable_gqa), same run.", "",
             "| B | L | µs | KV TB/s | % of copy | torch µs | torch / ours | max error | best swept |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    print("\n".join(lines), flush=True)
    for b in [int(x) for x in a.batches.split(",")]:
        for length in [int(x) for x in a.lengths.split(",")]:
            seed = b * 100_003 + length
            us, got, host = case(dev, b, length, seed)
            tus = _torch_us(host["q"], host["k"], host["v"])
            ref = oracle(host["q"], host["k"], host["v"])
            err = f"{np.abs(got - ref).max() / np.abs(ref).max():.1e}"
            best = f"{us:.1f} (default)"
            if a.sweep or a.rings:
                best_us = us
                for tag, knobs in _variants(a.sweep, a.rings, a.scatter):
                    try:
                        t, got_v, _ = case(dev, b, length, seed, **knobs)
                    except Exception as exc:  # (a tiling the kernel refuses)
                        print(f"  {tag}: {type(exc).__name__}: {exc}", flush=True)
                        continue
                    err_v = np.abs(got_v - ref).max() / np.abs(ref).max()
                    print(f"  B={b} L={length} {tag}: {t:.1f} us (error {err_v:.1e})", flush=True)
                    if err_v > 1e-3:
                        print(f"  {tag}: WRONG (error {err_v:.1e} against the oracle)", flush=True)
                    elif t < best_us:
                        best_us, best = t, f"{t:.1f} ({tag})"
            tbs = b * length * KV_HEADS * HEAD_DIM * 2 * 2 / us / 1e6
            row = (f"| {b} | {length} | {us:.1f} | {tbs:.2f} | {100 * tbs / a.copy_tbs:.0f}% | "
                   f"{'-' if tus is None else f'{tus:.1f}'} | {'-' if tus is None else f'{tus / us:.2f}'} | {err} | "
                   f"{best} |")
            print(row, flush=True)
            lines.append(row)
    if a.out:
        a.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
