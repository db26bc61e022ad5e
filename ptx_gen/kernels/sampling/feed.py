"""Feeding a decode step's sampled tokens into the next step on the device, so the host can launch step
N + 1 before it has read step N's tokens.

``feed_tokens``: for each row ``r < n``, ``ids[r] = tokens[src[r]]`` where ``src[r]`` is not
``0xFFFFFFFF`` (the row continues a sequence whose token the previous step sampled, in its row
``src[r]``); rows with ``0xFFFFFFFF`` keep the id the host staged. Launch: grid ``ceil(n / block)``,
block ``block``.
"""

from __future__ import annotations

from ptx_gen.builder import KernelBuilder, Module
from ptx_gen.catalog import kernel

NO_SOURCE = 0xFFFFFFFF  # src[r]: the host staged row r's id


@kernel("feed_tokens", grid=[{"block": 256}, {"block": 64}])
def feed_tokens(m: Module, block: int = 256) -> KernelBuilder:
    """ids[r] = tokens[src[r]] for r < n where src[r] != 0xFFFFFFFF (u32 arrays)."""
    if block % 32 or not 32 <= block <= 1024:
        raise ValueError(f"block must be a multiple of 32 in [32, 1024], got {block}")
    k = m.kernel(f"feed_tokens_b{block}", [("ids", "u64"), ("src", "u64"), ("tokens", "u64"), ("n", "u32")],
                 max_threads=block)
    k.meta.update(block=block)
    r = k.global_index_x()
    with k.if_(k.setp("lt", r, k.param("n"))):
        off = k.mul_wide(r, 4)
        s = k.load("global", "u32", k.add(k.global_ptr("src"), off))
        with k.if_(k.setp("ne", s, NO_SOURCE)):
            tok = k.load("global", "u32", k.add(k.global_ptr("tokens"), k.mul_wide(s, 4)))
            k.store("global", "u32", k.add(k.global_ptr("ids"), off), tok)
    k.ret()
    return k
