"""KV transport wrappers that inject faults around a real transport (the decode side reads
through them): corrupt what landed, hold a read open, gate a read until the test lets it go."""

from __future__ import annotations

import threading
import time

from splitserve.kv_transfer.base import TransferHandle, TransferState, TransferStatus

_PENDING = TransferStatus(TransferState.PENDING)


class Wrapped:
    """Delegates everything to `inner`; subclasses change one step."""

    def __init__(self, inner, worker=None) -> None:
        self.inner, self.worker, self.name = inner, worker, inner.name

    def register(self, storage, layout, host, serve=True):
        return self.inner.register(storage, layout, host, serve)

    def allow(self, token, blocks) -> None:
        self.inner.allow(token, blocks)

    def revoke(self, token) -> None:
        self.inner.revoke(token)

    def granted(self) -> int:
        return self.inner.granted()

    def read(self, src, dst_blocks, layers=None):
        return self.inner.read(src, dst_blocks, layers)

    def poll(self, handle):
        return self.inner.poll(handle)

    def release(self, handle) -> None:
        self.inner.release(handle)

    def close(self) -> None:
        self.inner.close()


class CorruptLanding(Wrapped):
    """The bytes land, then one value of the first block changes: verification must catch it."""

    def poll(self, handle):
        st = self.inner.poll(handle)
        if st.state is TransferState.DONE and not getattr(handle, "_flipped", False):
            handle._flipped = True
            w = self.worker
            w.engine.kv.storage.view(-1)[w.layout.offset(0, 0, handle.dst_blocks[0]) // w.layout.element_size] += 1.0
        return st


class _Deferred(TransferHandle):
    inner_handle: TransferHandle | None = None
    released: bool = False


class HeldOpen(Wrapped):
    """The read reports PENDING for `hold_s` after the bytes are in, unless released first."""

    hold_s = 10.0

    def read(self, src, dst_blocks, layers=None):
        h = self.inner.read(src, dst_blocks, layers)
        h._until, h._released = time.monotonic() + self.hold_s, False
        return h

    def poll(self, handle):
        st = self.inner.poll(handle)
        if st.state is TransferState.DONE and not handle._released and time.monotonic() < handle._until:
            return _PENDING
        return st

    def release(self, handle) -> None:
        handle._released = True
        self.inner.release(handle)


class Gated(Wrapped):
    """The read does not start until `gate` is set; `on_done` runs once when it reports DONE."""

    def __init__(self, inner, worker=None) -> None:
        super().__init__(inner, worker)
        self.gate = threading.Event()
        self.on_done = None

    def read(self, src, dst_blocks, layers=None):
        return _Deferred(src.request_id, src, tuple(dst_blocks), layers or range(src.header.num_layers))

    def poll(self, handle):
        if handle.inner_handle is None:
            if handle.released:
                return TransferStatus(TransferState.FAILED)
            if not self.gate.is_set():
                return _PENDING
            handle.inner_handle = self.inner.read(handle.src, handle.dst_blocks)
        st = self.inner.poll(handle.inner_handle)
        if st.state is TransferState.DONE and self.on_done is not None:
            cb, self.on_done = self.on_done, None
            cb()
        return st

    def release(self, handle) -> None:
        handle.released = True
        if handle.inner_handle is not None:
            self.inner.release(handle.inner_handle)


class SlowToStop(Wrapped):
    """Holds every read open once the bytes are in, and takes `stop_after_s` to stop after
    release (a NIXL read already posted runs to its end): `stopped_at` says when it did."""

    stop_after_s = 0.3

    def __init__(self, inner, worker=None) -> None:
        super().__init__(inner, worker)
        self.stopped_at: float | None = None

    def read(self, src, dst_blocks, layers=None):
        h = self.inner.read(src, dst_blocks, layers)
        h._released_at = None
        return h

    def poll(self, handle):
        if handle._released_at is None:
            st = self.inner.poll(handle)
            return _PENDING if st.state is TransferState.DONE else st
        if time.monotonic() < handle._released_at + self.stop_after_s:
            return _PENDING
        self.stopped_at = self.stopped_at or time.monotonic()
        return TransferStatus(TransferState.FAILED)

    def release(self, handle) -> None:
        handle._released_at = time.monotonic()
        self.inner.release(handle)


class CorruptNthLanding(Wrapped):
    """Like CorruptLanding, for the `n`-th read only (0-based): one piece in a stream's middle."""

    def __init__(self, inner, worker=None, n: int = 2) -> None:
        super().__init__(inner, worker)
        self.n, self.reads = n, 0

    def read(self, src, dst_blocks, layers=None):
        h = self.inner.read(src, dst_blocks, layers)
        h._corrupt, self.reads = self.reads == self.n, self.reads + 1
        return h

    def poll(self, handle):
        st = self.inner.poll(handle)
        if st.state is TransferState.DONE and handle._corrupt:
            handle._corrupt = False
            w = self.worker
            w.engine.kv.storage.view(-1)[w.layout.offset(0, 0, handle.dst_blocks[0]) // w.layout.element_size] += 1.0
        return st


class CorruptScaleLanding(Wrapped):
    """FP8 KV: the bytes land, then the scale of the first landed row changes (its exponent byte,
    the row's last, one bit flipped): a value off by a factor of two, which the checksum over
    values and scales together must catch."""

    def poll(self, handle):
        st = self.inner.poll(handle)
        if st.state is TransferState.DONE and not getattr(handle, "_flipped", False):
            handle._flipped = True
            w = self.worker
            row = w.layout.head_dim  # bytes: head_dim values + the exponent
            w.engine.kv.storage.view(-1)[w.layout.offset(0, 0, handle.dst_blocks[0]) + row - 1] ^= 1
        return st
