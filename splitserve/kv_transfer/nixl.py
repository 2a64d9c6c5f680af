"""NIXL transport: the decode worker pulls a request's KV blocks from the prefill worker's memory
with one-sided NIXL READs (UCX backend: RDMA between hosts, CUDA IPC / CMA within one, TCP as a
fallback).

Where this sits in a request's life (see base.py for the whole handoff):
  * At start-up every worker calls `register(storage, layout, host)`: the whole KV storage tensor
    is registered with this process's NIXL agent once, and the returned `TransportEndpoint`
    (agent name + agent metadata) is published with the worker.
  * The prefill worker does nothing per request: NIXL reads are one-sided, so the prefill side's
    CPU never touches the bytes; its job is only to keep the blocks pinned under the lease.
  * The decode worker calls `read(handoff, dst_blocks)`: it checks and plans the block lists
    into a few large descriptors (`plan_transfer`: one per run of consecutive blocks per layer
    and K/V) and returns at once; a poster thread loads the prefill agent's metadata (once per
    agent: this connects) and posts the READ, since both can block (a TCP connect; over CMA UCX
    copies everything inside the post). The worker `poll`s, never blocking, until DONE or
    FAILED, verifies the checksum elsewhere, and `release`s the handle. Released early (an
    abort), a handle stays PENDING until no READ of it can still write (`release`); only then
    may the worker free the destination blocks.

The endpoint's `metadata` is this module's own envelope: a small header (format version, base
address and device of the registered storage, needed to address remote bytes) followed by the
NIXL agent metadata blob. Starting the agent (UCX transports, a progress thread that sleeps):
nixl_agent.py.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
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
    UngatedReads,
)
from splitserve.kv_transfer.nixl_agent import PROGRESS_DELAY_US, default_ucx_tls, import_nixl, make_agent
from splitserve.kv_transfer.regions import Segment, plan_transfer, storage_tensor

log = logging.getLogger(__name__)

# Envelope in front of the agent metadata: magic, version, base address, device id, memory kind.
_MAGIC = b"SSNX"
_HEADER = struct.Struct("<4sBQiB")
_VERSION = 1
_DRAM, _VRAM = 0, 1
_MEM_NAMES = {_DRAM: "DRAM", _VRAM: "VRAM"}
_CLOSE_DRAIN_S = 5.0  # how long close() waits for released READs still in flight


def _is_disconnect(exc: BaseException) -> bool:
    # NIXL raises per-status exception classes from its compiled bindings (nixlRemoteDisconnectError,
    # nixlNotFoundError, ...); matching by name avoids importing a CUDA-flavoured module path.
    name = type(exc).__name__
    return "Disconnect" in name or "NOT_FOUND" in str(exc) or "DISCONNECT" in str(exc)


def _as_transfer_error(exc: BaseException, what: str) -> TransferError:
    if isinstance(exc, TransferError):
        return exc
    kind = "unreachable" if _is_disconnect(exc) else "internal"
    return TransferError(kind, f"NIXL {what} failed: {type(exc).__name__}: {exc}")


@dataclass(eq=False)  # identity semantics: live handles are kept in a set
class NixlTransferHandle(TransferHandle):
    started: Future | None = None  # the connect-and-post job; its exception is the failure
    xfer: Any = None  # nixl_xfer_handle once posted; None before, for an empty read, once released
    remote_agent: str = ""
    posted_at: float = 0.0  # time.monotonic() when NIXL accepted the READ
    status: TransferStatus = field(default_factory=lambda: TransferStatus(TransferState.PENDING))
    aborted: bool = False

    __eq__ = object.__eq__
    __hash__ = object.__hash__


@dataclass(frozen=True)
class _Remote:
    metadata: bytes  # the agent blob as loaded, to notice a peer that restarted under the same name
    base_addr: int
    dev_id: int
    mem: str


class NixlTransport(UngatedReads):
    """KV transport over NIXL. One instance per worker process; thread-safe.

    `progress_delay_us`: how long NIXL's progress thread sleeps between rounds (0 = NIXL's
    default busy spin, one core per worker).
    """

    name = "nixl"

    def __init__(
        self,
        agent_name: str | None = None,
        backends: Sequence[str] = ("UCX",),
        *,
        progress_delay_us: int = PROGRESS_DELAY_US,
    ) -> None:
        default_ucx_tls()
        api = import_nixl()
        self.agent_name = agent_name or f"splitserve-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # STRICT sync: the poster thread below and the engine's poll() use the agent concurrently.
        config = api.nixl_agent_config(
            enable_prog_thread=True, backends=list(backends), sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
        )
        self._agent = make_agent(api, self.agent_name, config, progress_delay_us)
        missing = [b for b in backends if b not in self._agent.backends]
        if missing:
            raise RuntimeError(f"NIXL backend(s) {missing} unavailable; plugins found: {self._agent.get_plugin_list()}")
        # Connecting to a peer and posting can block (TCP connect; CMA copies inside the post),
        # and read() must return at once: one thread does both, in read() order.
        self._poster = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-nixl")
        self._lock = threading.Lock()
        self._remotes: dict[str, _Remote] = {}
        # not yet freed: unreleased, or released with a READ that may still write (close waits)
        self._handles: set[NixlTransferHandle] = set()
        self._storage = None  # keeps the registered tensor alive while NIXL points at it
        self._layout: KVLayout | None = None
        self._reg = None
        self._mem = "DRAM"
        self._dev_id = 0
        self.endpoint: TransportEndpoint | None = None

    # -- registration ----------------------------------------------------------------------

    def register(self, storage, layout: KVLayout, host: str, serve: bool = True) -> TransportEndpoint:
        """Register the whole KV storage (a KVCacheTensors or its tensor) once; peers address it
        by byte offset from its start. A reader's memory is registered too (it is the target
        of its reads), so `serve` changes nothing here."""
        if self._reg is not None:
            raise RuntimeError("NixlTransport.register called twice; one storage per transport (close() first)")
        tensor = storage_tensor(storage)
        self._check_storage(tensor, layout)
        self._mem = "DRAM" if tensor.device.type == "cpu" else "VRAM"
        self._dev_id = 0 if self._mem == "DRAM" else tensor.get_device()
        self._reg = self._agent.register_memory(tensor)
        self._storage, self._layout = tensor, layout
        # The agent metadata must be taken after registering: it carries the registered regions.
        kind = _VRAM if self._mem == "VRAM" else _DRAM
        header = _HEADER.pack(_MAGIC, _VERSION, tensor.data_ptr(), self._dev_id, kind)
        self.endpoint = TransportEndpoint(
            transport=self.name,
            host=host,
            address=self.agent_name,
            layout=layout,
            metadata=header + self._agent.get_agent_metadata(),
        )
        return self.endpoint

    @staticmethod
    def _check_storage(tensor, layout: KVLayout) -> None:
        if not tensor.is_contiguous():
            raise ValueError("KV storage must be contiguous to register it as one region")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes != layout.storage_bytes:
            raise ValueError(f"KV storage has {nbytes} bytes but its layout says {layout.storage_bytes}")
        if tensor.device.type not in ("cpu", "cuda"):
            raise ValueError(f"NIXL can register cpu or cuda tensors, not {tensor.device.type}")

    # -- reading ---------------------------------------------------------------------------

    def read(self, src: KVHandoff, dst_blocks: Sequence[int], layers: range | None = None) -> NixlTransferHandle:
        """Start a READ of src.block_ids (layers `layers`, default all) into local dst_blocks.

        Returns at once. Every failure, a rejected plan included, comes back from `poll` as
        FAILED: "header" (geometry, block ids, endpoint), "unreachable" (peer gone), "internal".
        """
        if self._reg is None or self._layout is None:
            raise RuntimeError("NixlTransport.read before register(): the destination memory is not registered")
        ep = src.endpoint
        layers = layers if layers is not None else range(ep.layout.num_layers)
        handle = NixlTransferHandle(src.request_id, src, tuple(dst_blocks), layers, remote_agent=ep.address)
        try:
            if ep.transport != self.name:
                raise TransferError("header", f"endpoint is for {ep.transport!r}, not 'nixl'")
            segments = plan_transfer(ep.layout, self._layout, src.block_ids, handle.dst_blocks, layers)
            info = self._parse_metadata(ep)
        except TransferError as e:
            return self._finish(handle, TransferStatus(TransferState.FAILED, e))
        handle.nbytes = sum(s.nbytes for s in segments)
        if not segments:  # nothing to move; NIXL rejects empty descriptor lists
            return self._finish(handle, TransferStatus(TransferState.DONE))
        with self._lock:
            self._handles.add(handle)
        handle.started = self._poster.submit(self._start, handle, ep, info, segments)
        return handle

    @staticmethod
    def _finish(handle: NixlTransferHandle, status: TransferStatus) -> NixlTransferHandle:
        handle.status = status
        return handle

    def _start(self, handle: NixlTransferHandle, ep: TransportEndpoint, info: _Remote, segments: list[Segment]) -> None:
        """Poster thread: connect to the peer if needed, then create and post the READ."""
        if handle.aborted:
            return
        self._connect(ep, info)
        local, remote = self._descriptors(segments, info)
        agent = self._agent
        try:
            xfer = agent.initialize_xfer(
                "READ", agent.get_xfer_descs(local, self._mem), agent.get_xfer_descs(remote, info.mem), ep.address
            )
        except Exception as e:
            raise self._failure(e, f"creating the READ from {ep.address!r}", ep.address) from e
        with self._lock:
            handle.xfer = xfer
            if handle.aborted:  # released while we connected: never post it
                self._free_xfer(handle)
                return
        try:
            state = agent.transfer(xfer)
        except Exception as e:
            raise self._failure(e, f"posting the READ from {ep.address!r}", ep.address) from e
        handle.posted_at = time.monotonic()
        if state == "ERR":
            raise TransferError("internal", f"NIXL refused to post the READ from {ep.address!r}")

    def _descriptors(self, segments: list[Segment], info: _Remote) -> tuple[np.ndarray, np.ndarray]:
        """(address, nbytes, device) rows, one per merged segment, for each side."""
        rows = np.array([(s.dst_offset, s.src_offset, s.nbytes) for s in segments], dtype=np.uint64)
        local = np.empty((len(rows), 3), dtype=np.uint64)
        remote = np.empty((len(rows), 3), dtype=np.uint64)
        local[:, 0] = rows[:, 0] + np.uint64(self._storage.data_ptr())
        remote[:, 0] = rows[:, 1] + np.uint64(info.base_addr)
        local[:, 1] = remote[:, 1] = rows[:, 2]
        local[:, 2], remote[:, 2] = self._dev_id, info.dev_id
        return local, remote

    def _connect(self, ep: TransportEndpoint, info: _Remote) -> None:
        """Load the peer's agent metadata once; reload it if it changed (a restarted peer)."""
        with self._lock:
            cached = self._remotes.get(ep.address)
            if cached is not None and cached.metadata == info.metadata:
                return
            if cached is not None:
                self._forget(ep.address)
        try:
            loaded = self._agent.add_remote_agent(info.metadata)
        except Exception as e:
            # Loading metadata connects to the peer (UCX wire-up): a backend error means it is gone.
            kind = "unreachable" if "Backend" in type(e).__name__ or _is_disconnect(e) else "internal"
            raise TransferError(kind, f"NIXL cannot connect to agent {ep.address!r}: {type(e).__name__}: {e}") from e
        # NIXL returns the name as bytes; the rest of its API wants str.
        loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
        if loaded != ep.address:
            self._agent.remove_remote_agent(loaded)
            raise TransferError("header", f"endpoint names agent {ep.address!r} but its metadata is {loaded!r}")
        with self._lock:
            self._remotes[ep.address] = info

    @staticmethod
    def _parse_metadata(ep: TransportEndpoint) -> _Remote:
        md = ep.metadata
        if len(md) <= _HEADER.size:
            raise TransferError("header", f"endpoint {ep.address!r} carries no NIXL metadata")
        magic, version, base, dev, mem = _HEADER.unpack_from(md)
        if magic != _MAGIC or version != _VERSION or mem not in _MEM_NAMES:
            raise TransferError("header", f"endpoint {ep.address!r}: unknown NIXL metadata format {magic!r} v{version}")
        return _Remote(metadata=bytes(md[_HEADER.size:]), base_addr=base, dev_id=dev, mem=_MEM_NAMES[mem])

    def _failure(self, exc: BaseException, what: str, agent_name: str) -> TransferError:
        err = _as_transfer_error(exc, what)
        if err.kind == "unreachable":
            # The peer may come back under the same name with new metadata: load it afresh then.
            self._forget_quietly(agent_name)
        return err

    # -- completion --------------------------------------------------------------------------

    def poll(self, handle: NixlTransferHandle) -> TransferStatus:
        """Never blocks: looks at the post job, then asks NIXL once. Terminal states are sticky; a
        released handle is PENDING until no READ of it can write (`release`)."""
        if handle.status.state is not TransferState.PENDING:
            return handle.status
        if handle.aborted:
            return self._settle_released(handle)
        started = handle.started
        if started is None or not started.done():
            return handle.status
        exc = started.exception()
        if exc is not None:
            if not isinstance(exc, TransferError):  # a bug must still surface as a status
                exc = TransferError("internal", f"{type(exc).__name__}: {exc}")
            return self._finish(handle, TransferStatus(TransferState.FAILED, exc)).status
        try:
            state = self._agent.check_xfer_state(handle.xfer)
        except Exception as e:
            err = self._failure(e, f"READ from {handle.remote_agent!r}", handle.remote_agent)
            return self._finish(handle, TransferStatus(TransferState.FAILED, err)).status
        if state == "DONE":
            self._finish(handle, TransferStatus(TransferState.DONE))
        elif state == "ERR":
            err = TransferError("internal", f"NIXL READ from {handle.remote_agent!r} ended in error")
            self._finish(handle, TransferStatus(TransferState.FAILED, err))
        return handle.status

    def release(self, handle: NixlTransferHandle) -> None:
        """Abort a pending READ; free its NIXL request once nothing of it can write any more.

        A READ not yet posted never will be. One being posted or in flight is left to end: UCX
        cannot recall an RDMA read it has issued, and a NIXL request released in flight could no
        longer tell us when its bytes stop landing. So the handle stays PENDING until the poster
        has left transfer() and NIXL reports the READ over; `poll` then answers FAILED("aborted")
        (or the DONE / FAILED it had reached) and the caller may free the blocks. Idempotent."""
        with self._lock:
            if handle.aborted:
                return
            handle.aborted = True
            if handle.started is not None:
                handle.started.cancel()  # not started yet: it never will
        self._settle_released(handle)

    def _settle_released(self, handle: NixlTransferHandle) -> TransferStatus:
        """A released handle's status: PENDING while a READ of it may still write, else its
        NIXL request is freed and the status final."""
        started = handle.started
        if started is not None and not started.done():
            return handle.status  # the poster may be inside transfer() for it
        with self._lock:
            if handle.xfer is not None and self._in_flight(handle.xfer):
                return handle.status
            self._free_xfer(handle)
            self._handles.discard(handle)
            if handle.status.state is TransferState.PENDING:
                handle.status = _aborted()
            return handle.status

    def _in_flight(self, xfer) -> bool:
        try:
            return self._agent.check_xfer_state(xfer) == "PROC"
        except Exception:  # NIXL failed the READ: its peer disconnected, or we closed the endpoint
            return False

    def _free_xfer(self, handle: NixlTransferHandle) -> None:
        """Caller holds the lock."""
        xfer, handle.xfer = handle.xfer, None
        if xfer is None:
            return
        try:
            xfer.release()
        except Exception as e:
            # Dropping `xfer` is enough: its finalizer retries and, failing that, parks it on the
            # agent's leak list, which NIXL frees when the agent goes away.
            log.warning("NIXL could not release the READ from %s: %s", handle.remote_agent, e)

    # -- teardown ----------------------------------------------------------------------------

    def _forget(self, name: str) -> None:
        """Drop a peer's metadata (caller holds the lock); this also disconnects from it."""
        self._remotes.pop(name, None)
        self._agent.remove_remote_agent(name)

    def _forget_quietly(self, name: str) -> None:
        with self._lock:
            if name in self._remotes:
                try:
                    self._forget(name)
                except Exception:
                    log.debug("forgetting NIXL agent %s", name, exc_info=True)

    def close(self) -> None:
        """Abort open requests and wait until none can write, then disconnect from peers and
        deregister memory. Idempotent."""
        if self._agent is None:
            return
        with self._lock:
            handles = list(self._handles)
        for h in handles:
            self.release(h)
        self._poster.shutdown(wait=True, cancel_futures=True)  # a running post finishes
        self._drain(_CLOSE_DRAIN_S)
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

    def _drain(self, timeout: float) -> None:
        """Wait until the released READs still in flight end; past `timeout`, free them anyway
        (NIXL then tries to cancel them) rather than hang a shutdown."""
        deadline = time.monotonic() + timeout
        while self._settle_all() and time.monotonic() < deadline:
            time.sleep(0.001)
        with self._lock:
            for h in self._handles:
                log.warning("NIXL READ from %s still in flight at close: freeing it", h.remote_agent)
                self._free_xfer(h)
            self._handles.clear()

    def _settle_all(self) -> bool:
        """Settle every released handle; True while a READ of one may still write."""
        with self._lock:
            handles = list(self._handles)
        for h in handles:
            self._settle_released(h)
        with self._lock:
            return bool(self._handles)

    def __enter__(self) -> "NixlTransport":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _aborted() -> TransferStatus:
    return TransferStatus(TransferState.FAILED, TransferError("aborted", "the transfer was released"))
