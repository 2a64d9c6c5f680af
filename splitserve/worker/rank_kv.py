"""What a tensor-parallel worker's ranks do for the KV handoff (each runs as a RankCall on every
rank, engine/parallel/rank_calls.py): a prefill group's ranks 1..T-1 serve their caches through
transports of their own and let a lease's token read its blocks; every rank checksums its heads
of a handoff's blocks; a decode group's ranks each pull their heads (kv_transfer/head_slices.py).
Rank 0's own transports are the worker's; these functions leave them to it."""

from __future__ import annotations

from typing import Sequence

from splitserve.kv_transfer import make_transport
from splitserve.kv_transfer.head_slices import SLICED_TRANSPORTS, head_checksums, pull_heads
from splitserve.worker.kv_layout import layout_of


def own_transports(engine) -> dict:
    """The transports this rank serves its cache through (none on rank 0: the worker's are)."""
    if not hasattr(engine, "rank_transports"):
        engine.rank_transports = {}
        engine.on_close.append(lambda: close(engine))  # before the cache they serve is freed
    return engine.rank_transports


def serve_kv(engine, kinds: Sequence[str], options: dict, host: str):
    """Ranks 1..T-1: serve this rank's cache; its endpoints (None on rank 0)."""
    if engine.tp.rank == 0:
        return None
    own, layout = own_transports(engine), layout_of(engine)
    for kind in kinds:
        if kind in SLICED_TRANSPORTS and kind not in own:
            own[kind] = make_transport(kind, **options.get(kind, {}))
    return tuple(t.register(engine.kv, layout, host, serve=True) for t in own.values())


def allow(engine, token: bytes, blocks: Sequence[int]) -> None:
    for t in own_transports(engine).values():
        t.allow(token, blocks)


def revoke(engine, token: bytes) -> None:
    for t in own_transports(engine).values():
        t.revoke(token)


def granted(engine) -> int:
    return max((t.granted() for t in own_transports(engine).values()), default=0)


def checksums(engine, blocks: Sequence[int]) -> tuple[int, ...]:
    return head_checksums(engine.kv.storage, blocks)


def pull(engine, handoff, plan, dst_blocks: Sequence[int], kind: str, secret: str | None) -> int:
    """This rank's slices of `plan` into its cache; bytes moved."""
    mine = [s for s in plan if s.dst_rank == engine.tp.rank]
    return pull_heads(handoff, mine, engine.kv.storage, dst_blocks, kind, secret)


def close(engine) -> None:
    for t in own_transports(engine).values():
        t.close()
