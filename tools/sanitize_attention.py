"""Small launches of every attention kernel, for compute-sanitizer (memcheck, racecheck).

Picked up by ``tools/sanitize_cases.py`` (``cases(cache, rng, small)``) and runnable alone:

    compute-sanitizer --tool memcheck  python tools/sanitize_attention.py
    compute-sanitizer --tool racecheck python tools/sanitize_attention.py --small

Shapes are awkward on purpose: head_dim 80 (lane groups with an idle chunk) and 48, sequence lengths
one past a chunk/tile quantum, a flash-decoding grid with more chunks than the sequence needs
(neutral partials), single-launch flash decoding with one-row chunks (two combine levels) called
twice on the same counters, a causal prefill whose last query tile is partial, and caches read in
place with spare rows. Every case checks its result against the float64 oracle, so a kernel that misbehaves
only under the sanitizer is noticed too.
"""

from __future__ import annotations

import argparse

import numpy as np

from ptx_gen.kernels.flash_decoding import fused_buffer_sizes
from realizar import cuda
from realizar.models.attention import attention_with_cache_gqa, gqa_attention

# (num_heads, num_kv_heads, head_dim, seq_len, max_len)
DECODE_SHAPES = [(4, 2, 80, 33, 40), (6, 3, 48, 17, 17), (7, 1, 64, 65, 70), (8, 2, 128, 129, 130), (2, 1, 256, 9, 12)]
DECODE_SHAPES_SMALL = [(4, 2, 80, 33, 40), (7, 1, 64, 65, 70)]
# (num_heads, num_kv_heads, head_dim, seq_q, seq_k, causal)
PREFILL_SHAPES = [(2, 1, 64, 70, 70, True), (3, 3, 80, 17, 40, True), (4, 2, 48, 33, 33, False),
                  (1, 1, 256, 34, 34, True)]
PREFILL_SHAPES_SMALL = [(2, 1, 64, 70, 70, True), (3, 3, 80, 17, 40, True)]


def _check(got: np.ndarray, ref: np.ndarray, what: str) -> None:
    err = float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-30))
    if not np.all(np.isfinite(got)) or err > 1e-5:
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


def cases(cache, rng, small: bool) -> None:
    """All attention cases (``small``: the racecheck subset)."""
    decode_cases(cache, rng, DECODE_SHAPES_SMALL if small else DECODE_SHAPES)
    prefill_cases(cache, rng, PREFILL_SHAPES_SMALL if small else PREFILL_SHAPES)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="the racecheck subset")
    a = ap.parse_args()
    cases(cuda.module_cache(), np.random.default_rng(0), a.small)
    cuda.current_device().synchronize()
    print("ok attention sanitize cases")


if __name__ == "__main__":
    main()
