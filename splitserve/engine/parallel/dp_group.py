"""The ranks of a data-parallel engine (data-parallel attention + expert parallelism,
engine/parallel/dp_engine.py) and their collectives: D replicas, each a whole Engine on its own
requests, meeting in every MoE layer's all-to-all and once a step to agree on the step.

Replica 0 is the calling process (the front's own replica); replicas 1..D-1 are started by a
*launcher*, a callable `(config) -> (DPGroup, Ranks)` as for tensor parallelism
(engine/parallel/launch.py): this module's runs them as local processes; on a Ray cluster they
would be actors of the worker's placement group. Each runs `replica_main`: its Engine, serving
the front's step orders until the front sends None."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import time
from typing import Any

import torch

from splitserve.engine.parallel.group import DistGroup, GroupSpec, meeting_point
from splitserve.engine.parallel.launch import LocalRanks, on_cuda


class DPGroup(DistGroup):
    """`size` data-parallel replicas over torch.distributed. Beside the TP group's broadcast (the
    step order, untimed: an idle engine waits there) and gather: the experts' all-to-all and the
    step answers' gather, both bounded by the spec's timeout (every replica ran the same step in
    lockstep, so a late one is a lost one). Counts what the all-to-alls moved for the benchmark:
    `a2a_bytes` this rank's sends, `a2a_remote_bytes` those to other ranks (what crosses a
    wire), `a2a_s` the time spent in them."""

    kind = "data-parallel"

    def __init__(self, spec: GroupSpec, store=None) -> None:
        super().__init__(spec, store)
        self.a2a_bytes = self.a2a_remote_bytes = 0
        self.a2a_s = 0.0
        self.a2a_calls = 0

    def all_to_all(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        """Rows `send` cut by `send_splits` (rows to rank 0, 1, ...); the rows every rank sent
        here, in rank order (`recv_splits` of them from each)."""
        recv = send.new_empty((sum(recv_splits), *send.shape[1:]))
        t = time.perf_counter()
        # gloo has all_to_all_single (uneven splits, every dtype we send); NCCL too
        self._collective(self._dist.all_to_all_single, recv, send.contiguous(), recv_splits, send_splits)
        self.a2a_s += time.perf_counter() - t
        row = send[0].numel() * send.element_size() if send.shape[0] else 0
        self.a2a_bytes += send.shape[0] * row
        self.a2a_remote_bytes += (send.shape[0] - send_splits[self.rank]) * row
        self.a2a_calls += 1
        return recv

    def gather_step(self, obj: Any) -> list | None:
        """Every replica's answer to a step on rank 0 (timed, on the default group)."""
        out = [None] * self.size if self.rank == 0 else None
        self._collective(self._dist.gather_object, obj, out, dst=0)
        return out


class LocalReplicas(LocalRanks):
    def lost(self) -> str | None:
        gone = [r for r, p in enumerate(self.procs, 1) if not p.is_alive()]
        return f"data-parallel replica {gone[0]} exited" if gone else None

    def abandon(self, group: DPGroup) -> None:
        """End the replicas of a broken group without a word (they would wait on it)."""
        for p in self.procs:
            p.kill()
            p.join()
        group.close()


def start_local_replicas(config, timeout_s: float = 60.0) -> tuple[DPGroup, LocalReplicas]:
    """Start replicas 1..D-1 of `config`'s engine as local processes (replica r on GPU r) and join
    them as replica 0."""
    size = config.data_parallel_size
    store, address = meeting_point("127.0.0.1", size, timeout_s)
    backend = "nccl" if on_cuda(config) else "gloo"
    ctx = mp.get_context("spawn")  # a fresh interpreter: no forked torch or thread state
    procs = [ctx.Process(target=replica_main, args=(config, GroupSpec(r, size, address, backend, timeout_s), r),
                         name=f"splitserve-dp-replica{r}", daemon=True) for r in range(1, size)]
    for p in procs:
        p.start()
    try:
        return DPGroup(GroupSpec(0, size, address, backend, timeout_s), store), LocalReplicas(procs)
    except Exception:
        for p in procs:
            p.kill()
        raise


def replica_main(config, spec: GroupSpec, gpu: int | None = 0) -> int:
    """One replica > 0, to the end of its group; how many steps it ran."""
    from splitserve.engine.engine import Engine
    from splitserve.engine.parallel.dp_engine import serve

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.size))  # the host's cores shared
    if on_cuda(config):
        torch.cuda.set_device(gpu)
        config = dataclasses.replace(config, device=f"cuda:{gpu}")
    # no peer reads a replica's cache (no handoff lands on a data-parallel engine): not in /dev/shm
    config = dataclasses.replace(config, kv_shared_memory=False)
    group = DPGroup(spec)
    engine = Engine(config, dp=group)
    try:
        group.wait_all()  # with the front, once every replica has loaded
        return serve(engine, group)
    finally:
        engine.close()
        group.close()


def check(cfg, config) -> None:
    """Refuse, before any replica starts, a data-parallel size the model cannot take."""
    from splitserve.types import ConfigError

    d = config.data_parallel_size
    if d == 1:
        return
    if cfg.moe is None:
        raise ConfigError("data_parallel_size > 1 needs a mixture-of-experts model (data-parallel attention "
                          "spreads the experts over the replicas; a dense model wants independent workers)")
    if cfg.moe.num_experts % d:
        raise ConfigError(f"data_parallel_size {d} does not divide num_experts {cfg.moe.num_experts}")
