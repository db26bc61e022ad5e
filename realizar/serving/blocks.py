"""The paged KV pool's allocator: which block ids are free, who holds which, and the prefix cache.

A sequence's keys and values live in fixed-size blocks of ``block_size`` positions; its *block table*
lists their ids, position ``p`` in block ``table[p // block_size]``. Block 0 is the null block (padding
rows of a batch write there) and is never handed out.

Prefix cache: once a block is full, it can be registered under a key that chains the keys of the
blocks before it, ``hash((parent_key, tuple(its tokens)))``, so the key names the whole token prefix
up to the block's end. A later sequence whose tokens start with the same prefix takes those blocks
(:meth:`BlockPool.match_prefix`) instead of recomputing them; several sequences may hold one block
(reference counts). A cached block whose last holder lets go stays cached but *evictable* (an LRU);
it is reused for new content only when the free list is empty, least recently released first.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Sequence

from realizar.errors import InvalidRequestError, KVPoolExhaustedError, ShapeError

__all__ = ["BlockPool", "PoolStats", "ROOT_KEY"]

#: parent key of a sequence's first block
ROOT_KEY = 0


@dataclass(frozen=True)
class PoolStats:
    """A snapshot of the pool. ``usable`` = num_blocks - 1 (block 0 is reserved); ``used`` blocks are
    held by at least one sequence; ``free`` = usable - used (includes ``evictable``: cached blocks
    nobody holds); ``cached``: blocks registered in the prefix cache (held or not). Prefix lookups:
    ``queries`` (admissions that asked), ``hits`` (those that found >= 1 block), ``query_tokens``
    (tokens looked up) and ``hit_tokens`` (tokens found)."""

    num_blocks: int
    block_size: int
    usable: int
    used: int
    free: int
    cached: int
    evictable: int
    queries: int
    hits: int
    query_tokens: int
    hit_tokens: int

    @property
    def hit_rate(self) -> float:
        """Fraction of looked-up tokens found in the cache (0 before any lookup)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class BlockPool:
    """Free list, reference counts and prefix cache of ``num_blocks`` blocks of ``block_size``
    positions (block 0 reserved). Not thread-safe: the scheduler owns it."""

    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool = True):
        if int(num_blocks) != num_blocks or num_blocks < 2:
            raise ShapeError(f"a block pool needs num_blocks >= 2 (block 0 is reserved), got {num_blocks}")
        if int(block_size) != block_size or block_size < 1:
            raise ShapeError(f"block_size must be a positive integer, got {block_size}")
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        self.prefix_cache = bool(prefix_cache)
        self._free: deque[int] = deque(range(1, self.num_blocks))
        self._ref = [0] * self.num_blocks
        # prefix cache: key -> block, and per cached block its key and what the key stands for
        self._cached: dict[int, int] = {}
        self._key: dict[int, int] = {}
        self._content: dict[int, tuple[int, tuple[int, ...]]] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._queries = self._hits = self._query_tokens = self._hit_tokens = 0
        self.events: list[tuple] | None = None  # the prefix cache's changes, when recorded (record_events)

    # -- accounting --------------------------------------------------------------------------------

    @property
    def usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_available(self) -> int:
        """Blocks :meth:`allocate` can hand out now (free plus evictable cached ones)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.usable - self.num_available

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def is_cached(self, block: int) -> bool:
        return block in self._key

    def stats(self) -> PoolStats:
        return PoolStats(
            num_blocks=self.num_blocks, block_size=self.block_size, usable=self.usable, used=self.num_used,
            free=self.num_available, cached=len(self._key), evictable=len(self._evictable),
            queries=self._queries, hits=self._hits, query_tokens=self._query_tokens, hit_tokens=self._hit_tokens,
        )  # fmt: skip

    def blocks_for(self, num_positions: int) -> int:
        """Blocks needed to hold ``num_positions`` positions."""
        return -(-int(num_positions) // self.block_size)

    # -- allocation --------------------------------------------------------------------------------

    def allocate(self, n: int = 1) -> list[int]:
        """``n`` blocks, each with reference count 1: from the free list first, then by evicting the
        least recently released cached blocks. Raises :class:`KVPoolExhaustedError` (taking nothing)
        when fewer than ``n`` are available."""
        if n < 0:
            raise InvalidRequestError(f"cannot allocate {n} blocks")
        if n > self.num_available:
            raise KVPoolExhaustedError(f"asked for {n} KV blocks, {self.num_available} available")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._evictable.popitem(last=False)
                self._uncache(b)
            self._ref[b] = 1
            out.append(b)
        return out

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; a block nobody holds goes back to the free list, or to
        the evictable LRU (most recent last) when it is cached."""
        for b in blocks:
            self._check(b)
            if self._ref[b] <= 0:
                raise InvalidRequestError(f"block {b} is freed but not held")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if b in self._key:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    def _check(self, b: int) -> None:
        if not 1 <= b < self.num_blocks:
            raise InvalidRequestError(f"block id {b} is outside 1..{self.num_blocks - 1}")

    # -- prefix cache --------------------------------------------------------------------------------

    @staticmethod
    def block_key(parent_key: int, tokens: Sequence[int]) -> int:
        """The key of a full block holding ``tokens`` after the prefix named by ``parent_key``."""
        return hash((parent_key, tuple(int(t) for t in tokens)))

    def record_events(self) -> None:
        """From now on keep the prefix cache's changes in :attr:`events` (drained by their reader):
        ``("stored", key, parent_key, tokens)`` when a block becomes the cached one of its prefix,
        ``("removed", key)`` when that block is given new content."""
        if self.events is None:
            self.events = []

    def _uncache(self, b: int) -> None:
        key = self._key.pop(b)
        del self._content[b]
        if self._cached.get(key) == b:
            del self._cached[key]
            if self.events is not None:
                self.events.append(("removed", key))

    def register(self, block: int, parent_key: int, tokens: Sequence[int]) -> int:
        """Record that ``block`` (held by the caller) is full and holds ``tokens`` after the prefix
        ``parent_key``; returns the block's key (the parent key of the next block). When another block
        already caches that prefix, it stays the cached one and ``block`` remains private."""
        if len(tokens) != self.block_size:
            raise ShapeError(f"a full block holds {self.block_size} tokens, got {len(tokens)}")
        self._check(block)
        toks = tuple(int(t) for t in tokens)
        key = hash((parent_key, toks))
        if not self.prefix_cache or block in self._key:
            return key
        if key not in self._cached:
            self._cached[key] = block
            self._key[block] = key
            self._content[block] = (parent_key, toks)
            if self.events is not None:
                self.events.append(("stored", key, parent_key, toks))
        return key

    def lookup_prefix(self, tokens: Sequence[int]) -> tuple[list[int], list[int]]:
        """Cached blocks holding a prefix of ``tokens``, and their keys, without taking them: full
        blocks only, and never the last token (at least one token is always left to prefill)."""
        if not self.prefix_cache:
            return [], []
        bs = self.block_size
        blocks: list[int] = []
        keys: list[int] = []
        parent = ROOT_KEY
        for i in range((len(tokens) - 1) // bs):
            toks = tuple(int(t) for t in tokens[i * bs : (i + 1) * bs])
            key = hash((parent, toks))
            b = self._cached.get(key)
            if b is None or self._content[b] != (parent, toks):  # a hash collision is a miss
                break
            blocks.append(b)
            keys.append(key)
            parent = key
        return blocks, keys

    def evictable_among(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` nobody holds (taking them lowers :attr:`num_available`)."""
        return sum(1 for b in blocks if self._ref[b] == 0)

    def match_prefix(self, tokens: Sequence[int]) -> tuple[list[int], list[int]]:
        """Take (one reference each) the cached blocks :meth:`lookup_prefix` finds for ``tokens`` and
        count the lookup in the stats; returns ``(blocks, keys)``."""
        blocks, keys = self.lookup_prefix(tokens)
        for b in blocks:
            if self._ref[b] == 0:
                del self._evictable[b]
            self._ref[b] += 1
        if self.prefix_cache:
            self._queries += 1
            self._query_tokens += len(tokens)
            self._hits += bool(blocks)
            self._hit_tokens += len(blocks) * self.block_size
        return blocks, keys

    def check_consistency(self) -> None:
        """Assert the invariants (for tests): every usable block is exactly one of free, evictable
        (cached, unheld) or held; block 0 is nowhere."""
        free, evict = set(self._free), set(self._evictable)
        held = {b for b in range(1, self.num_blocks) if self._ref[b] > 0}
        assert len(free) == len(self._free), "a block is twice on the free list"
        assert not (free & evict) and not (free & held) and not (evict & held)
        assert free | evict | held == set(range(1, self.num_blocks)), "a block is lost"
        assert self._ref[0] == 0 and 0 not in self._key
        assert evict <= set(self._key) and not (free & set(self._key))
        for key, b in self._cached.items():
            assert self._key[b] == key
