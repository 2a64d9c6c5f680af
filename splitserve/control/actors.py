"""The thin Ray shells: worker classes become actors here and nowhere else.

Each shell reads, inside the actor process, the Ray node it landed on (node id and IP) and
hands them to the worker, whose TCP KV server then listens on that IP. `spawn` asks Ray for one
CPU (and the GPU share), plus the pool's own resources (`prefill_resources` /
`decode_resources`: on KubeRay, a custom resource of that pool's worker group), so the pools
sit on their node groups.
"""

from __future__ import annotations

import functools
import importlib
import math
from typing import Any, NamedTuple

import ray

from splitserve.control.bundles import bundles, placement
from splitserve.config import EngineConfig
from splitserve import tracing
from splitserve.control.deploy_config import DeployConfig
from splitserve.tracing import TraceConfig
from splitserve.types import ConfigError, Role, WorkerId


def _where() -> tuple[str, str]:
    return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()


def default_class(role: Role) -> type:
    # imported here: the worker classes load the engine (torch), which the Controller and the
    # ingress replicas that import this module never run
    if role is Role.PREFILL:
        from splitserve.worker.prefill.worker import PrefillWorker

        return PrefillWorker
    from splitserve.worker.decode.worker import DecodeWorker

    return DecodeWorker


@functools.cache
def actor_class(worker_cls: type):
    """The Ray actor of a worker class: the same class, told inside the actor process where it
    runs (its KV server listens on that node's IP)."""
    class Shell(worker_cls):
        def __init__(self, *args: Any, trace: TraceConfig | None = None, trace_as: tuple[str, str] = ("", ""),
                     **kwargs: Any) -> None:
            from splitserve.control.tp_ranks import start_ray_ranks  # in the worker's process

            tracing.setup(trace, *trace_as)  # its spans: as its role, under its actor's name
            ip, node = _where()
            # a tensor-, pipeline- or data-parallel engine's other ranks / stages / replicas: actors of
            # this one's placement group
            super().__init__(*args, host=ip, node_id=node, start_ranks=start_ray_ranks, **kwargs)

    Shell.__name__ = Shell.__qualname__ = f"{worker_cls.__name__}Actor"  # what Ray's logs and errors call it
    return ray.remote(Shell)


def worker_class(cfg: DeployConfig, role: Role) -> type:
    """The pool's worker class: the real one, or the `worker_classes` entry (module:Class)."""
    path = cfg.worker_classes.get(role.value)
    if path is None:
        return default_class(role)
    module, name = path.split(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"worker_classes: {role.value}: cannot import {path!r}: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, default_class(role))):
        raise ConfigError(f"worker_classes: {role.value}: {path!r} is not a {default_class(role).__name__}")
    return cls


class ActorPlacement(NamedTuple):
    engine: EngineConfig
    transports: list[str]
    resources: dict  # Ray actor options


def resolve_transports(name: str) -> list[str]:
    """The transports every worker offers. `auto`: all that work here, in order of preference;
    each handoff then takes the one that suits its pair (router.transport_choice)."""
    if name != "auto":
        return [name]
    try:
        import nixl  # noqa: F401

        return ["shm", "nixl", "tcp"]
    except ImportError:
        return ["shm", "tcp"]


def gpu_share(device: str, cluster_gpus: float, workers: int, joined: bool, growing: bool = False) -> float:
    """The GPUs one worker asks Ray for. Ray hides every GPU from an actor that did not ask
    (CUDA_VISIBLE_DEVICES=""), so a GPU worker must: `auto` does when the cluster has GPUs,
    `cuda` always. With fewer GPUs than workers they share one evenly (1/2, 1/3 ... so every
    worker fits; each engine sizes its own KV cache). `cuda` with no GPU in sight fails here on
    a cluster we started, and waits on one we joined (an autoscaler may add GPU nodes). On a
    joined cluster whose pools autoscale (`growing`) each asks a whole GPU: a worker Ray cannot
    place yet is what makes the cluster autoscaler add a GPU node, not a reason to share."""
    if device == "cpu" or (device == "auto" and cluster_gpus == 0):
        return 0.0
    if cluster_gpus == 0:
        if not joined:
            raise ConfigError(f"device {device!r}, but Ray sees no GPU here; use device auto or cpu")
        return 1.0
    if growing and joined:
        return 1.0
    return 1.0 / math.ceil(workers / cluster_gpus) if workers > cluster_gpus else 1.0


def worker_placement(cfg: DeployConfig, role: Role, transports: list[str], share: float) -> ActorPlacement:
    """What a worker runs, which KV transports it offers, what it asks Ray for (`gpu_share`).
    Inside the actor Ray's GPU is device 0: `cuda:N` becomes `cuda`. shm shares CPU caches
    only, so a GPU worker offers the others (tcp stages through host memory, nixl reads GPU
    memory directly)."""
    device = str(cfg.engine.get("device", "auto"))
    offered = [t for t in transports if not (share and t == "shm")]
    if not offered:
        raise ConfigError("the shm transport shares CPU KV caches only; GPU workers need tcp or nixl "
                          "(transport auto picks them), or run them on the CPU (device cpu)")
    tp = cfg.tp(role.value)
    if tp > 1 and 0 < share < 1:
        raise ConfigError(f"{role.value}_tp {tp}: each tensor-parallel rank needs a GPU of its own, and there are "
                          f"fewer GPUs than ranks")
    pp = cfg.pp(role.value)
    if pp > 1 and 0 < share < 1:
        raise ConfigError(f"{role.value}_pp {pp}: each pipeline stage needs a GPU of its own (one per rank), and "
                          f"there are fewer GPUs than ranks")
    if cfg.dp > 1 and 0 < share < 1:
        raise ConfigError(f"data_parallel_size {cfg.dp}: each data-parallel replica needs a GPU of its own, and "
                          f"there are fewer GPUs than replicas")
    overrides: dict[str, Any] = {"kv_shared_memory": "shm" in offered, "tensor_parallel_size": tp}
    if device.startswith("cuda:"):
        overrides["device"] = "cuda"
    engine = EngineConfig.from_dict({"model": cfg.model, **cfg.pool_engine(role.value), **overrides})
    options = {"num_cpus": 1, "num_gpus": share}
    if cfg.resources(role.value):
        options["resources"] = cfg.resources(role.value)
    return ActorPlacement(engine, offered, options)


class Spawned(NamedTuple):
    handle: Any  # the worker actor (rank 0)
    group: Any  # its placement group: removed with it
    bundles: list  # what the group asks of its node (for unplaced.diagnose)
    one_node: bool = True  # STRICT_PACK; a pipeline-parallel worker's group may span nodes (PACK, STRICT_SPREAD)


def spawn(cfg: DeployConfig, wid: WorkerId, transports: list[str], share: float, name: str) -> Spawned:
    """A new worker actor (it loads its model in the background; `describe` answers when done).
    Detached and named `name` in the app's namespace, as is its placement group: it outlives
    the Controller, whose restart finds it again (control/persisted.py); the Controller kills it
    when the app stops. Every worker is a
    placement group of one bundle per rank on one node (STRICT_PACK), the actor in bundle 0 —
    so whether Ray has placed it is known (`group.ready()`) before its model has loaded; a
    tensor-parallel one starts the other ranks itself (control/tp_ranks.py). A pipeline-parallel
    worker's group is one bundle per stage x TP rank, PACK (its stages may sit on different
    nodes; STRICT_PACK would need them all on one), or with `pp_placement` spread STRICT_SPREAD
    (each stage, one process, on a node of its own: deploy_config refuses it for stages of
    several ranks). Only bundle 0 asks the pool's resource, so the other stages may land on any
    node with a CPU (or GPU) free. A data-parallel worker (engine data_parallel_size D) is D
    bundles, STRICT_PACK, the actor replica 0 starting replicas 1..D-1 in bundles 1..D-1."""
    from ray.util.placement_group import placement_group

    p = worker_placement(cfg, wid.role, transports, share)
    pp = p.engine.pipeline_parallel_size
    processes = p.engine.tensor_parallel_size * pp * p.engine.data_parallel_size  # one bundle each
    asked = bundles(processes, p.resources["num_cpus"], p.resources["num_gpus"],
                    p.resources.get("resources", {}))
    group = placement_group(asked, strategy=_strategy(cfg, pp), name=name, lifetime="detached")
    # the actor asks what bundle 0 holds
    opts = {**p.resources, "max_restarts": 0, "scheduling_strategy": placement(group, 0), "name": name,
            "namespace": cfg.namespace, "lifetime": "detached"}
    kv = {"transport_options": {"tcp": {"secret": cfg.kv_secret}}}  # the app's KV secret: readers prove it
    role = {"lease_s": cfg.lease_s} if wid.role is Role.PREFILL else {"on_transfer_failure": cfg.on_transfer_failure}
    if wid.role is Role.PREFILL and cfg.decode_pp > 1:  # its readers' stages: it hands off by stage
        role["reader_stages"] = cfg.decode_pp
    try:
        actor = actor_class(worker_class(cfg, wid.role)).options(**opts)
        traced = {"trace": cfg.trace, "trace_as": (f"splitserve-{wid.role.value}", name)}
        return Spawned(actor.remote(p.engine, p.transports, **role, **kv, **traced), group, asked, pp == 1)
    except BaseException:  # no worker: no reservation either
        ray.util.remove_placement_group(group)
        raise


def _strategy(cfg: DeployConfig, pp: int) -> str:
    if pp == 1:
        return "STRICT_PACK"
    return "STRICT_SPREAD" if cfg.pp_placement == "spread" else "PACK"


__all__ = ["actor_class", "worker_class", "spawn", "Spawned", "worker_placement", "gpu_share", "resolve_transports"]
