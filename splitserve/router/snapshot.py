"""What the Controller publishes and each ingress replica's directory reads (DESIGN.md §4 "Ray"):
a versioned snapshot of the worker registry, one record per live worker. The Controller's
`control.registry` is the only writer; the router only reads, so these values live here, with
the view they feed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from splitserve.types import Role, WorkerId, WorkerLoad, WorkerState
from splitserve.worker.info import WorkerInfo


@dataclass(frozen=True)
class WorkerRecord:
    id: WorkerId
    state: WorkerState
    handle: Any = None  # the Ray actor handle (a value Ray can send anywhere)
    info: WorkerInfo | None = None  # set when READY
    load: WorkerLoad | None = None  # the last health probe's answer
    since: float = 0.0  # time.time() of the last state change
    # time.time() when the health probe now unanswered was sent (None: it answers): a worker
    # silent past the probe timeout is slow — shown, and placed on only when no worker of its
    # pool answers (DESIGN.md §4 "Liveness"); silent past dead_after_s, it is DEAD
    silent_since: float | None = None
    reason: str = ""  # why it is DEAD (or STOPPED)
    final_counts: dict | None = None  # a drained worker's block counts, checked before it stopped

    @property
    def slow(self) -> bool:
        return self.silent_since is not None

    @property
    def role(self) -> Role:
        return self.id.role

    @property
    def node_ip(self) -> str:
        return self.info.node_ip if self.info else ""


@dataclass(frozen=True)
class RegistrySnapshot:
    version: int
    workers: tuple[WorkerRecord, ...]  # live ones (STARTING, READY, DRAINING)
    targets: tuple[tuple[Role, int], ...]
    autoscale: Any = None  # autoscale.AutoscaleReport when the pools autoscale
    epoch: str = ""  # the Controller's incarnation: a new one (it restarted) wants its owners to attach again

    def role(self, role: Role, state: WorkerState | None = None) -> list[WorkerRecord]:
        return [w for w in self.workers if w.role is role and (state is None or w.state is state)]
