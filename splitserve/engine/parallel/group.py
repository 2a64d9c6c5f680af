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
    failure: str | None = None  # set once a collective failed: the ranks are out of step for good

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return x

    def broadcast(self, obj: Any = None) -> Any:
        return obj

    def broadcast_tensor(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` into every rank's `x` (the others' of the same shape and dtype)."""
        return x

    def wait_all(self) -> None:
        """Until every rank gets here (each has loaded its shard), however long that takes."""

    def gather(self, obj: Any) -> list | None:
        """Every rank's `obj` on rank 0, in rank order (None on the others)."""
        return [obj]

    def close(self) -> None:
        pass


IDLE_FOREVER = datetime.timedelta(days=365)


def meeting_point(host: str, size: int, timeout_s: float):
    """Process 0's rendezvous store, listening before any other process starts, and its
    address. The OS picks the port while the store holds it: a port probed free and closed
    again could be taken by another group starting at the same moment (two tests in parallel),
    whose processes would then meet ours."""
    import torch.distributed as dist

    store = dist.TCPStore(host, 0, size, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    return store, f"{host}:{store.port}"


class DistGroup(TPGroup):
    """`size` ranks over torch.distributed. A rank that dies makes the others' next collective
    fail (at once where its connections close, else within `timeout_s`): the engine stops, it
    does not hang. The step broadcast is apart, on a group of its own without that limit: a
    follower waits in it between steps, and an engine may stay idle for hours."""

    kind = "tensor-parallel"  # what the group is, in its failure's words

    def __init__(self, spec: GroupSpec, store=None) -> None:
        """`store`: process 0's `meeting_point` (the others reach it at `spec.address`)."""
        import torch.distributed as dist

        self._dist = dist
        self.rank, self.size = spec.rank, spec.size
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        if store is None:
            dist.init_process_group(spec.backend, init_method=f"tcp://{spec.address}", rank=spec.rank,
                                    world_size=spec.size, timeout=timeout)
        else:  # under the prefix the others' `init_method` gives their keys
            dist.init_process_group(spec.backend, store=dist.PrefixStore("default_pg", store), rank=spec.rank,
                                    world_size=spec.size, timeout=timeout)
        self._steps = dist.new_group(backend=spec.backend, timeout=IDLE_FOREVER)

    def _collective(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # a rank is gone or late: no later collective lines up with the others'
            self.failure = self.failure or f"a collective of its {self.kind} group failed with {type(e).__name__}"
            raise

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self._collective(self._dist.all_reduce, x)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._collective(self._dist.all_gather, parts, x.contiguous())
        return torch.cat(parts, dim=dim)

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank (what rank 0 decided for the step)."""
        box = [obj]
        self._collective(self._dist.broadcast_object_list, box, src=0, group=self._steps)
        return box[0]

    def broadcast_tensor(self, x: torch.Tensor) -> torch.Tensor:
        self._collective(self._dist.broadcast, x, src=0)
        return x

    def wait_all(self) -> None:
        self._collective(self._dist.barrier, group=self._steps)

    def gather(self, obj: Any) -> list | None:
        # untimed as the step broadcast: a rank's call (a long pull) may take longer than a step's
        # collectives may; each call bounds its own I/O
        out = [None] * self.size if self.rank == 0 else None
        self._collective(self._dist.gather_object, obj, out, dst=0, group=self._steps)
        return out

    def close(self) -> None:
        if self._dist.is_initialized():
            self._dist.destroy_process_group()
