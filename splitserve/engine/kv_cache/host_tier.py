"""HostTier: a bounded second KV pool in host memory, below the device BlockPool, keyed by the
same block hashes. Mechanism only.

A cached block the device pool evicts (to reuse its memory) is copied here instead of lost
(`save`, the pool's eviction hook). A later prefix that runs on past the device pool's match into
blocks held here gets them back (`promote`): copied into fresh device blocks, cached there, and
reused as a device hit would be, instead of recomputed. The tiers are exclusive: a promoted block
leaves the host tier (its device copy is the cached one again); the host tier evicts its least
recently saved block when full. Its changes are KV events with `tier=Tier.HOST`, so routers know
where a worker's blocks are. On CUDA the host storage is pinned memory; on CPU it is a second,
larger pool in the same RAM — nothing is recomputed, only copied.

Every host slot is either free or holds exactly one hash: `free + held == capacity`, always.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch

from splitserve.engine.kv_cache.block_pool import BlockPool
from splitserve.hashing import BlockHash
from splitserve.types import BlockRemoved, BlockStored, KVEvent, Tier


class HostTier:
    def __init__(self, num_blocks: int, device_storage: torch.Tensor) -> None:
        if num_blocks <= 0:
            raise ValueError(f"host tier needs a positive number of blocks, got {num_blocks}")
        self.device_storage = device_storage  # [layers, 2, blocks, block_size, kv_heads, head_dim]
        shape = (*device_storage.shape[:2], num_blocks, *device_storage.shape[3:])
        pin = device_storage.device.type == "cuda"
        self.storage = torch.empty(shape, dtype=device_storage.dtype, pin_memory=pin)
        self.num_blocks = num_blocks
        self._slot: OrderedDict[BlockHash, int] = OrderedDict()  # oldest saved first
        self._free = list(range(num_blocks - 1, -1, -1))
        self._events: list[KVEvent] = []  # in order: a hash may leave and come back within one drain
        self.saved_total = self.promoted_total = 0

    def __len__(self) -> int:
        return len(self._slot)

    def __contains__(self, h: BlockHash) -> bool:
        return h in self._slot

    def save(self, block: int, h: BlockHash) -> None:
        """The device pool evicts `block` (holding prefix `h`): keep a copy. Called before the
        block is reused, so its content is still `h`'s."""
        if h in self._slot:
            self._slot.move_to_end(h)
            return
        if not self._free:
            if not self._slot:  # every slot is being promoted right now: this block is not kept
                return
            old, slot = self._slot.popitem(last=False)
            self._emit(BlockRemoved, [old])
            self._free.append(slot)
        slot = self._free.pop()
        self.storage[:, :, slot].copy_(self.device_storage[:, :, block])
        self._slot[h] = slot
        self._emit(BlockStored, [h])
        self.saved_total += 1

    def promote(self, pool: BlockPool, matched: Sequence[int], rest: Sequence[BlockHash]) -> tuple[int, ...]:
        """Device blocks, cached in `pool`, holding the leading run of `rest` (the hashes right
        after the device match `matched`) that this tier holds; () when none, or when the pool
        cannot spare the blocks without evicting the match itself."""
        n = 0
        for h in rest:
            if h not in self._slot or pool.has(h):
                break
            n += 1
        if n == 0 or pool.num_available - pool.count_available(matched) < n:
            return ()
        hashes = list(rest[:n])
        slots = [self._slot.pop(h) for h in hashes]  # out of the LRU: the allocation's saves cannot take them
        pool.touch(matched)  # nor may the allocation evict the device part of the match
        blocks = pool.allocate(n)
        index = torch.tensor(blocks, dtype=torch.int64)
        src = self.storage[:, :, torch.tensor(slots, dtype=torch.int64)]
        self.device_storage.index_copy_(2, index.to(self.device_storage.device), src.to(self.device_storage.device))
        pool.cache_blocks(blocks, hashes)
        pool.free(list(matched) + blocks)
        self._free.extend(slots)
        self._emit(BlockRemoved, hashes)
        self.promoted_total += n
        return tuple(blocks)

    def reset(self) -> None:
        """Forget every block and the counters (the engine's warm-up leaves no trace)."""
        self.saved_total = self.promoted_total = 0
        if self._slot:
            self._emit(BlockRemoved, list(self._slot))
        self._free.extend(self._slot.values())
        self._slot.clear()

    def _emit(self, kind: type, hashes: list[BlockHash]) -> None:
        last = self._events[-1] if self._events else None
        if type(last) is kind:  # consecutive changes of one kind: one event
            self._events[-1] = kind(last.block_hashes + tuple(hashes), Tier.HOST)
        else:
            self._events.append(kind(tuple(hashes), Tier.HOST))

    def drain_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def held_hashes(self) -> tuple[BlockHash, ...]:
        return tuple(self._slot)

    def check_invariants(self) -> None:
        slots = list(self._slot.values())
        if len(set(slots)) != len(slots):
            raise AssertionError("two hashes share a host slot")
        if set(slots) & set(self._free) or len(slots) + len(self._free) != self.num_blocks:
            raise AssertionError(f"host slots: {len(slots)} held + {len(self._free)} free != {self.num_blocks}")
