"""The thin Ray shells: worker classes become actors here and nowhere else."""

from __future__ import annotations

import ray

from splitserve.config import EngineConfig
from splitserve.decode_worker.worker import DecodeWorker
from splitserve.prefill_worker.worker import PrefillWorker

PrefillActor = ray.remote(PrefillWorker)
DecodeActor = ray.remote(DecodeWorker)


def _engine_config(cfg, **overrides) -> EngineConfig:
    return EngineConfig.from_dict({"model": cfg.model, **cfg.engine, **overrides})


def make_prefill(cfg, transports: list[str], index: int):
    ecfg = _engine_config(cfg, kv_shared_memory="shm" in transports)
    return PrefillActor.options(num_cpus=1).remote(
        ecfg, transports, lease_s=cfg.lease_s, transport_options=cfg.prefill_transport_options)


def make_decode(cfg, transports: list[str], index: int):
    return DecodeActor.options(num_cpus=1).remote(
        _engine_config(cfg, kv_shared_memory="shm" in transports), transports,
        on_transfer_failure=cfg.on_transfer_failure, fault=cfg.decode_fault)


__all__ = ["PrefillActor", "DecodeActor", "make_prefill", "make_decode"]
