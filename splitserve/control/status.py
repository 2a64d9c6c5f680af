"""What `Controller.status` answers (`splitserve status`): one row per worker, the pools'
targets, why a pool cannot grow or a worker is not placed yet (and what would place it), CPU
workers sharing a local machine's cores, the autoscaler's decisions."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitserve.control.autoscale import AutoscaleReport
from splitserve.router.snapshot import WorkerRecord
from splitserve.control.unplaced import Unplaced

if TYPE_CHECKING:
    from splitserve.control.deploy_config import DeployConfig


@dataclass(frozen=True)
class WorkerStatus:
    """One line of `splitserve status`."""

    id: str
    role: str
    state: str
    node_ip: str
    node_id: str
    num_waiting: int
    num_running: int
    kv_usage: float
    reason: str = ""  # why it is dead or stopped, or why Ray has not placed it yet
    ranks: tuple[str, ...] = ()  # a tensor-parallel worker: every rank's node IP, rank 0 first
    memory: str = ""  # what its engine holds (MemoryReport.describe), once registered
    # slow: its health probes go unanswered (for `silent_s` seconds so far) — alive, not dead
    # (DESIGN.md §4 "Liveness"); it turns DEAD only past dead_after_s
    slow: bool = False
    silent_s: float = 0.0


@dataclass(frozen=True)
class ClusterStatus:
    targets: dict
    workers: tuple[WorkerStatus, ...]
    errors: dict  # role -> why the pool cannot grow (a worker refused its configuration)
    version: int
    autoscale: AutoscaleReport | None = None
    unplaced: tuple[Unplaced, ...] = ()  # pools with a worker Ray has not placed yet, and why
    retrying: dict = dataclasses.field(default_factory=dict)  # role -> its workers' start failures, backing off
    sharing: str = ""  # CPU workers sharing this machine's cores (a local cluster), in words

    def to_json(self) -> dict:
        from dataclasses import asdict

        out = {"targets": dict(self.targets), "workers": [asdict(w) for w in self.workers],
               "errors": dict(self.errors), "retrying": dict(self.retrying), "sharing": self.sharing,
               "unplaced": [{"role": u.role.value, "message": u.message, "remedy": u.remedy} for u in self.unplaced]}
        if self.autoscale is not None:
            a = self.autoscale
            out["autoscale"] = {
                "decisions": [{"role": r.value, "reason": why.value, "count": n} for r, why, n in a.decisions],
                "last": None if a.last is None else _decision_json(a.last),
                "changes": [_decision_json(d) for d in a.changes]}
        return out


def status_row(r: WorkerRecord, unplaced: Unplaced | None = None) -> WorkerStatus:
    s = r.load.stats if r.load else None
    return WorkerStatus(str(r.id), r.role.value, r.state.value, r.node_ip, r.info.node_id if r.info else "",
                        s.num_waiting if s else 0, s.num_running if s else 0,
                        round(s.kv_usage, 4) if s else 0.0, unplaced.describe() if unplaced else r.reason,
                        _rank_ips(r), r.info.memory.describe() if r.info and r.info.memory else "", r.slow,
                        round(time.time() - r.silent_since, 1) if r.silent_since is not None else 0.0)


def cores_shared(cfg: DeployConfig, workers: dict, cluster_gpus: float, cores: int) -> str:
    """On a local cluster we started, CPU workers beyond the machine's `cores` share them (its
    Ray counts a logical CPU for each rank the pools may take, launch.local_cpus): said, not
    hidden. `workers`: the live workers per pool, by role name."""
    device = str(cfg.engine.get("device", "auto"))
    if device not in ("auto", "cpu") or (device == "auto" and cluster_gpus > 0):
        return ""  # GPU workers: each waits for its GPU (share), never for a core
    ranks = cfg.ranks(workers.get("prefill", 0), workers.get("decode", 0))
    if ranks <= cores:
        return ""
    return (f"{ranks} CPU worker processes share this machine's {cores} cores: each runs slower than on a core "
            f"of its own (a local cluster places a worker beyond the cores rather than leave it waiting)")


def _rank_ips(r: WorkerRecord) -> tuple[str, ...]:
    if r.info is None or not r.info.ranks:
        return ()
    return (r.node_ip, *(p.node_ip for p in r.info.ranks))


def _decision_json(d) -> dict:
    return {"at": d.at, "prefill": d.prefill, "decode": d.decode, "prefill_reason": d.prefill_reason.value,
            "decode_reason": d.decode_reason.value, "detail": d.detail}
