import pytest

from splitserve.engine.kv_cache import BlockPool, BlockRemoved, BlockStored, OutOfBlocks
from splitserve.hashing import block_hashes


def hashes(tokens, salt=None):
    return block_hashes(tokens, 4, salt)


def test_allocate_free_counts():
    pool = BlockPool(8, 4)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_in_use == 3 and pool.num_free == 5
    with pytest.raises(OutOfBlocks):
        pool.allocate(6)
    assert pool.num_in_use == 3, "a failed allocation must take nothing"
    pool.free(a)
    assert pool.num_free == 8 and pool.num_in_use == 0
    pool.check_invariants()
    with pytest.raises(ValueError):
        pool.free(a)


def test_prefix_cache_hit_and_sharing():
    pool = BlockPool(8, 4)
    toks = list(range(12))
    h = hashes(toks)
    a = pool.allocate(3)
    pool.cache_blocks(a, h)
    assert pool.drain_events() == [BlockStored(tuple(h))]
    # A second holder of the same prefix shares the blocks while the first still runs.
    m = pool.match_prefix(h)
    assert m.block_ids == tuple(a)
    pool.touch(m.block_ids)
    pool.free(a)
    assert pool.num_in_use == 3
    pool.free(list(m.block_ids))
    assert pool.num_cached == 3 and pool.num_free == 5 and pool.num_in_use == 0
    # Cached blocks are reusable after their holders are gone.
    assert pool.match_prefix(h[:2]).block_ids == tuple(a[:2])
    # A different prefix (or salt) shares nothing.
    assert pool.match_prefix(hashes([99] + toks[1:])).num_blocks == 0
    assert pool.match_prefix(hashes(toks, salt="tenant-b")).num_blocks == 0
    pool.check_invariants()


def test_lru_eviction_emits_removed_and_prefers_tail():
    pool = BlockPool(4, 4)
    h = hashes(list(range(16)))
    a = pool.allocate(4)
    pool.cache_blocks(a, h)
    pool.free(a)
    pool.drain_events()
    got = pool.allocate(1)
    # The prefix's tail is evicted first so the head stays useful.
    assert got == [a[3]]
    assert pool.drain_events() == [BlockRemoved((h[3],))]
    assert pool.match_prefix(h).block_ids == tuple(a[:3])
    pool.free(got)
    pool.check_invariants()


def test_touch_free_block_is_an_error():
    pool = BlockPool(2, 4)
    with pytest.raises(ValueError):
        pool.touch([0])


def test_duplicate_prefix_is_not_double_cached():
    pool = BlockPool(4, 4)
    h = hashes(list(range(4)))
    a, b = pool.allocate(1), pool.allocate(1)
    pool.cache_blocks(a, h)
    pool.cache_blocks(b, h)  # computed concurrently; the first stays the cached copy
    pool.free(a)
    pool.free(b)
    assert pool.num_cached == 1 and pool.num_free == 3
    pool.check_invariants()


def test_disabled_prefix_caching():
    pool = BlockPool(4, 4, enable_prefix_caching=False)
    h = hashes(list(range(4)))
    a = pool.allocate(1)
    pool.cache_blocks(a, h)
    pool.free(a)
    assert pool.match_prefix(h).num_blocks == 0 and pool.num_cached == 0
    pool.check_invariants()
