"""NCCL through realizar.parallel.nccl on real GPUs, one process driving them all.

* One GPU: a one-rank communicator (ncclCommInitAll and ncclCommInitRank), in-place and out-of-place
  all-reduce, all-gather, a group, and NCCL calls issued inside a CUDA stream capture then replayed.
* 2+ GPUs (skipped below 2 visible GPUs; not yet run: no multi-GPU machine has been lent):
  communicators from ncclCommInitAll and from ncclCommInitRank with one unique id, an in-place float32
  all-reduce and an all-gather on each rank's stream, checked against NumPy.

Skipped without libnccl.so.2 (pip install "realizar[multigpu]", or REALIZAR_NCCL_LIBRARY)."""

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
def one_gpu():
    if not cuda.is_available():
        pytest.skip(f"no GPU: {cuda.unavailable_reason()}")
    d = cuda.Device(0)
    return d, cuda.Stream(d)


def test_one_rank_communicator(lib, one_gpu):
    d, s = one_gpu
    print(f"\nNCCL {'.'.join(map(str, lib.version()))} from {lib.origin}: {lib.path}")
    (comm,) = lib.comm_init_all([0])
    uid = lib.unique_id()
    with lib.group():
        d.make_current()
        other = lib.comm_init_rank(1, uid, 0)
    try:
        assert (comm.count, comm.device, comm.rank) == (1, 0, 0) == (other.count, other.device, other.rank)
        rng = np.random.default_rng(3)
        x = rng.standard_normal(COUNT).astype(np.float32)
        buf, out = cuda.GpuBuffer.from_numpy(x, device=d), cuda.GpuBuffer(COUNT, device=d)
        with lib.group():
            lib.all_reduce(buf, buf, COUNT, np.float32, comm, s)  # in place: the sum of one rank is itself
        lib.all_reduce(buf, out, COUNT, np.float32, other, s)
        s.synchronize()
        assert buf.to_numpy().tobytes() == x.tobytes() and out.to_numpy().tobytes() == x.tobytes()
        piece = cuda.GpuBuffer.from_numpy(np.arange(16, dtype=np.int32), device=d)
        gathered = cuda.GpuBuffer.from_numpy(np.zeros(16, np.int32), device=d)
        lib.all_gather(piece, gathered, 16, np.int32, comm, s)
        s.synchronize()
        assert np.array_equal(gathered.to_numpy(), np.arange(16, dtype=np.int32))
    finally:
        comm.destroy()
        other.destroy()


def test_nccl_calls_in_a_captured_graph(lib, one_gpu):
    """An out-of-place all-reduce and all-gather issued inside a stream capture (in one group, as the
    decode step issues them) run when the graph is replayed, not when captured."""
    d, s = one_gpu
    (comm,) = lib.comm_init_all([0])
    try:
        rng = np.random.default_rng(4)
        send = cuda.GpuBuffer.from_numpy(rng.standard_normal(COUNT).astype(np.float32), device=d)
        recv = cuda.GpuBuffer(COUNT, device=d)
        g_send = cuda.GpuBuffer.from_numpy(np.arange(8, dtype=np.uint64), device=d)
        g_recv = cuda.GpuBuffer(8, np.uint64, device=d)
        lib.all_reduce(send, recv, COUNT, np.float32, comm, s)  # eager first: NCCL connects outside the capture
        s.synchronize()
        recv.fill_bytes(0)
        g_recv.fill_bytes(0)
        with cuda.capture(s) as cap:
            with lib.group():
                lib.all_reduce(send, recv, COUNT, np.float32, comm, s)
                lib.all_gather(g_send, g_recv, 8, np.uint64, comm, s)
        s.synchronize()
        assert not recv.to_numpy().any() and not g_recv.to_numpy().any()  # captured, not run
        exe = cap.graph.instantiate()
        print(f"\ncaptured one-rank all-reduce + all-gather: {cap.graph.node_count()} graph nodes")
        for trial in range(3):
            x = rng.standard_normal(COUNT).astype(np.float32)
            ids = rng.integers(0, 2**40, 8).astype(np.uint64)
            send.copy_from_host(x)
            g_send.copy_from_host(ids)
            exe.launch(s)
            s.synchronize()
            assert recv.to_numpy().tobytes() == x.tobytes(), trial
            assert np.array_equal(g_recv.to_numpy(), ids), trial
    finally:
        comm.destroy()


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
