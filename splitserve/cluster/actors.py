"""The thin Ray shells: worker classes become actors here and nowhere else."""

from __future__ import annotations

from typing import NamedTuple

import ray

from splitserve.config import EngineConfig
from splitserve.types import ConfigError
from splitserve.decode_worker.worker import DecodeWorker
from splitserve.prefill_worker.worker import PrefillWorker

PrefillActor = ray.remote(PrefillWorker)
DecodeActor = ray.remote(DecodeWorker)


def _engine_config(cfg, **overrides) -> EngineConfig:
    return EngineConfig.from_dict({"model": cfg.model, **cfg.engine, **overrides})


class Placement(NamedTuple):
    engine: EngineConfig
    transports: list[str]
    resources: dict  # Ray actor options


def worker_placement(cfg, transports: list[str], cluster_gpus: float) -> Placement:
    """What a worker runs, which KV transports it offers, what it asks Ray for. Ray hides every
    GPU from an actor that did not ask for one (CUDA_VISIBLE_DEVICES=""), so a GPU worker must
    ask: `device: auto` asks for one GPU when the cluster has any, `cuda` always (an autoscaler
    may add GPU nodes), `cpu` never. Inside the actor Ray's GPU is device 0: `cuda:N` becomes
    `cuda`. shm shares CPU caches only, so a GPU worker offers the others (tcp stages through
    host memory, nixl reads GPU memory directly)."""
    device = str(cfg.engine.get("device", "auto"))
    gpu = device.startswith("cuda") or (device == "auto" and cluster_gpus > 0)
    offered = [t for t in transports if not (gpu and t == "shm")]
    if not offered:
        raise ConfigError("the shm transport shares CPU KV caches only; GPU workers need tcp or nixl "
                          "(transport: auto picks them)")
    overrides = {"kv_shared_memory": "shm" in offered}
    if device.startswith("cuda:"):
        overrides["device"] = "cuda"
    return Placement(_engine_config(cfg, **overrides), offered, {"num_cpus": 1, "num_gpus": 1 if gpu else 0})


def make_prefill(cfg, transports: list[str], index: int, cluster_gpus: float = 0.0):
    p = worker_placement(cfg, transports, cluster_gpus)
    return PrefillActor.options(**p.resources).remote(
        p.engine, p.transports, lease_s=cfg.lease_s, transport_options=cfg.prefill_transport_options)


def make_decode(cfg, transports: list[str], index: int, cluster_gpus: float = 0.0):
    p = worker_placement(cfg, transports, cluster_gpus)
    return DecodeActor.options(**p.resources).remote(
        p.engine, p.transports, on_transfer_failure=cfg.on_transfer_failure, fault=cfg.decode_fault)


__all__ = ["PrefillActor", "DecodeActor", "make_prefill", "make_decode", "worker_placement"]
