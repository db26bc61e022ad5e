"""The streaming-read yardstick kernel on the emulator: every 16-byte vector read exactly once, by the
thread the grid-stride order gives it."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ptx_gen import catalog
from ptx_gen.emulator import Memory, run as simt_run
from tests.helpers import examples


@settings(max_examples=examples(20), deadline=None)
@given(unroll=st.sampled_from([1, 3, 4, 8]), block=st.sampled_from([32, 64, 128]), grid=st.integers(1, 4),
       n16=st.integers(1, 700), seed=st.integers(0, 2**32 - 1))
def test_stream_read_xors_every_vector_once(unroll, block, grid, n16, seed):
    rng = np.random.default_rng(seed)
    words = rng.integers(0, 2**32, 4 * n16, dtype=np.uint64).astype(np.uint32)
    k = catalog.emit("stream_read", target="sm_80", unroll=unroll, block=block)
    mem = Memory()
    threads = grid * block
    src, out = mem.alloc_array(words), mem.alloc_array(np.full(threads, 0xDEADBEEF, np.uint32))
    simt_run(k.ptx, grid=(grid,), block=(block,), params=dict(src=src, n16=n16, out=out), memory=mem)
    got = mem.read(out, np.uint32, threads)
    per_vec = np.bitwise_xor.reduce(words.reshape(n16, 4), axis=1)
    want = np.zeros(threads, np.uint32)
    for t in range(threads):
        want[t] = np.bitwise_xor.reduce(per_vec[t::threads]) if t < n16 else 0
    assert (got == want).all()
