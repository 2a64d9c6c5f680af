"""Which bytes move: source and destination blocks turned into few large, aligned segments, and
the checksum both sides compute over them.

A block of one layer's K (or V) is `layout.block_bytes` contiguous bytes; consecutive block ids
are adjacent in memory, so a run of blocks that is consecutive on both sides moves as one
segment per (layer, K/V). The checksum streams the source blocks in canonical order (layer,
K/V, handoff order), so it does not depend on how the bytes were split into segments.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from splitserve.kv_transfer.base import KVLayout, TransferError, layers_differ
from splitserve.types import KV_FP8

try:  # xxh3: ~10x faster than crc32 here; crc32 keeps things working without it
    import xxhash

    def _hasher():
        return xxhash.xxh3_64()
except ImportError:  # pragma: no cover - exercised only where xxhash is missing
    import zlib

    class _Crc:
        def __init__(self) -> None:
            self.v = 0

        def update(self, b) -> None:
            self.v = zlib.crc32(b, self.v)

        def intdigest(self) -> int:
            return self.v

    def _hasher():
        return _Crc()


@dataclass(frozen=True)
class Segment:
    src_offset: int  # bytes from the start of the source storage
    dst_offset: int
    nbytes: int


def block_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, count) runs where both sides are consecutive."""
    if len(src) != len(dst):
        raise TransferError("header", f"{len(src)} source blocks but {len(dst)} destination blocks")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def plan_segments(layout: KVLayout, src: Sequence[int], dst: Sequence[int], layers: range | None = None,
                  dst_layout: KVLayout | None = None) -> list[Segment]:
    """Segments in canonical order (layer, K/V, handoff order). `dst_layout` (default: `layout`)
    matters when the two workers' caches hold different numbers of blocks: the same (layer, kv,
    block) then sits at different byte offsets on each side."""
    layers = layers if layers is not None else range(layout.num_layers)
    dst_layout = dst_layout if dst_layout is not None else layout
    bb = layout.block_bytes
    # Offsets inline (== layout.offset): a fragmented 64-block handoff is ~4k segments, and
    # planning runs in the decode worker's step loop.
    runs = [(s * bb, d * bb, n * bb) for s, d, n in block_runs(src, dst)]
    out = []
    for layer in layers:
        for kv in (0, 1):
            src_base, dst_base = layout.offset(layer, kv, 0), dst_layout.offset(layer, kv, 0)
            out.extend(Segment(src_base + s, dst_base + d, n) for s, d, n in runs)
    return out


# Fields that fix where a block's bytes sit; both sides must agree on them or a copy would
# scribble over the wrong memory. num_blocks may differ (each worker sizes its own cache).
_GEOMETRY = ("num_layers", "block_size", "num_kv_heads", "head_dim", "dtype", "element_size")


def plan_transfer(src_layout: KVLayout, dst_layout: KVLayout, src: Sequence[int], dst: Sequence[int],
                  layers: range | None = None) -> list[Segment]:
    """`plan_segments` for two workers' caches, after the checks that keep every segment inside
    both storages. Raises TransferError("header") naming what does not fit."""
    layers = check_transfer(src_layout, dst_layout, src, dst, layers)
    return plan_segments(src_layout, src, dst, layers, dst_layout=dst_layout)


def check_transfer(src_layout: KVLayout, dst_layout: KVLayout, src: Sequence[int], dst: Sequence[int],
                   layers: range | None = None) -> range:
    """The checks of `plan_transfer` alone; returns the layer range (default: all layers)."""
    if src_layout.num_layers != dst_layout.num_layers:
        raise TransferError("header", layers_differ(src_layout.num_layers, dst_layout.num_layers))
    for name in _GEOMETRY:
        if getattr(src_layout, name) != getattr(dst_layout, name):
            raise TransferError("header", f"{name} differs: source {getattr(src_layout, name)!r}, "
                                          f"local {getattr(dst_layout, name)!r}")
    layers = layers if layers is not None else range(src_layout.num_layers)
    if len(layers) == 0 or layers.step != 1 or layers.start < 0 or layers.stop > src_layout.num_layers:
        raise TransferError("header", f"layers {layers} not a non-empty slice of 0..{src_layout.num_layers}")
    if len(src) != len(dst):
        raise TransferError("header", f"{len(src)} source blocks but {len(dst)} destination blocks")
    _check_ids("source", src, src_layout.num_blocks)
    _check_ids("destination", dst, dst_layout.num_blocks)
    return layers


def _check_ids(side: str, blocks: Sequence[int], num_blocks: int) -> None:
    bad = [b for b in blocks if not 0 <= b < num_blocks]
    if bad:
        raise TransferError("header", f"{side} block ids {bad[:4]} outside 0..{num_blocks - 1}")


def dtype_name(storage: torch.Tensor) -> str:
    """The KV dtype a storage tensor holds, as layouts name it: a byte storage is an FP8 cache."""
    return KV_FP8 if storage.dtype == torch.uint8 else str(storage.dtype).removeprefix("torch.")


def storage_tensor(kv) -> torch.Tensor:
    """The storage tensor of a KVCacheTensors, or the tensor itself (callers may pass either)."""
    return kv if isinstance(kv, torch.Tensor) else kv.storage


def byte_view(storage: torch.Tensor) -> memoryview:
    """The storage's bytes, without a copy (the tensor must be contiguous, on CPU)."""
    if not storage.is_contiguous() or storage.device.type != "cpu":
        raise ValueError("KV storage must be a contiguous CPU tensor")
    return memoryview(storage.view(torch.uint8).reshape(-1).numpy())


class HostBytes:
    """A CPU storage's bytes: ranges are sent from and received into it in place."""

    def __init__(self, storage: torch.Tensor) -> None:
        self.mem = byte_view(storage)

    def __len__(self) -> int:
        return len(self.mem)

    def read(self, ranges: Sequence[tuple[int, int]]) -> list[memoryview]:
        return [self.mem[o: o + n] for o, n in ranges]

    def receive(self, ranges: Sequence[tuple[int, int]]) -> tuple[list[memoryview], Callable[[], None]]:
        """Views to receive the ranges into, and what to call once they are full."""
        return self.read(ranges), lambda: None


class StagedBytes:
    """A device (GPU) storage's bytes, which sockets cannot reach: a read gathers the ranges
    into one host buffer, a receive lands in one and scatters it. Ranges that are whole blocks
    (`unit` = one layer's K or V block, as every transfer plan's are) move as row gathers and
    scatters, a few large copies however fragmented the handoff; others range by range. Copies
    run on a side stream (overlapping the engine's steps) after the work already queued on the
    default stream, so a read sees finished KV and a landing is not overwritten by a late write
    of the blocks' last owner; the caller's thread waits for its own copies only."""

    CHUNK_BYTES = 64 << 20  # device scratch per gather / scatter step

    def __init__(self, storage: torch.Tensor, unit: int = 1) -> None:
        if not storage.is_contiguous():
            raise ValueError("KV storage must be contiguous")
        self._flat = storage.view(torch.uint8).reshape(-1)
        self._unit = unit if unit > 1 and self._flat.numel() % unit == 0 else 1
        self._cuda = storage.device.type == "cuda"
        self._stream = torch.cuda.Stream(storage.device) if self._cuda else None

    def __len__(self) -> int:
        return self._flat.numel()

    def read(self, ranges: Sequence[tuple[int, int]]) -> list[memoryview]:
        host = self._host(ranges)
        self._on_side_stream(lambda: self._move(ranges, host, out=True))
        return [memoryview(host.numpy())]

    def receive(self, ranges: Sequence[tuple[int, int]]) -> tuple[list[memoryview], Callable[[], None]]:
        host = self._host(ranges)
        return [memoryview(host.numpy())], lambda: self._on_side_stream(lambda: self._move(ranges, host, out=False))

    def _host(self, ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
        # pinned: asynchronous copies at full bus speed (page-locked, so only for GPU storages)
        return torch.empty(sum(n for _, n in ranges), dtype=torch.uint8, pin_memory=self._cuda)

    def _move(self, ranges: Sequence[tuple[int, int]], host: torch.Tensor, out: bool) -> None:
        """Storage ranges → host buffer (out) or back."""
        rows = self._rows_of(ranges)
        if rows is None:
            for p, (o, n) in zip(_starts(ranges), ranges):
                a, b = (host[p: p + n], self._flat[o: o + n]) if out else (self._flat[o: o + n], host[p: p + n])
                a.copy_(b, non_blocking=self._cuda)
            return
        u = self._unit
        table, buf = self._flat.view(-1, u), host.view(-1, u)
        step = max(1, self.CHUNK_BYTES // u)
        for i in range(0, rows.numel(), step):
            idx = rows[i: i + step]
            if out:
                buf[i: i + idx.numel()].copy_(table.index_select(0, idx), non_blocking=self._cuda)
            else:
                table.index_copy_(0, idx, buf[i: i + idx.numel()].to(self._flat.device, non_blocking=self._cuda))

    def _rows_of(self, ranges: Sequence[tuple[int, int]]) -> torch.Tensor | None:
        u = self._unit
        if u == 1 or any(o % u or n % u for o, n in ranges):
            return None
        idx = np.concatenate([np.arange(o // u, (o + n) // u) for o, n in ranges]) if ranges else np.zeros(0, int)
        return torch.from_numpy(idx.astype(np.int64)).to(self._flat.device)

    def _on_side_stream(self, work: Callable[[], None]) -> None:
        if not self._cuda:
            work()
            return
        self._stream.wait_stream(torch.cuda.default_stream(self._flat.device))
        with torch.cuda.stream(self._stream):
            work()
            done = torch.cuda.Event()
            done.record(self._stream)
        done.synchronize()


def _starts(ranges: Sequence[tuple[int, int]]) -> list[int]:
    """Where each range begins in a buffer holding them back to back."""
    return list(itertools.accumulate((n for _, n in ranges), initial=0))[:-1]


def storage_bytes(storage: torch.Tensor, staged: bool = False, unit: int = 1) -> HostBytes | StagedBytes:
    """In-place access for a CPU storage; host staging for a device one (or when asked: tests).
    `unit`: the bytes of one block of one layer's K or V (StagedBytes moves whole ones at once)."""
    return StagedBytes(storage, unit) if staged or storage.device.type != "cpu" else HostBytes(storage)


def kv_checksum(storage: torch.Tensor, layout: KVLayout, blocks: Sequence[int], layers: range | None = None) -> int:
    """64-bit checksum of `blocks` over `layers`, in canonical order."""
    if storage.device.type != "cpu":
        return gathered_checksum(storage, blocks, layers)
    mem = byte_view(storage)
    h = _hasher()
    for seg in plan_segments(layout, blocks, blocks, layers):
        h.update(mem[seg.src_offset: seg.src_offset + seg.nbytes])
    return h.intdigest()


def tensor_checksum(t: torch.Tensor) -> int:
    """The same 64-bit checksum over one tensor's bytes, in its logical order (a strided view is
    gathered first)."""
    h = _hasher()
    h.update(memoryview(t.detach().cpu().contiguous().view(torch.uint8).reshape(-1).numpy()))
    return h.intdigest()


def gathered_checksum(storage: torch.Tensor, blocks: Sequence[int], layers: range | None = None) -> int:
    """`kv_checksum` by gathering the blocks ([layers, K/V, blocks, ...] is the canonical order
    itself), one (layer, K/V) at a time into host memory: how a device storage is checksummed,
    without a second copy of the whole handoff on the device."""
    layers = layers if layers is not None else range(storage.shape[0])
    if layers.step != 1:
        raise ValueError(f"layers must be a contiguous range, got {layers}")
    ids = torch.as_tensor(list(blocks), dtype=torch.int64, device=storage.device)
    h = _hasher()
    for layer in layers:
        for kv in (0, 1):
            part = storage[layer, kv].index_select(0, ids).cpu()
            h.update(memoryview(part.view(torch.uint8).reshape(-1).numpy()))
    return h.intdigest()
