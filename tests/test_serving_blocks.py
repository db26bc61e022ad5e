"""BlockPool: allocation, reference counts, the prefix cache and its LRU of evictable blocks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from realizar.errors import KVPoolExhaustedError, ShapeError
from realizar.serving.blocks import ROOT_KEY, BlockPool
from tests.helpers import examples


def _fill(pool: BlockPool, tokens: list[int]) -> tuple[list[int], list[int]]:
    """Take blocks for ``tokens`` as a sequence would (prefix hits, then new blocks) and register
    every full block; returns (blocks, keys of the full ones)."""
    bs = pool.block_size
    blocks, keys = pool.match_prefix(tokens)
    blocks = list(blocks) + pool.allocate(pool.blocks_for(len(tokens)) - len(blocks))
    keys = list(keys)
    for i in range(len(keys), len(tokens) // bs):
        keys.append(pool.register(blocks[i], keys[-1] if keys else ROOT_KEY, tokens[i * bs : (i + 1) * bs]))
    return blocks, keys


def test_block_zero_is_never_handed_out_and_exhaustion_is_typed():
    pool = BlockPool(5, 4)
    got = pool.allocate(4)
    assert sorted(got) == [1, 2, 3, 4] and pool.num_available == 0
    with pytest.raises(KVPoolExhaustedError, match="asked for 1 KV blocks, 0 available"):
        pool.allocate(1)
    pool.free(got[:2])
    assert pool.stats().used == 2 and pool.stats().free == 2
    with pytest.raises(KVPoolExhaustedError):
        pool.allocate(3)
    assert pool.num_available == 2  # a failed allocation takes nothing
    pool.check_consistency()
    with pytest.raises(ShapeError):
        BlockPool(1, 4)


def test_prefix_hits_share_blocks_and_never_cover_the_last_token():
    pool = BlockPool(16, 4)
    a = list(range(10, 20))  # 10 tokens: 2 full blocks + 2
    blocks_a, keys_a = _fill(pool, a)
    assert len(blocks_a) == 3 and len(keys_a) == 2
    b = a[:8] + [99, 98, 97]  # shares the two full blocks
    hit, _ = pool.lookup_prefix(b)
    assert hit == blocks_a[:2]
    blocks_b, _ = _fill(pool, b)
    assert blocks_b[:2] == blocks_a[:2] and blocks_b[2] not in blocks_a
    assert pool.ref_count(blocks_a[0]) == 2 and pool.ref_count(blocks_a[2]) == 1
    # exactly 8 tokens: only one block can be a hit (the last token must be prefilled)
    assert pool.lookup_prefix(a[:8])[0] == blocks_a[:1]
    assert pool.lookup_prefix(a[:9])[0] == blocks_a[:2]
    # a different first block: no hit for the second one either (keys chain the whole prefix)
    assert pool.lookup_prefix([0] + a[1:])[0] == []
    s = pool.stats()
    assert (s.queries, s.hits, s.query_tokens, s.hit_tokens) == (2, 1, 21, 8)
    pool.free(blocks_a)
    pool.free(blocks_b)
    s = pool.stats()
    assert s.used == 0 and s.free == 15 and s.cached == 2 and s.evictable == 2
    pool.check_consistency()


def test_cached_blocks_are_reused_only_when_the_free_list_is_empty_lru_first():
    pool = BlockPool(6, 2)  # 5 usable
    x, _ = _fill(pool, [1, 2, 3])  # blocks: full [1,2] + partial
    y, _ = _fill(pool, [5, 6, 7])
    pool.free(x)  # x[0] evictable first, then y[0]
    pool.free(y)
    assert pool.stats().evictable == 2
    fresh = pool.allocate(3)  # the 3 free ones, caches untouched
    assert not set(fresh) & {x[0], y[0]} and pool.lookup_prefix([1, 2, 3])[0] == [x[0]]
    assert pool.allocate(1) == [x[0]]  # the least recently released cached block goes first
    assert pool.lookup_prefix([1, 2, 3])[0] == [] and pool.lookup_prefix([5, 6, 7])[0] == [y[0]]
    pool.check_consistency()


def test_a_duplicate_full_block_stays_private():
    pool = BlockPool(8, 2)
    a, _ = _fill(pool, [1, 2, 3])
    b = pool.allocate(1)  # computed the same prefix without a hit (e.g. concurrently)
    pool.register(b[0], ROOT_KEY, [1, 2])
    assert not pool.is_cached(b[0]) and pool.is_cached(a[0])
    pool.free(b)
    assert pool.stats().evictable == 0  # a private block goes straight back to the free list
    pool.check_consistency()


def test_prefix_cache_off():
    pool = BlockPool(8, 2, prefix_cache=False)
    a, _ = _fill(pool, [1, 2, 3, 4, 5])
    assert pool.lookup_prefix([1, 2, 3, 4, 5])[0] == [] and pool.stats().cached == 0
    pool.free(a)
    assert pool.stats().free == 7
    pool.check_consistency()


@settings(max_examples=examples(60), deadline=None)
@given(st.data())
def test_random_sequences_keep_the_accounting_exact(data):
    """Sequences drawn over a tiny alphabet (many shared prefixes) come and go; the invariants hold
    after every operation, every hit's blocks hold exactly the looked-up tokens, and once all are
    gone every block is free again."""
    bs = data.draw(st.sampled_from([1, 2, 4]))
    pool = BlockPool(data.draw(st.integers(2, 24)), bs)
    content: dict[int, tuple[int, ...]] = {}  # what each registered block holds (its token span)
    live: list[list[int]] = []
    for _ in range(data.draw(st.integers(1, 30))):
        if live and data.draw(st.booleans()):
            pool.free(live.pop(data.draw(st.integers(0, len(live) - 1))))
        else:
            toks = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=12))
            hit, _ = pool.lookup_prefix(toks)
            for i, b in enumerate(hit):
                assert content[b] == tuple(toks[: (i + 1) * bs])
            need = pool.blocks_for(len(toks)) - len(hit)
            if need > pool.num_available - pool.evictable_among(hit):
                with pytest.raises(KVPoolExhaustedError):
                    pool.allocate(pool.num_available + 1)
                continue
            blocks, keys = _fill(pool, toks)
            for i in range(len(keys)):
                if pool.is_cached(blocks[i]):
                    content[blocks[i]] = tuple(toks[: (i + 1) * bs])
            live.append(blocks)
        pool.check_consistency()
    for blocks in live:
        pool.free(blocks)
    pool.check_consistency()
    assert pool.stats().used == 0 and pool.num_available == pool.usable
