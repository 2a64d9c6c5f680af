"""Leases on handed-off KV blocks: the prefill worker keeps a request's blocks pinned until the
decode worker acknowledges its read, or the lease lapses (then the blocks are freed and a late
acknowledgement is refused, so the reader knows its copy may be torn).

Mechanism only: who frees what is the worker's business; this table just keeps time."""

from __future__ import annotations

import itertools
import os
import time
import uuid
from dataclasses import dataclass
from typing import Callable


@dataclass
class Lease:
    lease_id: str
    request_id: str
    epoch: int
    expires_at: float
    token: bytes  # what its reader shows the KV server: these blocks, no others (kv_transfer/grants.py)


class LeaseTable:
    def __init__(self, ttl_s: float = 30.0, clock: Callable[[], float] = time.time) -> None:
        if ttl_s <= 0:
            raise ValueError(f"lease ttl must be positive, got {ttl_s}")
        self.ttl_s = ttl_s
        self._clock = clock
        self._leases: dict[str, Lease] = {}
        self._epochs = itertools.count(1)

    def __len__(self) -> int:
        return len(self._leases)

    def grant(self, request_id: str) -> Lease:
        lease = Lease(uuid.uuid4().hex, request_id, next(self._epochs), self._clock() + self.ttl_s, os.urandom(16))
        self._leases[lease.lease_id] = lease
        return lease

    def renew(self, lease_id: str) -> bool:
        """Extend a live lease (the reader is still pulling); False if it has lapsed."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.expires_at <= self._clock():
            return False
        lease.expires_at = self._clock() + self.ttl_s
        return True

    def get(self, lease_id: str) -> Lease | None:
        """The lease if it is live."""
        lease = self._leases.get(lease_id)
        return lease if lease is not None and lease.expires_at > self._clock() else None

    def settle(self, lease_id: str) -> Lease | None:
        """The reader is done: the lease ends. Returns it if it was still live (the blocks were
        pinned throughout), None if it had lapsed or is unknown."""
        lease = self._leases.pop(lease_id, None)
        if lease is None or lease.expires_at <= self._clock():
            if lease is not None:
                self._leases[lease_id] = lease  # leave it for expire() to free its blocks
            return None
        return lease

    def request_ids(self) -> set[str]:
        return {lease.request_id for lease in self._leases.values()}

    def take(self, request_id: str) -> list[Lease]:
        """End every lease of this request now, lapsed or not (its caller is gone)."""
        gone = [lease for lease in self._leases.values() if lease.request_id == request_id]
        for lease in gone:
            del self._leases[lease.lease_id]
        return gone

    def expire(self) -> list[Lease]:
        now = self._clock()
        gone = [lease for lease in self._leases.values() if lease.expires_at <= now]
        for lease in gone:
            del self._leases[lease.lease_id]
        return gone
