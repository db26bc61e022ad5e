"""GraphCache on the emulated device: eager first, then capture (right after, or when the key comes back),
replay; manual graphs recorded from an eager run; the least recently used graph closed past capacity."""

from __future__ import annotations

import numpy as np
import pytest

from realizar import cuda
from realizar.cuda import GraphCache, GraphError

N = 64


@pytest.fixture
def setup():
    dev = cuda.EmulatedDevice(sm_count=2)
    k = cuda.module_cache(dev).get("vector_add", vec=1)
    a = cuda.GpuBuffer.from_numpy(np.arange(N, dtype=np.float32), device=dev)
    one = cuda.GpuBuffer.from_numpy(np.ones(N, np.float32), device=dev)
    s = cuda.Stream(dev)

    def issue():  # a += 1, recorded as one launch
        cuda.launch(k, 1, 64, k.args(a, one, a, N), stream=s)

    return dev, s, a, issue


def _value(a) -> float:
    return float(a.to_numpy()[0])


@pytest.mark.parametrize("mode", ["capture", "manual"])
def test_capture_on_first_runs_each_step_once(setup, mode):
    dev, s, a, issue = setup
    g = GraphCache(s, mode=mode, capture_on="first")
    for step in range(1, 5):
        g.run("k", issue)
        assert _value(a) == step  # the eager first run did the work; replays do it once each after
    assert g.keys() == ["k"] and g.graph("k").graph.kind == ("captured" if mode == "capture" else "manual")


@pytest.mark.parametrize("mode", ["capture", "manual"])
def test_capture_on_repeat_waits_for_the_key_to_come_back(setup, mode):
    dev, s, a, issue = setup
    g = GraphCache(s, mode=mode, capture_on="repeat")
    g.run("k", issue)
    assert len(g) == 0 and _value(a) == 1  # seen once: eager only
    g.run("k", issue)
    assert len(g) == 1 and _value(a) == 2  # captured (or recorded) and run once
    g.run("k", issue)
    assert _value(a) == 3


def test_eager_mode_keeps_no_graph_and_lru_bound(setup):
    dev, s, a, issue = setup
    eager = GraphCache(s, mode="eager")
    for _ in range(3):
        eager.run("k", issue)
    assert len(eager) == 0 and _value(a) == 3
    g = GraphCache(s, capacity=2)
    for key in ("a", "b", "a", "c"):
        g.run(key, issue)
    assert g.keys() == ["a", "c"]  # "b" was the least recently used
    assert _value(a) == 7
    g.clear()
    assert len(g) == 0


def test_bad_settings():
    dev = cuda.EmulatedDevice(sm_count=2)
    s = cuda.Stream(dev)
    with pytest.raises(GraphError, match="graph mode"):
        GraphCache(s, mode="lazy")
    with pytest.raises(GraphError, match="capture_on"):
        GraphCache(s, capture_on="never")
    with pytest.raises(GraphError, match="capacity"):
        GraphCache(s, capacity=0)
    with pytest.raises(GraphError, match="one stream"):
        GraphCache([(dev, s), (dev, cuda.Stream(dev))], mode="manual")
