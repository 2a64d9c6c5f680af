"""The simulator's clock: a heap of timed callbacks, run in time order (ties in the order they
were scheduled, so a run is deterministic)."""

from __future__ import annotations

import heapq
import itertools
from typing import Callable


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self.events = 0  # callbacks run
        self._heap: list = []
        self._seq = itertools.count()

    def at(self, t: float, fn: Callable, *args) -> None:
        if t < self.now:
            raise ValueError(f"an event at {t} is in the past (now {self.now})")
        heapq.heappush(self._heap, (t, next(self._seq), fn, args))

    def after(self, dt: float, fn: Callable, *args) -> None:
        if dt < 0:
            raise ValueError(f"an event {dt} s in the past")
        heapq.heappush(self._heap, (self.now + dt, next(self._seq), fn, args))

    def run(self, until: float = float("inf")) -> None:
        heap, pop = self._heap, heapq.heappop
        while heap and heap[0][0] <= until:
            t, _, fn, args = pop(heap)
            self.now = t
            self.events += 1
            fn(*args)

    def __len__(self) -> int:
        return len(self._heap)
