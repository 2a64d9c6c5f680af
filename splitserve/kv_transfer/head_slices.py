"""The KV handoff between tensor-parallel groups of different sizes: each destination rank pulls
the KV heads it holds, slice by slice (engine/parallel/kv_slices.py says which heads from which source
rank), through the pair's transport, and checks every head that landed against the checksum
its source rank took of it.

A handoff from a group of P ranks carries one `RankSource` per source rank: its endpoints, the
global KV heads it holds, and a checksum per head (over the handoff's blocks, all layers, K and
V). One lease covers them all: every source rank lets the lease's token read its blocks, and
all of them free those blocks when it ends.

The cache layout is [layers][K/V][blocks][block_size][heads][head_dim], so a slice of heads is
strided within each block. `shm` copies exactly the slice, strided, from the source rank's
mapped file. `tcp` moves whole blocks (its server serves and gates whole blocks of one source
rank) into a staging buffer of that rank's geometry, from which the slice is copied: exact
where the source rank's heads are all the destination wants (P ≥ D), more bytes than needed
where a destination takes part of a rank's heads (P < D)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from splitserve.kv_transfer.base import KVHandoff, KVLayout, TransferError, TransportEndpoint
from splitserve.kv_transfer.jobs import wait_transfer
from splitserve.kv_transfer.regions import block_runs, dtype_name, tensor_checksum
from splitserve.kv_transfer.shm import PeerMaps

SLICED_TRANSPORTS = ("shm", "tcp")  # nixl moves whole blocks of one registered cache only, so far
PEER_MAPS = PeerMaps(16)  # shared with stage_slices.py: one process's maps of its peers' caches


@dataclass(frozen=True)
class RankSource:
    """One source rank's part of a handoff."""

    rank: int
    kv_heads: range  # the global KV heads its cache holds (local index i is kv_heads[i])
    endpoints: tuple[TransportEndpoint, ...]  # its cache, per transport
    head_checksums: tuple[int, ...]  # per local head, over the handoff's blocks

    def endpoint(self, kind: str) -> TransportEndpoint:
        for e in self.endpoints:
            if e.transport == kind:
                return e
        raise TransferError("unreachable", f"source rank {self.rank} offers no {kind!r} endpoint")


def head_checksums(storage: torch.Tensor, blocks: Sequence[int]) -> tuple[int, ...]:
    """Per local KV head: the checksum of that head over `blocks`, every layer, K and V."""
    ids = torch.as_tensor(list(blocks), dtype=torch.int64, device=storage.device)
    picked = storage.index_select(2, ids)  # [L, 2, n, B, H, D]
    return tuple(tensor_checksum(picked[..., h, :]) for h in range(storage.shape[4]))


def sliced_kind(kind: str) -> str:
    """The transport a sliced pull takes for a pair that chose `kind`."""
    return kind if kind in SLICED_TRANSPORTS else "tcp"


def pull_heads(h: KVHandoff, slices, storage: torch.Tensor, dst_blocks: Sequence[int], kind: str,
               secret: str | None = None) -> int:
    """Pull `slices` (kv_slices.KVSlice, this rank's) of handoff `h` into `storage`'s
    `dst_blocks` and check each head that landed; bytes moved. Raises TransferError."""
    moved = 0
    for sl in slices:
        if not 0 <= sl.src_rank < len(h.ranks):
            raise TransferError("header", f"slice from rank {sl.src_rank}; the handoff has {len(h.ranks)} source ranks")
        src = h.ranks[sl.src_rank]
        ep = src.endpoint(kind)
        _check_geometry(ep.layout, storage, h, sl)
        if kind == "shm":
            moved += _copy_shm(ep, h.block_ids, storage, dst_blocks, sl)
        else:
            moved += _copy_tcp(h, ep, storage, dst_blocks, sl, secret)
        _verify(storage, dst_blocks, src, sl)
    return moved


def _check_geometry(src: KVLayout, storage: torch.Tensor, h: KVHandoff, sl) -> None:
    L, _, nb, B, H, D = storage.shape
    dtype = dtype_name(storage)
    for name, a, b in (("num_layers", src.num_layers, L), ("block_size", src.block_size, B),
                       ("head_dim", src.head_dim, D), ("dtype", src.dtype, dtype)):
        if a != b:
            raise TransferError("header", f"{name} differs: source rank {sl.src_rank} {a!r}, local {b!r}")
    if sl.src_heads.start < 0 or sl.src_heads.stop > src.num_kv_heads or sl.dst_heads.stop > H:
        raise TransferError("header", f"slice {sl} outside the caches' heads ({src.num_kv_heads}, {H})")
    bad = [b for b in h.block_ids if not 0 <= b < src.num_blocks]
    if bad:
        raise TransferError("header", f"source block ids {bad[:4]} outside 0..{src.num_blocks - 1}")


def cache_view(data: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """A byte tensor as [L, 2, blocks, block_size, heads, head_dim * element_size]."""
    return data[: layout.storage_bytes].view(layout.num_layers, 2, layout.num_blocks, layout.block_size,
                                             layout.num_kv_heads, layout.head_dim * layout.element_size)


def _copy_shm(ep: TransportEndpoint, src_blocks: Sequence[int], storage: torch.Tensor, dst_blocks: Sequence[int],
              sl) -> int:
    source = cache_view(PEER_MAPS.get(ep.address, ep.layout.storage_bytes), ep.layout)
    dst = storage.view(torch.uint8)  # [..., head_dim * element_size]: the same shape as `source`
    sh, dh = slice(sl.src_heads.start, sl.src_heads.stop), slice(sl.dst_heads.start, sl.dst_heads.stop)
    moved = 0
    for s, d, n in block_runs(src_blocks, dst_blocks):
        part = source[:, :, s: s + n, :, sh]
        dst[:, :, d: d + n, :, dh].copy_(part)
        moved += part.numel()
    return moved


def _copy_tcp(h: KVHandoff, ep: TransportEndpoint, storage: torch.Tensor, dst_blocks: Sequence[int], sl,
              secret: str | None) -> int:
    staging = fetch_tcp(h, ep, storage.dtype, secret)
    ids = torch.as_tensor(list(dst_blocks), dtype=torch.int64, device=storage.device)
    part = staging[:, :, :, :, sl.src_heads.start: sl.src_heads.stop].to(storage.device)
    view = storage[:, :, :, :, sl.dst_heads.start: sl.dst_heads.stop]
    view.index_copy_(2, ids, part)
    return staging.numel() * staging.element_size()


def fetch_tcp(h: KVHandoff, ep: TransportEndpoint, dtype: torch.dtype, secret: str | None,
              layers: range | None = None) -> torch.Tensor:
    """The handoff's whole blocks from the source cache behind `ep`, over tcp, into a staging
    tensor of that source's geometry (`layers`: only those are read; the rest stay unset)."""
    from splitserve.kv_transfer.tcp import TcpTransport

    lay = ep.layout
    n = len(h.block_ids)
    staging = torch.empty((lay.num_layers, 2, n, lay.block_size, lay.num_kv_heads, lay.head_dim), dtype=dtype)
    local = KVLayout(lay.num_layers, n, lay.block_size, lay.num_kv_heads, lay.head_dim, lay.dtype,
                     lay.element_size, lay.model_fingerprint)
    t = TcpTransport(secret=secret)
    try:
        t.register(staging, local, "", serve=False)
        status = wait_transfer(t, t.read(from_endpoint(h, ep), range(n), layers))
        if status.reason is not None:
            raise status.reason
    finally:
        t.close()
    return staging


def from_endpoint(h: KVHandoff, ep: TransportEndpoint) -> KVHandoff:
    import dataclasses

    return dataclasses.replace(h, endpoint=ep)


def _verify(storage: torch.Tensor, dst_blocks: Sequence[int], src: RankSource, sl) -> None:
    ids = torch.as_tensor(list(dst_blocks), dtype=torch.int64, device=storage.device)
    landed = storage.index_select(2, ids)
    for s, d in zip(sl.src_heads, sl.dst_heads):
        got = tensor_checksum(landed[..., d, :])
        if got != src.head_checksums[s]:
            raise TransferError("corrupt", f"KV head {src.kv_heads[s]} from source rank {src.rank} landed with "
                                           f"checksum {got:#018x}, its source sent {src.head_checksums[s]:#018x}")
