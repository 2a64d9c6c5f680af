"""`Pending`: the placements a router made that a worker's reported load may not show yet.

A worker's load arrives as snapshots, late and at intervals (router/directory.py polls them;
the simulator hands them on its own clock); without these counts a burst of simultaneous
requests would all see the worker that looked idle in the last snapshot. Pure Python.
"""

from __future__ import annotations

import itertools
import time

from splitserve.types import WorkerId


class Pending:
    """Placements this router made that a worker's reported load may not show yet. An entry
    counts until the worker confirms it has the request and a snapshot sent after that
    confirmation has been applied, or until the request ends; one never confirmed (a plan that
    was refused or never ran) lapses after `ttl_s`."""

    def __init__(self, ttl_s: float = 2.0, clock=time.monotonic, on_change=lambda wid: None) -> None:
        self.ttl_s, self._clock = ttl_s, clock
        self._on_change = on_change  # a worker's count may have changed
        self._entries: dict[WorkerId, dict[int, list]] = {}  # worker -> ticket -> [placed_at, confirmed_at]
        self._tickets = itertools.count()

    def add(self, wid: WorkerId) -> int:
        t = next(self._tickets)
        self._entries.setdefault(wid, {})[t] = [self._clock(), None]
        self._on_change(wid)
        return t

    def confirm(self, wid: WorkerId, ticket: int) -> None:
        e = self._entries.get(wid, {}).get(ticket)
        if e is not None and e[1] is None:
            e[1] = self._clock()
            self._on_change(wid)

    def done(self, wid: WorkerId, ticket: int) -> None:
        if self._entries.get(wid, {}).pop(ticket, None) is not None:
            self._on_change(wid)

    def lapses_at(self, wid: WorkerId) -> float:
        """When the worker's count next drops by itself (an unconfirmed entry's ttl ends)."""
        return min((placed + self.ttl_s for placed, confirmed in self._entries.get(wid, {}).values()
                    if confirmed is None), default=float("inf"))

    def count(self, wid: WorkerId, seen_at: float | None) -> int:
        now, entries = self._clock(), self._entries.get(wid, {})
        for t, (placed, confirmed) in list(entries.items()):
            if (confirmed is None and now - placed > self.ttl_s) or (
                    confirmed is not None and seen_at is not None and seen_at > confirmed):
                del entries[t]
        return len(entries)

    def forget(self, wid: WorkerId) -> None:
        self._entries.pop(wid, None)
        self._on_change(wid)
