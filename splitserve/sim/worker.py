"""SimWorker: one simulated worker — a SimEngine stepping on the simulated clock, its lifecycle
state (the registry's STARTING → READY → DRAINING → STOPPED), and its load reports to the
router, at most one per `report_interval_s` as the Directory's poller takes them."""

from __future__ import annotations

from typing import Callable

from splitserve.engine.scheduler import SchedulerOutput
from splitserve.sim.engine import SimEngine
from splitserve.sim.events import EventLoop
from splitserve.types import Request, Role, TokenChunk, WorkerId, WorkerState, WorkerStats


class HostCPU:
    """The cores of one node that its workers share (CPU serving): a step that starts while more
    workers step than there are cores runs that much slower (processor sharing, fixed for the
    step at its start). GPU workers have none: each has its device."""

    def __init__(self, cores: int) -> None:
        self.cores, self.stepping = cores, 0

    def start(self) -> float:
        self.stepping += 1
        return max(1.0, self.stepping / self.cores)

    def stop(self) -> None:
        self.stepping -= 1


class SimWorker:
    def __init__(self, wid: WorkerId, role: Role, node: str, slot: int, engine: SimEngine, loop: EventLoop,
                 on_chunk: Callable[["SimWorker", TokenChunk], None],
                 on_report: Callable[["SimWorker", WorkerStats, list, float], None],
                 report_interval_s: float = 0.05, host: HostCPU | None = None, gpus: int = 1) -> None:
        self.id, self.role, self.node, self.slot, self.host = wid, role, node, slot, host
        self.gpus = gpus  # a tensor-parallel worker holds several
        self.engine, self.loop = engine, loop
        self.state = WorkerState.STARTING
        self._on_chunk, self._on_report = on_chunk, on_report
        self.report_interval_s = report_interval_s
        self.stepping = False
        self.compiling = 0  # requests waiting for their grammar's compile
        self.busy_s = 0.0  # simulated seconds spent in steps
        self.steps = 0
        self.started_at = loop.now  # asked for: its GPU counts from here
        self.stopped_at: float | None = None
        self._last_report = -1.0
        self._report_due = False

    def held_s(self, until: float) -> float:
        """Seconds this worker held its device, from being asked for to its stop (or `until`)."""
        return (self.stopped_at if self.stopped_at is not None else until) - self.started_at

    # -- work in -------------------------------------------------------------------------------
    def submit(self, req: Request, *, prefill_only: bool = False, outputs: tuple[int, ...] = (),
               grammar: str | None = None) -> None:
        """Queue a request; one with a grammar this worker has not compiled waits for its compile
        first (off the engine's steps, as EngineLoop.prepare)."""
        delay = self.engine.grammars.delay(grammar)
        if delay > 0:
            self.compiling += 1
            self.loop.after(delay, self._compiled, req, prefill_only, outputs)
            return
        self.engine.add_request(req, prefill_only=prefill_only, outputs=outputs)
        self.kick()

    def _compiled(self, req: Request, prefill_only: bool, outputs: tuple[int, ...]) -> None:
        self.compiling -= 1
        self.submit(req, prefill_only=prefill_only, outputs=outputs)

    def kick(self) -> None:
        """New work may be runnable: start a step unless one is running."""
        if not self.stepping:
            self._begin()

    @property
    def idle(self) -> bool:
        return not self.stepping and not self.compiling and self.engine.holds_nothing()

    # -- stepping ------------------------------------------------------------------------------
    def _begin(self) -> None:
        got = self.engine.begin()
        if got is None:
            self.stepping = False
            self._report_later()  # the idle state must reach the router too
            return
        sched, seconds = got
        if self.host is not None:
            seconds *= self.host.start()
        self.stepping = True
        self.busy_s += seconds
        self.loop.after(seconds, self._finish, sched)

    def _finish(self, sched: SchedulerOutput) -> None:
        self.steps += 1
        if self.host is not None:
            self.host.stop()
        for chunk in self.engine.finish(sched):
            self._on_chunk(self, chunk)
        if self.loop.now - self._last_report >= self.report_interval_s:
            self.report()
        self._begin()

    # -- load reports --------------------------------------------------------------------------
    def report(self) -> None:
        """What the router's next poll of this worker reads: load and KV events."""
        self._last_report = self.loop.now
        self._on_report(self, self.engine.stats(), self.engine.drain_kv_events(), self.loop.now)

    def _report_later(self) -> None:
        if self._report_due:
            return
        self._report_due = True
        self.loop.at(max(self.loop.now, self._last_report + self.report_interval_s), self._due_report)

    def _due_report(self) -> None:
        self._report_due = False
        if self.state is not WorkerState.STOPPED:
            self.report()
