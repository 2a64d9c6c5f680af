"""Starting the ranks of one tensor-parallel engine. Rank 0 is the calling process (its
Engine); ranks 1..T-1 are started by a *launcher*, a callable `(config) -> (DistGroup, Ranks)`
that starts them, joins the group as rank 0 and returns the group and a handle on the ranks.
This module's launcher runs them as local processes (`start_local_group`: one host, no Ray);
on a Ray cluster they are actors of the worker's placement group (control/tp_ranks.py). Either
way each rank runs `rank_main`: the same Engine on its rank, following rank 0's steps."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import socket
from typing import Protocol

from splitserve.engine.parallel.group import DistGroup, GroupSpec, TPGroup, meeting_point
from splitserve.types import RankPlace


class Ranks(Protocol):
    """Ranks 1..T-1 as their launcher started them."""

    def places(self) -> tuple[RankPlace, ...]: ...

    def lost(self) -> str | None:
        """Why the group is broken (a rank exited), or None while every rank runs."""

    def stop(self, tp: TPGroup) -> None:
        """End the followers' loop and wait for them (killing any that hang)."""


def on_cuda(config) -> bool:
    import torch

    return config.device.startswith("cuda") or (config.device == "auto" and torch.cuda.is_available())


class LocalRanks:
    def __init__(self, procs: list) -> None:
        self.procs = procs

    def places(self) -> tuple[RankPlace, ...]:
        host = socket.gethostname()
        return tuple(RankPlace(r, host, "127.0.0.1", p.pid or 0) for r, p in enumerate(self.procs, 1))

    def lost(self) -> str | None:
        gone = [r for r, p in enumerate(self.procs, 1) if not p.is_alive()]
        return f"tensor-parallel rank {gone[0]} exited" if gone else None

    def stop(self, tp: TPGroup, timeout_s: float = 10.0) -> None:
        end_followers(tp)
        for p in self.procs:
            p.join(timeout_s)
            if p.is_alive():
                p.kill()
        tp.close()


def start_local_group(config, timeout_s: float = 60.0) -> tuple[DistGroup, LocalRanks]:
    """Start ranks 1..T-1 of `config`'s engine as local processes (rank r on GPU r) and join
    them as rank 0."""
    size = config.tensor_parallel_size
    store, address = meeting_point("127.0.0.1", size, timeout_s)
    backend = "nccl" if on_cuda(config) else "gloo"
    ctx = mp.get_context("spawn")  # a fresh interpreter: no forked torch or thread state
    procs = [ctx.Process(target=rank_main, args=(config, GroupSpec(r, size, address, backend, timeout_s), r),
                         name=f"splitserve-tp-rank{r}", daemon=True) for r in range(1, size)]
    for p in procs:
        p.start()
    try:
        return DistGroup(GroupSpec(0, size, address, backend, timeout_s), store), LocalRanks(procs)
    except Exception:
        for p in procs:
            p.kill()
        raise


def end_followers(tp: TPGroup) -> None:
    try:
        tp.broadcast(None)  # the followers' loop ends
    except Exception:  # a rank already gone: the others exit on the broken group
        pass


def rank_main(config, spec: GroupSpec, gpu: int | None = 0) -> int:
    """One follower rank, to the end of its group; how many steps it ran. `gpu`: the CUDA
    device it runs on (a local rank r takes GPU r; a Ray actor the one Ray gave it)."""
    import torch

    from splitserve.engine.engine import Engine
    from splitserve.engine.parallel.follower import follow

    # the host's cores shared among the ranks (rank 0 keeps its own setting)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.size))
    if on_cuda(config):
        torch.cuda.set_device(gpu)
        config = dataclasses.replace(config, device=f"cuda:{gpu}")
    tp = DistGroup(spec)
    engine = Engine(config, tp)
    try:
        return follow(engine)
    finally:
        engine.close()  # and what was attached to it: the transports it served its cache through
        tp.close()
