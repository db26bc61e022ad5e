"""The serving engine in a process of its own (:class:`realizar.serving.remote.EngineProcess`) on the CPU: the
same tokens as in this process (greedy and seeded), a cancel mid-stream, bad requests refused at once, stats and
the step hook, close ending what is in flight, a failing build reported; and through the HTTP server, streamed
completions and a JSON-schema chat (its grammar processor rebuilt in the engine process)."""

from __future__ import annotations

import functools
import json
import threading

import pytest

from realizar.engine import load_engine
from realizar.errors import InvalidRequestError
from realizar.generation import SamplingParams
from realizar.serving import ServingEngine
from realizar.serving.engine import EngineClosedError
from realizar.serving.remote import EngineProcess, build_serving
from tests.test_server import LiveServer, _tiny_gguf

OPTIONS = {"max_batch": 4, "num_blocks": 64, "block_size": 16}


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return str(_tiny_gguf(tmp_path_factory))


@pytest.fixture(scope="module")
def remote(path):
    proc = EngineProcess(functools.partial(build_serving, path, "cpu", None, OPTIONS))
    yield proc
    proc.close()


class _Collect:
    """A sink: every request's chunks, and an event set when ``n`` have ended."""

    def __init__(self, n: int):
        self.chunks, self.ended, self._n, self.all_done = {}, 0, n, threading.Event()

    def __call__(self, handle, chunk):
        if chunk is None:
            self.ended += 1
            if self.ended == self._n:
                self.all_done.set()
        else:
            self.chunks.setdefault(handle.rid, []).append(chunk)


REQUESTS = [([5, 17, 42, 7], SamplingParams(max_tokens=8)),
            ([9, 3, 11, 250, 1], SamplingParams(max_tokens=6, temperature=0.8, top_k=20, seed=5)),
            ([64, 64, 8], SamplingParams(max_tokens=5, temperature=1.0, seed=9, stop_token_ids=(3,))),
            ([13, 21, 34, 55, 89, 144], SamplingParams(max_tokens=7, logprobs=2))]


def _local_tokens(path) -> list[list[int]]:
    """REQUESTS' tokens from a serving engine in this process."""
    engine = load_engine(path, device="cpu")
    with ServingEngine.from_engine(engine, **OPTIONS) as local:
        return [list(r.token_ids) for r in local.generate_batch([ids for ids, _ in REQUESTS], [p for _, p in REQUESTS])]


def test_the_engine_process_gives_this_process_s_tokens(path, remote):
    want = _local_tokens(path)
    steps = []
    remote.on_step = steps.append
    sink = _Collect(len(REQUESTS))
    handles = [remote.submit(ids, p, sink=sink) for ids, p in REQUESTS]
    assert sink.all_done.wait(60)
    got = [list(h.wait(0).token_ids) for h in handles]
    assert got == want
    assert [[c.token_id for c in sink.chunks[h.rid]] for h in handles] == want
    assert all(c.logprob is not None for c in sink.chunks[handles[3].rid])
    assert steps and sum(s.tokens_out for s in steps) >= sum(map(len, want)) - len(want)
    s = remote.stats()
    assert s.decoded_tokens > 0 and s.running == 0 and s.waiting == 0


def test_cancel_bad_requests_and_close(path):
    proc = EngineProcess(functools.partial(build_serving, path, "cpu", None, OPTIONS))
    try:
        with pytest.raises(InvalidRequestError, match="context"):
            proc.submit(list(range(3, 10)), SamplingParams(max_tokens=10**6), sink=lambda h, c: None)
        with pytest.raises(InvalidRequestError, match="temperature"):
            proc.submit([5], SamplingParams(temperature=-1.0), sink=lambda h, c: None)
        first = threading.Event()
        h = proc.submit([5, 6, 7], SamplingParams(max_tokens=200, temperature=0.7, seed=1),
                        sink=lambda h, c: first.set())
        assert first.wait(60)
        h.cancel()
        assert h.wait(30).finish_reason == "cancelled"
        long = proc.submit([5, 6, 7], SamplingParams(max_tokens=200, temperature=0.7, seed=2), sink=lambda h, c: None)
    finally:
        proc.close()
    with pytest.raises(EngineClosedError):
        long.wait(10)
    with pytest.raises(EngineClosedError):
        proc.submit([5], SamplingParams(max_tokens=2), sink=lambda h, c: None)


def test_a_build_that_fails_is_raised_here(tmp_path):
    with pytest.raises(Exception, match="no model at|not a regular file|No such file"):
        EngineProcess(functools.partial(build_serving, str(tmp_path / "missing.gguf"), "cpu", None, {}))


def test_the_server_on_an_engine_process(path, remote):
    engine = load_engine(path, device="cpu")
    srv = LiveServer(engine, serving=remote).start()
    try:
        client = srv.client()
        stream = client.completions.create(model=engine.name, prompt="The capital of France is", max_tokens=6,
                                           temperature=0, stream=True)
        text = "".join(c.choices[0].text for c in stream if c.choices)
        want = engine.generate("The capital of France is", SamplingParams(max_tokens=6)).text
        assert text == want
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                  "additionalProperties": False}
        r = client.chat.completions.create(
            model=engine.name, messages=[{"role": "user", "content": "a number"}], max_tokens=40, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content)["n"], int)
        assert r.choices[0].message.content.startswith("{")
    finally:
        srv.stop()


def _children(pid: int) -> list[int]:
    """The live processes multiprocessing spawned whose parent is ``pid`` (from /proc; not its resource tracker)."""
    import os

    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[1]) == pid and stat[0] != "Z" and b"spawn_main" in open(f"/proc/{entry}/cmdline", "rb").read():
                out.append(int(entry))
    return out


def test_serve_with_an_engine_process(path):
    """``realizar serve`` (the engine in a child process by default): it answers streamed and whole completions
    with the in-process engine's text, /health names the child's device, a bad value is refused at once, SIGTERM
    stops both processes within 10 s without a traceback."""
    import signal
    import time

    import httpx

    from tests.test_cli import _start_server

    proc, url = _start_server("-m", path, "--device", "cpu", "--model-name", "tiny")
    try:
        engines = _children(proc.pid)
        assert engines, "serve started no engine process"
        body = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
        whole = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        want = load_engine(path, device="cpu").generate("The capital of France is", SamplingParams(max_tokens=6)).text
        assert whole == want
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]"
        assert "".join(json.loads(d)["choices"][0]["text"] for d in data[:-1]) == want
        health = httpx.get(url + "/health", timeout=10).json()
        assert health["device"] == "cpu" and health["queue_depth"] == 0
        r = httpx.post(url + "/v1/completions", json={**body, "max_tokens": 10**6}, timeout=10)
        assert r.status_code == 400 and "context" in r.json()["error"]["message"]
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert time.monotonic() - t0 < 10 and "Traceback" not in err, err[-2000:]
        assert not [p for p in engines if p in _children(proc.pid) or _alive(p)]
    finally:
        if proc.poll() is None:
            proc.kill()


def _alive(pid: int) -> bool:
    try:
        stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return stat[0] != "Z"


def test_two_clients_of_one_engine_process(path):
    """An engine process started with ``listen``: a second client (as another server process has) submits beside
    the first; each gets its own requests' tokens (those of the in-process engine), the step hook reaches the
    first only, and a client that leaves has its requests cancelled while the other's go on."""
    import time

    from realizar.serving.remote import EngineClient

    want = _local_tokens(path)
    owner = EngineProcess(functools.partial(build_serving, path, "cpu", None, OPTIONS), listen=True)
    try:
        other = EngineClient.connect(owner.address)
        steps_owner, steps_other = [], []
        owner.on_step, other.on_step = steps_owner.append, steps_other.append
        a, b = _Collect(2), _Collect(2)
        ha = [owner.submit(ids, p, sink=a) for ids, p in REQUESTS[:2]]
        hb = [other.submit(ids, p, sink=b) for ids, p in REQUESTS[2:]]
        assert a.all_done.wait(60) and b.all_done.wait(60)
        assert [[c.token_id for c in a.chunks[h.rid]] for h in ha] == want[:2]
        assert [[c.token_id for c in b.chunks[h.rid]] for h in hb] == want[2:]
        assert steps_owner and not steps_other
        assert owner.warm_up() >= 0 and other.warm_up() == 0.0  # (once per engine)
        # a client that leaves mid-stream: its request is cancelled there, the owner's runs to its end
        long = SamplingParams(max_tokens=200, temperature=0)
        done = _Collect(1)
        mine = owner.submit([5, 6, 7], SamplingParams(max_tokens=40, temperature=0), sink=done)
        theirs = other.submit([8, 9], long, sink=lambda h, c: None)
        other.close()
        assert theirs.done and isinstance(theirs.error, EngineClosedError)
        assert done.all_done.wait(60) and mine.error is None and mine.result.finish_reason in ("stop", "length")
        deadline = time.monotonic() + 30
        while owner.stats().running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert owner.stats().running == 0
    finally:
        owner.close()


def test_serve_with_several_server_processes(path):
    """``realizar serve --api-servers 3``: three server processes share the port over one engine process; 12
    concurrent streams all get the in-process engine's text, /metrics (whichever process answers) counts every
    request, and SIGTERM stops every process within 15 s without a traceback."""
    import concurrent.futures
    import signal
    import time

    import httpx

    from tests.test_cli import _start_server

    proc, url = _start_server("-m", path, "--device", "cpu", "--model-name", "tiny", "--api-servers", "3")
    try:
        kids = _children(proc.pid)
        deadline = time.monotonic() + 20
        while len(kids) < 3 and time.monotonic() < deadline:  # (a process just started may not have exec'd yet)
            time.sleep(0.05)
            kids = _children(proc.pid)
        assert len(kids) == 3, kids  # the engine process and two more server processes
        body = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0,
                "stream": True}
        want = load_engine(path, device="cpu").generate("The capital of France is", SamplingParams(max_tokens=6)).text

        def stream(_):
            with httpx.Client(timeout=60) as client:  # (a connection of its own: any process may take it)
                with client.stream("POST", url + "/v1/completions", json=body) as r:
                    data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            return "".join(json.loads(d)["choices"][0]["text"] for d in data[:-1])

        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            assert list(pool.map(stream, range(12))) == [want] * 12
        for _ in range(3):
            with httpx.Client(timeout=10) as client:
                text = client.get(url + "/metrics").text
            line = next(ln for ln in text.splitlines()
                        if ln.startswith('realizar_requests_total{endpoint="/v1/completions",status="200"}'))
            assert float(line.split()[-1]) == 12
            assert "vllm:num_requests_running" in text
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert time.monotonic() - t0 < 15 and "Traceback" not in err, err[-2000:]
        time.sleep(0.5)
        assert not [p for p in kids if _alive(p)]
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("how", ["SIGTERM", "Ctrl-C"])
def test_several_server_processes_stop_together(path, tmp_path, how):
    """``serve --api-servers 3`` stopped (SIGTERM to it, or Ctrl-C: SIGINT to the whole process group) with 8
    streams admitted on all three (one runs at a time): every stream ends with [DONE], complete or with the shutdown error (never the
    engine's closing under a server process still draining), every process exits within 15 s without a traceback
    and the shared metrics directory is gone."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.test_server_shutdown import _ended_well, start_long_streams

    root = __import__("pathlib").Path(__file__).resolve().parents[1]
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "realizar", "serve", "--port", "0", "--log-level", "warning",
                             "-m", path, "--device", "cpu", "--model-name", "tiny", "--api-servers", "3",
                             "--max-batch", "1", "--shutdown-grace", "0.01"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=root, env=env,
                            start_new_session=True)
    try:
        url = None
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line, "the server did not start"
            m = __import__("re").search(r"at (http://127\.0\.0\.1:\d+)/v1", line)
            url = m and m.group(1)
        kids = _children(proc.pid)
        deadline = time.monotonic() + 20
        while len(kids) < 3 and time.monotonic() < deadline:  # (a process just started may not have exec'd yet)
            time.sleep(0.05)
            kids = _children(proc.pid)
        assert len(kids) == 3 and [p.name for p in tmp_path.iterdir() if p.name.startswith("realizar-metrics-")]
        streams, threads = start_long_streams(url, 8)
        # every request admitted (its 200 sent); one runs at a time, so most still wait at the signal
        deadline = time.monotonic() + 60
        while not all(any(k == "status" for k, _ in out) for out in streams):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        t0 = time.monotonic()
        if how == "SIGTERM":
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        for t, _ in threads:
            t.join(15)
        assert time.monotonic() - t0 < 15
        assert "Traceback" not in err and "EngineClosedError" not in err, err[-2000:]
        ends = [_ended_well(out) for out in streams]
        assert "shut down" in ends, ends
        time.sleep(0.5)
        assert not [p for p in kids if _alive(p)]
        assert not [p for p in tmp_path.iterdir() if p.name.startswith("realizar-metrics-")]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_client_that_stops_reading_holds_up_nobody(path):
    """A second client submits long requests and never reads its messages: the engine's steps go on, the first
    client's requests finish, and a client that fails the handshake does not stop the listener."""
    import time
    from multiprocessing.connection import Client

    from realizar.serving.remote import EngineClient

    owner = EngineProcess(functools.partial(build_serving, path, "cpu", None, OPTIONS), listen=True)
    try:
        where, key = owner.address
        try:
            Client(where, family="AF_UNIX", authkey=b"wrong key")
        except Exception:  # noqa: BLE001 - refused: what matters is the next client
            pass
        silent = Client(where, family="AF_UNIX", authkey=key)
        silent.recv()  # its hello; nothing more is read from here on
        for rid in range(12):
            silent.send(("submit", rid, [5 + rid, 6, 7], SamplingParams(max_tokens=200, temperature=0.8, seed=rid)))
        time.sleep(1.0)  # (its messages pile up)
        other = EngineClient.connect(owner.address)  # the listener still takes clients
        done = _Collect(2)
        t0 = time.monotonic()
        mine = [owner.submit([9, 8, 7], SamplingParams(max_tokens=30, temperature=0), sink=done),
                other.submit([1, 2, 3], SamplingParams(max_tokens=30, temperature=0), sink=done)]
        assert done.all_done.wait(60), "a client that does not read held up the others"
        assert all(h.error is None for h in mine) and time.monotonic() - t0 < 60
        other.close()
        silent.close()
    finally:
        owner.close()


def test_a_gone_engine_is_a_503_to_retry():
    """A request that meets a closed engine (stopping, or its engine process gone) is answered 503, OpenAI-style,
    for the client or the router to retry elsewhere; not a 500."""
    from realizar.server.errors import as_server_error

    err = as_server_error(EngineClosedError("the engine process exited"))
    assert err.status == 503 and err.body()["error"]["code"] == "engine_closed"
    assert "retry" in err.body()["error"]["message"]
