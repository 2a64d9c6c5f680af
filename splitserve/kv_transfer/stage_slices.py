"""The KV handoff by pipeline stage: a pipeline-parallel worker's stages each hold a contiguous
range of the model's layers (engine/parallel/stages.py: their caches hold those layers only,
local index 0..n-1, under one set of block ids), so a handoff from or into one moves each
layer from the source stage holding it into the destination stage (or single cache) holding it.

A handoff by stage carries one `StageSource` per source stage — a single worker is one stage
holding every layer — with its endpoints, the global layers it holds and a checksum per layer
(over the handoff's blocks, K and V): any destination cut (a single cache, the same stages, or
other ones) checks exactly the layers it took. One lease covers them all: every source stage
lets the lease's token read its blocks, and all of them free those blocks when it ends.

Each destination pulls, per source stage, the overlap of their layer ranges (`plan`), whole
KV heads: both sides are one tensor-parallel rank per stage (a stage of several ranks would
need the layers cut by heads too, head_slices.py's job; not built). `shm` copies exactly those
layers from the source stage's mapped file; `tcp` reads them (a transport's layer range) into a
staging buffer of that stage's geometry and the handoff's block count, from which they are
copied into place (a stage placed on another node than stage 0 is read over tcp even where the
pair shares memory). Every layer is checked as it lands."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from splitserve.kv_transfer.base import KVHandoff, KVLayout, TransferError, TransportEndpoint
from splitserve.kv_transfer.head_slices import PEER_MAPS, cache_view, fetch_tcp
from splitserve.kv_transfer.regions import block_runs, dtype_name, kv_checksum


@dataclass(frozen=True)
class StageSource:
    """One source stage's part of a handoff."""

    stage: int
    layers: range  # the global layers its cache holds (local index i is layers[i])
    endpoints: tuple[TransportEndpoint, ...]  # its cache, per transport
    layer_checksums: tuple[int, ...]  # per local layer, over the handoff's blocks (K and V)

    def endpoint(self, kind: str) -> TransportEndpoint:
        for e in self.endpoints:
            if e.transport == kind:
                return e
        raise TransferError("unreachable", f"source stage {self.stage} offers no {kind!r} endpoint")


@dataclass(frozen=True)
class LayerSlice:
    src_stage: int  # index into the handoff's stages
    src_layers: range  # local layers of the source stage's cache
    dst_layers: range  # local layers of the destination cache (same length)


def storage_layout(storage: torch.Tensor) -> KVLayout:
    """A cache tensor's own geometry, for the checksum's byte offsets."""
    L, _, nb, B, H, D = storage.shape
    return KVLayout(L, nb, B, H, D, dtype_name(storage), storage.element_size(), "")


def layer_checksums(storage: torch.Tensor, blocks: Sequence[int]) -> tuple[int, ...]:
    """Per local layer: the checksum of `blocks` in that layer, K and V (kv_checksum's order)."""
    lay = storage_layout(storage)
    return tuple(kv_checksum(storage, lay, blocks, range(i, i + 1)) for i in range(lay.num_layers))


def plan(sources: Sequence[range], dst: range) -> tuple[LayerSlice, ...]:
    """Which layers a destination holding global layers `dst` takes from each source stage
    (`sources`: each one's global layers). Raises TransferError("header") unless every layer
    is covered exactly once."""
    out, got = [], []
    for i, src in enumerate(sources):
        lo, hi = max(src.start, dst.start), min(src.stop, dst.stop)
        if lo < hi:
            out.append(LayerSlice(i, range(lo - src.start, hi - src.start), range(lo - dst.start, hi - dst.start)))
            got += range(lo, hi)
    if sorted(got) != list(dst):
        raise TransferError("header", f"the source stages' layers {[list(s) for s in sources]} do not cover "
                                      f"layers {dst.start}..{dst.stop - 1} exactly once")
    return tuple(out)


def pull_layers(h: KVHandoff, dst: range, storage: torch.Tensor, dst_blocks: Sequence[int], kind: str,
                secret: str | None = None) -> int:
    """Pull global layers `dst` (those `storage` holds, in order) of handoff `h` into its
    `dst_blocks` from the source stages holding them, and check each layer; bytes moved.
    Raises TransferError."""
    if storage.shape[0] != len(dst):
        raise TransferError("header", f"a cache of {storage.shape[0]} layers cannot take layers {dst}")
    moved = 0
    for sl in plan([s.layers for s in h.stages], dst):
        src = h.stages[sl.src_stage]
        ep = src.endpoint(_kind_for(h, src, kind))
        _check_geometry(ep.layout, storage, h, src)
        if ep.transport == "shm":
            moved += _copy_shm(ep, h.block_ids, storage, dst_blocks, sl)
        else:
            moved += _copy_tcp(h, ep, storage, dst_blocks, sl, secret)
        _verify(storage, dst_blocks, src, sl)
    return moved


def _kind_for(h: KVHandoff, src: StageSource, kind: str) -> str:
    """The pair's transport, except that shm (chosen because the handoff's endpoint, stage 0's,
    shares the reader's host) reaches no stage placed on another node: tcp does."""
    if kind == "shm" and any(e.transport == "shm" and e.host != h.endpoint.host for e in src.endpoints):
        return "tcp"
    return kind


def _check_geometry(src: KVLayout, storage: torch.Tensor, h: KVHandoff, stage: StageSource) -> None:
    L, _, nb, B, H, D = storage.shape
    for name, a, b in (("block_size", src.block_size, B), ("num_kv_heads", src.num_kv_heads, H),
                       ("head_dim", src.head_dim, D), ("dtype", src.dtype, dtype_name(storage))):
        if a != b:
            raise TransferError("header", f"{name} differs: source stage {stage.stage} {a!r}, local {b!r}")
    if src.num_layers != len(stage.layers) or len(stage.layer_checksums) != len(stage.layers):
        raise TransferError("header", f"source stage {stage.stage} holds layers {stage.layers} but its cache has "
                                      f"{src.num_layers} and it sent {len(stage.layer_checksums)} checksums")
    bad = [b for b in h.block_ids if not 0 <= b < src.num_blocks]
    if bad:
        raise TransferError("header", f"source block ids {bad[:4]} outside 0..{src.num_blocks - 1}")


def _copy_shm(ep: TransportEndpoint, src_blocks: Sequence[int], storage: torch.Tensor, dst_blocks: Sequence[int],
              sl: LayerSlice) -> int:
    source = cache_view(PEER_MAPS.get(ep.address, ep.layout.storage_bytes), ep.layout)
    dst = storage.view(torch.uint8)  # [..., head_dim * element_size]: the same shape as `source`
    sL, dL = slice(sl.src_layers.start, sl.src_layers.stop), slice(sl.dst_layers.start, sl.dst_layers.stop)
    moved = 0
    for s, d, n in block_runs(src_blocks, dst_blocks):
        part = source[sL, :, s: s + n]
        dst[dL, :, d: d + n].copy_(part)
        moved += part.numel()
    return moved


def _copy_tcp(h: KVHandoff, ep: TransportEndpoint, storage: torch.Tensor, dst_blocks: Sequence[int],
              sl: LayerSlice, secret: str | None) -> int:
    staging = fetch_tcp(h, ep, storage.dtype, secret, sl.src_layers)
    ids = torch.as_tensor(list(dst_blocks), dtype=torch.int64, device=storage.device)
    part = staging[sl.src_layers.start: sl.src_layers.stop].to(storage.device)
    storage[sl.dst_layers.start: sl.dst_layers.stop].index_copy_(2, ids, part)
    return part.numel() * part.element_size()


def _verify(storage: torch.Tensor, dst_blocks: Sequence[int], src: StageSource, sl: LayerSlice) -> None:
    lay = storage_layout(storage)
    for s, d in zip(sl.src_layers, sl.dst_layers):
        got = kv_checksum(storage, lay, dst_blocks, range(d, d + 1))
        if got != src.layer_checksums[s]:
            raise TransferError("corrupt", f"KV layer {src.layers[s]} from source stage {src.stage} landed with "
                                           f"checksum {got:#018x}, its source sent {src.layer_checksums[s]:#018x}")
