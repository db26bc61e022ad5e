"""``realizar serve --data-parallel 2`` on two GPUs (skipped below 2 visible GPUs): one replica per physical GPU
(each replica's ready line names its GPU's PCI bus id, and the two differ), answering through sglang-router's
cache-aware policy; a shared long prefix stays on one replica, which finds it in its prefix cache; concurrent
distinct prompts are spread over both; a greedy request alone gives the same text through the router and from
each replica directly (two GPUs of one kind, batches of one)."""

from __future__ import annotations

import concurrent.futures
import re
import signal
import sys
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("prometheus_client")
pytest.importorskip("sglang_router", reason="sglang-router comes with the cluster extra: pip install '.[cluster]'")

from realizar import cuda  # noqa: E402
from realizar.cli.data_parallel import free_port  # noqa: E402
from realizar.parallel import visible_gpu_count  # noqa: E402
from tests.gguf_factory import make_gguf_model  # noqa: E402
from tests.parallel_gpu_cases import DIMS  # noqa: E402
from tests.test_router import MODEL, WORDS, Proc, _complete, _metric, _served  # noqa: E402

pytestmark = pytest.mark.gpu

SERVING = re.compile(r"^\[replica (\d)\] .*serving .* \(cuda: (.+?) at PCI ([0-9A-Fa-f:.]+)")


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
    if not cuda.is_available():
        pytest.skip(f"no GPU: {cuda.unavailable_reason()}")
    if visible_gpu_count() < 2:
        pytest.skip(f"--data-parallel 2 needs 2 visible GPUs; this machine has {visible_gpu_count()}")
    # a small llama the GPU model runs (--device cuda: no quiet fall-back to the CPU)
    path, _, _ = make_gguf_model("llama", tmp_path_factory.mktemp("dp"), "Q8_0", seed=3, num_layers=2,
                                 max_position_embeddings=1024, **DIMS)
    port = free_port()
    proc = Proc([sys.executable, "-m", "realizar", "serve", "-m", str(path), "--device", "cuda",
                 "--data-parallel", "2", "--port", str(port), "--model-name", MODEL, "--block-size", "16"])
    try:
        proc.wait_for("serving 2 replicas behind sglang-router", 300)
        replicas = sorted({m.group(1) for ln in proc.lines if ln.startswith("[replica")
                           for m in [re.search(r"at (http://127\.0\.0\.1:\d+)/v1", ln)] if m})
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:  # (the router takes the replicas once its first health checks pass)
            try:
                if _complete(url, "warm up", 1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "\n".join(proc.lines[-30:])
            time.sleep(0.2)
        yield proc, url, replicas
        proc.p.send_signal(signal.SIGTERM)
        assert proc.p.wait(60) == 0
    finally:
        proc.kill()


def test_one_replica_per_physical_gpu(launcher):
    proc, _, replicas = launcher
    gpus = {int(m.group(1)): (m.group(2), m.group(3)) for ln in proc.lines for m in [SERVING.search(ln)] if m}
    assert len(replicas) == 2 and sorted(gpus) == [0, 1], "\n".join(proc.lines[-30:])
    assert gpus[0][1] != gpus[1][1], f"both replicas on the GPU at {gpus[0][1]}"


def test_router_answers_equal_the_replicas_and_spread_over_both(launcher):
    _, url, replicas = launcher
    prompts = [f"request {i}: {WORDS[i:]}" for i in range(16)]
    # one at a time (batches of one on both GPUs, so bit for bit the same), through the router and directly
    for p in prompts[:2]:
        alone = [_complete(u, p, 8).json()["choices"][0]["text"] for u in (url, *replicas)]
        assert alone[0] == alone[1] == alone[2], alone
    served0 = _served(replicas)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda p: _complete(url, p, 8), prompts))
    assert all(r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8 for r in answers)
    served = [a - b for a, b in zip(_served(replicas), served0)]
    assert sum(served) == 16 and min(served) > 0, f"requests per replica: {served}"


def test_a_shared_prefix_stays_on_the_replica_that_caches_it(launcher):
    _, url, replicas = launcher
    prefix = "delta " + " ".join([WORDS] * 2)
    served0 = _served(replicas)
    hits0 = [_metric(u, "vllm:prefix_cache_hits_total") for u in replicas]
    for i in range(4):
        assert _complete(url, f"{prefix} tail {i}").status_code == 200
    served = [a - b for a, b in zip(_served(replicas), served0)]
    hits = [_metric(u, "vllm:prefix_cache_hits_total") - h for u, h in zip(replicas, hits0)]
    assert sorted(served) == [0, 4], f"requests per replica {served}"
    home = served.index(4)
    assert hits[home] > 0 and hits[1 - home] == 0, f"prefix-cache hits per replica {hits}"
