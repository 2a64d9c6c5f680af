"""Bringing an app up from a driver (`splitserve serve`, `Cluster.start`): join the Ray cluster
that runs here or start one, refuse a configuration no worker could run before any actor
starts, and wait until the Controller's pools are READY (printing progress), surfacing a
worker's refusal of its configuration as a ConfigError in our words."""

from __future__ import annotations

import ipaddress
import os
import time
from typing import Callable

import ray

from splitserve.cluster.actors import gpu_share, resolve_transports, worker_placement
from splitserve.config import DeployConfig
from splitserve.types import ConfigError, Role


def connect_ray(address: str | None, num_cpus: int) -> bool:
    """Join the cluster at `address` ("auto": the one running here), or, with no address, the
    one running on this machine if any; else start a local one. True when we started it."""
    if ray.is_initialized():
        return False
    found = address
    if address in (None, "auto"):
        try:
            from ray._private.services import canonicalize_bootstrap_address

            found = canonicalize_bootstrap_address(address)
        except Exception:  # "auto" with nothing running
            if address == "auto":
                raise ConfigError("--address auto: no Ray cluster is running on this machine") from None
            found = None
    if found is None:
        ray.init(num_cpus=max(os.cpu_count() or 1, num_cpus), include_dashboard=False, log_to_driver=False)
        return True
    kwargs = {}
    host = found.rsplit(":", 1)[0].strip("[]")
    try:
        if ipaddress.ip_address(host).is_loopback:  # a local multi-node cluster: the driver joins the head's IP
            kwargs["_node_ip_address"] = host
    except ValueError:
        pass
    ray.init(address=found, log_to_driver=False, **kwargs)
    return False


def precheck(cfg: DeployConfig, joined: bool) -> None:
    """What every worker would refuse, refused here (before any actor starts)."""
    share = gpu_share(str(cfg.engine.get("device", "auto")), ray.cluster_resources().get("GPU", 0.0),
                      cfg.ranks(cfg.prefill, cfg.decode), joined, growing=cfg.autoscale is not None)
    for role in Role:
        worker_placement(cfg, role, resolve_transports(cfg.transport), share)


def wait_ready(controller, on_ready: Callable[[int, int], None] | None = None, timeout_s: float | None = None) -> None:
    """Until every pool has its target of READY workers; a pool that cannot grow raises."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    last = -1
    while True:
        status = ray.get(controller.status.remote())
        if status.errors:
            raise ConfigError("; ".join(status.errors.values()))
        ready = sum(1 for w in status.workers if w.state == "ready")
        total = sum(status.targets.values())
        if on_ready is not None and ready != last:
            on_ready(ready, total)
            last = ready
        if ready >= total:
            return
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"{ready} of {total} workers ready after {timeout_s:g} s")
        time.sleep(0.2)
