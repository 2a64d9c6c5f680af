"""Placement, pure (no Ray, no torch, no engine): each ingress replica's view of the workers
(`directory`, fed by the Controller's registry `snapshot`s and the workers' loads), the cluster KV
index, the placement policies (filters, scorers, picker) and the PD decision, admission, the
pending load a replica has placed, and which KV transport a pair uses. The simulator and the
unit tests run it as is."""

from splitserve.router.kv_index import KVIndex
from splitserve.router.policy import POLICIES, NoCapacity, Placement, RouteRequest, Router, WorkerView, make_router

__all__ = ["KVIndex", "POLICIES", "NoCapacity", "Placement", "RouteRequest", "Router", "WorkerView", "make_router"]
