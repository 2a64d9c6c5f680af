"""Same-host KV transfer through shared memory: the CPU analogue of CUDA IPC (DESIGN.md §4).

Where it sits in a request's life (§1 steps 5–6): both workers allocate their KV cache in a
/dev/shm file (`KVCacheTensors.allocate(..., shm_path=...)`) and `register` it; the endpoint's
address is that file's path. When a decode worker pulls a handoff, it maps the prefill worker's
file read-only (`PeerMaps`: once per path, dropped once the peer is gone) and copies each planned
Segment straight from the source bytes into its own cache: one memcpy per segment of
`regions.plan_segments` (issued one block run at a time, for all layers in one numpy call), no
intermediate buffer, no server on the source side. The copy runs in a background thread; `poll`
only looks at its future.

A missing file is FAILED("unreachable"), a file shorter than the layout says is
FAILED("truncated"). Verification (checksum, header) is the caller's job (`verify.py`).
"""

from __future__ import annotations

import mmap
import os
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from splitserve.kv_transfer.base import KVHandoff, KVLayout, TransferError, TransferHandle, TransportEndpoint, UngatedReads
from splitserve.kv_transfer.jobs import AsyncHandle, PooledTransport, TransferPool, start_read
from splitserve.kv_transfer.regions import block_runs, check_transfer, storage_tensor

_HOW_TO = ("ShmTransport needs KV storage backed by a shared-memory file: allocate it with "
           "KVCacheTensors.allocate(..., shm_path='/dev/shm/<unique name>') and register that "
           "KVCacheTensors itself, not its .storage; use the 'tcp' transport otherwise")


@dataclass
class _Mapping:
    """A read-only mapping of a peer's KV file, with the identity of the file it maps."""

    ident: tuple[int, int, int]  # (st_dev, st_ino, st_size)
    mm: mmap.mmap
    data: torch.Tensor | None  # uint8 view of mm; read-only memory, never written


class PeerMaps:
    """Read-only maps of peers' KV files by path, each kept only while its path still names the
    file it maps. A peer that restarts gets a new path, and its old file is unlinked (by its
    owner, or swept once the owner is dead); a map would keep that whole KV cache in memory. So
    every lookup drops the maps whose file is gone or replaced, and beyond `max_maps` the least
    recently used.

    Dropping a map never takes memory from a read in progress: the copy holds the tensor `get`
    gave it, and an mmap is unmapped only when the last view of it goes (it refuses to close
    while buffers are exported)."""

    def __init__(self, max_maps: int) -> None:
        if max_maps < 1:
            raise ValueError(f"max_maps must be >= 1, got {max_maps}")
        self._max = max_maps
        self._maps: OrderedDict[str, _Mapping] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, path: str, need: int) -> torch.Tensor:
        """The bytes of the peer file at `path`; TransferError when it is missing or shorter than
        `need`."""
        with self._lock:
            self._drop_stale()  # the map at `path` too, if its file went or changed
            m = self._maps.get(path)
            if m is None:
                m = self._maps[path] = _open_mapping(path, need)
            self._maps.move_to_end(path)
            while len(self._maps) > self._max:
                self._drop(next(iter(self._maps)))
            _check_size(path, m.ident[2], need)
            return m.data

    def _drop_stale(self) -> None:
        """Caller holds the lock. A stat per map: a few microseconds against a whole transfer."""
        for path, m in list(self._maps.items()):
            if _identity(path) != m.ident:
                self._drop(path)

    def _drop(self, path: str) -> None:
        m = self._maps.pop(path)
        m.data = None
        try:
            m.mm.close()
        except BufferError:  # a copy still reads it: unmapped when its last view goes
            pass

    def close(self) -> None:
        with self._lock:
            for path in list(self._maps):
                self._drop(path)


class ShmTransport(UngatedReads, PooledTransport):
    name = "shm"

    def __init__(self, max_workers: int = 2, max_maps: int = 16) -> None:
        """`max_maps`: peers' files kept mapped at most (a decode worker reads from the prefill
        workers of its node; one dropped while live is mapped again on its next read)."""
        self._pool = TransferPool(self.name, max_workers)
        self._maps = PeerMaps(max_maps)
        self._dst: torch.Tensor | None = None  # the local storage's bytes (uint8, flat)
        self._layout: KVLayout | None = None
        self._handles: set[AsyncHandle] = set()

    # -- registration -------------------------------------------------------------------------

    def register(self, storage, layout: KVLayout, host: str, serve: bool = True) -> TransportEndpoint:
        """`storage`: a KVCacheTensors allocated with `shm_path` (a bare tensor does not say its file). `serve`
        changes nothing here: the file is this host's, opened by the same user's processes."""
        tensor, path = _resolve_shm(storage)
        if tensor.numel() * tensor.element_size() != layout.storage_bytes:
            raise ValueError(f"storage has {tensor.numel() * tensor.element_size()} bytes, "
                             f"layout says {layout.storage_bytes}")
        if self._dst is not None:
            raise RuntimeError("ShmTransport.register called twice; one KV cache per transport")
        self._dst = tensor.view(torch.uint8).reshape(-1)
        self._layout = layout
        return TransportEndpoint(transport=self.name, host=host, address=path, layout=layout)

    # -- transfers ----------------------------------------------------------------------------

    def read(self, src: KVHandoff, dst_blocks: Sequence[int], layers: range | None = None) -> TransferHandle:
        handle, layers = start_read(self.name, self._layout if self._dst is not None else None, src, dst_blocks,
                                    layers, lambda h: check_transfer(src.endpoint.layout, self._layout,
                                                                     src.block_ids, h.dst_blocks, h.layers))
        if layers is None:
            return handle
        runs = block_runs(src.block_ids, handle.dst_blocks)
        handle.nbytes = len(layers) * 2 * sum(n for _, _, n in runs) * self._layout.block_bytes
        self._handles.add(handle)
        return self._pool.submit(handle, lambda: self._copy(handle, src.endpoint, runs, layers))

    def _copy(self, handle: AsyncHandle, endpoint: TransportEndpoint, runs: list[tuple[int, int, int]],
              layers: range) -> None:
        """The segments of `plan_segments`, moved one block run at a time: rows are the (layer,
        K/V) pairs, so one strided torch copy_ performs the run's memcpy for every layer (a
        fragmented handoff costs a Python call per run, not per 16 KiB segment). torch rather
        than numpy: copy_ spreads a large copy over the intra-op threads (~1.3x on 2 cores)."""
        src_layout, bb = endpoint.layout, self._layout.block_bytes
        # `source` keeps the map alive until this copy ends, whatever PeerMaps drops meanwhile.
        source = self._maps.get(endpoint.address, src_layout.storage_bytes)[: src_layout.storage_bytes]
        src_rows = source.reshape(src_layout.num_layers * 2, src_layout.num_blocks * bb)
        dst_rows = self._dst.reshape(self._layout.num_layers * 2, self._layout.num_blocks * bb)
        rows = slice(layers.start * 2, layers.stop * 2)
        for s, d, n in runs:
            handle.check_aborted()
            dst_rows[rows, d * bb: (d + n) * bb].copy_(src_rows[rows, s * bb: (s + n) * bb])

    def close(self) -> None:
        self._abort_all()
        self._pool.close()
        self._maps.close()
        self._dst = None


def _identity(path: str) -> tuple[int, int, int] | None:
    """What tells one file at `path` from the next; None when nothing (readable) is there."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size


def _open_mapping(path: str, need: int) -> _Mapping:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise TransferError("unreachable", f"shm file {path} does not exist (source worker gone?)") from None
    try:
        st = os.fstat(fd)  # the identity of the file mapped, not of whatever `path` names next
        _check_size(path, st.st_size, need)
        mm = mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)  # the mapping keeps the file alive, even after the owner unlinks it
    with warnings.catch_warnings():
        # torch warns that the buffer is not writable: it is only ever a copy_ source here
        warnings.simplefilter("ignore", UserWarning)
        data = torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))
    return _Mapping((st.st_dev, st.st_ino, st.st_size), mm, data)


def _check_size(path: str, size: int, need: int) -> None:
    # Checked on every read: touching a mapping past the end of its file is SIGBUS, not an error.
    if size < need:
        raise TransferError("truncated", f"shm file {path} has {size} bytes, layout needs {need}")


def _resolve_shm(storage):
    """(tensor, shm file path) of a shm-backed KVCacheTensors; ValueError otherwise."""
    tensor = storage_tensor(storage)
    path = getattr(storage, "shm_path", None)  # a KVCacheTensors knows its file; a bare tensor does not
    if path is None:
        raise ValueError(_HOW_TO)
    if not tensor.is_contiguous():
        raise ValueError("KV storage must be contiguous")
    return tensor, path
