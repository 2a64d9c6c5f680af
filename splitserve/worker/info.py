"""What a worker says about itself once, at registration (the Controller's registry keeps it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitserve.types import MemoryReport, RankPlace

if TYPE_CHECKING:  # kv_transfer brings torch; the registry and the router stay without it
    from splitserve.kv_transfer.base import TransportEndpoint


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker tells the registry once, when it is ready: where it runs and how peers
    reach its KV cache (one endpoint per transport it offers, in its order of preference)."""

    node_id: str
    node_ip: str
    pid: int
    endpoints: tuple[TransportEndpoint, ...]
    ranks: tuple[RankPlace, ...] = ()  # a tensor-parallel worker's ranks 1..T-1 (rank 0 is this one)
    memory: MemoryReport | None = None  # what its engine holds (rank 0's)

    @property
    def transports(self) -> tuple[str, ...]:
        return tuple(e.transport for e in self.endpoints)
