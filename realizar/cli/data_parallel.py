"""``realizar serve --data-parallel N``: N replicas of the server, one per GPU (``CUDA_VISIBLE_DEVICES``), on
loopback ports, behind sglang-router's cache-aware policy on the requested address, started and stopped by
one command. ``--device cpu`` runs the N replicas on the CPU (to try the setup without GPUs)."""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from realizar.cli.common import CliError, note
from realizar.server.fronts import die_with_parent

__all__ = ["serve_data_parallel"]

# serve options a replica gets from the launcher instead of the command line
_OWN = {"--data-parallel": 1, "--host": 1, "--port": 1, "--kv-events": 1}
READY = re.compile(r"at (http://127\.0\.0\.1:\d+)/v1")


def _replica_argv(argv: list[str]) -> list[str]:
    """``argv`` (the ``serve`` command line) without the options the launcher sets per replica."""
    out, skip = [], 0
    for a in argv:
        if skip:
            skip -= 1
            continue
        name = a.split("=", 1)[0]
        if name in _OWN:
            skip = 0 if "=" in a else _OWN[name]
            continue
        out.append(a)
    return out


def offset_endpoint(endpoint: str, rank: int) -> str:
    """A ZeroMQ tcp endpoint with its port moved up by ``rank`` (each replica publishes on its own port)."""
    base, _, port = endpoint.rpartition(":")
    if not endpoint.startswith("tcp://") or not port.isdigit():
        raise CliError(f"--kv-events with --data-parallel needs a tcp://host:port endpoint, got {endpoint!r}")
    return f"{base}:{int(port) + rank}" if int(port) else endpoint


def free_port() -> int:
    """A TCP port free on loopback now (for a child process to bind)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Child:
    def __init__(self, argv: list[str], env: dict, name: str):
        self.name = name
        self.p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  start_new_session=True,
                                  preexec_fn=die_with_parent if sys.platform.startswith("linux") else None)
        self.lines: list[str] = []
        self.url: str | None = None
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.p.stdout:
            line = line.rstrip()
            self.lines.append(line)
            m = READY.search(line)
            if m and self.url is None:
                self.url = m.group(1)
            print(f"[{self.name}] {line}", file=sys.stderr, flush=True)

    def stop(self) -> None:
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, signal.SIGTERM)
                self.p.wait(10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(self.p.pid, signal.SIGKILL)


def serve_data_parallel(args: argparse.Namespace) -> int:
    n = args.data_parallel
    try:
        import sglang_router  # noqa: F401  (runs as a child process; checked here for a clear error)
    except ImportError:
        raise CliError("--data-parallel runs sglang-router in front of the replicas: pip install 'realizar[cluster]'") \
            from None
    if args.device != "cpu":
        from realizar.parallel import visible_gpu_count

        count = visible_gpu_count()
        if count < n:
            raise CliError(f"--data-parallel {n} runs one replica per GPU and needs {n} visible GPUs; this machine has "
                           f"{count} (--device cpu runs the replicas on the CPU)")
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]

    def stop(signum, frame):  # SIGTERM (a supervisor stopping us) stops the children as Ctrl-C does
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    base = _replica_argv(list(getattr(args, "argv", None) or ["serve"]))
    children: list[_Child] = []
    try:
        for rank in range(n):
            env = dict(os.environ)
            if args.device != "cpu":
                env["CUDA_VISIBLE_DEVICES"] = visible[rank] if visible else str(rank)
            argv = [sys.executable, "-m", "realizar", *base, "--host", "127.0.0.1", "--port", str(free_port())]
            if args.kv_events:
                argv += ["--kv-events", offset_endpoint(args.kv_events, rank)]
            children.append(_Child(argv, env, f"replica {rank}"))
        deadline = time.monotonic() + 600
        while not all(c.url for c in children):
            dead = next((c for c in children if c.p.poll() is not None), None)
            if dead is not None:
                raise CliError(f"{dead.name} stopped before it was ready: {(dead.lines or ['no output'])[-1]}")
            if time.monotonic() > deadline:
                raise CliError("the replicas were not ready within 600 s")
            time.sleep(0.1)
        router = [sys.executable, "-m", "sglang_router.launch_router", "--host", args.host, "--port", str(args.port),
                  "--worker-urls", *[c.url for c in children], "--policy", "cache_aware",
                  "--health-check-interval-secs", "2", "--log-level", "warn",
                  # (its Prometheus exporter on a free loopback port: the default one is the same for every router)
                  "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        children.append(_Child(router, dict(os.environ), "router"))
        note(f"serving {n} replicas behind sglang-router (cache-aware) at http://{args.host}:{args.port}/v1 "
             "- Ctrl-C to stop")
        while True:
            dead = next((c for c in children if c.p.poll() is not None), None)
            if dead is not None:
                raise CliError(f"{dead.name} stopped (exit {dead.p.returncode}): {(dead.lines or ['no output'])[-1]}")
            time.sleep(0.2)
    except KeyboardInterrupt:
        return 0
    finally:
        for c in reversed(children):
            c.stop()
        note("stopped")
