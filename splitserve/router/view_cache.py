"""`ViewCache`: a router's views of its workers, each built once per change of that worker's
facts, and each pool's tuple of them once per change of any — the policy re-scores only the views
that are new objects (router/policy.py `Pool`). A view carries the worker's `Pending` count, which
also drops by itself when an unconfirmed placement lapses, so the cache empties at the earliest
such moment. The Directory and the simulator's router keep their views in one. Pure Python."""

from __future__ import annotations

from typing import Callable, Hashable, Iterable

from splitserve.router.pending import Pending
from splitserve.router.policy import WorkerView
from splitserve.types import WorkerId


class ViewCache:
    def __init__(self, build: Callable[[WorkerId], WorkerView], pending: Pending, clock) -> None:
        self._build, self._pending, self._clock = build, pending, clock
        self._views: dict[WorkerId, WorkerView] = {}
        self._pools: dict[Hashable, tuple[WorkerView, ...]] = {}
        self._lapse = float("inf")  # when some cached view's pending count drops by itself

    def pool(self, key: Hashable, ids: Callable[[], Iterable[WorkerId]]) -> tuple[WorkerView, ...]:
        """The views of the workers `ids()` names, the same tuple until one of them changes."""
        if self._clock() >= self._lapse:
            self.stale()
        got = self._pools.get(key)
        if got is None:  # the views that did not change are reused as they are
            cached, view = self._views, self._view
            got = self._pools[key] = tuple(cached.get(w) or view(w) for w in ids())
        return got

    def _view(self, wid: WorkerId) -> WorkerView:
        v = self._views[wid] = self._build(wid)
        self._lapse = min(self._lapse, self._pending.lapses_at(wid))
        return v

    def stale(self, wid: WorkerId | None = None) -> None:
        """A worker's facts changed (None: any worker's): its view is built again when next asked."""
        if wid is None:
            self._views.clear()
            self._lapse = float("inf")
        else:
            self._views.pop(wid, None)
        self._pools.clear()
