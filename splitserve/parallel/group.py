"""The ranks of one tensor-parallel engine and the collectives its model needs. Rank 0 runs
the engine (scheduler, block pool, sampling); every rank runs the model on its shard."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class GroupSpec:
    """Where the ranks meet: rank `rank` of `size`, rendezvous at `address` (host:port)."""

    rank: int
    size: int
    address: str
    backend: str = "gloo"  # "gloo" (CPU) or "nccl" (GPU)
    timeout_s: float = 60.0  # a collective waiting longer than this on a lost rank fails, never hangs


class TPGroup:
    """A single rank: every collective is the identity (tensor_parallel_size 1)."""

    rank = 0
    size = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return x

    def broadcast(self, obj: Any = None) -> Any:
        return obj

    def gather(self, obj: Any) -> list | None:
        """Every rank's `obj` on rank 0, in rank order (None on the others)."""
        return [obj]

    def close(self) -> None:
        pass


class DistGroup(TPGroup):
    """`size` ranks over torch.distributed. A rank that dies makes the others' next collective
    fail within `timeout_s` (gloo's timeout): the engine stops, it does not hang."""

    def __init__(self, spec: GroupSpec) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.rank, self.size = spec.rank, spec.size
        dist.init_process_group(spec.backend, init_method=f"tcp://{spec.address}", rank=spec.rank,
                                world_size=spec.size, timeout=datetime.timedelta(seconds=spec.timeout_s))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self._dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=dim)

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank (what rank 0 decided for the step)."""
        box = [obj]
        self._dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj: Any) -> list | None:
        out = [None] * self.size if self.rank == 0 else None
        self._dist.gather_object(obj, out, dst=0)
        return out

    def close(self) -> None:
        if self._dist.is_initialized():
            self._dist.destroy_process_group()
