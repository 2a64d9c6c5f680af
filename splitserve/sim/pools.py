"""SimPools: the simulated cluster's workers by role — what the Controller does on Ray: start a
worker (READY after `start_s`, the model load), scale a pool up or down (down: the least loaded
go DRAINING, out of placement at once, and STOP once idle), and the autoscaler's tick applying
its targets. GPUs are counted from a worker's start to its stop.

Nodes: `by-role` puts each pool on its own nodes of `workers_per_node` workers (the Helm chart's
prefill and decode worker groups), so a handoff always crosses nodes; `mixed` fills nodes in
the order workers start, whatever their role.
"""

from __future__ import annotations

from typing import Callable

from splitserve.sim.events import EventLoop
from splitserve.sim.router import SimRouter
from splitserve.sim.worker import SimWorker
from splitserve.types import Role, WorkerId, WorkerState

LAYOUTS = ("by-role", "mixed")


class SimPools:
    def __init__(self, loop: EventLoop, router: SimRouter, make_worker: Callable[[WorkerId, Role, str, int], SimWorker],
                 workers_per_node: int = 8, layout: str = "by-role", start_s: float = 30.0, drain_grace_s: float = 1.0
                 ) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"unknown node layout {layout!r}; known: {', '.join(LAYOUTS)}")
        self.loop, self.router, self._make = loop, router, make_worker
        self.workers_per_node, self.layout = workers_per_node, layout
        self.start_s, self.drain_grace_s = start_s, drain_grace_s
        self.workers: dict[WorkerId, SimWorker] = {}
        self.stopped: list[SimWorker] = []
        self._count = 0
        self._slots: dict[str, set[int]] = {}  # occupied slots per node group
        self.history: list[tuple[float, int, int]] = []  # (time, prefill READY, decode READY) at each change

    # -- sizes ------------------------------------------------------------------------------------
    def live(self, role: Role) -> list[SimWorker]:
        """Workers that count toward the pool's size: starting or ready (not draining)."""
        return [w for w in self.workers.values() if w.role is role and w.state in (WorkerState.STARTING, WorkerState.READY)]

    def ready(self, role: Role) -> list[SimWorker]:
        return [w for w in self.workers.values() if w.role is role and w.state is WorkerState.READY]

    def scale(self, role: Role, n: int) -> None:
        live = self.live(role)
        for _ in range(n - len(live)):
            self.start(role, self.start_s)
        if n < len(live):
            # the ones starting go first (nothing on them), then the least loaded
            live.sort(key=lambda w: (w.state is WorkerState.READY, _load(w), w.id))
            for w in live[: len(live) - n]:
                self.drain(w)

    def start(self, role: Role, after_s: float) -> SimWorker:
        group = role.value if self.layout == "by-role" else "node"
        used = self._slots.setdefault(group, set())
        slot = next(i for i in range(len(used) + 1) if i not in used)
        used.add(slot)
        self._count += 1
        node = f"{group}-{slot // self.workers_per_node}"
        w = self._make(WorkerId(role, f"{self._count:05d}"), role, node, slot)
        self.workers[w.id] = w
        if after_s > 0:
            self.loop.after(after_s, self._ready, w)
        else:
            self._ready(w)
        return w

    def _ready(self, w: SimWorker) -> None:
        if w.state is not WorkerState.STARTING:
            return
        w.state = WorkerState.READY
        self.router.add(w.id, w.role, w.node)
        w.report()
        self._record()

    def drain(self, w: SimWorker) -> None:
        if w.state is WorkerState.STARTING:  # never became READY: nothing to drain
            self._stop(w)
            return
        w.state = WorkerState.DRAINING
        self.router.drain(w.id)
        self._record()
        self._check_drained(w)

    def _check_drained(self, w: SimWorker) -> None:
        if w.state is not WorkerState.DRAINING:
            return
        if w.idle:
            self.loop.after(self.drain_grace_s, self._stop_if_idle, w)
        else:
            self.loop.after(1.0, self._check_drained, w)

    def _stop_if_idle(self, w: SimWorker) -> None:
        if w.state is WorkerState.DRAINING and w.idle:
            w.engine.check_invariants()
            self._stop(w)
        else:
            self._check_drained(w)

    def _stop(self, w: SimWorker) -> None:
        w.state = WorkerState.STOPPED
        w.stopped_at = self.loop.now
        self.router.remove(w.id)
        del self.workers[w.id]
        self._slots[w.role.value if self.layout == "by-role" else "node"].discard(w.slot)
        self.stopped.append(w)
        self._record()

    def _record(self) -> None:
        self.history.append((self.loop.now, len(self.ready(Role.PREFILL)), len(self.ready(Role.DECODE))))

    # -- accounting ------------------------------------------------------------------------------
    def gpu_seconds(self, until: float) -> float:
        return sum(w.held_s(until) * w.gpus for w in self.all_workers())

    def all_workers(self) -> list[SimWorker]:
        return list(self.workers.values()) + self.stopped


def _load(w: SimWorker) -> int:
    s = w.engine.scheduler
    return len(s.running) + len(s.waiting)
