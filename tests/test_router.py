"""Replicas behind an existing router, on this machine (CPU, loopback only, bounded): two ``realizar serve``
processes of a tiny fixture model behind ``sglang-router`` (the ``cluster`` extra).

* requests through the router are answered (completions and chat);
* with the router's cache-aware policy, requests sharing a long prompt prefix land on one replica, which
  then finds the prefix in its cache (its ``vllm:prefix_cache_hits`` grow by the shared blocks); the same
  check fails behind the round-robin policy, which spreads them;
* one replica killed mid-run: the router's retries and health checks keep the rest answering."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("prometheus_client")
pytest.importorskip("sglang_router", reason="sglang-router comes with the cluster extra: pip install '.[cluster]'")

from realizar.cli.data_parallel import free_port  # noqa: E402
from realizar.server.fronts import die_with_parent  # noqa: E402
from tests.gguf_factory import shared_tiny_gguf  # noqa: E402

MODEL = "tiny-llama"
WORDS = "the quick brown fox jumps over a lazy dog while seven curious owls watch quietly from an old oak"


class Proc:
    """A child process whose output is drained in the background (kept for failure messages)."""

    def __init__(self, argv: list[str]):
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                  start_new_session=True,  # (and it dies with the test run, however that ends)
                                  preexec_fn=die_with_parent if sys.platform.startswith("linux") else None)
        self.lines: list[str] = []
        self._t = threading.Thread(target=self._drain, daemon=True)
        self._t.start()

    def _drain(self) -> None:
        for line in self.p.stdout:
            self.lines.append(line.rstrip())

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                m = re.search(pattern, line)
                if m:
                    return m
            if self.p.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} from {self.p.args[:4]}; output:\n" + "\n".join(self.lines[-30:]))

    def kill(self) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGKILL)
        self.p.wait(10)


def _replica(path) -> tuple[Proc, str]:
    proc = Proc([sys.executable, "-m", "realizar", "serve", "-m", str(path), "--device", "cpu", "--port", "0",
                 "--max-batch", "4", "--block-size", "16", "--model-name", MODEL])
    m = proc.wait_for(r"at (http://127\.0\.0\.1:\d+)/v1", 90)
    return proc, m.group(1)


def _router(urls: list[str], policy: str) -> tuple[Proc, str]:
    port = free_port()
    proc = Proc([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                 "--worker-urls", *urls, "--policy", policy, "--health-check-interval-secs", "1",
                 "--health-failure-threshold", "1", "--log-level", "warn",
                 "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())])  # (not the shared default)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200 and _complete(url, "warm up").status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.p.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("the router did not come up; output:\n" + "\n".join(proc.lines[-30:]))


def _complete(url: str, prompt: str, max_tokens: int = 2) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def _metric(url: str, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    path = shared_tiny_gguf(tmp_path_factory)
    procs = []
    try:
        for _ in range(2):
            procs.append(_replica(path))
        yield procs
    finally:
        for proc, _ in procs:
            proc.kill()


def _served(urls: list[str]) -> list[float]:
    return [_metric(u, "realizar_requests_total", endpoint="/v1/completions", status="200") for u in urls]


def _prefix_run(router_url: str, urls: list[str], tag: str, n: int = 4) -> tuple[list[float], list[float]]:
    """``n`` requests sharing a long prefix (different tails) through the router: (completions each replica
    served, prompt tokens each found in its prefix cache), as deltas."""
    prefix = f"{tag} " + " ".join([WORDS] * 2)  # (about 150 tokens: several blocks of 16, within the context of 256)
    served0 = _served(urls)
    hits0 = [_metric(u, "vllm:prefix_cache_hits_total") for u in urls]
    for i in range(n):
        assert _complete(router_url, f"{prefix} tail {i}").status_code == 200
    served = [a - b for a, b in zip(_served(urls), served0)]
    hits = [_metric(u, "vllm:prefix_cache_hits_total") - h for u, h in zip(urls, hits0)]
    return served, hits


def test_requests_through_the_router_are_answered(replicas):
    router, url = _router([u for _, u in replicas], "cache_aware")
    try:
        r = _complete(url, "Hello there", 3)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        r = httpx.post(url + "/v1/chat/completions", json=chat, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
    finally:
        router.kill()


def test_cache_aware_routing_keeps_a_prefix_on_one_replica(replicas):
    urls = [u for _, u in replicas]
    router, url = _router(urls, "cache_aware")
    try:
        for tag in ("alpha", "beta"):
            served, hits = _prefix_run(url, urls, tag)
            assert sorted(served) == [0, 4], f"{tag}: requests per replica {served}"
            home = served.index(4)
            assert hits[home] > 0 and hits[1 - home] == 0, f"{tag}: prefix-cache hits per replica {hits}"
    finally:
        router.kill()
    # the same check behind round robin fails: the shared prefix is spread over both replicas
    router, url = _router(urls, "round_robin")
    try:
        served, hits = _prefix_run(url, urls, "gamma")
        assert sorted(served) != [0, 4] and min(served) > 0, f"round robin put them on one replica: {served}"
    finally:
        router.kill()


def test_a_killed_replica_does_not_stop_the_service(tmp_path_factory):
    path = shared_tiny_gguf(tmp_path_factory)
    procs = [_replica(path) for _ in range(2)]
    router, url = _router([u for _, u in procs], "round_robin")
    try:
        assert all(_complete(url, f"before {i}").status_code == 200 for i in range(4))
        procs[0][0].kill()
        codes = [_complete(url, f"after {i}").status_code for i in range(8)]
        assert codes == [200] * 8, codes
        assert _metric(procs[1][1], "realizar_requests_total", endpoint="/v1/completions", status="200") >= 8
    finally:
        router.kill()
        for proc, _ in procs:
            proc.kill()
