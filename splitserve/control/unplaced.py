"""Why Ray has not placed a worker yet, in our words (pure Python: no Ray calls here).

Every worker is a placement group (one bundle per rank, all on one node). One still pending a
few seconds after it was asked for is diagnosed from the cluster's nodes and free resources:
`infeasible` when no node of the cluster, even empty, could hold it (a cluster we started will
never grow; on KubeRay the autoscaler may still add a node of the right group), else the
cluster could hold it but no node has that much free now (other workers hold it). `remedy`
says what would place it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from splitserve.types import Role

PLACEMENT_GRACE_S = 2.0  # how long a worker may wait for Ray's placement before it is diagnosed


@dataclass(frozen=True)
class Unplaced:
    role: Role
    infeasible: bool  # no node of the cluster, even empty, could hold it
    message: str
    remedy: str = ""  # what would place it

    def describe(self) -> str:
        return f"{self.message} — {self.remedy}" if self.remedy else self.message


def demand(bundles: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """What a worker's bundles ask of the one node they must share."""
    total: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            if v:
                total[k] = total.get(k, 0.0) + v
    return total


def diagnose(role: Role, need: Mapping[str, float], node_totals: Iterable[Mapping[str, float]],
             free: Mapping[str, float], joined: bool = True) -> Unplaced:
    """`node_totals`: each live node's resources; `free`: the cluster's free resources, all nodes;
    `joined`: a cluster we joined, which may gain nodes (a local one we started never does)."""
    fits = [n for n in node_totals if all(n.get(k, 0.0) >= v for k, v in need.items())]
    head = f"cannot place a {role.value} worker: it needs {_fmt(need)} on one node"
    if not fits:
        return Unplaced(role, True, f"{head}, and no node of the cluster has that much",
                        "it starts when a node that has that much joins the cluster" if joined else
                        "this machine never has that much: ask less of a worker, or serve on a cluster that has "
                        "such a node (--address)")
    have = {k: free.get(k, 0.0) for k in need}
    return Unplaced(role, False, f"{head}; no node has that free now (the cluster has {_fmt(have)} free in all)",
                    "it starts when that much is freed (scale a pool down) or a node with it joins the cluster"
                    if joined else "it starts when that much is freed: scale a pool down")


def _fmt(res: Mapping[str, float]) -> str:
    def one(k: str, v: float) -> str:
        n = f"{v:g}"
        plural = "" if v == 1 else "s"
        return f"{n} CPU{plural}" if k == "CPU" else f"{n} GPU{plural}" if k == "GPU" else f"{n} {k}"

    return " + ".join(one(k, v) for k, v in sorted(res.items(), key=lambda kv: (kv[0] not in ("CPU", "GPU"), kv[0])))
