"""The serving engine in a process of its own, so the HTTP server's event loop and the engine's steps do not
share one interpreter lock.

:class:`EngineProcess` starts a child process ("spawn") that builds a :class:`~realizar.serving.ServingEngine`
with a picklable ``build()`` (:func:`build_serving` loads a model file) and offers what the HTTP server uses of
an engine: :meth:`~EngineProcess.submit` with a sink, :meth:`~EngineProcess.stats`, the ``on_step`` hook,
:meth:`~EngineProcess.warm_up`, :meth:`~EngineProcess.close` and ``scheduler.max_batch``. A request goes to the
child as (id, prompt ids, sampling params) after the checks :meth:`ServingEngine.submit` makes, here, so a bad
one is refused at once; the child sends back, once a step, every request's chunks of that step in one
message, with the engine's stats and the step's :class:`~realizar.serving.engine.StepStats`. The chunks reach
each request's sink from this process's reader thread, in the order the engine made them; its end (``None``)
comes after :attr:`RemoteHandle.result` or :attr:`RemoteHandle.error` is set.
"""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing
import pickle
import threading
from typing import Any, Callable, Sequence

from realizar.errors import InvalidRequestError, RealizarError
from realizar.generation import SamplingParams, TokenChunk
from realizar.serving.engine import EngineClosedError, EngineStats, RequestEnd, ServingEngine, admit_params
from realizar.serving.scheduler import RequestLimits, check_request

__all__ = ["EngineClient", "EngineProcess", "RemoteHandle", "build_serving", "kv_share_bytes"]

_FLUSH_SECONDS = 0.005  # chunks made outside a step (cancels, failures) wait at most this long in the child
_MAX_BEHIND = 100_000  # messages a client may leave unread before the engine process drops it


def build_serving(path: str, device: str, max_context: int | None, options: dict) -> ServingEngine:
    """A serving engine over the model at ``path`` (``load_engine`` then ``ServingEngine.from_engine`` with the
    :class:`~realizar.config.ServingConfig` keywords of ``options``; its ``kv_events`` and ``kv_events_topic``
    start a :class:`~realizar.serving.kv_events.KVEventPublisher`): the ``build`` of an :class:`EngineProcess`
    (``functools.partial(build_serving, path, device, max_context, options)``)."""
    from realizar.engine import load_engine

    options = dict(options)
    endpoint, topic = options.pop("kv_events", None), options.pop("kv_events_topic", "")
    share = options.pop("gpu_memory_utilization", None)
    engine = load_engine(path, device=device, max_context=max_context)
    if share is not None:
        options["kv_memory"] = kv_share_bytes(share, str(engine.device))
    publisher = None
    if endpoint is not None:
        from realizar.serving.kv_events import KVEventPublisher

        publisher = KVEventPublisher(endpoint, topic, medium="CPU" if engine.device == "cpu" else "GPU")
    return ServingEngine.from_engine(engine, kv_events=publisher, **options)


def kv_share_bytes(share: float, device: str) -> int:
    """The KV pool's bytes when this process may fill ``share`` of the GPU's total memory (vLLM's
    ``--gpu-memory-utilization``): that share less what is already in use with the model loaded (weights,
    runtime). Raises :class:`InvalidRequestError` on a ``device`` other than a GPU, or when that leaves no room."""
    from realizar import cuda

    if not device.startswith("cuda"):
        raise InvalidRequestError(f"--gpu-memory-utilization applies to a GPU (running on {device}); give "
                                  "--kv-memory in GiB")
    free, total = cuda.current_device().memory_info()
    room = int(share * total) - (total - free)
    if room <= 0:
        used = (total - free) / 2**30
        raise InvalidRequestError(f"--gpu-memory-utilization {share:g} leaves no room for the KV cache: {used:.1f} "
                                  f"GiB of the GPU's {total / 2**30:.1f} GiB are in use with the model loaded")
    return room


class RemoteHandle(RequestEnd):
    """A request running in the engine process: :meth:`cancel`; once it has ended, :attr:`result` (or
    :attr:`error`); :meth:`wait`."""

    def __init__(self, owner: "EngineClient", rid: int, prompt_tokens: int, sink: Callable[[Any, Any], None]):
        super().__init__()
        self._owner, self.rid, self.prompt_tokens, self._sink = owner, rid, prompt_tokens, sink

    def cancel(self) -> None:
        """Stop generating (a no-op once it has ended); it ends with ``finish_reason == "cancelled"``."""
        if not self.done:
            try:
                self._owner._send(("cancel", self.rid))
            except EngineClosedError:  # (the engine process is gone: the request ends with that error)
                pass


class EngineClient:
    """What the HTTP server uses of an engine, over a connection to an engine process (see the module docstring):
    :class:`EngineProcess` is the one that started it; :meth:`connect` gives another process its own, to the
    address of an engine process started with ``listen=True``. Requests of one client never reach another."""

    def __init__(self, conn: Any, hello: dict):
        self._conn = conn
        self.limits: RequestLimits = hello["limits"]
        self.device: str = hello["device"]
        self.where: str = hello["where"]
        self.scheduler = _SchedulerView(hello["max_batch"])
        self._stats: EngineStats = hello["stats"]
        self.on_step: Callable[[Any], None] | None = None
        #: called (on the reader thread) once the connection to the engine process has ended
        self.on_gone: Callable[[], None] | None = None
        self._handles: dict[int, RemoteHandle] = {}
        self._ids = itertools.count()
        self._sent = 0  # submissions sent; the child's stats say how many it has taken
        self._taken = 0
        self._embeds = 0  # embed calls made (each waits for its own answer)
        self._lock = threading.Lock()  # the handles and counters (never held while sending)
        self._send_lock = threading.Lock()
        self._closed = False  # no more submissions (closed here, or the engine process is gone)
        self._shut = False  # close() has run
        self._replies: dict[str, Any] = {}
        self._replied = threading.Condition(self._lock)
        self._reader = threading.Thread(target=self._read, name="realizar-engine-reader", daemon=True)
        self._reader.start()

    @classmethod
    def connect(cls, address: tuple[str, bytes], timeout: float = 60.0) -> "EngineClient":
        """A client of the engine process listening at ``address`` (:attr:`EngineProcess.address`)."""
        from multiprocessing.connection import Client

        where, key = address
        try:
            conn = Client(where, family="AF_UNIX", authkey=key)
        except (OSError, EOFError) as e:
            raise EngineClosedError(f"cannot reach the engine process at {where}: {e}") from None
        if not conn.poll(timeout):
            conn.close()
            raise EngineClosedError(f"the engine process at {where} did not answer within {timeout} s")
        kind, hello = conn.recv()
        return cls(conn, hello)

    # -- requests ------------------------------------------------------------------------------------
    def submit(self, prompt_ids: Sequence[int], params: SamplingParams | None = None, *,
               sink: Callable[[RemoteHandle, TokenChunk | None], None]) -> RemoteHandle:
        """Queue a request (token ids); its chunks go to ``sink`` as :meth:`ServingEngine.submit` says. Raises
        :class:`InvalidRequestError` for bad parameters or a request that could never fit, as the engine would."""
        params = admit_params(params)
        if isinstance(prompt_ids, str):
            raise InvalidRequestError("the engine process takes token ids, not text")
        ids = [int(t) for t in prompt_ids]
        if params.max_tokens:
            check_request(ids, params.max_tokens, self.limits)
        with self._lock:
            if self._closed:
                raise EngineClosedError("the serving engine is closed")
            handle = RemoteHandle(self, next(self._ids), len(ids), sink)
            self._handles[handle.rid] = handle
            self._sent += 1
        try:
            self._send(("submit", handle.rid, ids, params))
        except EngineClosedError:
            with self._lock:
                self._handles.pop(handle.rid, None)
                self._sent -= 1
            raise
        return handle

    def stats(self) -> EngineStats:
        """The engine's counters as of its last step; ``waiting`` also counts the requests on their way to it."""
        with self._lock:
            snap, in_pipe = self._stats, self._sent - self._taken
        return dataclasses.replace(snap, waiting=snap.waiting + max(0, in_pipe))

    def warm_up(self) -> float:
        """:meth:`ServingEngine.warm_up` in the engine process, the first time any client asks (before any
        request); its seconds (0 after the first)."""
        return float(self._call("warm_up"))

    def embed(self, inputs: Sequence[Sequence[int]], dimensions: int | None = None) -> Any:
        """:meth:`ServingEngine.embed` in the engine process (on a thread of its own there, beside the steps)."""
        with self._lock:
            self._embeds += 1
            key = f"embed {self._embeds}"
        return self._call(key, [list(map(int, ids)) for ids in inputs], dimensions)

    _FAREWELL = "detach"  # what :meth:`close` tells the engine process: this client leaves

    def close(self, timeout: float | None = 10.0) -> None:
        """Leave the engine process: this client's requests in flight are cancelled there and end here with
        :class:`EngineClosedError`; the engine goes on for the others (:class:`EngineProcess`: it stops)."""
        self.on_gone = None
        with self._lock:
            if self._shut:
                return
            self._shut = self._closed = True
        try:
            self._send((self._FAREWELL,))
        except EngineClosedError:
            pass
        self._after_farewell(timeout)
        self._fail_all(EngineClosedError("the serving engine was closed"))

    def _after_farewell(self, timeout: float | None) -> None:
        self._reader.join(timeout)
        self._conn.close()

    def __enter__(self) -> "EngineClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------------------
    def _send(self, msg: tuple) -> None:
        try:
            with self._send_lock:
                self._conn.send(msg)
        except (OSError, EOFError, ValueError) as e:
            raise EngineClosedError(f"the engine process is gone ({type(e).__name__})") from None

    def _alive(self) -> bool:
        return True

    def _call(self, what: str, *args: Any) -> Any:
        """Send ``(what, *args)`` and wait for the engine process's answer of that kind (an exception is raised)."""
        with self._replied:
            self._replies.pop(what, None)
        self._send((what, *args))
        with self._replied:
            while what not in self._replies:
                if not self._reader.is_alive() or not self._alive():
                    raise EngineClosedError("the engine process is gone")
                self._replied.wait(1.0)
            reply = self._replies.pop(what)
        if isinstance(reply, BaseException):
            raise reply
        return reply

    def _read(self) -> None:
        try:
            while True:
                kind, *rest = self._conn.recv()
                if kind == "out":
                    self._deliver(*rest)
                elif kind == "closed":
                    return
                else:
                    with self._replied:
                        self._replies[kind] = rest[0]
                        self._replied.notify_all()
        except (EOFError, OSError):
            pass
        finally:
            with self._replied:
                self._closed = True  # (nothing more can be submitted: it would wait for an answer forever)
                self._replied.notify_all()
            self._fail_all(EngineClosedError("the engine process exited"))
            hook = self.on_gone
            if hook is not None:
                hook()

    def _deliver(self, items: list, stats: EngineStats, taken: int, steps: list) -> None:
        with self._lock:
            self._stats, self._taken = stats, taken
        hook = self.on_step
        if hook is not None:
            for step in steps:
                hook(step)
        for rid, chunk, result, error in items:
            handle = self._handles.get(rid)
            if handle is None:
                continue
            if chunk is None:
                handle._result, handle._error = result, error
                with self._lock:
                    self._handles.pop(rid, None)
                handle._done.set()
            handle._sink(handle, chunk)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            left, self._handles = list(self._handles.values()), {}
        for handle in left:
            if not handle.done:
                handle._error = exc
                handle._done.set()
                handle._sink(handle, None)


class EngineProcess(EngineClient):
    """A :class:`ServingEngine` built by ``build()`` in a child process (see the module docstring), and this
    process's client of it. Raises what ``build`` raised when the child could not build it; ``start_timeout``
    seconds at most for that. With ``listen``, other processes may connect their own clients to
    :attr:`address` (:meth:`EngineClient.connect`): several HTTP server processes over one engine. Only this
    client gets the engine's steps (``on_step``), so they are counted once."""

    def __init__(self, build: Callable[[], ServingEngine], *, start_timeout: float | None = 600.0,
                 listen: bool = False):
        import os

        ctx = multiprocessing.get_context("spawn")
        conn, child = ctx.Pipe()
        key = os.urandom(32) if listen else None
        self._proc = ctx.Process(target=_child_main, args=(child, build, key), name="realizar-engine", daemon=True)
        start_ignoring_sigint(self._proc)
        child.close()
        if not conn.poll(start_timeout):
            self._proc.kill()
            raise RealizarError(f"the engine process did not start within {start_timeout} s")
        try:
            kind, payload = conn.recv()
        except EOFError:
            raise RealizarError(f"the engine process exited while starting (exit code {self._proc.exitcode})") from None
        if kind == "failed":
            self._proc.join(10)
            raise payload
        #: where other processes connect (:meth:`EngineClient.connect`); None without ``listen``
        self.address: tuple[str, bytes] | None = (payload["address"], key) if listen else None
        super().__init__(conn, payload)

    _FAREWELL = "close"  # (:meth:`close` stops the engine process: every client's requests end)

    def _after_farewell(self, timeout: float | None) -> None:
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._reader.join(5)

    def _alive(self) -> bool:
        return self._proc.is_alive()


@dataclasses.dataclass(frozen=True)
class _SchedulerView:
    max_batch: int


def _portable(exc: BaseException | None) -> BaseException | None:
    """``exc`` if it pickles, else a RealizarError that says what it was."""
    if exc is None:
        return None
    try:
        pickle.dumps(exc)
        return exc
    except Exception:  # noqa: BLE001 - any exception type may fail to pickle
        return RealizarError(f"{type(exc).__name__}: {exc}")


def start_ignoring_sigint(proc: Any) -> None:
    """Start ``proc`` (a spawned process) with Ctrl-C's SIGINT ignored from its first instruction: Ctrl-C reaches
    the whole process group, and a child still importing would die with a traceback; this process stops it."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        proc.start()
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        proc.start()
    finally:
        signal.signal(signal.SIGINT, previous)


class _Client:
    """(In the engine process) one connected client: its requests' handles, the chunks not yet sent, and its own
    writer thread, so a client that reads slowly (or not at all) never holds up the engine or the others. One
    that falls :data:`_MAX_BEHIND` messages behind is dropped (its requests cancelled)."""

    def __init__(self, conn: Any, primary: bool):
        import queue

        self.conn, self.primary = conn, primary
        self.handles: dict[int, Any] = {}
        self.pending: list[tuple] = []
        self.taken = 0
        self.gone = False
        self._out: Any = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write, name="realizar-engine-writer", daemon=True)
        self._writer.start()

    def send(self, msg: tuple) -> bool:
        """Queue ``msg`` for the client; False when it is gone or too far behind."""
        if self.gone or self._out.qsize() > _MAX_BEHIND:
            self.gone = True
            return False
        self._out.put(msg)
        return True

    def finish(self, timeout: float = 5.0) -> None:
        """Send what is queued, then stop the writer."""
        self._out.put(None)
        self._writer.join(timeout)

    def _write(self) -> None:
        while True:
            msg = self._out.get()
            if msg is None:
                return
            try:
                self.conn.send(msg)
            except (OSError, EOFError, ValueError):  # gone: its reader drops it
                self.gone = True
                return


def _child_main(conn: Any, build: Callable[[], ServingEngine], key: bytes | None = None) -> None:
    """The engine process: build the engine, then run its clients' commands until the one that started it
    says close (or goes away). With ``key``, other clients connect to a listener (AF_UNIX, authenticated
    with ``key``). Ctrl-C reaches the whole process group: here it is ignored (the parent decides when to stop)."""
    import signal
    from multiprocessing.connection import Listener, wait

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        serving = build()
        from realizar import structured

        structured.use_process_tokenizer(serving.tokenizer)  # the requests' grammars are rebuilt against it
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("failed", _portable(exc)))
        return
    lock = threading.Lock()  # the clients, their pending chunks and the steps not yet sent
    owner = _Client(conn, primary=True)
    clients: dict[Any, _Client] = {conn: owner}
    joining: list[Any] = []
    steps: list = []
    warmed = [False]

    def hello() -> dict:
        return {"limits": serving.scheduler.limits(), "max_batch": serving.scheduler.max_batch,
                "stats": serving.stats(), "device": serving.device or "unknown",
                "where": serving.where or serving.device or "unknown"}

    def flush(step: Any = None) -> None:
        with lock:  # (taken and queued under one lock: batches leave in the order they were taken)
            if step is not None:
                steps.append(step)
            batches = [(c, c.pending, steps[:] if c.primary else []) for c in clients.values()]
            for c in clients.values():
                c.pending = []
            steps[:] = []
            if any(items or done for _, items, done in batches):
                stats = serving.stats()
                for c, items, done in batches:
                    c.send(("out", items, stats, c.taken, done))

    def sink_for(client: _Client, rid: int) -> Callable[[Any, Any], None]:
        def sink(handle: Any, chunk: Any) -> None:
            end = chunk is None
            item = (rid, chunk, handle.result if end else None, _portable(handle.error) if end else None)
            with lock:
                client.pending.append(item)
        return sink

    def drop(client: _Client) -> None:
        with lock:
            clients.pop(client.conn, None)
        for handle in client.handles.values():
            handle.cancel()
        client.finish(1.0)
        try:
            client.conn.close()
        except OSError:
            pass

    listener, listening = None, [True]
    if key is not None:
        listener = Listener(family="AF_UNIX", authkey=key)

        def accept() -> None:
            while listening[0]:
                try:
                    c = listener.accept()
                except Exception:  # noqa: BLE001 - a client that failed the handshake or left: keep listening
                    continue
                try:
                    c.send(("ready", hello()))
                except (OSError, EOFError):
                    c.close()
                    continue
                with lock:
                    joining.append(c)

        threading.Thread(target=accept, name="realizar-engine-listener", daemon=True).start()
    serving.on_step = flush
    owner.send(("ready", {**hello(), "address": None if listener is None else listener.address}))
    try:
        while True:
            with lock:
                for c in joining:
                    clients[c] = _Client(c, primary=False)
                joining.clear()
                gone = [c for c in clients.values() if c.gone and c is not owner]
            for c in gone:
                drop(c)
            with lock:
                conns = list(clients)
            ready = wait(conns, _FLUSH_SECONDS)
            if not ready:
                flush()
                continue
            for c in ready:
                client = clients.get(c)
                if client is None:
                    continue
                try:
                    kind, *rest = c.recv()
                except (EOFError, OSError):
                    if client is owner:
                        raise
                    drop(client)
                    continue
                if kind == "submit":
                    rid, ids, params = rest
                    client.taken += 1
                    try:
                        client.handles[rid] = serving.submit(ids, params, sink=sink_for(client, rid))
                    except BaseException as exc:  # noqa: BLE001 - checked in the parent; a failure is the request's
                        with lock:
                            client.pending.append((rid, None, None, _portable(exc)))
                    for done in [r for r, h in client.handles.items() if h.done]:
                        del client.handles[done]
                elif kind == "cancel":
                    handle = client.handles.pop(rest[0], None)
                    if handle is not None:
                        handle.cancel()
                elif kind.startswith("embed "):
                    def embed(client=client, key=kind, inputs=rest[0], dimensions=rest[1]) -> None:
                        try:
                            client.send((key, serving.embed(inputs, dimensions)))
                        except BaseException as exc:  # noqa: BLE001 - the parent raises it
                            client.send((key, _portable(exc)))

                    threading.Thread(target=embed, name="realizar-embed", daemon=True).start()
                elif kind == "warm_up":
                    try:
                        seconds = 0.0 if warmed[0] else serving.warm_up()
                        warmed[0] = True
                        client.send(("warm_up", seconds))
                    except BaseException as exc:  # noqa: BLE001 - the parent raises it
                        client.send(("warm_up", _portable(exc)))
                elif kind == "detach" or (kind == "close" and client is not owner):
                    flush()
                    client.send(("closed",))
                    drop(client)
                elif kind == "close":
                    raise EOFError
    except (EOFError, OSError):  # told to close, or the parent is gone
        pass
    finally:
        listening[0] = False
        serving.close()
        flush()
        with lock:
            left = list(clients.values())
        for client in left:
            client.send(("closed",))
            client.finish(2.0)
        if listener is not None:
            listener.close()
