"""KV transfer: how a decode worker pulls a request's KV blocks from the prefill worker that
computed them (DESIGN.md §1 steps 5–6, §4 "KV transfer").

`base` is the contract, `regions` plans which bytes move, `verify` guards their use; the
transports (`shm` same host, `tcp` anywhere, `nixl` RDMA/UCX) only move bytes. Which transport a
(prefill, decode) pair uses is policy (`router.transport_choice`); `make_transport` makes one by name.
"""

from __future__ import annotations

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
from splitserve.config import KV_TRANSPORTS as KNOWN_TRANSPORTS

# The transports and their helpers load torch (and NIXL its own stack): imported when first
# named, so that a process that only reads the contract's types (an ingress replica reading
# worker endpoints) never loads them.
_LAZY = {
    "wait_transfer": "jobs",
    "Segment": "regions", "block_runs": "regions", "kv_checksum": "regions", "plan_segments": "regions",
    "plan_transfer": "regions",
    "ShmTransport": "shm",
    "TcpTransport": "tcp",
    "check_handoff": "verify", "check_header": "verify", "verify_landed": "verify",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"splitserve.kv_transfer.{_LAZY[name]}"), name)
    raise AttributeError(name)


def make_transport(name: str, **opts) -> KVTransport:
    """A transport by name; `opts` go to its constructor. NIXL is imported only when asked for,
    so machines without it never touch its dependencies."""
    if name == "shm":
        from splitserve.kv_transfer.shm import ShmTransport

        return ShmTransport(**opts)
    if name == "tcp":
        from splitserve.kv_transfer.tcp import TcpTransport

        return TcpTransport(**opts)
    if name == "nixl":
        from splitserve.kv_transfer.nixl import NixlTransport

        return NixlTransport(**opts)
    raise ValueError(f"unknown KV transport {name!r}; known: {', '.join(sorted(KNOWN_TRANSPORTS))}")


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
    "kv_checksum",
    "make_transport",
    "plan_segments",
    "plan_transfer",
    "verify_landed",
    "wait_transfer",
]
