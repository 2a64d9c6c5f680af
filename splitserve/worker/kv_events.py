"""KV events from a worker to the router, delivered at least once (DESIGN.md §3: the router's
KV index is fed by the workers' BlockStored / BlockRemoved events).

The worker keeps what it sent until the router acknowledges it: each reply carries a sequence
number, the router's next request carries the last one it applied, and everything up to it is
dropped. A lost reply (an actor call that failed, a cancelled refresh) therefore loses nothing;
events sent twice are applied twice, which is harmless (both kinds are idempotent, and order is
kept). The worker answers with one full listing of its cache, flagged `reset` (forget this
worker, then apply), to a router that knows nothing of it yet (no ack: a new or restarted
router, or one that forgot the worker after a failed call), to an ack it never issued, and
when a router that stopped asking let the backlog pass `limit` hashes. Each router (an ingress
replica keeps its own index) has its own outbox (`RouterOutboxes`).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, NamedTuple

from splitserve.types import KVEvent, WorkerStats


class Snapshot(NamedTuple):
    stats: WorkerStats
    seq: int  # acknowledge with this in the next request
    events: list[KVEvent]  # not acknowledged yet, oldest first
    reset: bool  # the events list the whole cache: forget what this worker held before applying


class Outgoing(NamedTuple):
    seq: int
    events: list[KVEvent]
    reset: bool


class EventOutbox:
    """One router's view of one worker's events (see the module docstring)."""

    def __init__(self, limit: int = 200_000) -> None:
        self.limit = limit
        self._batches: deque[tuple[int, list[KVEvent]]] = deque()
        self._size = 0  # hashes in _batches
        self._seq = 0
        self._overflowed = False  # the backlog was dropped: a listing is owed
        self._reset_seq: int | None = None  # a listing was sent: owed again until the router acks this

    def record(self, new: list[KVEvent]) -> None:
        if not new:
            return
        self._seq += 1
        self._batches.append((self._seq, new))
        self._size += _hashes(new)
        if self._size > self.limit:  # memory stays bounded whether or not the router asks
            self._batches.clear()
            self._size = 0
            self._overflowed = True

    def take(self, ack: int | None, listing: Callable[[], list[KVEvent]]) -> Outgoing:
        """Drop what `ack` covers, say what to send."""
        unknown = ack is None or ack > self._seq  # the router has nothing of ours to build on
        if not unknown:
            while self._batches and self._batches[0][0] <= ack:
                self._size -= _hashes(self._batches.popleft()[1])
            if self._reset_seq is not None and ack >= self._reset_seq:
                self._reset_seq = None
        if unknown or self._overflowed or self._reset_seq is not None:
            # the listing is the current state: it subsumes every batch, sent or not
            self._batches.clear()
            self._size = 0
            self._overflowed = False
            self._seq += 1
            self._reset_seq = self._seq
            return Outgoing(self._seq, listing(), True)
        return Outgoing(self._seq, [ev for _, batch in self._batches for ev in batch], False)


class RouterOutboxes:
    """An outbox per router, so that several ingress replicas, each keeping its own KV index,
    acknowledge independently. Events drained from the engine go to every outbox; one whose
    router has been silent for `idle_s` is dropped (should it come back, it gets a listing)."""

    def __init__(self, idle_s: float = 300.0, limit: int = 200_000) -> None:
        self.idle_s, self.limit = idle_s, limit
        self._boxes: dict[str, tuple[EventOutbox, float]] = {}

    def take(self, router: str, ack: int | None, new: list[KVEvent], listing: Callable[[], list[KVEvent]],
             now: float | None = None) -> Outgoing:
        now = time.monotonic() if now is None else now
        self._boxes = {r: (box, seen) for r, (box, seen) in self._boxes.items() if now - seen <= self.idle_s}
        for box, _ in self._boxes.values():
            box.record(new)
        box = self._boxes[router][0] if router in self._boxes else EventOutbox(self.limit)
        self._boxes[router] = (box, now)
        return box.take(ack, listing)

    def __len__(self) -> int:
        return len(self._boxes)


def _hashes(events: list[KVEvent]) -> int:
    return sum(len(ev.block_hashes) for ev in events)
