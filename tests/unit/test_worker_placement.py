"""Workers ask Ray for a GPU exactly when their engine will run on one (Ray hides GPUs from an
actor that did not ask, CUDA_VISIBLE_DEVICES="", and `device: auto` would then fall back to the
CPU on a GPU cluster), and offer only the KV transports their cache can serve."""

import pytest

from splitserve.cluster.cluster import ClusterConfig
from splitserve.types import ConfigError

actors = pytest.importorskip("splitserve.cluster.actors")


@pytest.mark.parametrize("device,cluster_gpus,gpus,runs_on", [
    ("auto", 0, 0, "auto"),  # a CPU cluster: the CPU
    ("auto", 8, 1, "auto"),  # a GPU cluster: one GPU each, auto then finds CUDA
    ("cpu", 8, 0, "cpu"),  # asked for the CPU on a GPU cluster
    ("cuda", 0, 1, "cuda"),  # no GPU yet: the request lets an autoscaler add one
    ("cuda:3", 8, 1, "cuda"),  # Ray's GPU is device 0 inside the actor
])
def test_worker_placement(tiny_checkpoint, device, cluster_gpus, gpus, runs_on):
    cfg = ClusterConfig(str(tiny_checkpoint("llama")), engine={"device": device, "block_size": 32})
    p = actors.worker_placement(cfg, ["shm", "tcp"], cluster_gpus)
    assert p.resources == {"num_cpus": 1, "num_gpus": gpus}
    assert p.engine.device == runs_on and p.engine.block_size == 32
    # a GPU cache cannot live in /dev/shm: GPU workers offer tcp (and nixl), never shm
    assert p.transports == (["tcp"] if gpus else ["shm", "tcp"])
    assert p.engine.kv_shared_memory == (not gpus)


def test_shm_alone_cannot_serve_gpu_workers(tiny_checkpoint):
    cfg = ClusterConfig(str(tiny_checkpoint("llama")), engine={"device": "cuda"})
    with pytest.raises(ConfigError, match="shm transport shares CPU KV caches only"):
        actors.worker_placement(cfg, ["shm"], 1)
