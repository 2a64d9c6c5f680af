"""The cluster KV index: which worker holds which block hash, fed by the workers' KV events
(BlockStored / BlockRemoved from their BlockPools). Exact, and bounded: past `max_hashes` the
least recently touched hashes are forgotten (a forgotten hash only costs a missed cache hit).

The router asks one question of it: for a request's chain of block hashes, how many leading
blocks does each worker already hold? Hashes chain the whole prefix (splitserve.hashing), so a
leading run of matches is exactly a cached prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Sequence

from splitserve.types import BlockRemoved, BlockStored, KVEvent
from splitserve.hashing import BlockHash


class KVIndex:
    def __init__(self, max_hashes: int = 1_000_000) -> None:
        if max_hashes <= 0:
            raise ValueError(f"max_hashes must be positive, got {max_hashes}")
        self.max_hashes = max_hashes
        self._holders: OrderedDict[BlockHash, set[str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._holders)

    def apply(self, worker_id: str, events: Iterable[KVEvent]) -> None:
        for ev in events:
            if isinstance(ev, BlockStored):
                for h in ev.block_hashes:
                    self._holders.setdefault(h, set()).add(worker_id)
                    self._holders.move_to_end(h)
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    self._discard(h, worker_id)
        while len(self._holders) > self.max_hashes:
            self._holders.popitem(last=False)

    def remove_worker(self, worker_id: str) -> None:
        """A worker left (or restarted with an empty cache): forget everything it held."""
        for h in [h for h, ws in self._holders.items() if worker_id in ws]:
            self._discard(h, worker_id)

    def _discard(self, h: BlockHash, worker_id: str) -> None:
        ws = self._holders.get(h)
        if ws is not None:
            ws.discard(worker_id)
            if not ws:
                del self._holders[h]

    def overlap(self, hashes: Sequence[BlockHash], workers: Iterable[str] | None = None) -> dict[str, int]:
        """Leading blocks of `hashes` each worker holds (workers holding none are omitted, unless
        listed in `workers`, which also restricts the answer)."""
        alive: set[str] | None = None
        out: dict[str, int] = {w: 0 for w in workers} if workers is not None else {}
        for depth, h in enumerate(hashes):
            ws = self._holders.get(h)
            if not ws:
                break
            alive = set(ws) if alive is None else alive & ws
            if workers is not None:
                alive &= out.keys()
            if not alive:
                break
            for w in alive:
                out[w] = depth + 1
            self._holders.move_to_end(h)
        return out
