"""NCCL on 2+ GPUs of one host, one process driving them all (realizar.parallel.nccl): communicators from
ncclCommInitAll and from ncclCommInitRank with one unique id, an in-place float32 all-reduce and an
all-gather on each rank's stream, checked against NumPy. Skipped below 2 visible GPUs or without
libnccl.so.2 (pip install "realizar[multigpu]"). Not yet run: no multi-GPU machine has been lent."""

from __future__ import annotations

import numpy as np
import pytest

from realizar import cuda
from realizar.parallel import nccl, visible_gpu_count

pytestmark = pytest.mark.gpu

COUNT = 8192  # one Llama-3-70B hidden vector


@pytest.fixture(scope="module")
def lib():
    try:
        return nccl.load()
    except nccl.NcclUnavailableError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def ranks():
    n = visible_gpu_count()
    if n < 2:
        pytest.skip(f"needs 2 visible GPUs, {n} here")
    devices = [cuda.Device(i) for i in range(n)]
    streams = []
    for d in devices:
        d.make_current()
        streams.append(cuda.Stream(d))
    return devices, streams


def _upload(devices, arrays):
    bufs = []
    for d, a in zip(devices, arrays):
        d.make_current()
        bufs.append(cuda.GpuBuffer.from_numpy(a, device=d))
    return bufs


def _download(devices, streams, bufs):
    out = []
    for d, s, b in zip(devices, streams, bufs):
        d.make_current()
        s.synchronize()
        out.append(b.to_numpy())
    return out


def test_comm_init_all_all_reduce_and_all_gather(lib, ranks):
    devices, streams = ranks
    n = len(devices)
    comms = lib.comm_init_all(list(range(n)))
    try:
        assert [(c.count, c.device, c.rank) for c in comms] == [(n, r, r) for r in range(n)]
        rng = np.random.default_rng(0)
        xs = [rng.standard_normal(COUNT).astype(np.float32) for _ in range(n)]
        bufs = _upload(devices, xs)
        with lib.group():  # one thread, n communicators: one group
            for r in range(n):
                lib.all_reduce(bufs[r], bufs[r], COUNT, np.float32, comms[r], streams[r])
        want = np.sum(np.stack(xs).astype(np.float64), axis=0)
        for got in _download(devices, streams, bufs):
            assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()

        pieces = _upload(devices, [np.full(16, r, np.int32) for r in range(n)])
        gathered = _upload(devices, [np.zeros(16 * n, np.int32) for _ in range(n)])
        with lib.group():
            for r in range(n):
                lib.all_gather(pieces[r], gathered[r], 16, np.int32, comms[r], streams[r])
        for got in _download(devices, streams, gathered):
            assert np.array_equal(got, np.repeat(np.arange(n, dtype=np.int32), 16))
    finally:
        for c in comms:
            c.destroy()


def test_comm_init_rank_with_one_unique_id(lib, ranks):
    devices, streams = ranks
    n = len(devices)
    uid = lib.unique_id()
    comms = []
    with lib.group():
        for r, d in enumerate(devices):
            d.make_current()  # ncclCommInitRank binds the communicator to the current device
            comms.append(lib.comm_init_rank(n, uid, r))
    try:
        assert [(c.rank, c.device) for c in comms] == [(r, r) for r in range(n)]
        bufs = _upload(devices, [np.full(4, r + 1, np.float32) for r in range(n)])
        with lib.group():
            for r in range(n):
                lib.all_reduce(bufs[r], bufs[r], 4, np.float32, comms[r], streams[r], op=nccl.RedOp.ncclMax)
        for got in _download(devices, streams, bufs):
            assert np.array_equal(got, np.full(4, n, np.float32))
    finally:
        for c in comms:
            c.destroy()
