"""A router replica's view of the cluster (DESIGN.md §4 "Ray": router replicas read the
registry and worker load in the background, never on the request path).

Two kinds of background task keep it fresh:
  * the registry watcher asks the Controller for the registry when its version changes (every
    `registry_interval_s`): workers that appear get a poller, workers that leave (drained,
    dead) leave placement and the KV index;
  * one poller per registered worker pulls its load and KV events (`snapshot`, at least once
    delivery, see worker/kv_events.py) every `load_interval_s`; one slow worker delays only
    its own view. A decode worker's poller
    first introduces this replica to it (`meet`, with `caller`: this replica's actor handle),
    alongside its first snapshot: under Ray, the first handle of an actor class to reach a
    process loads that class there — for an ingress replica, importing Ray Serve, 0.4 s
    measured — and would otherwise do so as the arguments of the first request's decode
    stream, between its first and second token.

Liveness (DESIGN.md §4 "Liveness"): a worker whose calls fail (its actor died, its engine
stopped) leaves placement at once, until it answers again; the Controller removes the dead ones.
A worker that is only *slow* — its poll or the Controller's probe unanswered for `slow_after_s`,
Ray unable to reach it for the moment, a request's stream silent on it — stays in placement
while no worker of its pool answers: the last ones of a pool are never dropped for slowness, so
a request waits for them (within its own timeouts; admission counts the silence so far in its
TTFT) rather than being refused. When another worker of the pool answers, the slow one takes
nothing new until it answers again. `ready()` is true exactly when `place` would place a request.

`place` runs the placement policy over these views without waiting on anything. It also counts
what this router placed on each worker and has not yet seen in that worker's reported load
(`Pending`), so a burst of simultaneous requests spreads over the pool instead of landing on
the worker that looked idle in the last snapshot. With a `SharedLoad` (Redis), the counts the
other router replicas placed are added in too, read in the background like everything else.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Protocol

from splitserve.router.snapshot import RegistrySnapshot, WorkerRecord
from splitserve.router.transport_choice import choose_transport
from splitserve.router.pending import Pending
from splitserve.router.policy import RouteRequest, Router, WorkerView
from splitserve.router.view_cache import ViewCache
from splitserve.types import PromptHashes, Request, Role, WorkerId, WorkerState, WorkerStats

log = logging.getLogger(__name__)


class RegistrySource(Protocol):
    async def fetch(self, known_version: int) -> RegistrySnapshot | None:
        """The registry if its version differs from `known_version`, else None."""


@dataclass
class Route:
    """Where one request runs: its prefill worker (None: the decode worker prefills it), its
    decode worker, the prompt tokens expected cached where it is prefilled, and the KV
    transport for the pair. Holds this router's pending counts until `close`."""

    prefill: WorkerRecord | None
    decode: WorkerRecord
    cached_tokens: int
    transport: str | None
    _directory: "Directory" = field(repr=False)
    hashes: PromptHashes | None = field(default=None, repr=False)  # the placed context's, as routed
    _tickets: dict = field(default_factory=dict, repr=False)

    def confirm(self, wid: WorkerId) -> None:
        """The worker has the request: from its next snapshot on, its own load counts it."""
        if wid in self._tickets:
            self._directory.pending.confirm(wid, self._tickets[wid])

    def close(self) -> None:
        for wid, t in self._tickets.items():
            self._directory.pending.done(wid, t)
        self._tickets.clear()


class Directory:
    def __init__(self, source: RegistrySource, policy: Router, block_size: int = 16,
                 registry_interval_s: float = 0.2, load_interval_s: float = 0.05, answer_timeout_s: float = 5.0,
                 slow_after_s: float = 1.0, clock=time.monotonic,
                 unreachable: Callable[[BaseException], bool] = lambda e: False) -> None:
        # slow_after_s: a poll unanswered this long marks its worker slow (the Controller's
        # probe_timeout_s); unreachable(e): a call's error that says the worker could not be
        # reached for the moment (Ray's ActorUnavailableError), slow rather than failed
        self.source, self.policy, self.block_size = source, policy, block_size
        self.registry_interval_s, self.load_interval_s, self.answer_timeout_s = (
            registry_interval_s, load_interval_s, answer_timeout_s)
        self.slow_after_s, self._unreachable = slow_after_s, unreachable
        self.router_id = uuid.uuid4().hex  # each router replica acknowledges KV events on its own
        self._clock = clock
        self.pending = Pending(clock=clock, on_change=self._stale)
        self._views = ViewCache(lambda wid: self.view(self.records[wid]), self.pending, clock)
        self.version = -1
        self.records: dict[WorkerId, WorkerRecord] = {}
        self._stats: dict[WorkerId, WorkerStats] = {}
        self._acked: dict[WorkerId, int] = {}
        self._seen_at: dict[WorkerId, float] = {}
        self._failed: set[WorkerId] = set()  # its calls fail: out of placement until it answers
        self._slow: set[WorkerId] = set()  # found slow here (a poll late, a stream silent) until it answers
        self._asked_at: dict[WorkerId, float] = {}  # when its poll now unanswered was sent
        self._brisk: dict[Role, bool] | None = None  # per pool: does a worker answer? (None: not known yet)
        self._pollers: dict[WorkerId, asyncio.Task] = {}
        self._watcher: asyncio.Task | None = None
        self.autoscale = None  # the Controller's last AutoscaleReport (None: fixed pools)
        self.shared = None  # ingress.shared.SharedLoad, set before start: the other replicas' pending counts (None: this one's only)
        self._sharer: asyncio.Task | None = None
        self.caller = None  # this replica's actor handle, introduced to each decode worker (None: a driver)
        self._introductions: set[asyncio.Task] = set()  # held until answered (nothing waits for them)

    # -- background -----------------------------------------------------------------------------
    async def start(self) -> None:
        """First registry read (waits for it), then the background tasks."""
        self.apply_registry(await self.source.fetch(self.version))
        self._watcher = asyncio.get_running_loop().create_task(self._watch_registry())
        if self.shared is not None:
            self._sharer = asyncio.get_running_loop().create_task(self.shared.run(self._my_pending, self._others_moved))

    def _my_pending(self) -> dict[str, int]:
        counts = {str(w): self.pending.count(w, self._seen_at.get(w)) for w in self.records}
        return {w: n for w, n in counts.items() if n}

    def _others_moved(self, workers: set[str]) -> None:
        for wid in self.records:
            if str(wid) in workers:
                self._stale(wid)

    def stop(self) -> None:
        for task in [self._watcher, self._sharer, *self._pollers.values(), *self._introductions]:
            if task is not None:
                task.cancel()
        self._pollers.clear()

    async def _watch_registry(self) -> None:
        while True:
            await asyncio.sleep(self.registry_interval_s)
            try:
                self.apply_registry(await self.source.fetch(self.version))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the Controller is away: keep routing on what we know
                log.warning("registry refresh failed: %s", e)

    def apply_registry(self, snap: RegistrySnapshot | None) -> None:
        if snap is None or snap.version == self.version:
            return
        self.version = snap.version
        self.autoscale = snap.autoscale
        records = {w.id: w for w in snap.workers if w.state in (WorkerState.READY, WorkerState.DRAINING)}
        for wid in set(self.records) - set(records):
            self._forget(wid)
            self._failed.discard(wid)
            self._slow.discard(wid)
            self._asked_at.pop(wid, None)
            task = self._pollers.pop(wid, None)
            if task is not None:
                task.cancel()
        self.records = records
        self._liveness_changed()
        for wid in records:
            if wid not in self._pollers:
                self._pollers[wid] = asyncio.get_running_loop().create_task(self._poll(wid))

    def _forget(self, wid: WorkerId) -> None:
        self._stale(wid)
        self._stats.pop(wid, None)
        self._acked.pop(wid, None)  # so its next answer is a full listing
        self._seen_at.pop(wid, None)
        self.pending.forget(wid)
        self.policy.index.remove_worker(wid)

    async def _poll(self, wid: WorkerId) -> None:
        self._introduce(wid)
        asked = None  # a call still unanswered is waited on again, never sent twice
        while wid in self.records:
            if asked is None:
                sent = self._clock()
                self._asked_at.setdefault(wid, sent)  # silent from the first call it has not answered
                asked = asyncio.ensure_future(self.records[wid].handle.snapshot.remote(self._acked.get(wid),
                                                                                      self.router_id))
            done, _ = await asyncio.wait({asked}, timeout=self.slow_after_s)
            if done:
                self._apply_snapshot(wid, asked, sent)
                asked = None
            else:
                self._set_slow(wid, True)
            await asyncio.sleep(self.load_interval_s)

    def _introduce(self, wid: WorkerId) -> None:
        """Send a decode worker this replica's handle (`meet`), once, as this replica learns of
        it; placement does not wait for it (a request placed meanwhile waits at most for the
        rest of the class's loading there, as it would have anyway)."""
        rec = self.records[wid]
        if self.caller is None or rec.role is not Role.DECODE:
            return
        task = asyncio.ensure_future(_answered(rec.handle.meet.remote(self.caller), self.answer_timeout_s))
        self._introductions.add(task)
        task.add_done_callback(self._introductions.discard)

    def _apply_snapshot(self, wid: WorkerId, answer: asyncio.Future, sent: float) -> None:
        if wid not in self.records:
            return
        try:
            snap = answer.result()
        except Exception as e:
            if self._unreachable(e):  # Ray could not reach it for the moment: slow, not failed
                self._set_slow(wid, True)
                return
            if wid not in self._failed:  # dead or failing: out of placement now, its cache forgotten
                log.warning("worker %s does not answer: %s", wid, type(e).__name__)
            self._mark(self._failed, wid, True)
            self._forget(wid)
            return
        self._asked_at.pop(wid, None)
        self._mark(self._failed, wid, False)
        self._set_slow(wid, False)
        self._stale(wid)
        self._stats[wid] = snap.stats
        self._acked[wid] = snap.seq
        self._seen_at[wid] = sent
        if snap.reset:
            self.policy.index.remove_worker(wid)
        self.policy.index.apply(wid, snap.events)

    # -- reading ----------------------------------------------------------------------------------
    def mark_failed(self, wid: WorkerId) -> None:
        """A request's call to this worker failed: out of placement until it answers again."""
        self._mark(self._failed, wid, True)

    def mark_silent(self, wid: WorkerId) -> None:
        """A request's call to this worker went unanswered past its timeout: slow until it
        answers again (out of placement only while another worker of its pool answers)."""
        self._set_slow(wid, True)

    def _set_slow(self, wid: WorkerId, slow: bool) -> None:
        if slow and wid in self.records and wid not in self._slow:
            log.warning("worker %s is slow: it has not answered for a while", wid)
        self._mark(self._slow, wid, slow)

    def _mark(self, marks: set[WorkerId], wid: WorkerId, on: bool) -> None:
        """Put a worker in or out of a liveness set: its view is built again, and every view of
        its pool when that changed whether any worker of the pool answers (the others' turn)."""
        if (wid in marks) == on or (on and wid not in self.records):
            return
        before = self._brisk_pools()[wid.role]
        (marks.add if on else marks.discard)(wid)
        self._brisk = None
        if self._brisk_pools()[wid.role] != before:  # every view of its pool may change
            self._stale()
        else:
            self._stale(wid)

    def _liveness_changed(self) -> None:
        """The registry changed: every view is built again."""
        self._brisk = None
        self._stale()

    def _brisk_pools(self) -> dict[Role, bool]:
        """Per pool, whether a worker of it is READY, its calls not failing, and not slow."""
        if self._brisk is None:
            self._brisk = {role: False for role in Role}
            for r in self.records.values():
                if r.state is WorkerState.READY and r.id not in self._failed and not self.slow(r.id):
                    self._brisk[r.role] = True
        return self._brisk

    def slow(self, wid: WorkerId) -> bool:
        """Whether the worker is slow: unanswered here, or to the Controller's probes."""
        rec = self.records.get(wid)
        return wid in self._slow or (rec is not None and rec.slow)

    def silence_s(self, wid: WorkerId) -> float:
        """How long the worker has left this router's poll unanswered (0: it answers)."""
        asked = self._asked_at.get(wid)
        return 0.0 if asked is None else max(0.0, self._clock() - asked)

    def wait_s(self, wid: WorkerId) -> float:
        """What a request placed on the worker now waits before it is even heard: a slow
        worker's silence so far (admission adds it to its TTFT), else 0."""
        return self.silence_s(wid) if self.slow(wid) else 0.0

    def stats(self, wid: WorkerId) -> WorkerStats | None:
        return self._stats.get(wid)

    def view(self, rec: WorkerRecord) -> WorkerView:
        wid = rec.id
        pending = self.pending.count(wid, self._seen_at.get(wid))
        if self.shared is not None:
            pending += self.shared.others.get(str(wid), 0)
        return WorkerView.of(wid, rec.role, rec.node_ip, self._stats.get(wid), pending, self._placeable(rec),
                             rec.state is WorkerState.DRAINING, self.slow(wid))

    def _placeable(self, rec: WorkerRecord) -> bool:
        """READY, its calls not failing, and not slow — or slow with no worker of its pool
        answering (the last ones are never dropped for slowness)."""
        if rec.state is not WorkerState.READY or rec.id in self._failed:
            return False
        return not self.slow(rec.id) or not self._brisk_pools()[rec.role]

    def views(self, role: Role | None = None) -> tuple[WorkerView, ...]:
        """The workers' views (of one role), the same objects until a worker's facts change:
        the policy re-scores only the views that are new (router/policy.py Pool)."""
        return self._views.pool(role, lambda: (r.id for r in self.records.values() if role is None or r.role is role))

    def _stale(self, wid: WorkerId | None = None) -> None:
        """A worker's facts changed (None: any worker's): its view is built again when next asked."""
        self._views.stale(wid)

    def ready(self) -> bool:
        """Whether a request sent now would be placed: a decode worker in placement (up: READY,
        not failing, not draining; `place` raises NoCapacity exactly when there is none)."""
        return any(v.up for v in self.views(Role.DECODE))

    # -- placing ----------------------------------------------------------------------------------
    def route_request(self, req: Request) -> RouteRequest:
        """The policy's view of `req`: its block hashes, computed here once (or carried by a
        request placed again) and then carried to the engines in the Route."""
        ph = req.prompt_hashes
        if ph is not None and ph.block_size == self.block_size:
            hashes = ph.hashes
        else:  # as far as any worker may hold the prefix; the engine hashes the rest
            hashes = self.policy.index.routable_hashes(req.prompt_token_ids, self.block_size, req.cache_salt)
        return RouteRequest(req.request_id, len(req.prompt_token_ids), hashes, self.block_size)

    def place(self, req: Request, route_req: RouteRequest | None = None,
              exclude: frozenset[WorkerId] = frozenset()) -> Route:
        """The policy's placement over the current views (raises NoCapacity), counted as pending
        on the workers it names. `exclude`: workers that already failed this request."""
        def views(role: Role) -> tuple[WorkerView, ...]:
            every = self.views(role)
            return tuple(v for v in every if v.worker_id not in exclude) if exclude else every

        rr = route_req or self.route_request(req)
        pl = self.policy.place(rr, views(Role.PREFILL), views(Role.DECODE))
        p = self.records[pl.prefill] if pl.prefill is not None else None
        d = self.records[pl.decode]
        transport = None
        if p is not None:
            transport = choose_transport(p.node_ip == d.node_ip, p.info.transports, d.info.transports)
        route = Route(p, d, pl.cached_tokens, transport, self, PromptHashes(rr.block_size, rr.block_hashes))
        for rec in (p, d):
            if rec is not None:
                route._tickets[rec.id] = self.pending.add(rec.id)
        return route


async def _answered(call, timeout_s: float) -> None:
    """Wait a while for a call nobody needs the answer of (a worker that fails it fails its
    snapshots too, and leaves placement by them)."""
    try:
        await asyncio.wait_for(asyncio.ensure_future(call), timeout_s)
    except Exception:  # failed or slow: nothing depends on it
        pass
