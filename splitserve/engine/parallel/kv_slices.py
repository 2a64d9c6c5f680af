"""Which KV heads each rank of a decode group reads from which rank of a prefill group, for any
pair of tensor-parallel sizes whose head counts divide (P2→D1, P1→D2, P2→D4, P4→D2, ...): the
plan the heterogeneous KV handoff moves, slice by slice.

A rank's KV cache holds only its KV heads (parallel/shard.py: split over the ranks, or
replicated where there are fewer KV heads than ranks). Each destination rank gets every head it
holds exactly once, from a source rank holding it; where several source ranks hold a head (a
replicated one), destination ranks take it from different ones, so that no source serves every
read. Heads are grouped into runs contiguous on both sides: one slice per run.

A latent-attention (MLA) model caches one "KV head" per token, the latent, and every rank of
either group holds all of it (shard.py): each decode rank reads the whole latent from a single
prefill rank — rank d takes it from prefill rank d mod P — and nothing is split or merged."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.engine.model.config import ModelConfig
from splitserve.engine.parallel.shard import Shard


@dataclass(frozen=True)
class KVSlice:
    dst_rank: int
    src_rank: int
    src_heads: range  # local KV-head indices in the source rank's cache
    dst_heads: range  # local indices in the destination rank's cache (same length)


def plan(cfg: ModelConfig, src_size: int, dst_size: int, src_expert_parallel: bool = False,
         dst_expert_parallel: bool = False) -> tuple[KVSlice, ...]:
    """Each side as its engine shards it (`expert_parallel` changes which sizes it accepts)."""
    src = [Shard.of(cfg, r, src_size, src_expert_parallel) for r in range(src_size)]
    dst = [Shard.of(cfg, r, dst_size, dst_expert_parallel) for r in range(dst_size)]
    out: list[KVSlice] = []
    for d in dst:
        run: list[int] = []  # [src rank, first global head, length] of the run being built
        for h in d.kv_heads:
            holders = [s.rank for s in src if h in s.kv_heads]
            rank = holders[d.rank % len(holders)]
            if run and run[0] == rank and run[1] + run[2] == h:
                run[2] += 1
                continue
            if run:
                out.append(_slice(d, src[run[0]], *run[1:]))
            run = [rank, h, 1]
        out.append(_slice(d, src[run[0]], *run[1:]))
    check(cfg, out, src, dst)
    return tuple(out)


def _slice(d: Shard, s: Shard, first: int, n: int) -> KVSlice:
    a, b = first - s.kv_heads.start, first - d.kv_heads.start
    return KVSlice(d.rank, s.rank, range(a, a + n), range(b, b + n))


def check(cfg: ModelConfig, slices: list[KVSlice], src: list[Shard], dst: list[Shard]) -> None:
    """Every destination head filled once, from a source that holds that very head."""
    for d in dst:
        got: list[int] = []
        for sl in (x for x in slices if x.dst_rank == d.rank):
            s = src[sl.src_rank]
            heads = [s.kv_heads.start + i for i in sl.src_heads]
            if heads != [d.kv_heads.start + i for i in sl.dst_heads]:
                raise AssertionError(f"slice {sl} moves heads {heads} into other heads")
            got += heads
        if sorted(got) != list(d.kv_heads):
            raise AssertionError(f"rank {d.rank} of {len(dst)} gets heads {sorted(got)}, holds {list(d.kv_heads)}")
