"""The thin Ray shells: worker classes become actors here and nowhere else."""

from __future__ import annotations

import math
from typing import NamedTuple

import ray

from splitserve.config import EngineConfig
from splitserve.decode_worker.worker import DecodeWorker
from splitserve.prefill_worker.worker import PrefillWorker
from splitserve.types import ConfigError

PrefillActor = ray.remote(PrefillWorker)
DecodeActor = ray.remote(DecodeWorker)


def _engine_config(cfg, **overrides) -> EngineConfig:
    return EngineConfig.from_dict({"model": cfg.model, **cfg.engine, **overrides})


class Placement(NamedTuple):
    engine: EngineConfig
    transports: list[str]
    resources: dict  # Ray actor options


def gpu_share(device: str, cluster_gpus: float, workers: int, joined: bool) -> float:
    """The GPUs one worker asks Ray for. Ray hides every GPU from an actor that did not ask
    (CUDA_VISIBLE_DEVICES=""), so a GPU worker must: `auto` does when the cluster has GPUs,
    `cuda` always. With fewer GPUs than workers they share one evenly (1/2, 1/3 ... so every
    worker fits; each engine sizes its own KV cache). `cuda` with no GPU in sight fails here on
    a cluster we started, and waits on one we joined (an autoscaler may add GPU nodes)."""
    if device == "cpu" or (device == "auto" and cluster_gpus == 0):
        return 0.0
    if cluster_gpus == 0:
        if not joined:
            raise ConfigError(f"device {device!r}, but Ray sees no GPU here; use device auto or cpu")
        return 1.0
    return 1.0 / math.ceil(workers / cluster_gpus) if workers > cluster_gpus else 1.0


def worker_placement(cfg, transports: list[str], share: float) -> Placement:
    """What a worker runs, which KV transports it offers, what it asks Ray for (`gpu_share`).
    Inside the actor Ray's GPU is device 0: `cuda:N` becomes `cuda`. shm shares CPU caches
    only, so a GPU worker offers the others (tcp stages through host memory, nixl reads GPU
    memory directly)."""
    device = str(cfg.engine.get("device", "auto"))
    offered = [t for t in transports if not (share and t == "shm")]
    if not offered:
        raise ConfigError("the shm transport shares CPU KV caches only; GPU workers need tcp or nixl "
                          "(transport auto picks them), or run them on the CPU (device cpu)")
    overrides = {"kv_shared_memory": "shm" in offered}
    if device.startswith("cuda:"):
        overrides["device"] = "cuda"
    return Placement(_engine_config(cfg, **overrides), offered, {"num_cpus": 1, "num_gpus": share})


def make_prefill(cfg, transports: list[str], index: int, share: float):
    p = worker_placement(cfg, transports, share)
    return PrefillActor.options(**p.resources).remote(
        p.engine, p.transports, lease_s=cfg.lease_s, transport_options=cfg.prefill_transport_options)


def make_decode(cfg, transports: list[str], index: int, share: float):
    p = worker_placement(cfg, transports, share)
    return DecodeActor.options(**p.resources).remote(
        p.engine, p.transports, on_transfer_failure=cfg.on_transfer_failure, fault=cfg.decode_fault)


__all__ = ["PrefillActor", "DecodeActor", "make_prefill", "make_decode", "worker_placement", "gpu_share"]
