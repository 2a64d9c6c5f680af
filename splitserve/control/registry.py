"""The worker registry (DESIGN.md §4 "Ray"): every worker the Controller made, with its stable
id, where it runs, how to reach its KV cache, and its state. Pure Python: the Controller is
the only writer; router replicas read `snapshot()`s of it, versioned so an unchanged registry
costs them nothing.

A worker's life: STARTING (actor created, model loading) → READY (registered: node, endpoints)
→ DRAINING (out of placement, finishing what it holds) → STOPPED; DEAD from any live state
(its actor died, its engine stopped, or it stayed silent past `dead_after_s`; merely slow — a
probe unanswered for a moment — it stays READY, marked `silent_since`). Every change bumps
`version`; a transition the state machine does not allow raises, so a bookkeeping bug cannot
silently resurrect a worker.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import Any, Iterator

from splitserve.types import Role, WorkerId, WorkerLoad, WorkerState
from splitserve.router.snapshot import RegistrySnapshot, WorkerRecord

S = WorkerState
ALLOWED = {
    S.STARTING: {S.READY, S.STOPPED, S.DEAD},
    S.READY: {S.DRAINING, S.DEAD},
    S.DRAINING: {S.STOPPED, S.DEAD},
    S.STOPPED: set(),
    S.DEAD: set(),
}


class IllegalTransition(RuntimeError):
    pass


class Registry:
    def __init__(self, history: int = 64) -> None:
        self.version = 0
        self._live: dict[WorkerId, WorkerRecord] = {}
        self._ended: deque[WorkerRecord] = deque(maxlen=history)  # STOPPED / DEAD, newest last

    def __iter__(self) -> Iterator[WorkerRecord]:
        return iter(list(self._live.values()))

    def __getitem__(self, wid: WorkerId) -> WorkerRecord:
        return self._live[wid]

    def __contains__(self, wid: WorkerId) -> bool:
        return wid in self._live

    def restore(self, records: list[WorkerRecord], version: int) -> None:
        """A restarted Controller's registry: the live workers it found again, under a version
        past every one routers have seen (so they all refresh)."""
        self._live = {r.id: r for r in records}
        self.version = version + 1

    def record_lost(self, rec: WorkerRecord, reason: str) -> None:
        """A worker a restarted Controller could not find again: DEAD, in the history."""
        self._ended.append(dataclasses.replace(rec, state=S.DEAD, handle=None, since=time.time(), reason=reason))
        self.version += 1

    def add(self, wid: WorkerId, handle: Any) -> WorkerRecord:
        if wid in self._live:
            raise IllegalTransition(f"{wid} is registered already")
        rec = WorkerRecord(wid, S.STARTING, handle, since=time.time())
        self._live[wid] = rec
        self.version += 1
        return rec

    def move(self, wid: WorkerId, state: WorkerState, **changes: Any) -> WorkerRecord:
        rec = self._live[wid]
        if state not in ALLOWED[rec.state]:
            raise IllegalTransition(f"{wid}: {rec.state.value} → {state.value} is not a worker transition")
        rec = dataclasses.replace(rec, state=state, since=time.time(), **changes)
        if state.live:
            self._live[wid] = rec
        else:
            del self._live[wid]
            self._ended.append(dataclasses.replace(rec, handle=None))
        self.version += 1
        return rec

    def observe(self, wid: WorkerId, load: WorkerLoad) -> None:
        """A probe's answer: load only, not a change routers need (no version bump)."""
        if wid in self._live:
            self._live[wid] = dataclasses.replace(self._live[wid], load=load)

    def set_silent(self, wid: WorkerId, since: float | None) -> None:
        """A probe went unanswered (`since`: when it was sent, time.time()) or answered again
        (None). Only a flip is a change routers need (version bump): how long it has been silent
        is read off `since`."""
        rec = self._live.get(wid)
        if rec is not None and rec.slow != (since is not None):
            self._live[wid] = dataclasses.replace(rec, silent_since=since)
            self.version += 1

    def pool(self, role: Role, *states: WorkerState) -> list[WorkerRecord]:
        return [w for w in self._live.values() if w.role is role and (not states or w.state in states)]

    def ended(self) -> list[WorkerRecord]:
        return list(self._ended)

    def touch(self) -> None:
        """Something routers read beside the workers changed (the autoscaler decided)."""
        self.version += 1

    def snapshot(self, targets: dict[Role, int], autoscale: Any = None, epoch: str = "") -> RegistrySnapshot:
        return RegistrySnapshot(self.version, tuple(self._live.values()), tuple(sorted(targets.items())), autoscale,
                                epoch)

    def check_invariants(self) -> None:
        for wid, rec in self._live.items():
            if rec.id != wid or not rec.state.live:
                raise AssertionError(f"registry entry {wid} holds {rec}")
            if rec.state is not S.STARTING and rec.info is None:
                raise AssertionError(f"{wid} is {rec.state.value} without registration info")
