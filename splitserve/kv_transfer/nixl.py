"""NIXL transport: the decode worker pulls a request's KV blocks from the prefill worker's memory
with one-sided NIXL READs (UCX backend: RDMA between hosts, CUDA IPC / CMA within one, TCP as a
fallback).

Where this sits in a request's life (see base.py for the whole handoff):
  * At start-up every worker calls `register(storage, layout, host)`: the whole KV storage tensor
    is registered with this process's NIXL agent once, and the returned `TransportEndpoint`
    (agent name + agent metadata) is published with the worker.
  * The prefill worker does nothing per request: NIXL reads are one-sided, so the prefill side's
    CPU never touches the bytes; its job is only to keep the blocks pinned under the lease.
  * The decode worker calls `read(handoff, dst_blocks)`: it loads the prefill agent's metadata
    (once per agent), turns the block lists into a few large descriptors (`plan_segments`: one
    per run of consecutive blocks per layer and K/V) and posts a READ. It then `poll`s, never
    blocking, until DONE or FAILED, verifies the checksum elsewhere, and `release`s the handle.

The endpoint's `metadata` is this module's own envelope: a small header (format version, base
address and device of the registered storage, needed to address remote bytes) followed by the
NIXL agent metadata blob.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from splitserve.kv_transfer.base import (
    KVHandoff,
    KVLayout,
    TransferError,
    TransferHandle,
    TransferState,
    TransferStatus,
    TransportEndpoint,
)
from splitserve.kv_transfer.regions import plan_segments

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'splitserve[nixl]'  (or: pip install nixl)"

# Envelope in front of the agent metadata: magic, version, base address, device id, memory kind.
_MAGIC = b"SSNX"
_HEADER = struct.Struct("<4sBQiB")
_VERSION = 1
_DRAM, _VRAM = 0, 1
_MEM_NAMES = {_DRAM: "DRAM", _VRAM: "VRAM"}


def _default_ucx_tls() -> None:
    """Choose UCX transports unless the user already has (UCX reads UCX_TLS when the agent's
    backend starts, so this must run before the agent is created).

    On a machine with neither RDMA devices nor CUDA, tcp+cma is the fastest host-to-host path
    (measured ~2-3 GB/s on loopback) and avoids UCX probing transports that cannot work. Where
    RDMA or CUDA exists we leave UCX to pick rc/dc/cuda_ipc: forcing tcp,cma there would turn
    the RDMA path DESIGN.md chose NIXL for into plain TCP.
    """
    if "UCX_TLS" in os.environ:
        return
    if _has_rdma_device() or _cuda_available():
        return
    os.environ["UCX_TLS"] = "tcp,cma"


def _has_rdma_device() -> bool:
    try:
        return bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        return False


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch is a hard dependency
        return False


def _import_nixl():
    try:
        import nixl  # noqa: F401  (the meta package picks the nixl_cu12/cu13 backend wheel)
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
    except ImportError as e:
        raise RuntimeError(f"the nixl KV transport needs the NIXL Python package ({e}); install it with: {INSTALL_HINT}") from e
    return nixl_agent, nixl_agent_config, nixl_thread_sync_t


def _is_disconnect(exc: BaseException) -> bool:
    # NIXL raises per-status exception classes from its compiled bindings (nixlRemoteDisconnectError,
    # nixlNotFoundError, ...); matching by name avoids importing a CUDA-flavoured module path.
    name = type(exc).__name__
    return "Disconnect" in name or "NOT_FOUND" in str(exc) or "DISCONNECT" in str(exc)


def _failure(exc: BaseException, what: str) -> TransferError:
    if isinstance(exc, TransferError):
        return exc
    kind = "unreachable" if _is_disconnect(exc) else "internal"
    return TransferError(kind, f"NIXL {what} failed: {type(exc).__name__}: {exc}")


@dataclass
class NixlTransferHandle(TransferHandle):
    xfer: Any = None  # nixl_xfer_handle; None for an empty read or once released
    remote_agent: str = ""
    posted_at: float = 0.0
    status: TransferStatus = field(default_factory=lambda: TransferStatus(TransferState.PENDING))
    released: bool = False


@dataclass(frozen=True)
class _Remote:
    metadata: bytes  # the agent blob as loaded, to notice a peer that restarted under the same name
    base_addr: int
    dev_id: int
    mem: str


class NixlTransport:
    """KV transport over NIXL. One instance per worker process; thread-safe."""

    name = "nixl"

    def __init__(self, agent_name: str | None = None, backends: Sequence[str] = ("UCX",)) -> None:
        _default_ucx_tls()
        nixl_agent, nixl_agent_config, sync_t = _import_nixl()
        self.agent_name = agent_name or f"splitserve-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # STRICT sync: the engine may poll from one thread while another starts reads.
        config = nixl_agent_config(backends=list(backends), sync_mode=sync_t.NIXL_THREAD_SYNC_STRICT)
        self._agent = nixl_agent(self.agent_name, config)
        missing = [b for b in backends if b not in self._agent.backends]
        if missing:
            raise RuntimeError(
                f"NIXL backend(s) {missing} unavailable; plugins found: {self._agent.get_plugin_list()}"
            )
        self._lock = threading.Lock()
        self._remotes: dict[str, _Remote] = {}
        self._handles: dict[int, NixlTransferHandle] = {}  # posted, not yet released: freed on close
        self._storage = None  # keeps the registered tensor alive while NIXL points at it
        self._layout: KVLayout | None = None
        self._reg = None
        self._mem = "DRAM"
        self._dev_id = 0
        self.endpoint: TransportEndpoint | None = None

    # -- registration ----------------------------------------------------------------------

    def register(self, storage, layout: KVLayout, host: str) -> TransportEndpoint:
        """Register the whole KV storage tensor once; peers address it by byte offset."""
        if self._reg is not None:
            raise RuntimeError("NixlTransport.register called twice; one storage per transport (close() first)")
        self._check_storage(storage, layout)
        self._mem = "DRAM" if storage.device.type == "cpu" else "VRAM"
        self._dev_id = 0 if self._mem == "DRAM" else storage.get_device()
        self._reg = self._agent.register_memory(storage)
        self._storage, self._layout = storage, layout
        # The agent metadata must be taken after registering: it carries the registered regions.
        header = _HEADER.pack(_MAGIC, _VERSION, storage.data_ptr(), self._dev_id, _VRAM if self._mem == "VRAM" else _DRAM)
        self.endpoint = TransportEndpoint(
            transport=self.name,
            host=host,
            address=self.agent_name,
            layout=layout,
            metadata=header + self._agent.get_agent_metadata(),
        )
        return self.endpoint

    @staticmethod
    def _check_storage(storage, layout: KVLayout) -> None:
        if not storage.is_contiguous():
            raise ValueError("KV storage must be contiguous to register it as one region")
        nbytes = storage.numel() * storage.element_size()
        if nbytes != layout.storage_bytes:
            raise ValueError(f"KV storage has {nbytes} bytes but its layout says {layout.storage_bytes}")
        if storage.device.type not in ("cpu", "cuda"):
            raise ValueError(f"NIXL can register cpu or cuda tensors, not {storage.device.type}")

    # -- reading ---------------------------------------------------------------------------

    def read(self, src: KVHandoff, dst_blocks: Sequence[int], layers: range | None = None) -> NixlTransferHandle:
        """Post a READ of src.block_ids (layers `layers`) into local dst_blocks.

        Raises TransferError for anything that fails before the transfer is posted (bad
        geometry: "header"; peer gone: "unreachable"); later failures come back from `poll`.
        """
        if self._reg is None or self._layout is None:
            raise RuntimeError("NixlTransport.read before register(): the destination memory is not registered")
        ep = src.endpoint
        if ep.transport != self.name:
            raise TransferError("header", f"handoff endpoint is for transport {ep.transport!r}, not 'nixl'")
        layers = layers if layers is not None else range(ep.layout.num_layers)
        self._check_geometry(ep.layout, src.block_ids, dst_blocks, layers)
        handle = NixlTransferHandle(
            request_id=src.request_id, src=src, dst_blocks=tuple(dst_blocks), layers=layers, remote_agent=ep.address
        )
        local, remote = self._descriptors(ep.layout, src.block_ids, dst_blocks, layers)
        handle.nbytes = int(local[:, 1].sum()) if len(local) else 0
        if not len(local):  # nothing to move; NIXL rejects empty descriptor lists
            handle.status = TransferStatus(TransferState.DONE)
            return handle
        remote_info = self._remote(ep)
        local[:, 0] += self._storage.data_ptr()
        local[:, 2] = self._dev_id
        remote[:, 0] += remote_info.base_addr
        remote[:, 2] = remote_info.dev_id
        self._post(handle, local, remote, remote_info)
        return handle

    def _check_geometry(self, src_layout: KVLayout, src_blocks, dst_blocks, layers: range) -> None:
        """Only the byte geometry matters to a data mover; model identity is verify's job."""
        dst_layout = self._layout
        if src_layout.block_bytes != dst_layout.block_bytes or src_layout.num_layers != dst_layout.num_layers:
            raise TransferError(
                "header",
                f"KV geometry differs: source block_bytes={src_layout.block_bytes} layers={src_layout.num_layers}, "
                f"local block_bytes={dst_layout.block_bytes} layers={dst_layout.num_layers}",
            )
        if len(src_blocks) != len(dst_blocks):
            raise TransferError("header", f"{len(src_blocks)} source blocks but {len(dst_blocks)} destination blocks")
        if layers.step != 1 or (len(layers) and (layers.start < 0 or layers.stop > dst_layout.num_layers)):
            raise TransferError("header", f"layers {layers} outside 0..{dst_layout.num_layers}")
        # Bounds-check both sides: an out-of-range local block would let the NIC write past the storage.
        for blocks, n, side in ((src_blocks, src_layout.num_blocks, "source"), (dst_blocks, dst_layout.num_blocks, "destination")):
            bad = [b for b in blocks if not 0 <= b < n]
            if bad:
                raise TransferError("header", f"{side} block ids {bad[:8]} outside 0..{n - 1}")

    def _descriptors(self, src_layout: KVLayout, src_blocks, dst_blocks, layers: range) -> tuple[np.ndarray, np.ndarray]:
        """(offset, nbytes, dev) rows for the local and remote side, one per merged segment.

        plan_segments computes both offsets with one layout, but the two workers may have
        different num_blocks (so different strides between layers). Planning once with each
        layout yields segments in the same order and sizes; take each side's offsets from its own.
        """
        src_plan = plan_segments(src_layout, src_blocks, dst_blocks, layers)
        dst_plan = plan_segments(self._layout, src_blocks, dst_blocks, layers)
        local = np.zeros((len(src_plan), 3), dtype=np.uint64)
        remote = np.zeros((len(src_plan), 3), dtype=np.uint64)
        for i, (s, d) in enumerate(zip(src_plan, dst_plan)):
            remote[i, 0], remote[i, 1] = s.src_offset, s.nbytes
            local[i, 0], local[i, 1] = d.dst_offset, d.nbytes
        return local, remote

    def _remote(self, ep: TransportEndpoint) -> _Remote:
        """Load the peer's agent metadata once; reload if it changed (a restarted peer)."""
        info = self._parse_metadata(ep)
        with self._lock:
            cached = self._remotes.get(ep.address)
            if cached is not None and cached.metadata == info.metadata:
                return cached
            if cached is not None:
                self._forget(ep.address)
            try:
                loaded = self._agent.add_remote_agent(info.metadata)
            except Exception as e:
                # Loading metadata connects to the peer: a backend error here means it is not there.
                err = _failure(e, f"connecting to agent {ep.address!r}")
                if "Backend" in type(e).__name__:
                    err = TransferError("unreachable", str(err).split(": ", 1)[1])
                raise err from e
            # NIXL returns the name as bytes; everything else in its API wants str.
            loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
            if loaded != ep.address:
                self._agent.remove_remote_agent(loaded)
                raise TransferError("header", f"endpoint names agent {ep.address!r} but its metadata is {loaded!r}")
            self._remotes[ep.address] = info
            return info

    @staticmethod
    def _parse_metadata(ep: TransportEndpoint) -> _Remote:
        md = ep.metadata
        if len(md) <= _HEADER.size:
            raise TransferError("header", f"endpoint {ep.address!r} carries no NIXL metadata")
        magic, version, base, dev, mem = _HEADER.unpack_from(md)
        if magic != _MAGIC or version != _VERSION or mem not in _MEM_NAMES:
            raise TransferError("header", f"endpoint {ep.address!r}: unknown NIXL metadata format {magic!r} v{version}")
        return _Remote(metadata=bytes(md[_HEADER.size:]), base_addr=base, dev_id=dev, mem=_MEM_NAMES[mem])

    def _post(self, handle: NixlTransferHandle, local: np.ndarray, remote: np.ndarray, info: _Remote) -> None:
        agent = self._agent
        try:
            local_descs = agent.get_xfer_descs(local, self._mem)
            remote_descs = agent.get_xfer_descs(remote, info.mem)
            handle.xfer = agent.initialize_xfer("READ", local_descs, remote_descs, handle.remote_agent)
            handle.posted_at = time.monotonic()
            state = agent.transfer(handle.xfer)
        except Exception as e:
            self._drop_xfer(handle)
            err = _failure(e, f"READ from {handle.remote_agent!r}")
            if err.kind == "unreachable":
                self._forget_quietly(handle.remote_agent)
            raise err from e
        if state == "ERR":
            self._drop_xfer(handle)
            raise TransferError("internal", f"NIXL refused to post the READ from {handle.remote_agent!r}")
        if state == "DONE":
            handle.status = TransferStatus(TransferState.DONE)
        with self._lock:
            self._handles[id(handle)] = handle

    # -- completion --------------------------------------------------------------------------

    def poll(self, handle: NixlTransferHandle) -> TransferStatus:
        """Never blocks: asks NIXL for the state once. Terminal states are sticky."""
        if handle.status.state is not TransferState.PENDING:
            return handle.status
        if handle.released or handle.xfer is None:
            handle.status = TransferStatus(TransferState.FAILED, TransferError("aborted", "transfer was released while pending"))
            return handle.status
        try:
            state = self._agent.check_xfer_state(handle.xfer)
        except Exception as e:
            err = _failure(e, f"READ from {handle.remote_agent!r}")
            if err.kind == "unreachable":
                self._forget_quietly(handle.remote_agent)
            handle.status = TransferStatus(TransferState.FAILED, err)
            return handle.status
        if state == "DONE":
            handle.status = TransferStatus(TransferState.DONE)
        elif state == "ERR":
            handle.status = TransferStatus(
                TransferState.FAILED, TransferError("internal", f"NIXL READ from {handle.remote_agent!r} ended in error")
            )
        return handle.status

    def release(self, handle: NixlTransferHandle) -> None:
        """Free the NIXL request. A pending one is aborted by NIXL if its backend can; if it
        cannot, the request stays alive (and may still write into dst_blocks) and this raises
        TransferError("aborted") so the caller does not hand those blocks to anyone else."""
        if handle.released:
            return
        handle.released = True
        with self._lock:
            self._handles.pop(id(handle), None)
        if handle.xfer is None:
            return
        xfer, handle.xfer = handle.xfer, None
        try:
            xfer.release()
        except Exception as e:
            # NIXL keeps un-releasable requests on the agent's leak list and retries at teardown.
            self._agent._leaked_xfer_handles.append(xfer._handle)
            xfer._released = True
            if handle.status.state is TransferState.PENDING:
                raise TransferError("aborted", f"could not abort the pending READ from {handle.remote_agent!r}: {e}") from e
            log.warning("NIXL could not release a finished transfer handle: %s", e)

    def _drop_xfer(self, handle: NixlTransferHandle) -> None:
        if handle.xfer is not None:
            try:
                handle.xfer.release()
            except Exception:
                log.debug("releasing a failed NIXL request", exc_info=True)
            handle.xfer = None

    # -- teardown ----------------------------------------------------------------------------

    def _forget(self, name: str) -> None:
        """Drop a peer's metadata (caller holds the lock); this also disconnects from it."""
        self._remotes.pop(name, None)
        self._agent.remove_remote_agent(name)

    def _forget_quietly(self, name: str) -> None:
        # After a disconnect the peer may come back under the same name with new metadata.
        with self._lock:
            if name in self._remotes:
                try:
                    self._forget(name)
                except Exception:
                    log.debug("forgetting NIXL agent %s", name, exc_info=True)

    def close(self) -> None:
        """Release open requests, disconnect from peers, deregister memory. Idempotent."""
        if self._agent is None:
            return
        with self._lock:
            handles = list(self._handles.values())
        for h in handles:
            try:
                self.release(h)
            except TransferError as e:
                log.warning("closing NIXL transport: %s", e)
        with self._lock:
            for name in list(self._remotes):
                try:
                    self._forget(name)
                except Exception:
                    log.debug("removing NIXL agent %s", name, exc_info=True)
        if self._reg is not None:
            try:
                self._agent.deregister_memory(self._reg)
            except Exception:
                log.warning("deregistering KV storage from NIXL failed", exc_info=True)
        self._reg = self._storage = self._layout = self.endpoint = None
        self._agent = None  # drops the agent; its destructor stops the UCX worker

    def __enter__(self) -> "NixlTransport":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
