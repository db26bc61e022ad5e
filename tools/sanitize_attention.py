"""Small launches of every attention kernel, for compute-sanitizer (memcheck, racecheck).

Picked up by ``tools/sanitize_cases.py`` (``cases(cache, rng, small)``) and runnable alone:

    compute-sanitizer --tool memcheck  python tools/sanitize_attention.py
    compute-sanitizer --tool racecheck python tools/sanitize_attention.py --small

Shapes are awkward on purpose: head_dim 80 (lane groups with an idle chunk) and 48, sequence lengths
one past a chunk/tile quantum, a flash-decoding grid with more chunks than the sequence needs
(neutral partials), single-launch flash decoding with one-row chunks (two combine levels) called
twice on the same counters, a causal prefill whose last query tile is partial, and caches read in
place with spare rows. The paged KV cache (f16 and q8_0 pools): a batched decode append and split-KV
decode attention over rows of lengths 0, 1 and across block/chunk boundaries through shuffled block
tables (twice, on the same combine counters), and a prefill chunk after a cached prefix on tensor cores.
The paged f32 forms of kv_append and flash_attention (``block_size=``) launched directly, an append
running past its block table; and CudaExecutor over its paged f32 cache (host- and device-positioned
appends, one-pass and split-KV decode, graph replays with a new length, prefill after a prefix). Every
case checks its result against the float64 oracle, so a kernel that misbehaves only under the
sanitizer is noticed too.
"""

from __future__ import annotations

import argparse

import numpy as np

from ptx_gen.kernels.attention.flash_decoding import fused_buffer_sizes
from realizar import cuda
from realizar.models.attention import attention_with_cache_gqa, gqa_attention

# (num_heads, num_kv_heads, head_dim, seq_len, max_len)
DECODE_SHAPES = [(4, 2, 80, 33, 40), (6, 3, 48, 17, 17), (7, 1, 64, 65, 70), (8, 2, 128, 129, 130), (2, 1, 256, 9, 12)]
DECODE_SHAPES_SMALL = [(4, 2, 80, 33, 40), (7, 1, 64, 65, 70)]
# (num_heads, num_kv_heads, head_dim, seq_q, seq_k, causal)
PREFILL_SHAPES = [(2, 1, 64, 70, 70, True), (3, 3, 80, 17, 40, True), (4, 2, 48, 33, 33, False),
                  (1, 1, 256, 34, 34, True)]
PREFILL_SHAPES_SMALL = [(2, 1, 64, 70, 70, True), (3, 3, 80, 17, 40, True)]


def _check(got: np.ndarray, ref: np.ndarray, what: str, tol: float = 1e-5) -> None:
    err = float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-30))
    if not np.all(np.isfinite(got)) or err > tol:
        raise AssertionError(f"{what}: relative error {err:.3e} (finite: {bool(np.all(np.isfinite(got)))})")


def decode_cases(cache, rng, shapes) -> None:
    for h, kvh, d, length, max_len in shapes:
        group = h // kvh
        q = (rng.standard_normal((h, d)) * 4).astype(np.float32)
        kc = rng.standard_normal((kvh, max_len, d)).astype(np.float32)
        vc = rng.standard_normal((kvh, max_len, d)).astype(np.float32)
        k64, v64 = kc[:, :length].astype(np.float64), vc[:, :length].astype(np.float64)
        ref = attention_with_cache_gqa(q.astype(np.float64), k64[:, :-1], v64[:, :-1], k64[:, -1], v64[:, -1])
        # the last position goes in through kv_append (indirect position), the rest is uploaded
        app = cache.get("kv_append", head_dim=d, indirect=True)
        inc = cache.get("incremental_attention", head_dim=d, group=group, indirect=False)
        chunk = cache.get("flash_decoding_chunk", head_dim=d, group=group, indirect=True)
        nch = 7
        red = cache.get("flash_decoding_reduce", head_dim=d, num_chunks=nch, indirect=True)
        fused = cache.get("flash_decoding", head_dim=d, group=group, indirect=True)
        fx, fch = kvh * fused.meta["subgroups"], 40
        n_acc, n_ml, n_cnt = fused_buffer_sizes(h, fx, fch, d)
        knew, vnew = kc[:, length - 1].copy(), vc[:, length - 1].copy()
        kc[:, length - 1:] = np.nan
        vc[:, length - 1:] = np.nan
        bufs = dict(
            q=cuda.GpuBuffer.from_numpy(q), k=cuda.GpuBuffer.from_numpy(kc), v=cuda.GpuBuffer.from_numpy(vc),
            kn=cuda.GpuBuffer.from_numpy(knew), vn=cuda.GpuBuffer.from_numpy(vnew), out=cuda.GpuBuffer(h * d),
            out2=cuda.GpuBuffer(h * d), acc=cuda.GpuBuffer(h * nch * d), ml=cuda.GpuBuffer(h * nch * 2),
            step=cuda.GpuBuffer.from_numpy(np.array([length - 1, length], np.uint32)),
            facc=cuda.GpuBuffer(n_acc), fml=cuda.GpuBuffer(n_ml), cnt=cuda.GpuBuffer.zeros(n_cnt, np.uint32),
            out3=cuda.GpuBuffer(h * d),
        )
        try:
            b = bufs
            cuda.launch(app, (-(-d // 4 // app.meta["block"]), kvh), app.meta["block"],
                        app.args(b["k"], b["v"], b["kn"], b["vn"], b["step"].ptr, 1, max_len))
            cuda.launch(inc, kvh * inc.meta["subgroups"], inc.meta["block"],
                        inc.args(b["q"], b["k"], b["v"], b["out"], length, max_len))
            seq_ptr = b["step"].ptr + 4
            cuda.launch(chunk, (kvh * chunk.meta["subgroups"], nch), chunk.meta["block"],
                        chunk.args(b["q"], b["k"], b["v"], b["acc"], b["ml"], seq_ptr, max_len, chunk.meta["quantum"]))
            cuda.launch(red, h, red.meta["block"], red.args(b["acc"], b["ml"], b["out2"], seq_ptr, max_len))
            _check(b["out"].to_numpy((h, d)), ref, f"incremental {h}/{kvh}/{d} L={length}")
            _check(b["out2"].to_numpy((h, d)), ref, f"flash decoding {h}/{kvh}/{d} L={length}")
            for rep in range(2):  # the second call reuses the counters the first one left at zero
                b["out3"].poison()
                cuda.launch(fused, (fx, fch), fused.meta["block"],
                            fused.args(b["q"], b["k"], b["v"], b["out3"], b["facc"], b["fml"], b["cnt"], seq_ptr,
                                       max_len, 1, 0))
                _check(b["out3"].to_numpy((h, d)), ref, f"single-launch flash decoding {h}/{kvh}/{d} L={length} "
                                                        f"call {rep}")
            if b["cnt"].to_numpy().any():
                raise AssertionError(f"single-launch flash decoding left counters {b['cnt'].to_numpy().tolist()}")
        finally:
            for buf in bufs.values():
                buf.free()


def prefill_cases(cache, rng, shapes) -> None:
    for h, kvh, d, sq, sk, causal in shapes:
        stride = sk + 3
        q = rng.standard_normal((h, sq, d)).astype(np.float32)
        k = rng.standard_normal((kvh, stride, d)).astype(np.float32)
        v = rng.standard_normal((kvh, stride, d)).astype(np.float32)
        ref = gqa_attention(q.astype(np.float64), k[:, :sk].astype(np.float64), v[:, :sk].astype(np.float64), causal)
        kern = cache.get("flash_attention", head_dim=d, group=h // kvh, causal=causal)
        with cuda.GpuBuffer.from_numpy(q) as dq, cuda.GpuBuffer.from_numpy(k) as dk, \
                cuda.GpuBuffer.from_numpy(v) as dv, cuda.GpuBuffer(q.size) as out:
            cuda.launch(kern, (-(-sq // kern.meta["block_q"]), h), kern.meta["block"],
                        kern.args(dq, dk, dv, out, sq, sk, sk - sq, stride), kern.launch.dyn_smem)
            _check(out.to_numpy(q.shape), ref, f"flash attention {h}/{kvh}/{d} {sq}x{sk} causal={causal}")
        if d % 16 == 0 and d <= 128:  # the tensor-core kernel: token-major f16 output, f16 operands
            kern = cache.get("flash_attention_mma", head_dim=d, group=h // kvh, causal=causal)
            with cuda.GpuBuffer.from_numpy(q) as dq, cuda.GpuBuffer.from_numpy(k) as dk, \
                    cuda.GpuBuffer.from_numpy(v) as dv, cuda.GpuBuffer(q.size, np.float16) as out:
                cuda.launch(kern, (-(-sq // kern.meta["block_q"]), h), kern.meta["block"],
                            kern.args(dq, dk, dv, out, sq, sk, sk - sq, stride, h), kern.launch.dyn_smem)
                got = out.to_numpy((sq, h, d)).transpose(1, 0, 2).astype(np.float64)
                err = np.abs(got - ref).max() / np.abs(ref).max()
                assert err < 4e-3, f"tensor-core flash attention {h}/{kvh}/{d} {sq}x{sk}: relative error {err:.2e}"


# (num_heads, num_kv_heads, head_dim, block_size, kv_dtype, decode lengths, prefix, chunk, decode ring stages (sm_90))
PAGED_SHAPES = [(4, 2, 64, 16, "f16", [1, 17, 0, 70], 20, 33, 0), (6, 2, 96, 32, "q8_0", [33, 1, 130], 40, 30, 0),
                (4, 1, 128, 16, "q8_0", [65, 0], 16, 70, 0), (8, 2, 128, 32, "f16", [1, 33, 0, 200, 95], 20, 33, 2),
                (4, 2, 64, 16, "bf16", [70, 17, 1], 20, 33, 3)]
PAGED_SHAPES_SMALL = PAGED_SHAPES[:2] + PAGED_SHAPES[3:4]


def paged_cases(rng, shapes) -> None:
    from ptx_gen.kernels.elementwise.rope import inv_freq_table
    from realizar.gpu.paged_kv import PagedKVCache
    for h, kvh, d, bs, kv_dtype, lengths, prefix, chunk, ring in shapes:
        if ring and cuda.current_device().target.compute_capability < (9, 0):
            continue
        rows = len(lengths)
        stride = max(-(-(n + 1) // bs) for n in lengths + [prefix + chunk])
        nb = 1 + stride * (rows + 1)
        ids = rng.permutation(np.arange(1, nb))
        tab = ids[:rows * stride].reshape(rows, stride).astype(np.uint32)
        ptab = ids[rows * stride:(rows + 1) * stride].astype(np.uint32)
        cache = PagedKVCache(1, h, kvh, d, nb, bs, kv_dtype, max_batch=rows, num_chunks=5, min_chunk=16,
                             decode_ring=ring)
        pool = rng.standard_normal((2, nb, kvh, bs, d)).astype(np.float32)
        cache.pools_from_numpy(0, pool[0], pool[1])
        qn = (h + 2 * kvh) * d
        qkv = rng.standard_normal((rows, qn)).astype(np.float32)
        inv = inv_freq_table(d, 10000.0)
        positions = np.array([max(n - 1, 0) for n in lengths], np.uint32)  # the appended token is the last
        bufs = dict(qkv=cuda.GpuBuffer.from_numpy(qkv.reshape(-1)), inv=cuda.GpuBuffer.from_numpy(inv),
                    pos=cuda.GpuBuffer.from_numpy(positions), tab=cuda.GpuBuffer.from_numpy(tab.reshape(-1)),
                    lens=cuda.GpuBuffer.from_numpy(np.array(lengths, np.uint32)),
                    out=cuda.GpuBuffer(rows * h * d), out16=cuda.GpuBuffer(rows * h * d, np.float16),
                    ptab=cuda.GpuBuffer.from_numpy(ptab),
                    pqkv=cuda.GpuBuffer.from_numpy(rng.standard_normal(chunk * qn).astype(np.float32)),
                    pq=cuda.GpuBuffer(h * chunk * d), pout=cuda.GpuBuffer(chunk * h * d, np.float16))
        try:
            b = bufs
            cache.append_decode(0, b["qkv"], b["inv"], b["pos"], b["tab"], stride, rows)
            kp, vp = cache.pools_to_numpy(0)
            q = b["qkv"].to_numpy((rows, qn))[:, :h * d].reshape(rows, h, d).astype(np.float64)
            for rep in range(2):
                b["out"].poison()
                b["out16"].poison()
                cache.decode_attention(0, b["qkv"], b["out"], b["lens"], b["tab"], stride, rows, q_stride=qn)
                cache.decode_attention(0, b["qkv"], b["out16"], b["lens"], b["tab"], stride, rows, out_f16=True,
                                       q_stride=qn)
                got, got16 = b["out"].to_numpy((rows, h, d)), b["out16"].to_numpy((rows, h, d)).astype(np.float64)
                for r, n in enumerate(lengths):
                    p = np.arange(n)
                    keys = kp[tab[r, p // bs], :, p % bs].transpose(1, 0, 2).astype(np.float64)
                    vals = vp[tab[r, p // bs], :, p % bs].transpose(1, 0, 2).astype(np.float64)
                    ref = gqa_attention(q[r][:, None], keys, vals, causal=False)[:, 0] if n else np.zeros((h, d))
                    what = f"paged decode {kv_dtype} {h}/{kvh}/{d} b{bs} ring {ring} row {r} L={n} call {rep}"
                    if n:
                        _check(got[r], ref, what)
                        _check(got16[r], ref, what + " (f16 out)", 2e-3)
                    elif got[r].any() or got16[r].any():
                        raise AssertionError(f"{what}: an empty row must give zeros")
            if cache._counters.to_numpy().any():
                raise AssertionError("paged decode left its combine counters non-zero")
            total = prefix + chunk
            cache.append_rows(0, b["pqkv"], b["inv"], prefix, chunk, b["pq"], b["ptab"])
            cache.prefill_attention(0, b["pq"], b["pout"], chunk, prefix, total, b["ptab"])
            kp, vp = cache.pools_to_numpy(0)
            p = np.arange(total)
            keys = kp[ptab[p // bs], :, p % bs].transpose(1, 0, 2).astype(np.float64)
            vals = vp[ptab[p // bs], :, p % bs].transpose(1, 0, 2).astype(np.float64)
            ref = gqa_attention(b["pq"].to_numpy((h, chunk, d)).astype(np.float64), keys, vals, True, q_offset=prefix)
            got = b["pout"].to_numpy((chunk, h, d)).transpose(1, 0, 2).astype(np.float64)
            _check(got, ref, f"paged prefill {kv_dtype} {h}/{kvh}/{d} b{bs} {prefix}+{chunk}", 4e-3)
        finally:
            for buf in bufs.values():
                buf.free()
            cache.close()


# (num_heads, num_kv_heads, head_dim, block_size, prefix, chunk, causal, indirect): kv_append of the chunk
# after a cached prefix into paged f32 pools, then flash attention of the chunk's queries over the pools
PAGED_F32_SHAPES = [(4, 2, 64, 16, 20, 33, True, True), (3, 3, 80, 64, 0, 70, True, True),
                    (2, 1, 128, 32, 40, 17, False, False), (4, 2, 48, 16, 9, 24, True, False),
                    (2, 1, 256, 32, 5, 34, True, True)]
PAGED_F32_SHAPES_SMALL = PAGED_F32_SHAPES[:2]


def _gather(pool: np.ndarray, table: np.ndarray, positions: np.ndarray, bs: int) -> np.ndarray:
    """Rows ``positions`` of a ``[blocks, KVH, bs, D]`` pool through ``table`` as ``[KVH, n, D]``."""
    return pool[table[positions // bs], :, positions % bs].transpose(1, 0, 2)


def paged_f32_cases(cache, rng, shapes) -> None:
    """The paged forms of kv_append and flash_attention (``block_size=``; what CudaExecutor launches),
    launched directly: shuffled block tables holding exactly the entries read, an append running past
    the table's end (those rows must go nowhere), pools checked whole."""
    for h, kvh, d, bs, prefix, chunk, causal, indirect in shapes:
        total = prefix + chunk
        stride = -(-total // bs)
        count = stride * bs - prefix + 3  # through the table's last block and three rows past it
        nb = 2 + 2 * stride
        tab = rng.permutation(np.arange(1, nb))[:stride].astype(np.uint32)
        pools = rng.standard_normal((2, nb, kvh, bs, d)).astype(np.float32)
        new = rng.standard_normal((2, kvh, count, d)).astype(np.float32)
        want = pools.copy()
        p = np.arange(prefix, stride * bs)
        for i in range(2):
            want[i][tab[p // bs], :, p % bs] = new[i][:, :len(p)].transpose(1, 0, 2)
        q = rng.standard_normal((h, chunk, d)).astype(np.float32)
        p = np.arange(total)
        keys, vals = (_gather(want[i], tab, p, bs).astype(np.float64) for i in range(2))
        ref = gqa_attention(q.astype(np.float64), keys, vals, causal, q_offset=prefix)
        what = f"paged f32 {h}/{kvh}/{d} b{bs} {prefix}+{chunk}"
        app = cache.get("kv_append", head_dim=d, indirect=indirect, block_size=bs)
        fa = cache.get("flash_attention", head_dim=d, group=h // kvh, causal=causal, block_size=bs)
        bufs = dict(kp=cuda.GpuBuffer.from_numpy(pools[0]), vp=cuda.GpuBuffer.from_numpy(pools[1]),
                    kn=cuda.GpuBuffer.from_numpy(new[0]), vn=cuda.GpuBuffer.from_numpy(new[1]),
                    tab=cuda.GpuBuffer.from_numpy(tab), pos=cuda.GpuBuffer.from_numpy(np.array([prefix], np.uint32)),
                    q=cuda.GpuBuffer.from_numpy(q), out=cuda.GpuBuffer(q.size))
        try:
            b = bufs
            pos = {"pos_ptr": b["pos"]} if indirect else {"pos": prefix}
            cuda.launch(app, (-(-count * (d // 4) // app.meta["block"]), kvh), app.meta["block"],
                        app.args(k_pool=b["kp"], v_pool=b["vp"], k_new=b["kn"], v_new=b["vn"], count=count,
                                 block_table=b["tab"], table_stride=stride, n_kv=kvh, **pos))
            for i, name in enumerate(("kp", "vp")):
                got = b[name].to_numpy(want[i].shape)
                if not np.array_equal(got, want[i]):
                    bad = np.argwhere(got != want[i])
                    raise AssertionError(f"{what}: kv_append ({'indirect' if indirect else 'direct'}) wrote "
                                         f"{len(bad)} wrong values in the {'KV'[i]} pool, first at {bad[0].tolist()}")
            b["out"].poison()
            cuda.launch(fa, (-(-chunk // fa.meta["block_q"]), h), fa.meta["block"],
                        fa.args(q=b["q"], k=b["kp"], v=b["vp"], out=b["out"], seq_q=chunk, seq_k=total,
                                q_offset=prefix, n_kv=kvh, block_table=b["tab"]), fa.launch.dyn_smem)
            _check(b["out"].to_numpy(q.shape), ref, f"{what}: flash attention causal={causal}")
        finally:
            for buf in bufs.values():
                buf.free()


# (num_heads, num_kv_heads, head_dim, block_size, seq_len, max_len, num_chunks, min_chunk, prefill prefix)
EXECUTOR_SHAPES = [(4, 2, 80, 16, 33, 40, 7, 4, 20), (7, 1, 64, 32, 65, 70, None, None, 0),
                   (8, 2, 128, 64, 129, 130, 40, 16, 100), (6, 3, 48, 16, 17, 17, 3, 16, 1)]
EXECUTOR_SHAPES_SMALL = EXECUTOR_SHAPES[:2]


def executor_cases(rng, shapes) -> None:
    """CudaExecutor over its paged f32 cache: appends with a host and a device position, the one-pass
    and split-KV decode (twice on the same combine counters), graph replays reading a new length from
    the device, and a prefill after a cached prefix (f32, and token-major f16 on tensor cores)."""
    from ptx_gen.kernels.attention.flash_attention_mma import HEAD_DIMS as MMA_HEAD_DIMS
    from realizar.gpu.executor import CudaExecutor
    for h, kvh, d, bs, length, max_len, nch, mc, prefix in shapes:
        q = (rng.standard_normal((h, d)) * 4).astype(np.float32)
        k = rng.standard_normal((kvh, length, d)).astype(np.float32)
        v = rng.standard_normal((kvh, length, d)).astype(np.float32)
        q64, k64, v64 = q.astype(np.float64), k.astype(np.float64), v.astype(np.float64)

        def ref(n):
            return attention_with_cache_gqa(q64, k64[:, :n - 1], v64[:, :n - 1], k64[:, n - 1], v64[:, n - 1])

        what = f"executor {h}/{kvh}/{d} b{bs} L={length}"
        ex = CudaExecutor(1, h, kvh, d, max_len, block_size=bs, num_chunks=nch, min_chunk=mc)
        stream = cuda.Stream()
        bufs = dict(q=cuda.GpuBuffer.from_numpy(q), out=cuda.GpuBuffer(h * d),
                    kn=cuda.GpuBuffer.from_numpy(k[:, -1].copy()), vn=cuda.GpuBuffer.from_numpy(v[:, -1].copy()),
                    step=cuda.GpuBuffer.from_numpy(np.array([length - 1, length], np.uint32)))
        try:
            b = bufs
            ex.append_kv(0, k[:, :-1], v[:, :-1])  # host position 0
            ex.append_kv(0, b["kn"], b["vn"], position=(b["step"], 0))  # the last one at a device position
            ex.set_length(0, length)
            kc, vc = ex.cache_to_numpy(0)
            if not (np.array_equal(kc, k) and np.array_equal(vc, v)):
                raise AssertionError(f"{what}: the cache does not hold what was appended")
            _check(ex.incremental_attention_gpu(0, q), ref(length), f"{what} one pass")
            for rep in range(2):
                b["out"].poison()
                ex.flash_decoding(0, b["q"], b["out"], seq_len=(b["step"], 1))
                _check(b["out"].to_numpy((h, d)), ref(length), f"{what} flash decoding call {rep}")
            for n in (length, length - 1):  # the first call captures, the second replays with a new length
                stream.synchronize()
                b["step"].copy_from_host(np.array([n - 1, n], np.uint32))
                b["out"].poison(stream)
                ex.flash_decoding_graphed(0, b["q"], b["out"], (b["step"], 1), stream=stream)
                stream.synchronize()
                _check(b["out"].to_numpy((h, d)), ref(n), f"{what} graphed flash decoding L={n}")
            s = length - prefix
            ex.truncate(0, prefix)
            qs = rng.standard_normal((h, s, d)).astype(np.float32)
            pref = gqa_attention(qs.astype(np.float64), k64, v64, True, q_offset=prefix)
            _check(ex.prefill(0, qs, k[:, prefix:], v[:, prefix:]), pref, f"{what} prefill {prefix}+{s}")
            if d in MMA_HEAD_DIMS and ex.device.target.compute_capability >= (8, 0):
                with cuda.GpuBuffer.from_numpy(qs) as dq, cuda.GpuBuffer(qs.size, np.float16) as o16:
                    ex.prefill_device(0, dq, o16, s, prefix, length, True, out_layout="tokens-f16")
                    got = o16.to_numpy((s, h, d)).transpose(1, 0, 2).astype(np.float64)
                    _check(got, pref, f"{what} tensor-core prefill {prefix}+{s}", 4e-3)
        finally:
            for buf in bufs.values():
                buf.free()
            ex.close()
            stream.close()


def cases(cache, rng, small: bool) -> None:
    """All attention cases (``small``: the racecheck subset)."""
    decode_cases(cache, rng, DECODE_SHAPES_SMALL if small else DECODE_SHAPES)
    prefill_cases(cache, rng, PREFILL_SHAPES_SMALL if small else PREFILL_SHAPES)
    paged_cases(rng, PAGED_SHAPES_SMALL if small else PAGED_SHAPES)
    paged_f32_cases(cache, rng, PAGED_F32_SHAPES_SMALL if small else PAGED_F32_SHAPES)
    executor_cases(rng, EXECUTOR_SHAPES_SMALL if small else EXECUTOR_SHAPES)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="the racecheck subset")
    ap.add_argument("--paged", action="store_true", help="only the paged KV cache cases (the executor's too)")
    a = ap.parse_args()
    if a.paged:
        rng = np.random.default_rng(0)
        paged_cases(rng, PAGED_SHAPES_SMALL if a.small else PAGED_SHAPES)
        paged_f32_cases(cuda.module_cache(), rng, PAGED_F32_SHAPES_SMALL if a.small else PAGED_F32_SHAPES)
        executor_cases(rng, EXECUTOR_SHAPES_SMALL if a.small else EXECUTOR_SHAPES)
    else:
        cases(cuda.module_cache(), np.random.default_rng(0), a.small)
    cuda.current_device().synchronize()
    print("ok attention sanitize cases")


if __name__ == "__main__":
    main()
