"""A worker's placement group (DESIGN.md §4 "Ray"): one bundle per rank, on one node, the actor of
rank r in bundle r. Ray only: what the Controller asks for when it spawns a worker, and what a
tensor-parallel worker's rank 0 places its other ranks by (control/tp_ranks.py)."""

from __future__ import annotations

from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


def bundles(size: int, cpus: float, gpus: float, resources: dict) -> list[dict]:
    """One bundle per rank; the pool's own resources (its node group's) on rank 0's alone, so a
    node of that group holds as many groups as it has of that resource."""
    one = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    return [{**one, **(resources if r == 0 else {})} for r in range(size)]


def placement(pg: PlacementGroup, rank: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank,
                                            placement_group_capture_child_tasks=False)
