"""CUDA graphs on the GPU: eager vs captured vs manually built, per-step values, A/B, updates, lifetime."""

from __future__ import annotations

import numpy as np
import pytest

from realizar import cuda
from realizar.cuda.graph import GraphCaptureError
from tests.helpers import random_array

pytestmark = pytest.mark.gpu

ROWS, COLS, TOKENS = 64, 1000, 12


class Chain:
    """A decode-like step of five kernels; the step's position comes from a device value."""

    def __init__(self, kernels, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.x0 = random_array(rng, COLS)
        self.w = random_array(rng, COLS, scale=0.1)
        self.m = random_array(rng, (ROWS, COLS))
        self.x = cuda.GpuBuffer(COLS)
        self.wb = cuda.GpuBuffer.from_numpy(self.w)
        self.mb = cuda.GpuBuffer.from_numpy(self.m)
        self.hist = cuda.GpuBuffer(TOKENS * COLS)
        self.sums = cuda.GpuBuffer(ROWS)
        self.step = cuda.StepValues(("pos",))
        self.axpy = kernels.get("axpy", vec=4)
        self.copy_row = kernels.get("copy_row_indirect")
        self.row_sum = kernels.get("row_sum", block=256)
        self.args = [
            self.axpy.args(self.wb, self.x, 0.5, COLS),
            self.copy_row.args(self.x, self.hist, self.step.pointer("pos"), TOKENS, COLS),
            self.row_sum.args(self.mb, self.sums, COLS),
            self.axpy.args(self.x, self.mb, -0.25, COLS),  # feeds the next step's row sums
            self.axpy.args(self.sums, self.wb, 0.001, ROWS),
        ]
        self.args[1].buffers["step"] = self.step.device  # the position buffer is an input too

    def reset(self) -> None:
        self.x.copy_from_host(self.x0)
        self.wb.copy_from_host(self.w)
        self.mb.copy_from_host(self.m)
        self.hist.poison()
        self.sums.poison()

    def run(self, stream) -> None:
        a = self.args
        cuda.launch(self.axpy, -(-COLS // 1024), 256, a[0], stream=stream)
        cuda.launch(self.copy_row, -(-COLS // 256), 256, a[1], stream=stream)
        cuda.launch(self.row_sum, ROWS, 256, a[2], stream=stream)
        cuda.launch(self.axpy, -(-COLS // 1024), 256, a[3], stream=stream)
        cuda.launch(self.axpy, 1, 256, a[4], stream=stream)

    def result(self) -> list[np.ndarray]:
        return [b.to_numpy() for b in (self.x, self.hist, self.sums, self.mb, self.wb)]


def _eager(chain: Chain, stream) -> list[np.ndarray]:
    chain.reset()
    for t in range(TOKENS):
        chain.step.set(pos=t)
        chain.step.upload(stream)
        chain.run(stream)
        stream.synchronize()
    return chain.result()


def _assert_identical(a: list[np.ndarray], b: list[np.ndarray], what: str) -> None:
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.tobytes() == y.tobytes(), f"{what}: buffer {i} differs"


def test_eager_captured_and_manual_graphs_are_bit_identical(kernels):
    stream = cuda.Stream()
    chain = Chain(kernels, seed=1)
    eager = _eager(chain, stream)
    assert np.isfinite(eager[1]).all(), "every history row must be written"

    chain.reset()
    with cuda.capture(stream) as cap:
        chain.run(stream)
    exe = cap.graph.instantiate()
    assert cap.graph.num_kernels == 5 and cap.graph.node_count() == 5
    for t in range(TOKENS):
        chain.step.set(pos=t)
        exe.replay(stream, chain.step)
        stream.synchronize()
    _assert_identical(eager, chain.result(), "captured")

    chain.reset()
    chain.step.set(pos=0)
    chain.step.upload(stream)
    with cuda.record_graph() as rec:  # token 0 runs eagerly while recording
        chain.run(stream)
    stream.synchronize()
    manual = rec.graph.instantiate()
    assert rec.graph.node_count() == 5
    for t in range(1, TOKENS):
        chain.step.set(pos=t)
        manual.replay(stream, chain.step)
        stream.synchronize()
    _assert_identical(eager, chain.result(), "manual")


def test_buffer_derived_dependencies_give_the_same_result(kernels):
    stream = cuda.Stream()
    chain = Chain(kernels, seed=2)
    eager = _eager(chain, stream)
    chain.reset()
    chain.step.set(pos=0)
    chain.step.upload(stream)
    with cuda.record_graph(dependencies="buffers") as rec:
        chain.run(stream)
    exe = rec.graph.instantiate()
    for t in range(1, TOKENS):
        chain.step.set(pos=t)
        exe.replay(stream, chain.step)
        stream.synchronize()
    _assert_identical(eager, chain.result(), "buffer-dependency graph")


def test_ab_check_passes_and_detects_a_planted_difference(kernels):
    stream = cuda.Stream()
    chain = Chain(kernels, seed=3)
    chain.reset()
    with cuda.record_graph() as rec:
        chain.run(stream)
    exe = rec.graph.instantiate()
    report = cuda.ab_check(exe, chain.reset, stream)
    assert report.identical and report.compared >= 5
    planted = chain.axpy.args(chain.wb, chain.x, 0.5000001, COLS)
    exe.set_kernel_args(0, planted)
    # the eager side re-launches the (now planted) record too, so compare against the original
    chain.reset()
    chain.run(stream)
    stream.synchronize()
    expected_x = chain.x.to_numpy()
    chain.reset()
    exe.launch(stream)
    stream.synchronize()
    assert chain.x.to_numpy().tobytes() != expected_x.tobytes()
    exe.graph.records[0].args.set("alpha", 0.5)  # eager side back to the original value only
    bad = cuda.ab_check(exe, chain.reset, stream)
    assert not bad.identical and any("axpy" in m[0] for m in bad.mismatches), bad


def test_exec_update_takes_new_parameters(kernels):
    stream = cuda.Stream()
    chain = Chain(kernels, seed=4)
    chain.reset()
    with cuda.capture(stream) as first:
        chain.run(stream)
    exe = first.graph.instantiate()
    chain.args[0].set("alpha", 2.0)
    with cuda.capture(stream) as second:
        chain.run(stream)
    exe.update(second.graph)
    chain.reset()
    chain.step.set(pos=0)
    exe.replay(stream, chain.step)
    stream.synchronize()
    got = chain.x.to_numpy()
    np.testing.assert_allclose(got, chain.x0 + 2.0 * chain.w, rtol=1e-6, atol=1e-6)


def test_synchronous_call_inside_capture_is_reported(kernels):
    stream = cuda.Stream()
    chain = Chain(kernels, seed=5)
    chain.reset()
    with pytest.raises(GraphCaptureError, match="capture"):
        with cuda.capture(stream):
            chain.run(stream)
            stream.synchronize()  # synchronising a capturing stream is illegal
    stream.synchronize()  # the stream is usable again afterwards
    chain.run(stream)
    stream.synchronize()


def test_replay_1000_times_leaks_nothing(kernels, device):
    stream = cuda.Stream()
    chain = Chain(kernels, seed=6)
    chain.reset()
    with cuda.capture(stream) as cap:
        chain.run(stream)
    exe = cap.graph.instantiate()
    exe.replay(stream, chain.step)
    stream.synchronize()
    free_before, _ = device.memory_info()
    for t in range(1000):
        chain.step.set(pos=t % TOKENS)
        exe.replay(stream, chain.step)
        if t % 100 == 99:
            stream.synchronize()
    stream.synchronize()
    free_after, _ = device.memory_info()
    assert free_after == free_before


def test_replay_after_free_raises(kernels):
    stream = cuda.Stream()
    chain = Chain(kernels, seed=7)
    chain.reset()
    with cuda.record_graph() as rec:
        chain.run(stream)
    exe = rec.graph.instantiate()
    chain.sums.free()
    with pytest.raises(cuda.BufferFreedError, match="freed"):
        exe.launch(stream)
    exe.close()
    with pytest.raises(cuda.GraphError, match="closed"):
        exe.launch(stream)


def test_buffers_freed_during_capture_do_not_invalidate_it(kernels):
    stream = cuda.Stream()
    chain = Chain(kernels, seed=8)
    chain.reset()
    scratch = cuda.GpuBuffer(1 << 20)
    with cuda.capture(stream) as cap:
        chain.run(stream)
        scratch.free()  # a cuMemFree now would invalidate a global-mode capture: it is deferred
        del scratch
    assert cap.graph.num_kernels == 5
    cap.graph.instantiate().launch(stream)
    stream.synchronize()


def test_attention_decode_chain_is_bit_identical_eager_captured_manual(device):
    """Two layers of KV append + flash decoding per token, positions and lengths advancing on the
    device: eager launches, one stream-captured graph and one manually built graph replayed for every
    token must write exactly the same bytes (outputs of every token and both KV caches)."""
    from realizar.gpu.executor import CudaExecutor

    layers, heads, kv_heads, head_dim, tokens = 2, 8, 2, 64, 9
    rng = np.random.default_rng(21)
    qs = random_array(rng, (tokens, layers * heads * head_dim), scale=3.0)
    ks = random_array(rng, (tokens, layers * kv_heads * head_dim), scale=3.0)
    vs = random_array(rng, (tokens, layers * kv_heads * head_dim))
    stream = cuda.Stream()

    def run(mode: str) -> list[np.ndarray]:
        ex = CudaExecutor(layers, heads, kv_heads, head_dim, max_len=64, device=device)
        step = cuda.StepValues(("pos", "seq_len"))
        q, k, v = cuda.GpuBuffer(qs.shape[1]), cuda.GpuBuffer(ks.shape[1]), cuda.GpuBuffer(vs.shape[1])
        out = cuda.GpuBuffer(qs.shape[1])

        def issue() -> None:
            for layer in range(layers):
                ex.append_kv(layer, (k, layer * kv_heads * head_dim), (v, layer * kv_heads * head_dim),
                             position=(step.device, 0), stream=stream)
                ex.flash_decoding(layer, (q, layer * heads * head_dim), (out, layer * heads * head_dim),
                                  (step.device, 1), stream=stream)

        graph = None
        outputs = []
        for t in range(tokens):
            for buf, host in ((q, qs[t]), (k, ks[t]), (v, vs[t])):
                buf.copy_from_host(host)
            out.poison()
            step.set(pos=t, seq_len=t + 1)
            step.upload(stream)
            if mode == "eager":
                issue()
            elif graph is None and mode == "captured":
                with cuda.capture(stream) as cap:
                    issue()
                graph = cap.graph.instantiate()
                graph.launch(stream)
            elif graph is None:
                with cuda.record_graph() as rec:  # runs this token eagerly while recording
                    issue()
                graph = rec.graph.instantiate()
            else:
                graph.launch(stream)
            stream.synchronize()
            outputs.append(out.to_numpy())
        result = [np.stack(outputs), *ex.cache_to_numpy(0, tokens), *ex.cache_to_numpy(1, tokens)]
        ex.close()
        return result

    eager = run("eager")
    assert np.isfinite(eager[0]).all()
    for mode in ("captured", "manual"):
        for i, (a, b) in enumerate(zip(eager, run(mode))):
            assert a.tobytes() == b.tobytes(), f"{mode}: array {i} differs from eager"
