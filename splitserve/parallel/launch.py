"""A tensor-parallel group on this host: rank 0 is the calling process (its Engine), ranks
1..T-1 are processes it starts, each building the same Engine on its rank and following.
(On a Ray cluster the ranks are actors of one placement group instead; the group and the
follower loop are the same.)"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket

from splitserve.parallel.group import DistGroup, GroupSpec, TPGroup


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def start_local_group(config, timeout_s: float = 60.0) -> tuple[DistGroup, list]:
    """Start ranks 1..T-1 of `config`'s engine and join them as rank 0."""
    size = config.tensor_parallel_size
    address = free_address()
    backend = "nccl" if _on_cuda(config) else "gloo"
    ctx = mp.get_context("spawn")  # a fresh interpreter: no forked torch or thread state
    procs = [ctx.Process(target=_rank_main, args=(config, GroupSpec(r, size, address, backend, timeout_s)),
                         name=f"splitserve-tp-rank{r}", daemon=True) for r in range(1, size)]
    for p in procs:
        p.start()
    try:
        return DistGroup(GroupSpec(0, size, address, backend, timeout_s)), procs
    except Exception:
        for p in procs:
            p.kill()
        raise


def stop_local_group(tp: TPGroup, procs: list, timeout_s: float = 10.0) -> None:
    try:
        tp.broadcast(None)  # the followers' loop ends
    except Exception:  # a rank already gone: the others exit on the broken group
        pass
    for p in procs:
        p.join(timeout_s)
        if p.is_alive():
            p.kill()
    tp.close()


def _on_cuda(config) -> bool:
    import torch

    return config.device.startswith("cuda") or (config.device == "auto" and torch.cuda.is_available())


def _rank_main(config, spec: GroupSpec) -> None:
    import dataclasses

    import torch

    from splitserve.engine.engine import Engine
    from splitserve.parallel.follower import follow

    # the host's cores shared among the ranks (rank 0 keeps its own setting)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.size))
    if _on_cuda(config):  # rank r on GPU r (rank 0, the caller, on GPU 0): NCCL wants one each
        torch.cuda.set_device(spec.rank)
        config = dataclasses.replace(config, device=f"cuda:{spec.rank}")
    tp = DistGroup(spec)
    engine = Engine(config, tp)
    try:
        follow(engine)
    finally:
        engine.kv.close()
        tp.close()
