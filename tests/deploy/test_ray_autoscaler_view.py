"""The cluster as Ray's own KubeRay autoscaler sees it (ray.autoscaler._private.kuberay.
autoscaling_config, the code its sidecar runs over the RayCluster KubeRay makes from our
RayService): the node types, their resources and bounds, and that each splitserve actor's
demand fits exactly the node type meant for it, so the autoscaler makes the right pods."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest

from splitserve.control.deploy_config import DeployConfig
from splitserve.types import Role

from .chart import Rendered
from .k8s_checks import ray_cluster_of

autoscaling_config = pytest.importorskip("ray.autoscaler._private.kuberay.autoscaling_config")
ray_k8s_utils = pytest.importorskip("ray.autoscaler._private.kuberay.utils")


def _node_types(rendered: Rendered) -> dict:
    config = autoscaling_config._derive_autoscaling_config_from_ray_cr(ray_cluster_of(rendered.rayservice))
    return config


def _bytes(quantity) -> int:
    return int(math.ceil(ray_k8s_utils.parse_quantity(str(quantity))))


def test_node_types_and_bounds(rendered: Rendered) -> None:
    v = rendered.case.values()
    config = _node_types(rendered)
    head_type = autoscaling_config._HEAD_GROUP_NAME
    types = config["available_node_types"]
    assert set(types) == {head_type, "prefill", "decode"}
    assert config["head_node_type"] == head_type
    for name, want in ((head_type, v["head"]), ("prefill", v["prefill"]), ("decode", v["decode"])):
        res = types[name]["resources"]
        limits = want["resources"]["limits"]
        assert res["CPU"] == math.ceil(float(ray_k8s_utils.parse_quantity(str(limits["cpu"]))))
        assert res["memory"] == _bytes(limits["memory"])
        assert res.get("GPU", 0) == (0 if name == head_type else want["gpus"])
        assert res[want["rayResource"]] == (1000 if name == head_type else 1)
        others = {v[g]["rayResource"] for g in ("head", "prefill", "decode")} - {want["rayResource"]}
        assert not others & set(res)
        if name != head_type:
            bounds = (types[name]["min_workers"], types[name]["max_workers"])
            assert bounds == (want["minReplicas"], want["maxReplicas"])
    assert config["max_workers"] == v["prefill"]["maxReplicas"] + v["decode"]["maxReplicas"]
    if v["rayAutoscaler"]["enabled"]:
        assert config["idle_timeout_minutes"] == v["rayAutoscaler"]["idleTimeoutSeconds"] / 60


def _fits(demand: dict, resources: dict) -> bool:
    return all(resources.get(k, 0) >= amount for k, amount in demand.items() if amount)


def _local_args(rendered: Rendered) -> dict:
    """The app's args as this machine can read them: the key file and the KV secret's are in the
    head pod only."""
    return {k: v for k, v in rendered.args.items() if k not in ("api_keys", "kv_secret_file")}


def test_each_actor_fits_only_its_own_node_type(rendered: Rendered, tmp_path: Path) -> None:
    from splitserve.control.actors import gpu_share, resolve_transports, worker_placement
    from splitserve.cli.app import Ingress

    v = rendered.case.values()
    args = dict(_local_args(rendered), model=str(tmp_path))
    cfg = DeployConfig.from_options(args)
    types = _node_types(rendered)["available_node_types"]
    head_type = autoscaling_config._HEAD_GROUP_NAME
    # The GPUs Ray sees when the Controller sizes its workers' share: the pods that start.
    gpus_at_start = sum(v[r]["gpus"] * v[r]["replicas"] for r in ("prefill", "decode"))
    share = gpu_share(str(cfg.engine.get("device", "auto")), gpus_at_start, cfg.prefill + cfg.decode, joined=True,
                      growing=cfg.autoscale is not None)
    for role in (Role.PREFILL, Role.DECODE):
        p = worker_placement(cfg, role, resolve_transports(cfg.transport), share)
        demand = {"CPU": p.resources["num_cpus"], "GPU": p.resources["num_gpus"], **p.resources.get("resources", {})}
        fits = {name for name, t in types.items() if _fits(demand, t["resources"])}
        assert fits == {role.value}, (role, demand)

    (ingress,) = rendered.serve_config["applications"][0]["deployments"]
    opts = ingress["ray_actor_options"]
    demand = {"CPU": opts["num_cpus"], **opts["resources"]}
    assert {name for name, t in types.items() if _fits(demand, t["resources"])} == {head_type}
    assert Ingress.ray_actor_options.get("num_gpus", 0) == 0


def test_pending_workers_make_ray_add_pods_of_their_own_group(rendered: Rendered, tmp_path: Path) -> None:
    """Workers the Controller asked for beyond what the pods hold stay pending; Ray's own
    scheduler of resource demands (what its autoscaler runs every round) answers them with new
    pods of exactly that pool's group, up to the group's maxReplicas."""
    from ray.autoscaler._private.node_provider_availability_tracker import NodeAvailabilitySummary
    from ray.autoscaler._private.resource_demand_scheduler import _default_utilization_scorer, get_nodes_for

    from splitserve.control.actors import gpu_share, resolve_transports, worker_placement

    v = rendered.case.values()
    cfg = DeployConfig.from_options(dict(_local_args(rendered), model=str(tmp_path)))
    config = _node_types(rendered)
    types = config["available_node_types"]
    existing = {g: v[g]["replicas"] for g in ("prefill", "decode")}
    for role in (Role.PREFILL, Role.DECODE):
        group = v[role.value]
        share = gpu_share(str(cfg.engine.get("device", "auto")), 1, 8, joined=True, growing=cfg.autoscale is not None)
        if share and cfg.tp(role.value) * cfg.pp(role.value) * cfg.dp > 1:  # a GPU per rank (worker_placement refuses less)
            share = 1.0
        p = worker_placement(cfg, role, resolve_transports(cfg.transport), share)
        demand = {"CPU": p.resources["num_cpus"], **p.resources.get("resources", {})}
        if p.resources["num_gpus"]:
            demand["GPU"] = p.resources["num_gpus"]
        room = group["maxReplicas"] - group["replicas"]
        scorer = functools.partial(_default_utilization_scorer,
                                   node_availability_summary=NodeAvailabilitySummary(node_availabilities={}))
        added, left = get_nodes_for(types, existing, config["head_node_type"], 100, [demand] * (room + 1), scorer)
        assert added == ({role.value: room} if room else {}), (role, added)
        assert len(left) == 1  # one more than the group may hold stays pending
