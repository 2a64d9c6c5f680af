"""Workers ask Ray for a GPU exactly when their engine will run on one: Ray hides GPUs from an
actor that did not ask (CUDA_VISIBLE_DEVICES=""), and `device: auto` would then fall back to
the CPU on a GPU cluster."""

import pytest

from splitserve.config import EngineConfig

actors = pytest.importorskip("splitserve.cluster.actors")


@pytest.mark.parametrize("device,cluster_gpus,gpus,runs_on", [
    ("auto", 0, 0, "auto"),  # a CPU cluster: the CPU
    ("auto", 8, 1, "auto"),  # a GPU cluster: one GPU each, auto then finds CUDA
    ("cpu", 8, 0, "cpu"),  # asked for the CPU on a GPU cluster
    ("cuda", 0, 1, "cuda"),  # no GPU yet: the request lets an autoscaler add one
    ("cuda:3", 8, 1, "cuda"),  # Ray's GPU is device 0 inside the actor
])
def test_worker_placement(tiny_checkpoint, device, cluster_gpus, gpus, runs_on):
    cfg = EngineConfig(model=str(tiny_checkpoint("llama")), device=device, block_size=32)
    engine, resources = actors.worker_placement(cfg, cluster_gpus)
    assert resources == {"num_cpus": 1, "num_gpus": gpus}
    assert engine.device == runs_on and engine.block_size == 32
