"""Bringing an app up from a driver (`splitserve serve`, `Cluster.start`): join the Ray cluster
that runs here or start one, refuse a configuration no worker could run before any actor
starts, and wait until the Controller's pools are READY (printing progress), surfacing a
worker's refusal of its configuration as a ConfigError in our words."""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import logging
import os
import socket
import sys
import time
from typing import Callable

import ray

from splitserve.config import EngineConfig
from splitserve.control.deploy_config import DeployConfig
from splitserve.types import ConfigError, Role


def connect_ray(address: str | None, num_cpus: int) -> bool:
    """Join the cluster at `address` ("auto": the one running here), or, with no address, the
    one running on this machine if any; else start a local one with `num_cpus` logical CPUs
    (at least the cores). True when we started it: `stop_local_ray` ends it."""
    if ray.is_initialized():
        return False
    found = address
    if address in (None, "auto"):
        _token_of_the_local_cluster()
        found = _running_here(address)
    if found is None:
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, num_cpus), include_dashboard=False,
                 log_to_driver=False, logging_level=logging.WARNING)
        _note_address(ray.get_runtime_context().gcs_address)
        return True
    host, _, port = found.rpartition(":")
    host = host.strip("[]")
    if "://" not in found and port.isdigit():  # a GCS address (a ray:// client address is Ray's to check)
        _check_answers(host, int(port))
        _check_accepts(found)
    kwargs = {}
    try:
        if ipaddress.ip_address(host).is_loopback:  # a local multi-node cluster: the driver joins the head's IP
            kwargs["_node_ip_address"] = host
    except ValueError:
        pass
    ray.init(address=found, log_to_driver=False, logging_level=logging.WARNING, **kwargs)
    return False


def local_cpus(cfg: DeployConfig) -> int:
    """The logical CPUs of a local cluster we start: as many as both pools at their largest
    take, so that a CPU worker beyond this machine's cores (`scale`, the autoscaler) shares
    them — each runs slower, `status` says so — as the pools `serve` starts with already may;
    the cluster is this app's alone and ends with it."""
    a = cfg.autoscale
    most = max(cfg.max_pool_size, a.prefill.max if a else 0), max(cfg.max_pool_size, a.decode.max if a else 0)
    return cfg.ranks(*most)


def stop_local_ray() -> None:
    """End the cluster `connect_ray` started, and its note with it."""
    forget_local_address()
    ray.shutdown()


def _running_here(address: str | None) -> str | None:
    """The address of the cluster running on this machine: RAY_ADDRESS when set (the user named
    it), else the one noted where `ray start` notes its own, else (for "auto") any GCS running
    here; None: nothing runs here. A note whose GCS does not answer is one a cluster left when
    it was killed (SIGKILL runs no cleanup): ignored, with a notice, and removed."""
    if not os.environ.get("RAY_ADDRESS"):
        _drop_a_dead_note()
    try:
        from ray._private.services import canonicalize_bootstrap_address

        return canonicalize_bootstrap_address(address)
    except Exception:  # "auto" with nothing running
        if address == "auto":
            raise ConfigError("--address auto: no Ray cluster is running on this machine") from None
        return None


_noted: str | None = None  # the address this process noted for the cluster it started


def _note_address(address: str | None) -> None:
    """Note the cluster we started where `ray start` notes its own (RAY_TMPDIR's
    ray/ray_current_cluster): without it, `status` and `scale` (address "auto") take any Ray
    cluster running on this machine, and with two they may take the wrong one. The note goes
    when the cluster ends (`stop_local_ray`, or at this process's exit)."""
    global _noted
    try:
        from ray._private.utils import write_ray_address
    except ImportError:  # another Ray
        return
    if address:
        write_ray_address(address)
        if _noted is None:
            atexit.register(forget_local_address)  # a script that never called shutdown
        _noted = address


def forget_local_address() -> None:
    """The cluster we started is ending: nothing here should find it any more (a note another
    cluster wrote since stays)."""
    global _noted
    try:
        from ray._common.utils import reset_ray_address
        from ray._private.utils import read_ray_address
    except ImportError:  # another Ray
        return
    if _noted is not None and read_ray_address() == _noted:
        reset_ray_address()
    _noted = None


def _drop_a_dead_note() -> None:
    try:
        from ray._common.utils import reset_ray_address
        from ray._private.utils import read_ray_address
    except ImportError:  # another Ray
        return
    noted = read_ray_address()
    host, _, port = (noted or "").rpartition(":")
    if not port.isdigit():
        return
    why = _unreachable(host.strip("[]"), int(port))
    if why is not None:
        print(f"splitserve: ignoring the Ray cluster noted at {noted} ({why}): it ended without removing its note",
              file=sys.stderr, flush=True)
        reset_ray_address()


def _token_of_the_local_cluster() -> None:
    """The cluster running on this machine is joined by the address we find for it, and Ray turns
    its token authentication on only for a cluster it finds itself: as `ray.init()` does for
    one, use the token this machine's clusters were started with (~/.ray/auth_token, or
    RAY_AUTH_TOKEN[_PATH]) when RAY_AUTH_MODE is not set — so `status` and `scale` reach the app
    `splitserve serve` started with nothing set by hand."""
    try:
        from ray._private.authentication import authentication_token_setup as setup
    except ImportError:  # a Ray without token authentication
        return
    said = setup.logger.level
    setup.logger.setLevel(logging.ERROR)  # its "token authentication is enabled" notice is Ray's to a Ray user
    try:
        setup.maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    finally:
        setup.logger.setLevel(said)


def _check_answers(host: str, port: int) -> None:
    """Ray retries a cluster that is not there for minutes before it gives up: refuse at once."""
    why = _unreachable(host, port)
    if why is not None:
        raise ConfigError(f"cannot reach a Ray cluster at {host}:{port} ({why}): start one with "
                          "`splitserve serve`, or name a running one with --address HOST:PORT")


def _unreachable(host: str, port: int) -> str | None:
    """Why nothing answers at host:port (a GCS, even a busy one, accepts at once), or None."""
    try:
        with socket.create_connection((host, port), timeout=3.0):
            return None
    except OSError as e:
        return str(e.strerror or e)


TOKEN_HINT = ("run it where the cluster's token is readable (~/.ray/auth_token), or set RAY_AUTH_TOKEN_PATH or "
              "RAY_AUTH_TOKEN to the cluster's token")


def _check_accepts(address: str) -> None:
    """A cluster with token authentication that refuses this process's token: Ray retries for
    half a minute, printing a warning a second; one GCS call says so at once."""
    try:
        from ray._raylet import GcsClient
        from ray.exceptions import AuthenticationError
    except ImportError:  # another Ray: leave it to ray.init
        return
    try:
        with _quiet_stderr():  # the failed call's warning, from Ray's C++ logger
            GcsClient(address=address)
    except AuthenticationError:
        raise ConfigError(f"the Ray cluster at {address} refused this process's authentication token: "
                          f"{TOKEN_HINT}") from None
    except Exception:  # anything else: ray.init says it
        return


@contextlib.contextmanager
def _quiet_stderr():
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def check_files(cfg: DeployConfig) -> None:
    """What the model's and a draft head's files say every worker would refuse, refused before
    Ray starts (a head that cannot fit: in a second, not after the pools came up)."""
    from splitserve.engine.speculative.draft import check_draft_head  # torch: not for `status`

    spec = EngineConfig.from_dict({"model": cfg.model, **cfg.pool_engine("decode")}).speculative
    if spec is not None and spec.method == "draft":  # both pools run the head, each rank its shard
        check_draft_head(spec, cfg.model, max(cfg.prefill_tp, cfg.decode_tp))


def precheck(cfg: DeployConfig, joined: bool) -> None:
    """What every worker would refuse on this cluster, refused here (before any actor starts)."""
    from splitserve.control.actors import gpu_share, resolve_transports, worker_placement  # torch: not for `status`

    share = gpu_share(str(cfg.engine.get("device", "auto")), ray.cluster_resources().get("GPU", 0.0),
                      cfg.ranks(cfg.prefill, cfg.decode), joined, growing=cfg.autoscale is not None)
    for role in Role:
        worker_placement(cfg, role, resolve_transports(cfg.transport), share)


def wait_ready(controller, on_ready: Callable[[int, int], None] | None = None, timeout_s: float | None = None,
               unplaced_s: float | None = 10.0, on_unplaced: Callable[[str], None] | None = None) -> None:
    """Until every pool has its target of READY workers; a pool that cannot grow raises. A worker
    Ray cannot place (the Controller says why, control/unplaced.py) raises ConfigError with that
    reason once it has been unplaced for `unplaced_s` — at once when no node could ever hold it;
    with `unplaced_s` None (a cluster whose autoscaler may add nodes) it is only reported."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    last, unplaced_since, said = -1, None, None
    while True:
        status = ray.get(controller.status.remote())
        if status.errors:
            raise ConfigError("; ".join(status.errors.values()))
        why = status.unplaced[0] if status.unplaced else None
        unplaced_since = None if why is None else unplaced_since or time.monotonic()
        if why is not None and unplaced_s is not None and (
                why.infeasible or time.monotonic() - unplaced_since >= unplaced_s):
            raise ConfigError(why.message)
        if why is not None and on_unplaced is not None and why.describe() != said:
            said = why.describe()
            on_unplaced(said)
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
