"""KV-cache events for routers that track which replica holds which prompt prefixes (Dynamo's KV router,
llm-d's KV-cache manager), in vLLM's KV-event format, published over ZeroMQ.

    publisher = KVEventPublisher("tcp://*:5557")          # PUB socket, bound (or connected: tcp://host:port)
    serving = ServingEngine.from_engine(engine, kv_events=publisher)

After every scheduler step that changed the prefix cache, one message of three frames goes out: the topic
(``topic``, UTF-8), the batch's sequence number (8 bytes, big-endian, from 0) and the batch, msgpack-encoded
as vLLM's array-like tagged structs::

    [ts, [event, ...]]                                      ts: seconds since the epoch (float)
    ["BlockStored", [block_hash], parent_block_hash, token_ids, block_size, lora_id, medium]
    ["BlockRemoved", [block_hash], medium]
    ["AllBlocksCleared"]

A block's hash is the prefix cache's key of the block (a signed 64-bit integer naming the whole token
prefix up to the block's end: ``hash((parent key, tokens))``); ``parent_block_hash`` is the key of the block
before it, or None for a sequence's first block; ``lora_id`` is None; ``medium`` is "GPU" or "CPU" (where
the blocks live). ``BlockStored`` is sent when a full block becomes the cached one of its prefix,
``BlockRemoved`` when that block is reused for other content (evicted), ``AllBlocksCleared`` first in the
first batch (a replica's cache starts empty; sent with the first changes rather than at start, when no
subscriber may be connected yet: a PUB socket drops what no subscriber takes).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from realizar.errors import UnsupportedError

__all__ = ["KVEventPublisher"]


class KVEventPublisher:
    """A ZeroMQ PUB socket sending the prefix cache's changes (see the module docstring). ``endpoint``: where
    to bind (``tcp://*:5557``, ``tcp://127.0.0.1:0`` for any free port: :attr:`endpoint` then names the
    bound one) or, for an endpoint without a wildcard host, where to connect."""

    def __init__(self, endpoint: str, topic: str = "", medium: str = "GPU"):
        try:
            import msgpack
            import zmq
        except ImportError as e:
            raise UnsupportedError(f"KV events need pyzmq and msgpack ({e}): pip install 'realizar[cluster]'") from None
        self._pack = msgpack.Packer(use_bin_type=True)
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 500)
        host = endpoint.rsplit(":", 1)[0]
        if "*" in host or endpoint.startswith(("ipc://", "inproc://")) or endpoint.endswith(":0"):
            self._sock.bind(endpoint)
            self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self._sock.connect(endpoint)
            self.endpoint = endpoint
        self.topic = topic.encode("utf-8")
        self.medium = medium
        self._seq = 0
        self._lock = threading.Lock()

    def publish(self, events: list[list[Any]]) -> None:
        """Send one batch of events (already in the wire form) with the next sequence number."""
        with self._lock:
            seq = self._seq
            if seq == 0:
                events = [["AllBlocksCleared"], *events]
            payload = self._pack.pack([time.time(), events])
            self._seq += 1
            self._sock.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    def publish_pool_events(self, events: list[tuple], block_size: int, root_key: int) -> None:
        """Send the changes a :class:`~realizar.serving.blocks.BlockPool` recorded (``record_events``)."""
        wire = []
        for ev in events:
            if ev[0] == "stored":
                _, key, parent, tokens = ev
                wire.append(["BlockStored", [key], None if parent == root_key else parent, list(tokens), block_size,
                             None, self.medium])
            else:
                wire.append(["BlockRemoved", [ev[1]], self.medium])
        if wire:
            self.publish(wire)

    def close(self) -> None:
        self._sock.close()
