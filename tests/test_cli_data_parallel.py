"""``realizar serve --data-parallel N``: a clear one-line refusal without N GPUs; with ``--device cpu``, N replica
processes behind sglang-router answer through one address and stop with the launcher (SIGTERM)."""

from __future__ import annotations

import re
import signal
import sys
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("sglang_router", reason="sglang-router comes with the cluster extra: pip install '.[cluster]'")

from realizar.cli import main  # noqa: E402
from realizar.cli.data_parallel import _replica_argv, free_port, offset_endpoint  # noqa: E402
from realizar.cli.common import CliError  # noqa: E402
from tests.gguf_factory import shared_tiny_gguf  # noqa: E402
from tests.test_router import Proc  # noqa: E402


def test_replica_command_lines():
    argv = ["serve", "-m", "m.gguf", "--data-parallel", "2", "--host", "0.0.0.0", "--port=9000", "--max-batch", "8",
            "--kv-events", "tcp://*:5557"]
    assert _replica_argv(argv) == ["serve", "-m", "m.gguf", "--max-batch", "8"]
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    with pytest.raises(CliError, match="tcp://host:port"):
        offset_endpoint("ipc:///tmp/x", 1)


def test_refused_without_enough_gpus(tmp_path_factory, capsys, monkeypatch):
    monkeypatch.setattr("realizar.parallel.visible_gpu_count", lambda: 1)
    code = main(["serve", "-m", str(shared_tiny_gguf(tmp_path_factory)), "--data-parallel", "2"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and err.count("\n") == 0
    assert "--data-parallel 2" in err and "needs 2 visible GPUs; this machine has 1" in err


def _launch(tmp_path_factory, *extra: str) -> tuple[Proc, int, list[str]]:
    """``realizar serve --device cpu --data-parallel 2`` on a free port, once it says it serves: the launcher,
    its port and its two replicas' URLs."""
    port = free_port()
    proc = Proc([sys.executable, "-m", "realizar", "serve", "-m", str(shared_tiny_gguf(tmp_path_factory)),
                 "--device", "cpu", "--data-parallel", "2", "--port", str(port), "--model-name", "tiny-llama", *extra])
    proc.wait_for("serving 2 replicas behind sglang-router", 120)
    replicas = sorted({m.group(1) for ln in proc.lines if ln.startswith("[replica")
                       for m in [re.search(r"at (http://127\.0\.0\.1:\d+)/v1", ln)] if m})
    assert len(replicas) == 2, proc.lines
    return proc, port, replicas


def test_cpu_replicas_behind_the_router(tmp_path_factory):
    proc, port, replicas = _launch(tmp_path_factory, "--max-batch", "4")
    p = proc.p
    try:
        body = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 2, "temperature": 0}
        deadline = time.monotonic() + 60
        while True:  # (the router takes the replicas once its first health checks pass)
            try:
                r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30)
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "\n".join(proc.lines[-20:])
            time.sleep(0.2)
        assert all(httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30).status_code == 200
                   for _ in range(4))
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
        for url in replicas:  # the replicas stopped with the launcher
            with pytest.raises(httpx.HTTPError):
                httpx.get(url + "/health", timeout=2)
    finally:
        proc.kill()  # (its replicas and router die with it: they ask the kernel for SIGTERM when it goes)


def test_replicas_die_with_a_killed_launcher(tmp_path_factory):
    """A SIGKILL gives the launcher no chance to stop its children: they go on their own."""
    proc, _, replicas = _launch(tmp_path_factory)
    try:
        proc.kill()
        deadline = time.monotonic() + 30
        alive = list(replicas)
        while alive and time.monotonic() < deadline:
            still = []
            for url in alive:
                try:
                    httpx.get(url + "/health", timeout=1)
                    still.append(url)
                except httpx.HTTPError:
                    pass
            alive = still
            time.sleep(0.2)
        assert not alive, f"replicas outlived their launcher: {alive}"
    finally:
        proc.kill()
