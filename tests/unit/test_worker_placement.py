"""Workers ask Ray for a GPU exactly when their engine will run on one (Ray hides GPUs from an
actor that did not ask, CUDA_VISIBLE_DEVICES="", and `device: auto` would then fall back to the
CPU on a GPU cluster), share GPUs so every worker can be placed, and offer only the KV
transports their cache can serve."""

import pytest

from splitserve.control import actors
from splitserve.control.deploy_config import DeployConfig
from splitserve.types import ConfigError, Role



@pytest.mark.parametrize("device,cluster_gpus,workers,joined,share", [
    ("auto", 0, 2, False, 0.0),  # a CPU box: the CPU
    ("auto", 8, 2, False, 1.0),  # a GPU cluster: one GPU each, auto then finds CUDA
    ("auto", 1, 2, False, 0.5),  # the default 1P+1D on a one-GPU box: they share it
    ("auto", 3, 4, False, 0.5),  # 1/2, not 3/4: four workers fit three GPUs only in halves
    ("cpu", 8, 2, False, 0.0),  # asked for the CPU on a GPU cluster
    ("cuda", 0, 2, True, 1.0),  # a joined cluster with no GPU yet: an autoscaler may add one
    ("cuda:3", 8, 2, False, 1.0),
])
def test_gpu_share(device, cluster_gpus, workers, joined, share):
    assert actors.gpu_share(device, cluster_gpus, workers, joined) == share


def test_autoscaled_pools_on_a_joined_cluster_ask_a_whole_gpu_each():
    # three workers, two GPUs so far: the third waits for the node the autoscaler adds
    assert actors.gpu_share("auto", 2, 3, joined=True, growing=True) == 1.0
    assert actors.gpu_share("auto", 2, 3, joined=False, growing=True) == 0.5  # our own box does not grow
    assert actors.gpu_share("auto", 0, 3, joined=True, growing=True) == 0.0  # a CPU cluster


def test_cuda_without_a_gpu_on_our_own_cluster_is_refused():
    with pytest.raises(ConfigError, match="Ray sees no GPU here"):
        actors.gpu_share("cuda", 0, 2, joined=False)


@pytest.mark.parametrize("device,share,runs_on", [("auto", 0.0, "auto"), ("auto", 0.5, "auto"), ("cuda:3", 1.0, "cuda")])
def test_worker_placement(tiny_checkpoint, device, share, runs_on):
    cfg = DeployConfig(str(tiny_checkpoint("llama")), engine={"device": device, "block_size": 32})
    p = actors.worker_placement(cfg, Role.DECODE, ["shm", "tcp"], share)
    assert p.resources == {"num_cpus": 1, "num_gpus": share}
    assert p.engine.device == runs_on and p.engine.block_size == 32  # Ray's GPU is device 0 in the actor
    # a GPU cache cannot live in /dev/shm: GPU workers offer tcp (and nixl), never shm
    assert p.transports == (["tcp"] if share else ["shm", "tcp"])
    assert p.engine.kv_shared_memory == (not share)


def test_shm_alone_cannot_serve_gpu_workers(tiny_checkpoint):
    cfg = DeployConfig(str(tiny_checkpoint("llama")), engine={"device": "cuda"})
    with pytest.raises(ConfigError, match="shm transport shares CPU KV caches only"):
        actors.worker_placement(cfg, Role.PREFILL, ["shm"], 1.0)


def test_an_unplaced_worker_is_explained_by_what_the_nodes_have():
    from splitserve.control.unplaced import demand, diagnose

    need = demand([{"CPU": 1, "GPU": 0, "decode_node": 1}, {"CPU": 1}])
    assert need == {"CPU": 2, "decode_node": 1}
    nodes = [{"CPU": 4, "head_node": 100}, {"CPU": 3, "decode_node": 3}]
    busy = diagnose(Role.DECODE, need, nodes, {"CPU": 5, "decode_node": 2})
    assert not busy.infeasible and busy.message == (
        "cannot place a decode worker: it needs 2 CPUs + 1 decode_node on one node; no node has that free now "
        "(the cluster has 5 CPUs + 2 decode_node free in all)")
    never = diagnose(Role.PREFILL, {"CPU": 8}, nodes, {"CPU": 7})
    assert never.infeasible and never.message.endswith("it needs 8 CPUs on one node, and no node of the cluster has "
                                                       "that much")
