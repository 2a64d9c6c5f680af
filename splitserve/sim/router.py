"""SimRouter: one router replica's view of the simulated pools, running the real placement
policy (router/policy.py: filters, scorers, the PD decider) over the real KV index fed with the
workers' KV events, the real `Pending` counts, `WorkerView.of` and `ViewCache`, as
router/directory.py does on a Ray cluster — only the snapshots arrive by simulated reports
instead of polls."""

from __future__ import annotations

from splitserve.router.pending import Pending
from splitserve.router.policy import Placement, RouteRequest, Router, WorkerView
from splitserve.router.view_cache import ViewCache
from splitserve.types import Request, Role, WorkerId, WorkerState, WorkerStats


class SimRouter:
    def __init__(self, policy: Router, clock, block_size: int) -> None:
        self.policy, self.block_size = policy, block_size
        self.pending = Pending(clock=clock, on_change=self._stale)
        self._views = ViewCache(self._view, self.pending, clock)
        self.hosts: dict[WorkerId, str] = {}
        self.roles: dict[WorkerId, Role] = {}
        self.states: dict[WorkerId, WorkerState] = {}
        self.stats: dict[WorkerId, WorkerStats] = {}
        self._seen_at: dict[WorkerId, float] = {}
        self.decisions = 0

    # -- the registry: what the Controller's snapshot would say -----------------------------------
    def add(self, wid: WorkerId, role: Role, host: str) -> None:
        self.hosts[wid], self.roles[wid], self.states[wid] = host, role, WorkerState.READY
        self._stale(wid)

    def drain(self, wid: WorkerId) -> None:
        self.states[wid] = WorkerState.DRAINING
        self._stale(wid)

    def remove(self, wid: WorkerId) -> None:
        for d in (self.hosts, self.roles, self.states, self.stats, self._seen_at):
            d.pop(wid, None)
        self.pending.forget(wid)
        self.policy.index.remove_worker(wid)
        self._stale(wid)

    def report(self, wid: WorkerId, stats: WorkerStats, events: list, sent_at: float) -> None:
        """A worker's snapshot: its load and the KV events since the last one."""
        if wid not in self.states:
            return
        self.stats[wid] = stats
        self._seen_at[wid] = sent_at
        if events:
            self.policy.index.apply(wid, events)
        self._stale(wid)

    # -- placing ----------------------------------------------------------------------------------
    def route_request(self, req: Request) -> RouteRequest:
        ph = req.prompt_hashes
        hashes = ph.hashes if ph is not None and ph.block_size == self.block_size else ()
        return RouteRequest(req.request_id, len(req.prompt_token_ids), hashes, self.block_size)

    def place(self, rr: RouteRequest) -> tuple[Placement, dict[WorkerId, int]]:
        """The policy's placement (raises NoCapacity) and the pending tickets it holds."""
        self.decisions += 1
        pl = self.policy.place(rr, self.views(Role.PREFILL), self.views(Role.DECODE))
        tickets = {w: self.pending.add(w) for w in (pl.prefill, pl.decode) if w is not None}
        return pl, tickets

    def views(self, role: Role) -> tuple[WorkerView, ...]:
        return self._views.pool(role, lambda: (w for w, r in self.roles.items() if r is role))

    def _view(self, wid: WorkerId) -> WorkerView:
        pending = self.pending.count(wid, self._seen_at.get(wid))
        return WorkerView.of(wid, self.roles[wid], self.hosts[wid], self.stats.get(wid), pending, True,
                             self.states[wid] is WorkerState.DRAINING)

    def _stale(self, wid: WorkerId | None = None) -> None:
        self._views.stale(wid)
