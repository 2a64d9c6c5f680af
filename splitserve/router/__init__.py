"""The global router's core: KV index, placement policies, PD decision. No Ray, no engine."""

from splitserve.router.kv_index import KVIndex
from splitserve.router.policy import POLICIES, NoCapacity, Placement, RouteRequest, Router, WorkerView, make_router

__all__ = ["KVIndex", "POLICIES", "NoCapacity", "Placement", "RouteRequest", "Router", "WorkerView", "make_router"]
