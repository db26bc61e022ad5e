"""KV events in vLLM's format over ZeroMQ (the ``cluster`` extra): a subscriber receives, for a request, one
BlockStored per full block with the prefix cache's chained keys (each the hash of its parent's key and its
tokens, the first block's parent None) and the block's tokens; when a cached block is reused for other
content, a BlockRemoved with its key; an AllBlocksCleared opens the first batch; sequence numbers count up
from 0. Through the
server: ``--kv-events`` publishes the same."""

from __future__ import annotations

import time

import numpy as np
import pytest

zmq = pytest.importorskip("zmq", reason="KV events come with the cluster extra: pip install '.[cluster]'")
msgpack = pytest.importorskip("msgpack", reason="KV events come with the cluster extra: pip install '.[cluster]'")

from realizar.engine import load_engine  # noqa: E402
from realizar.generation import SamplingParams  # noqa: E402
from realizar.serving import ServingEngine  # noqa: E402
from realizar.serving.blocks import ROOT_KEY, BlockPool  # noqa: E402
from realizar.serving.cpu_backend import ReferenceBatchBackend  # noqa: E402
from realizar.serving.kv_events import KVEventPublisher  # noqa: E402
from tests.gguf_factory import shared_tiny_gguf  # noqa: E402

BS = 16


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return load_engine(str(shared_tiny_gguf(tmp_path_factory)), device="cpu")


class Subscriber:
    def __init__(self, endpoint: str, topic: str = ""):
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sock.connect(endpoint)
        self.seqs: list[int] = []
        self.events: list[list] = []

    def drain(self, settle: float = 0.3) -> None:
        deadline = time.monotonic() + settle
        while time.monotonic() < deadline:
            if self.sock.poll(50):
                topic, seq, payload = self.sock.recv_multipart()
                ts, events = msgpack.unpackb(payload, raw=False)
                assert isinstance(ts, float) and abs(ts - time.time()) < 60
                self.seqs.append(int.from_bytes(seq, "big"))
                self.events.extend(events)
                deadline = time.monotonic() + settle

    def close(self) -> None:
        self.sock.close(0)


def _chain(tokens: list[int]) -> list[int]:
    keys, parent = [], ROOT_KEY
    for i in range((len(tokens) - 1) // BS):
        parent = BlockPool.block_key(parent, tokens[i * BS:(i + 1) * BS])
        keys.append(parent)
    return keys


def _serving(engine, publisher, num_blocks: int) -> ServingEngine:
    backend = ReferenceBatchBackend(engine.model, num_blocks, BS, kv_dtype="f32", max_batch=2)
    return ServingEngine(backend, engine.tokenizer, background=False, kv_events=publisher)


def test_stored_and_removed_events_carry_the_prefix_keys(engine):
    pub = KVEventPublisher("tcp://127.0.0.1:0", topic="kv", medium="CPU")
    sub = Subscriber(pub.endpoint, "kv")
    time.sleep(0.2)  # (a PUB socket drops what it sends before the subscription arrives)
    serving = _serving(engine, pub, num_blocks=9)  # 8 usable blocks
    try:
        a = np.random.default_rng(1).integers(3, 300, 3 * BS + 5).tolist()
        h = serving.submit(a, SamplingParams(max_tokens=1, temperature=0))
        while not h.done:
            serving.step()
        sub.drain()
        stored = [e for e in sub.events if e[0] == "BlockStored"]
        want = _chain(a)
        assert [e[1] for e in stored] == [[k] for k in want]
        assert [e[2] for e in stored] == [None] + want[:-1]  # parents: none for the first block
        for i, e in enumerate(stored):
            assert e[3] == a[i * BS:(i + 1) * BS] and e[4:] == [BS, None, "CPU"]
        assert not [e for e in sub.events if e[0] == "BlockRemoved"]

        # a second prompt that needs every block: the cached ones are reused, each one's BlockRemoved is sent
        b = np.random.default_rng(2).integers(3, 300, 8 * BS - 2).tolist()
        h = serving.submit(b, SamplingParams(max_tokens=1, temperature=0))
        while not h.done:
            serving.step()
        sub.drain()
        removed = [k for e in sub.events if e[0] == "BlockRemoved" for k in e[1]]
        assert sorted(removed) == sorted(want), (removed, want)
        assert all(e[2] == "CPU" for e in sub.events if e[0] == "BlockRemoved")
        assert [e[1] for e in sub.events if e[0] == "BlockStored"][len(want):] == [[k] for k in _chain(b)]
        assert sub.seqs == list(range(sub.seqs[0], sub.seqs[0] + len(sub.seqs)))
    finally:
        serving.close()
        sub.close()


def test_the_first_batch_starts_by_clearing_everything():
    sub_ctx = zmq.Context.instance()
    pull = sub_ctx.socket(zmq.SUB)
    pull.setsockopt(zmq.SUBSCRIBE, b"")
    pull.bind("tcp://127.0.0.1:0")
    endpoint = pull.getsockopt_string(zmq.LAST_ENDPOINT)
    time.sleep(0.1)
    pub = KVEventPublisher(endpoint)  # (no wildcard: connects, as a publisher pointed at a collector does)
    try:
        pull.poll(300)  # (lets the bound SUB socket take the connection and send its subscription)
        pub.publish_pool_events([("stored", 7, ROOT_KEY, tuple(range(BS)))], BS, ROOT_KEY)
        assert pull.poll(5000)
        topic, seq, payload = pull.recv_multipart()
        assert topic == b"" and int.from_bytes(seq, "big") == 0
        assert msgpack.unpackb(payload)[1] == [["AllBlocksCleared"],
                                               ["BlockStored", [7], None, list(range(BS)), BS, None, "GPU"]]
    finally:
        pub.close()
        pull.close(0)


def test_the_server_publishes_with_kv_events(engine, tmp_path_factory):
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from tests.test_server import LiveServer

    srv = LiveServer(engine, kv_events="tcp://127.0.0.1:0", kv_events_topic="r1").start()  # (port 0: any free)
    sub = Subscriber(srv.serving.kv_events.endpoint, "r1")
    time.sleep(0.3)
    try:
        ids = list(range(5, 5 + 2 * srv.serving.scheduler.block_size + 3))
        body = {"model": engine.name, "prompt": ids, "max_tokens": 1, "temperature": 0}
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=30).status_code == 200
        sub.drain(0.5)
        stored = [e for e in sub.events if e[0] == "BlockStored"]
        assert len(stored) == 2 and stored[1][2] == stored[0][1][0]
    finally:
        sub.close()
        srv.stop()
