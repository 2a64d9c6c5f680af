"""BlockPool: the KV-cache block allocator, prefix cache and event source. Mechanism only.

Every block is in exactly one of three states:
  in use  — ref_count > 0 (held by one or more running sequences; shared prefixes share blocks)
  cached  — ref_count == 0 and the block holds a full, hashed block of some prefix: reusable by
            a later request with the same prefix, evictable (LRU) when memory is needed
  free    — ref_count == 0 and no hash
`free + cached + in_use == total`, always; after a drain `in_use == 0`.

Free and cached blocks share one LRU queue (oldest first); allocation takes from its head and
evicts a cached block's hash as it goes. Stored/removed hashes are recorded as `KVEvent`s for the
router's cluster-wide index. Who gets blocks, and when to preempt, is the scheduler's business.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from splitserve.hashing import BlockHash
from splitserve.types import BlockRemoved, BlockStored, KVEvent  # noqa: F401 (re-exported)


class OutOfBlocks(RuntimeError):
    """Not enough free or evictable blocks; nothing was allocated."""


@dataclass(frozen=True)
class PrefixMatch:
    block_ids: tuple[int, ...]  # cached blocks holding the longest matching prefix, in order

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._events: list[KVEvent] = []
        self._num_cached = 0  # available blocks that carry a hash (kept, not recounted)
        # called with (block, hash) as a cached block is evicted, before it is reused (a host tier's save)
        self.on_evict: Callable[[int, BlockHash], None] | None = None

    # -- counts -------------------------------------------------------------------------------
    @property
    def num_available(self) -> int:
        """Blocks allocate() can hand out now (free + cached)."""
        return len(self._lru)

    @property
    def num_cached(self) -> int:
        return self._num_cached

    @property
    def num_free(self) -> int:
        return len(self._lru) - self.num_cached

    @property
    def num_in_use(self) -> int:
        return self.num_blocks - len(self._lru)

    # -- allocation ----------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        if n > len(self._lru):
            raise OutOfBlocks(f"need {n} blocks, {len(self._lru)} available")
        out = []
        removed = []
        for _ in range(n):
            block, _ = self._lru.popitem(last=False)
            h = self._hash[block]
            if h is not None:
                self._num_cached -= 1
                self._hash[block] = None
                del self._cached[h]
                removed.append(h)
                if self.on_evict is not None:
                    self.on_evict(block, h)
            self._ref[block] = 1
            out.append(block)
        if removed:
            self._events.append(BlockRemoved(tuple(removed)))
        return out

    def match_prefix(self, hashes: Sequence[BlockHash]) -> PrefixMatch:
        """Longest run of leading hashes present in the cache. Takes no references."""
        if not self.enable_prefix_caching:
            return PrefixMatch(())
        ids = []
        for h in hashes:
            b = self._cached.get(h)
            if b is None:
                break
            ids.append(b)
        return PrefixMatch(tuple(ids))

    def has(self, h: BlockHash) -> bool:
        """Whether a block holds prefix `h` (in use or reusable)."""
        return h in self._cached

    def count_available(self, block_ids: Iterable[int]) -> int:
        """How many of these blocks sit in the free/cached queue (touching them shrinks it)."""
        return sum(1 for b in block_ids if self._ref[b] == 0)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cached or in-use blocks (a prefix hit)."""
        for b in block_ids:
            if self._ref[b] == 0:
                if self._hash[b] is None:
                    raise ValueError(f"block {b} is free, not cached: cannot share it")
                del self._lru[b]
                self._num_cached -= 1
            self._ref[b] += 1

    def cache_blocks(self, block_ids: Sequence[int], hashes: Sequence[BlockHash]) -> None:
        """Mark full, computed blocks as holding the prefixes `hashes` (same order)."""
        if not self.enable_prefix_caching:
            return
        stored = []
        for b, h in zip(block_ids, hashes, strict=True):
            if self._ref[b] <= 0:
                raise ValueError(f"block {b} is not in use: only a holder can cache it")
            if self._hash[b] is not None or h in self._cached:
                continue  # already cached, or another block computed the same prefix first
            self._hash[b] = h
            self._cached[h] = b
            stored.append(h)
        if stored:
            self._events.append(BlockStored(tuple(stored)))

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block. Pass a sequence's blocks in order: they are queued
        last-block-first so that, among equals, a prefix's tail is evicted before its head."""
        for b in reversed(block_ids):
            if self._ref[b] <= 0:
                raise ValueError(f"block {b} freed more often than allocated")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._lru[b] = None
                self._num_cached += self._hash[b] is not None

    def reset_prefix_cache(self) -> None:
        removed = [h for h in self._cached if self._ref[self._cached[h]] == 0]
        for h in removed:
            self._hash[self._cached.pop(h)] = None
        self._num_cached = 0
        if removed:
            self._events.append(BlockRemoved(tuple(removed)))

    def cached_hashes(self) -> tuple[BlockHash, ...]:
        """Every hash this pool holds a block for (in use or reusable): a full KV-index listing."""
        return tuple(self._cached)

    def drain_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def check_invariants(self) -> None:
        """free + cached + in_use == total, and every index agrees with every other."""
        # C-speed passes (map / count): the simulator checks thousands of pools at the end of a run
        ref, hashes, lru = self._ref, self._hash, self._lru
        if min(ref) < 0:
            raise AssertionError("negative reference count")
        in_use = len(ref) - ref.count(0)
        if in_use + len(lru) != self.num_blocks:
            raise AssertionError(f"in_use {in_use} + available {len(lru)} != total {self.num_blocks}")
        if any(map(ref.__getitem__, lru)):
            b = next(b for b in lru if ref[b])
            raise AssertionError(f"block {b} is queued as available but has ref {ref[b]}")
        for h, b in self._cached.items():
            if hashes[b] != h:
                raise AssertionError(f"cache index says block {b} holds a hash it does not")
        if len(lru) - list(map(hashes.__getitem__, lru)).count(None) != self._num_cached:
            raise AssertionError("cached-block counter disagrees with the queue")
        if len(hashes) - hashes.count(None) != len(self._cached):
            raise AssertionError("a block carries a hash missing from the cache index")
