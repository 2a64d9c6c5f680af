"""A tensor-parallel worker on Ray: its ranks 1..T-1 are actors in bundles 1..T-1 of the
worker's placement group (STRICT_PACK: one node, so the group's collectives stay on it), started
by rank 0 — the worker actor, in bundle 0 — from inside its Engine (`start_ray_group` is that
Engine's rank launcher, engine/parallel/launch.py). Rank 0 owns them: when the worker actor dies Ray
takes its ranks along, and the Controller removes the placement group with the worker.

A rank that dies breaks the group: rank 0's next collective fails (its engine stops), and
`lost` tells health probes at once, so an idle group is replaced as fast as a busy one.

A pipeline-parallel worker (`start_ray_stages`) is the same shape: processes 1..S*T-1 (stage
r // T, its TP rank r % T) are `PipeStage` actors in bundles 1..S*T-1 of a PACK group (stages may
sit on different nodes), each running the engine's `stage_main`; a stage that exits is `lost`
by name ("pipeline stage 1 exited"), and the worker stops and is replaced as for a lost TP rank.

A data-parallel worker (data-parallel attention + expert parallelism, `start_ray_replicas`) is
the same shape again: replicas 1..D-1 of its engine (engine/parallel/dp_engine.py) are
`DPReplica` actors in bundles 1..D-1 of a STRICT_PACK group (every MoE layer's all-to-all stays
on one node), each running `replica_main`; one that exits is `lost` by name ("data-parallel
replica 1 exited"). `start_ray_ranks` is the worker actor's launcher: it picks among the three
by the config."""

from __future__ import annotations

import os

import ray
from ray.util.placement_group import get_current_placement_group

from splitserve.engine.parallel.dp_group import DPGroup, replica_main
from splitserve.engine.parallel.group import DistGroup, GroupSpec, TPGroup
from splitserve.engine.parallel.launch import end_followers, free_address, on_cuda, rank_main
from splitserve.engine.parallel.pipe_group import PipeGroup, stage_main
from splitserve.control.bundles import placement
from splitserve.types import RankPlace


@ray.remote(max_restarts=0, max_concurrency=2)  # `where` answers while `run` follows
class TPRank:
    def where(self) -> RankPlace:
        return RankPlace(-1, ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid())

    def run(self, config, spec: GroupSpec) -> int:
        return rank_main(config, spec, gpu=0)  # Ray shows an actor only its own GPU, as device 0


@ray.remote(max_restarts=0, max_concurrency=2)
class PipeStage:
    """Process r > 0 of a pipeline-parallel worker: stage r // T, TP rank r % T."""

    def where(self) -> RankPlace:
        return RankPlace(-1, ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid())

    def run(self, config, spec: GroupSpec, tp_size: int) -> int:
        return stage_main(config, spec, gpu=0, tp_size=tp_size)


@ray.remote(max_restarts=0, max_concurrency=2)
class DPReplica:
    """Replica r > 0 of a data-parallel worker's engine."""

    def where(self) -> RankPlace:
        return RankPlace(-1, ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid())

    def run(self, config, spec: GroupSpec) -> int:
        return replica_main(config, spec, gpu=0)


class RayRanks:
    def __init__(self, actors: list, runs: list, places: tuple[RankPlace, ...]) -> None:
        self.actors, self.runs, self._places = actors, runs, places

    def places(self) -> tuple[RankPlace, ...]:
        return self._places

    def lost(self) -> str | None:
        done, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        if not done:
            return None
        return f"tensor-parallel rank {self.runs.index(done[0]) + 1} exited"

    def stop(self, tp: TPGroup, timeout_s: float = 10.0) -> None:
        end_followers(tp)
        ray.wait(self.runs, num_returns=len(self.runs), timeout=timeout_s)
        for a in self.actors:
            ray.kill(a, no_restart=True)
        tp.close()


def start_ray_group(config) -> tuple[DistGroup, RayRanks]:
    """Ranks 1..T-1 in this actor's placement group, rank r in bundle r; joined as rank 0."""
    pg = get_current_placement_group()
    size = config.tensor_parallel_size
    if pg is None or pg.bundle_count < size:
        raise RuntimeError(f"a tensor-parallel worker of {size} ranks must run in a placement group of "
                           f"{size} bundles")
    spec = pg.bundle_specs[1]  # every rank's bundle is alike
    address = free_address(ray.util.get_node_ip_address())
    backend = "nccl" if on_cuda(config) else "gloo"
    actors = [TPRank.options(num_cpus=spec.get("CPU", 1), num_gpus=spec.get("GPU", 0),
                             scheduling_strategy=placement(pg, r)).remote() for r in range(1, size)]
    places = tuple(RankPlace(r, p.node_id, p.node_ip, p.pid) for r, p in
                   enumerate(ray.get([a.where.remote() for a in actors]), 1))
    runs = [a.run.remote(config, GroupSpec(r, size, address, backend)) for r, a in enumerate(actors, 1)]
    try:
        return DistGroup(GroupSpec(0, size, address, backend)), RayRanks(actors, runs, places)
    except Exception:
        for a in actors:
            ray.kill(a, no_restart=True)
        raise


class RayStages(RayRanks):
    def __init__(self, actors: list, runs: list, places: tuple[RankPlace, ...], tp_size: int) -> None:
        super().__init__(actors, runs, places)
        self.tp_size = tp_size

    def lost(self) -> str | None:
        done, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        if not done:
            return None
        stage, rank = divmod(self.runs.index(done[0]) + 1, self.tp_size)
        return f"pipeline stage {stage} exited" + (f" (its tensor-parallel rank {rank})" if self.tp_size > 1 else "")


def start_ray_stages(config, timeout_s: float = 60.0) -> tuple[PipeGroup, RayStages]:
    """Processes 1..S*T-1 of a pipeline-parallel engine in this actor's placement group, process
    r in bundle r; joined as process 0 (stage 0, TP rank 0)."""
    pg = get_current_placement_group()
    t = config.tensor_parallel_size
    size = config.pipeline_parallel_size * t
    if pg is None or pg.bundle_count < size:
        raise RuntimeError(f"a pipeline-parallel worker of {size} processes ({config.pipeline_parallel_size} stages x "
                           f"{t} ranks) must run in a placement group of {size} bundles")
    spec = pg.bundle_specs[1]
    # other stages may be on other nodes: they reach process 0 at this node's address
    address = free_address(ray.util.get_node_ip_address())
    backend = "nccl" if on_cuda(config) else "gloo"
    actors = [PipeStage.options(num_cpus=spec.get("CPU", 1), num_gpus=spec.get("GPU", 0),
                                scheduling_strategy=placement(pg, r)).remote() for r in range(1, size)]
    try:
        places = tuple(RankPlace(r, p.node_id, p.node_ip, p.pid) for r, p in
                       enumerate(ray.get([a.where.remote() for a in actors]), 1))
        runs = [a.run.remote(config, GroupSpec(r, size, address, backend, timeout_s), t)
                for r, a in enumerate(actors, 1)]
        return PipeGroup(GroupSpec(0, size, address, backend, timeout_s), t), RayStages(actors, runs, places, t)
    except Exception:
        for a in actors:
            ray.kill(a, no_restart=True)
        raise


class RayReplicas(RayRanks):
    def lost(self) -> str | None:
        done, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        return f"data-parallel replica {self.runs.index(done[0]) + 1} exited" if done else None

    def abandon(self, group: DPGroup) -> None:
        """End the replicas of a broken group without a word (they would wait on it)."""
        for a in self.actors:
            ray.kill(a, no_restart=True)
        group.close()


def start_ray_replicas(config, timeout_s: float = 60.0) -> tuple[DPGroup, RayReplicas]:
    """Replicas 1..D-1 of a data-parallel engine in this actor's placement group, replica r in
    bundle r; joined as replica 0 (the front's own)."""
    pg = get_current_placement_group()
    size = config.data_parallel_size
    if pg is None or pg.bundle_count < size:
        raise RuntimeError(f"a data-parallel worker of {size} replicas must run in a placement group of "
                           f"{size} bundles")
    spec = pg.bundle_specs[1]
    address = free_address(ray.util.get_node_ip_address())
    backend = "nccl" if on_cuda(config) else "gloo"
    actors = [DPReplica.options(num_cpus=spec.get("CPU", 1), num_gpus=spec.get("GPU", 0),
                                scheduling_strategy=placement(pg, r)).remote() for r in range(1, size)]
    try:
        places = tuple(RankPlace(r, p.node_id, p.node_ip, p.pid) for r, p in
                       enumerate(ray.get([a.where.remote() for a in actors]), 1))
        runs = [a.run.remote(config, GroupSpec(r, size, address, backend, timeout_s)) for r, a in enumerate(actors, 1)]
        return DPGroup(GroupSpec(0, size, address, backend, timeout_s)), RayReplicas(actors, runs, places)
    except Exception:
        for a in actors:
            ray.kill(a, no_restart=True)
        raise


def start_ray_ranks(config):
    """The worker actor's launcher (Engine's `start_ranks`, the data-parallel front's
    `start_replicas`): replicas for a data-parallel engine, stages for a pipeline-parallel one,
    else tensor-parallel ranks."""
    if config.data_parallel_size > 1:
        return start_ray_replicas(config)
    if config.pipeline_parallel_size > 1:
        return start_ray_stages(config)
    return start_ray_group(config)
