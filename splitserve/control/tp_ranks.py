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
from typing import Callable

import ray
from ray.util.placement_group import get_current_placement_group

from splitserve.engine.parallel.dp_group import DPGroup, replica_main
from splitserve.engine.parallel.group import DistGroup, GroupSpec, TPGroup, meeting_point
from splitserve.engine.parallel.launch import end_followers, on_cuda, rank_main
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
    """The processes 1..N-1 a worker actor started: where they run, which one is gone."""

    def __init__(self, actors: list, runs: list, places: tuple[RankPlace, ...], name: Callable[[int], str]) -> None:
        self.actors, self.runs, self._places, self._name = actors, runs, places, name

    def places(self) -> tuple[RankPlace, ...]:
        return self._places

    def lost(self) -> str | None:
        done, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        return f"{self._name(self.runs.index(done[0]) + 1)} exited" if done else None

    def stop(self, tp: TPGroup, timeout_s: float = 10.0) -> None:
        end_followers(tp)
        ray.wait(self.runs, num_returns=len(self.runs), timeout=timeout_s)
        self.abandon(tp)

    def abandon(self, group) -> None:
        """End the processes without a word (those of a broken group would wait on it)."""
        for a in self.actors:
            ray.kill(a, no_restart=True)
        group.close()


def _start(config, actor, size: int, what: str, join: Callable[[GroupSpec, object], object], name: Callable[[int], str],
           timeout_s: float, *run_args) -> tuple[object, RayRanks]:
    """Processes 1..size-1 of `what` in this actor's placement group, process r in bundle r, each
    running `actor.run(config, its spec, *run_args)`; this actor joins as process 0 (`join`).
    What it started is killed if any of that fails."""
    pg = get_current_placement_group()
    if pg is None or pg.bundle_count < size:
        raise RuntimeError(f"{what} must run in a placement group of {size} bundles")
    bundle = pg.bundle_specs[1]  # every process's bundle is alike
    # processes on other nodes (pipeline stages may be) reach process 0 at this node's address
    store, address = meeting_point(ray.util.get_node_ip_address(), size, timeout_s)
    backend = "nccl" if on_cuda(config) else "gloo"
    actors = [actor.options(num_cpus=bundle.get("CPU", 1), num_gpus=bundle.get("GPU", 0),
                            scheduling_strategy=placement(pg, r)).remote() for r in range(1, size)]
    try:
        places = tuple(RankPlace(r, p.node_id, p.node_ip, p.pid) for r, p in
                       enumerate(ray.get([a.where.remote() for a in actors]), 1))
        runs = [a.run.remote(config, GroupSpec(r, size, address, backend, timeout_s), *run_args)
                for r, a in enumerate(actors, 1)]
        return join(GroupSpec(0, size, address, backend, timeout_s), store), RayRanks(actors, runs, places, name)
    except Exception:
        for a in actors:
            ray.kill(a, no_restart=True)
        raise


def start_ray_group(config, timeout_s: float = 60.0) -> tuple[DistGroup, RayRanks]:
    size = config.tensor_parallel_size
    return _start(config, TPRank, size, f"a tensor-parallel worker of {size} ranks", DistGroup,
                  lambda r: f"tensor-parallel rank {r}", timeout_s)


def start_ray_stages(config, timeout_s: float = 60.0) -> tuple[PipeGroup, RayRanks]:
    """Process r is stage r // T, its TP rank r % T; process 0 is stage 0's TP rank 0."""
    t = config.tensor_parallel_size
    size = config.pipeline_parallel_size * t

    def name(r: int) -> str:
        stage, rank = divmod(r, t)
        return f"pipeline stage {stage}" + (f" (its tensor-parallel rank {rank})" if t > 1 else "")

    return _start(config, PipeStage, size,
                  f"a pipeline-parallel worker of {size} processes ({config.pipeline_parallel_size} stages x {t} ranks)",
                  lambda spec, store: PipeGroup(spec, t, store), name, timeout_s, t)


def start_ray_replicas(config, timeout_s: float = 60.0) -> tuple[DPGroup, RayRanks]:
    size = config.data_parallel_size
    return _start(config, DPReplica, size, f"a data-parallel worker of {size} replicas", DPGroup,
                  lambda r: f"data-parallel replica {r}", timeout_s)


def start_ray_ranks(config):
    """The worker actor's launcher (Engine's `start_ranks`, the data-parallel front's
    `start_replicas`): replicas for a data-parallel engine, stages for a pipeline-parallel one,
    else tensor-parallel ranks."""
    if config.data_parallel_size > 1:
        return start_ray_replicas(config)
    if config.pipeline_parallel_size > 1:
        return start_ray_stages(config)
    return start_ray_group(config)
