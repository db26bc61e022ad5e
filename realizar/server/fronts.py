"""More HTTP server processes over one engine process (``realizar serve --api-servers N``).

One process's event loop parses every request, renders every stream event and runs the framework's code for
each; at a few hundred concurrent streams of a small model that is the limit, not the GPU. With
``--api-servers N`` the first server process (the one that started the engine process, with ``listen``: see
:class:`realizar.serving.remote.EngineProcess`) starts ``N - 1`` more. Each reads the model's tokenizer and
metadata (:func:`realizar.engine.load_front`), connects its own client to the engine process
(:meth:`~realizar.serving.remote.EngineClient.connect`) and serves the same listening socket, which the kernel
shares out connection by connection. Their Prometheus figures live in one directory (prometheus_client's
multiprocess mode, :func:`realizar.server.metrics.share_between_processes`), so whichever answers ``/metrics``
reports all of them; the engine's steps are counted by the first only. At shutdown the first passes the signal
on, and each drains its own requests.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import sys
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["FrontSpec", "default_api_servers", "die_with_parent", "join_fronts", "signal_fronts", "start_fronts"]


def default_api_servers() -> int:
    """``serve``'s server processes when none are asked for: one per four CPU cores, at most four (one on a
    small machine, where more would only take turns on the same cores)."""
    return max(1, min(4, (os.cpu_count() or 1) // 4))


@dataclass(frozen=True)
class FrontSpec:
    """What a further server process needs to know of the model: the file (or directory) to read the tokenizer
    and metadata from, the engine process's device, and the server's chat-content setting. Called in that
    process, it gives the front engine :func:`realizar.server.serve` takes."""

    model: str
    device: str
    special_tokens_in_content: bool = False

    def __call__(self) -> Any:
        from realizar.engine import load_front

        front = load_front(self.model)
        front.device = self.device
        front.tokenizer.special_tokens_in_content = self.special_tokens_in_content
        return front


def start_fronts(count: int, sock: socket.socket, address: tuple[str, bytes], front: Callable[[], Any],
                 serve_kwargs: dict) -> list[Any]:
    """Start ``count`` server processes on ``sock`` over the engine process at ``address``, each running
    :func:`realizar.server.serve` of ``front()`` (picklable: a :class:`FrontSpec`) with ``serve_kwargs``
    (picklable: no callbacks)."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_front_main, args=(sock, address, front, serve_kwargs), name=f"realizar-api-{i + 2}")
             for i in range(count)]
    from realizar.serving.remote import start_ignoring_sigint

    for p in procs:
        start_ignoring_sigint(p)  # (Ctrl-C stops the first process, which passes SIGTERM on)
    return procs


def signal_fronts(procs: list[Any], sig: int = signal.SIGTERM) -> None:
    """Pass ``sig`` on to the server processes still running (each then drains its requests and stops)."""
    for p in procs:
        if p.is_alive() and p.pid is not None:
            try:
                os.kill(p.pid, sig)
            except ProcessLookupError:
                pass


def join_fronts(procs: list[Any], timeout: float) -> None:
    """Wait ``timeout`` seconds in all for the server processes to stop; kill what is left."""
    import time

    end = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)


def _front_main(sock: socket.socket, address: tuple[str, bytes], front: Callable[[], Any], serve_kwargs: dict) -> None:
    from realizar.server import serve
    from realizar.serving.remote import EngineClient

    die_with_parent()
    client = None
    try:
        engine = front()
        client = EngineClient.connect(address)
        # the engine process gone (its owner died): stop as SIGTERM would, the requests in flight ending with 503s
        client.on_gone = lambda: os.kill(os.getpid(), signal.SIGTERM)
        serve(engine, serving=client, sock=sock, **serve_kwargs)
    except KeyboardInterrupt:  # (uvicorn takes SIGINT again while it runs: Ctrl-C reaches the whole group)
        pass
    finally:
        if client is not None:
            client.close()


def die_with_parent() -> None:
    """Ask the kernel for SIGTERM when the process that started this one dies, however it dies (Linux; a SIGKILL
    leaves it no chance to stop its children): a killed server leaves no process behind holding its port. Also
    ``serve --data-parallel``'s replicas' ``preexec_fn``."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
