"""The thin Ray shells: worker classes become actors here and nowhere else."""

from __future__ import annotations

import dataclasses

import ray

from splitserve.config import EngineConfig
from splitserve.decode_worker.worker import DecodeWorker
from splitserve.prefill_worker.worker import PrefillWorker

PrefillActor = ray.remote(PrefillWorker)
DecodeActor = ray.remote(DecodeWorker)


def _engine_config(cfg, **overrides) -> EngineConfig:
    return EngineConfig.from_dict({"model": cfg.model, **cfg.engine, **overrides})


def worker_placement(engine: EngineConfig, cluster_gpus: float) -> tuple[EngineConfig, dict]:
    """The engine config a worker runs and the Ray resources it asks for. Ray hides every GPU
    from an actor that did not ask for one (CUDA_VISIBLE_DEVICES=""), so a GPU worker must ask:
    `device: auto` asks for one GPU when the cluster has any, `cuda` always (an autoscaler may
    add GPU nodes), `cpu` never. Inside the actor Ray's GPU is device 0: `cuda:N` becomes `cuda`."""
    wants_gpu = engine.device.startswith("cuda") or (engine.device == "auto" and cluster_gpus > 0)
    if engine.device.startswith("cuda:"):
        engine = dataclasses.replace(engine, device="cuda")
    return engine, {"num_cpus": 1, "num_gpus": 1 if wants_gpu else 0}


def make_prefill(cfg, transports: list[str], index: int, cluster_gpus: float = 0.0):
    ecfg, resources = worker_placement(_engine_config(cfg, kv_shared_memory="shm" in transports), cluster_gpus)
    return PrefillActor.options(**resources).remote(
        ecfg, transports, lease_s=cfg.lease_s, transport_options=cfg.prefill_transport_options)


def make_decode(cfg, transports: list[str], index: int, cluster_gpus: float = 0.0):
    ecfg, resources = worker_placement(_engine_config(cfg, kv_shared_memory="shm" in transports), cluster_gpus)
    return DecodeActor.options(**resources).remote(
        ecfg, transports, on_transfer_failure=cfg.on_transfer_failure, fault=cfg.decode_fault)


__all__ = ["PrefillActor", "DecodeActor", "make_prefill", "make_decode", "worker_placement"]
