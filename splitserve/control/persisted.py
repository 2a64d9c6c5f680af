"""What a Controller keeps where its restart finds it (issue 30): the app's config, the pools'
targets, the registry's version and its live workers — in Ray's GCS key-value store, which
outlives any actor (and, with GCS fault tolerance on an external Redis, the head itself).

The workers are detached named actors in detached placement groups, so they outlive the
Controller; a restarted Controller (Ray restarts it: `max_restarts=-1`) finds each by name
again (`worker_name`) and re-adopts it instead of starting a new one. A worker that died while
the Controller was away is found missing and replaced as any dead worker is.
"""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass

from splitserve.control.deploy_config import DeployConfig
from splitserve.router.snapshot import WorkerRecord
from splitserve.types import Role, WorkerId


@dataclass(frozen=True)
class ControllerState:
    cfg: DeployConfig
    targets: tuple[tuple[Role, int], ...]
    version: int
    workers: tuple[WorkerRecord, ...]  # live ones, without their handles (found again by name)
    owned: bool  # ingress replicas had attached: a restart waits for them to come back, else stops

    @staticmethod
    def of(cfg: DeployConfig, targets: dict[Role, int], version: int, workers, owned: bool) -> "ControllerState":
        kept = tuple(dataclasses.replace(w, handle=None, load=None) for w in workers)
        return ControllerState(cfg, tuple(sorted(targets.items())), version, kept, owned)


def worker_name(cfg: DeployConfig, wid: WorkerId) -> str:
    """A worker actor's (and its placement group's) name in the app's namespace."""
    return f"{cfg.name}:{wid}"


def _key(cfg: DeployConfig) -> bytes:
    return f"splitserve:{cfg.namespace}:{cfg.name}:controller".encode()


def save(state: ControllerState) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(_key(state.cfg), pickle.dumps(state), overwrite=True)


def load(cfg: DeployConfig) -> ControllerState | None:
    """The state a previous incarnation of this app's Controller saved (None: a new app)."""
    from ray.experimental import internal_kv

    raw = internal_kv._internal_kv_get(_key(cfg))
    return None if raw is None else pickle.loads(raw)


def forget(cfg: DeployConfig) -> None:
    """The app stopped: nothing to resume."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_del(_key(cfg))


def kill_leftovers(cfg: DeployConfig) -> int:
    """Kill every worker of the app still alive, and its placement group: what a Controller that
    failed to stop them (or was killed for good) left behind, detached as they are. Returns how
    many workers it found."""
    import ray

    prefix = f"{cfg.name}:"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == cfg.namespace and a["name"].startswith(prefix)]
    for name in names:
        try:
            ray.kill(ray.get_actor(name, namespace=cfg.namespace), no_restart=True)
            ray.util.remove_placement_group(ray.util.get_placement_group(name))
        except (ValueError, ray.exceptions.RayError):  # gone meanwhile
            pass
    forget(cfg)
    return len(names)
