"""KV transfer: how a decode worker pulls a request's KV blocks from the prefill worker that
computed them (DESIGN.md §1 steps 5–6, §4 "KV transfer").

`base` is the contract, `regions` plans which bytes move, `verify` guards their use; the
transports (`shm` same host, `tcp` anywhere, `nixl` RDMA/UCX) only move bytes. Which transport a
(prefill, decode) pair uses is policy: `choose_transport` by locality, or `make_transport` by name.
"""

from __future__ import annotations

from typing import Sequence

from splitserve.kv_transfer.base import (
    KVHandoff,
    KVLayout,
    KVTransport,
    TransferError,
    TransferHandle,
    TransferHeader,
    TransferState,
    TransferStatus,
    TransportEndpoint,
)
from splitserve.kv_transfer.jobs import wait_transfer
from splitserve.kv_transfer.regions import Segment, block_runs, kv_checksum, plan_segments, plan_transfer
from splitserve.kv_transfer.shm import ShmTransport
from splitserve.kv_transfer.tcp import TcpTransport
from splitserve.kv_transfer.verify import check_handoff, check_header, verify_landed

KNOWN_TRANSPORTS = ("nixl", "shm", "tcp")


def make_transport(name: str, **opts) -> KVTransport:
    """A transport by name; `opts` go to its constructor. NIXL is imported only when asked for,
    so machines without it never touch its dependencies."""
    if name == "shm":
        return ShmTransport(**opts)
    if name == "tcp":
        return TcpTransport(**opts)
    if name == "nixl":
        from splitserve.kv_transfer.nixl import NixlTransport

        return NixlTransport(**opts)
    raise ValueError(f"unknown KV transport {name!r}; known: {', '.join(KNOWN_TRANSPORTS)}")


def choose_transport(same_node: bool, source: Sequence[str], reader: Sequence[str]) -> str:
    """The transport for one (prefill, decode) pair, from what each offers: shared memory when
    both run on one node, else NIXL, else TCP. A pair that shares only one takes that one (a
    transport chosen by name)."""
    common = [t for t in source if t in reader]
    if len(common) == 1:
        return common[0]
    if same_node and "shm" in common:
        return "shm"
    for name in ("nixl", "tcp"):
        if name in common:
            return name
    raise ValueError(f"no KV transport in common: the source offers {list(source)}, the reader {list(reader)}; "
                     f"known: {', '.join(KNOWN_TRANSPORTS)}")


__all__ = [
    "KNOWN_TRANSPORTS",
    "KVHandoff",
    "KVLayout",
    "KVTransport",
    "Segment",
    "ShmTransport",
    "TcpTransport",
    "TransferError",
    "TransferHandle",
    "TransferHeader",
    "TransferState",
    "TransferStatus",
    "TransportEndpoint",
    "block_runs",
    "check_handoff",
    "check_header",
    "choose_transport",
    "kv_checksum",
    "make_transport",
    "plan_segments",
    "plan_transfer",
    "verify_landed",
    "wait_transfer",
]
