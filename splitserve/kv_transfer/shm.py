"""Same-host KV transfer through shared memory: the CPU analogue of CUDA IPC (DESIGN.md §4).

Where it sits in a request's life (§1 steps 5–6): both workers allocate their KV cache in a
/dev/shm file (`KVCacheTensors.allocate(..., shm_path=...)`) and `register` it; the endpoint's
address is that file's path. When a decode worker pulls a handoff, it maps the prefill worker's
file read-only (once per path, cached) and copies each planned Segment straight from the source
bytes into its own cache: one memcpy per segment of `regions.plan_segments` (issued one block
run at a time, for all layers in one numpy call), no intermediate buffer, no server on the source
side. The copy runs in a background thread; `poll` only looks at its future.

A missing file is FAILED("unreachable"), a file shorter than the layout says is
FAILED("truncated"). Verification (checksum, header) is the caller's job (`verify.py`).
"""

from __future__ import annotations

import mmap
import os
import threading
import warnings
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from splitserve.kv_transfer.base import KVHandoff, KVLayout, TransferError, TransferHandle, TransportEndpoint
from splitserve.kv_transfer.jobs import AsyncHandle, PooledTransport, TransferPool, start_read
from splitserve.kv_transfer.regions import block_runs, check_transfer, storage_tensor

_HOW_TO = ("ShmTransport needs KV storage backed by a shared-memory file: allocate it with "
           "KVCacheTensors.allocate(..., shm_path='/dev/shm/<unique name>') and register that "
           "KVCacheTensors (or its .storage); use the 'tcp' transport otherwise")


@dataclass
class _Mapping:
    """A read-only mapping of a peer's KV file, keyed by the file's identity so that a peer that
    restarted (new file, same path) is mapped afresh."""

    ident: tuple[int, int, int]  # (st_dev, st_ino, st_size)
    mm: mmap.mmap
    data: torch.Tensor  # uint8 view of mm; read-only memory, never written


class ShmTransport(PooledTransport):
    name = "shm"

    def __init__(self, max_workers: int = 2) -> None:
        self._pool = TransferPool(self.name, max_workers)
        self._maps: dict[str, _Mapping] = {}
        self._maps_lock = threading.Lock()
        self._dst: torch.Tensor | None = None  # the local storage's bytes (uint8, flat)
        self._layout: KVLayout | None = None
        self._handles: set[AsyncHandle] = set()

    # -- registration -------------------------------------------------------------------------

    def register(self, storage, layout: KVLayout, host: str) -> TransportEndpoint:
        """`storage`: a KVCacheTensors or its storage tensor, allocated with `shm_path`."""
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
        source = self._map(endpoint.address, src_layout.storage_bytes)[: src_layout.storage_bytes]
        src_rows = source.reshape(src_layout.num_layers * 2, src_layout.num_blocks * bb)
        dst_rows = self._dst.reshape(self._layout.num_layers * 2, self._layout.num_blocks * bb)
        rows = slice(layers.start * 2, layers.stop * 2)
        for s, d, n in runs:
            handle.check_aborted()
            dst_rows[rows, d * bb: (d + n) * bb].copy_(src_rows[rows, s * bb: (s + n) * bb])

    def _map(self, path: str, need: int) -> torch.Tensor:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise TransferError("unreachable", f"shm file {path} does not exist (source worker gone?)") from None
        # Checked on every read: touching a mapping past the end of its file is SIGBUS, not an error.
        if st.st_size < need:
            raise TransferError("truncated", f"shm file {path} has {st.st_size} bytes, layout needs {need}")
        ident = (st.st_dev, st.st_ino, st.st_size)
        with self._maps_lock:
            cached = self._maps.get(path)
            if cached is None or cached.ident != ident:
                # A replaced mapping may still be in use by another copy: drop our reference only.
                cached = self._maps[path] = _open_mapping(path, ident)
            return cached.data

    def close(self) -> None:
        self._abort_all()
        self._pool.close()
        with self._maps_lock:
            maps, self._maps = list(self._maps.values()), {}
        for m in maps:
            del m.data
            try:
                m.mm.close()
            except BufferError:  # a caller still holds a view; the mapping goes with it
                pass
        self._dst = None


def _open_mapping(path: str, ident: tuple[int, int, int]) -> _Mapping:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise TransferError("unreachable", f"shm file {path} vanished") from None
    try:
        mm = mmap.mmap(fd, ident[2], prot=mmap.PROT_READ, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)  # the mapping keeps the file alive, even after the owner unlinks it
    with warnings.catch_warnings():
        # torch warns that the buffer is not writable: it is only ever a copy_ source here
        warnings.simplefilter("ignore", UserWarning)
        data = torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))
    return _Mapping(ident, mm, data)


def _resolve_shm(storage):
    """(tensor, shm file path) of a KVCacheTensors or a storage tensor; ValueError if not shm."""
    from splitserve.engine.kv_cache.tensors import shm_path_of  # kv_transfer stays importable alone

    tensor = storage_tensor(storage)
    path = getattr(storage, "shm_path", None) or shm_path_of(tensor)
    if path is None:
        raise ValueError(_HOW_TO)
    if not tensor.is_contiguous():
        raise ValueError("KV storage must be contiguous")
    return tensor, path
