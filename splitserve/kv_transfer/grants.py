"""Which bytes a reader may take from this worker's KV server: each lease's random token names
the blocks of that lease. The prefill worker grants it when it pins the blocks and revokes it
when the lease ends (acknowledged or lapsed), so a token opens nothing once its blocks may hold
another request's KV. The server checks a request's token before it reads the request's
segment table — which may be no longer than the lease's blocks can need — and every segment
against the lease's blocks.

Mechanism only: which blocks a lease covers is the prefill worker's business."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from splitserve.kv_transfer.base import KVLayout

TOKEN_SIZE = 16  # bytes of a lease token (os.urandom)


@dataclass(frozen=True)
class Grant:
    covered: np.ndarray  # covered[i] = leased blocks among ids 0..i-1 (a prefix count, num_blocks + 1 long)
    max_segments: int  # each block of each (layer, K/V) a segment of its own: the longest useful table
    max_bytes: int  # every leased block of every layer, once


class Grants:
    """Token → Grant; granted and revoked on the worker's event loop, read by the server's threads."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self._grants: dict[bytes, Grant] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._grants)

    def allow(self, token: bytes, blocks: Sequence[int]) -> None:
        lay = self.layout
        if len(token) != TOKEN_SIZE:
            raise ValueError(f"a lease token is {TOKEN_SIZE} bytes, got {len(token)}")
        leased = np.zeros(lay.num_blocks, dtype=np.int64)
        leased[np.asarray(blocks, dtype=np.int64)] = 1
        covered = np.concatenate(([0], np.cumsum(leased)))
        planes = 2 * lay.num_layers
        grant = Grant(covered, planes * len(blocks), planes * int(covered[-1]) * lay.block_bytes)
        with self._lock:
            self._grants[bytes(token)] = grant

    def revoke(self, token: bytes) -> None:
        with self._lock:
            self._grants.pop(bytes(token), None)

    def get(self, token: bytes) -> Grant | None:
        with self._lock:
            return self._grants.get(bytes(token))

    def refusal(self, grant: Grant, offsets: np.ndarray, lengths: np.ndarray) -> str | None:
        """Why these segments are not the lease's to read (None: they are). Each must be whole
        blocks of one (layer, K/V) plane, every one of them leased."""
        lay = self.layout
        bb, nb = lay.block_bytes, lay.num_blocks
        aligned = (offsets % bb == 0) & (lengths % bb == 0) & (lengths > 0)
        start, count = offsets // bb, lengths // bb
        first = start % nb
        inside = aligned & (start // nb < 2 * lay.num_layers) & (count <= nb - first)  # (no u64 overflow)
        first = np.where(inside, first, 0).astype(np.int64)  # both within 0..num_blocks now
        count = np.where(inside, count, 0).astype(np.int64)
        leased = grant.covered[first + count] - grant.covered[first] == count
        bad = np.flatnonzero(~(inside & leased))
        if bad.size:
            i = int(bad[0])
            return f"segment ({int(offsets[i])}, {int(lengths[i])}) is not in this lease's blocks"
        if int(lengths.sum()) > grant.max_bytes:  # each length is within the storage now: no overflow
            return f"{int(lengths.sum())} bytes asked under a lease of {grant.max_bytes}"
        return None
