"""Background transfers shared by the transports that copy on the CPU (shm, tcp).

`read()` (DESIGN.md §1 step 6) must return at once and `poll()` must never block: the decode
worker polls between engine steps. So a transport plans the segments in the caller's thread,
then runs the byte moving in a small thread pool; the handle carries the future and an abort
flag that the mover checks between segments. Copies release the GIL (memcpy, socket I/O), so
the engine keeps stepping while bytes land.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from splitserve.kv_transfer.base import TransferError, TransferHandle, TransferState, TransferStatus


@dataclass(eq=False)
class AsyncHandle(TransferHandle):
    future: Future | None = None
    aborted: threading.Event = field(default_factory=threading.Event)

    # Identity semantics: transports keep live handles in sets.
    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def check_aborted(self) -> None:
        """Called by the mover between segments: a released handle stops moving bytes."""
        if self.aborted.is_set():
            raise TransferError("aborted", f"transfer for {self.request_id} was released")


class PooledTransport:
    """poll / release / abort-all for the transports whose moves run in a TransferPool (shm,
    tcp). Subclasses keep their live handles in `_handles` and may stop a released move harder
    (e.g. shut its sockets) in `_stop`."""

    _handles: set[AsyncHandle]

    def poll(self, handle: TransferHandle) -> TransferStatus:
        return TransferPool.poll(handle)  # type: ignore[arg-type]

    def release(self, handle: TransferHandle) -> None:
        if isinstance(handle, AsyncHandle):
            handle.aborted.set()
            self._handles.discard(handle)
            self._stop(handle)

    def _stop(self, handle: AsyncHandle) -> None:
        """Beyond the abort flag the mover checks between segments: nothing by default."""

    def _abort_all(self) -> None:
        for h in list(self._handles):
            h.aborted.set()
        self._handles.clear()


def start_read(name: str, local_layout, src, dst_blocks, layers, plan):
    """The checks every CPU-copy transport's read() makes before moving a byte. Returns the
    handle and the plan, or a handle that is FAILED from the start (and None)."""
    if local_layout is None:
        raise RuntimeError("register the local KV cache before reading")
    layers = layers if layers is not None else range(src.endpoint.layout.num_layers)
    handle = AsyncHandle(src.request_id, src, tuple(dst_blocks), layers)
    try:
        if src.endpoint.transport != name:
            raise TransferError("header", f"endpoint is for {src.endpoint.transport!r}, not {name!r}")
        return handle, plan(handle)
    except TransferError as e:
        return TransferPool.failed(handle, e), None


class TransferPool:
    """Runs transfer jobs; turns their outcome into TransferStatus."""

    def __init__(self, name: str, max_workers: int) -> None:
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=f"kv-{name}")
        self._closed = False

    def submit(self, handle: AsyncHandle, job: Callable[[], None]) -> AsyncHandle:
        if self._closed:
            raise RuntimeError("transport is closed")
        handle.future = self._executor.submit(job)
        return handle

    @staticmethod
    def failed(handle: AsyncHandle, error: TransferError) -> AsyncHandle:
        """A handle that is FAILED from the start (e.g. the plan itself was rejected)."""
        handle.future = Future()
        handle.future.set_exception(error)
        return handle

    @staticmethod
    def poll(handle: AsyncHandle) -> TransferStatus:
        fut = handle.future
        if fut is None or not fut.done():
            return TransferStatus(TransferState.PENDING)
        if fut.cancelled():  # queued when the transport closed
            return TransferStatus(TransferState.FAILED, TransferError("aborted", "transport closed before the transfer ran"))
        exc = fut.exception()
        if exc is None:
            return TransferStatus(TransferState.DONE)
        if isinstance(exc, TransferError):
            return TransferStatus(TransferState.FAILED, exc)
        # A bug in a mover must still surface as a status, never as an exception in poll().
        return TransferStatus(TransferState.FAILED, TransferError("internal", f"{type(exc).__name__}: {exc}"))

    def close(self) -> None:
        self._closed = True
        self._executor.shutdown(wait=True, cancel_futures=True)


def wait_transfer(transport, handle: TransferHandle, timeout: float = 30.0, interval: float = 2e-4) -> TransferStatus:
    """Poll until DONE / FAILED, for callers that may block (tests, benchmarks, worker threads).
    Past `timeout` the handle is released and the status is FAILED("aborted")."""
    deadline = time.monotonic() + timeout
    while True:
        status = transport.poll(handle)
        if status.state is not TransferState.PENDING:
            return status
        if time.monotonic() > deadline:
            transport.release(handle)
            return TransferStatus(TransferState.FAILED, TransferError("aborted", f"no result after {timeout:.1f} s"))
        time.sleep(interval)
