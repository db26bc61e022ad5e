"""A plain streaming read, the yardstick of the bandwidth-bound kernels: every thread reads 16-byte
vectors of ``src`` (grid-stride, ``unroll`` loads in flight per iteration) and writes the xor of its
words to ``out[thread]`` (so no load can be dropped). ``tools/bench_gemv.py`` times it over the same
bytes, in the same graph-and-rotation harness, as each GEMV: the fastest a single launch of that size
reads memory there.
"""

from __future__ import annotations

from ptx_gen.builder import KernelBuilder, Module
from ptx_gen.catalog import kernel


@kernel("stream_read", grid=[{"unroll": 1, "block": 128}, {"unroll": 4, "block": 256}, {"unroll": 8, "block": 512}])
def stream_read(m: Module, unroll: int = 4, block: int = 256) -> KernelBuilder:
    """out[t] = xor of the 32-bit words of the vectors t, t + T, t + 2T, ... (T threads in the grid) of
    the ``n16`` 16-byte vectors at ``src`` (16-byte aligned). Launch: any grid, block ``block``."""
    if unroll < 1 or block % 32 or not 32 <= block <= 1024:
        raise ValueError(f"unroll must be >= 1 and block a multiple of 32 in 32..1024, got {unroll}, {block}")
    k = m.kernel(f"stream_read_u{unroll}_b{block}", [("src", "u64"), ("n16", "u32"), ("out", "u64")],
                 max_threads=block)
    k.meta.update(block=block)
    src, n16 = k.global_ptr("src"), k.param("n16")
    tid = k.global_index_x()
    threads = k.mul(k.sreg("nctaid.x"), block)
    acc = k.var("u32", 0)
    with k.loop(tid, n16, k.mul(threads, unroll)) as i:
        for u in range(unroll):
            idx = k.add(i, k.mul(threads, u)) if u else i
            v = k.load("global", "u32", k.add(src, k.mul_wide(idx, 16)), vec=4, nc=True,
                       pred=k.setp("lt", idx, n16) if u else None, other=0)
            k.assign(acc, k.xor(acc, k.xor(k.xor(v[0], v[1]), k.xor(v[2], v[3]))))
    k.store("global", "u32", k.add(k.global_ptr("out"), k.mul_wide(tid, 4)), acc)
    k.ret()
    return k
