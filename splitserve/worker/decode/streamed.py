"""The decode side of a streamed handoff (DESIGN.md §1 step 6, streamed): the orchestrator
calls `stage` as it sends the prompt to the prefill worker, so blocks for the context are
reserved here and every piece the prefill publishes (`PrefillWorker.kv_stream`) is pulled and
checked against its own checksum while the prompt is still being computed; the last piece,
the blocks the prefill's last step completed, comes as the prefill returns its handoff, and is
pulled while that handoff travels to the orchestrator and back here. Leading blocks this
worker's prefix cache holds already are shared, not moved: the first call tells the prefill how
many, and its pieces begin after them. `generate` then
finds the staging, waits for its end and acknowledges the lease before the request joins the
batch (a handoff that streamed less — no reader had called yet — brings the rest to pull).

A `Staging` is the landing's first half. It runs under the request's `Handoff` (the state
machine of handoff.py: ALLOCATING while blocks are reserved, PULLING while pieces land), so an
abort at any point frees the reserved blocks once no transfer writes them. Only the staging
itself frees an unclaimed staging, on its way out: an abort (or `drop_staging`) only asks it
to stop. One that no `generate` claims within `claim_s` after its stream ended frees itself
(its orchestrator went elsewhere, or away). Its failure — a corrupt or void piece, no room — is kept for `generate`,
which then recomputes (or fails) as for any pull.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from splitserve.engine.kv_cache import OutOfBlocks
from splitserve.kv_transfer.base import KVHandoff, StreamPiece, TransferError
from splitserve.kv_transfer.verify import check_header, verify_landed
from splitserve.types import ConfigError, Request
from splitserve.worker.decode.handoff import Handoff, HandoffState

log = logging.getLogger(__name__)
S = HandoffState
STREAM_POLL_S = 1.0  # the longest one kv_stream call waits for news


@dataclass
class Staging:
    ho: Handoff
    dst: list[int] = field(default_factory=list)  # reserved destination blocks, in context order
    held: int = 0  # leading ones this worker's prefix cache held already: not moved
    landed: int = 0  # leading blocks in place: held, then pulled and checked
    run: int = 0  # blocks after those landing layer group by layer group
    run_layers: int = 0  # how many of their layers landed
    pieces: int = 0  # pieces taken, of `epoch`
    epoch: int = 0
    failure: TransferError | None = None
    claimed: bool = False  # generate() has taken it over
    abandoned: bool = False  # generate() came with a handoff that streamed nothing: stop following
    transport: str = ""
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # stage() has returned
    nudged: asyncio.Event = field(default_factory=asyncio.Event)  # claimed: its wait for that ends now

    def claim(self) -> None:
        """generate() takes it over: a staging done with its stream returns at once (its
        handoff's first decode step waits on that)."""
        self.claimed = True
        self.nudged.set()


async def stage(worker, req: Request, prefill: Any, outputs: tuple[int, ...], claim_s: float,
                claimed: bool = False) -> Staging:
    """Reserve blocks and pull the pieces as they are published, until the stream ends."""
    rid = req.request_id
    ho = worker.handoffs[rid] = Handoff(rid)
    st = worker.staged[rid] = Staging(ho, claimed=claimed)
    try:
        return await _stage(worker, st, req, prefill, outputs, claim_s)
    finally:
        st.ended.set()


async def _stage(worker, st: Staging, req: Request, prefill: Any, outputs: tuple[int, ...], claim_s: float) -> Staging:
    rid, ho = req.request_id, st.ho
    try:
        await worker.loop.prepare(req.params)
        r = await worker.loop.call(ho.reserve, worker.engine, req, outputs)
        st.dst, st.held, st.landed = list(r.blocks), r.held, r.held
    except (OutOfBlocks, ConfigError) as e:  # no blocks reserved: generate() computes it here
        st.failure = TransferError("internal", f"the stream could not be staged here: {e}")
    if st.failure is None and ho.abort_requested:
        st.failure = TransferError("aborted", "aborted while its blocks were reserved")
    elif st.failure is None:
        ho.move(S.PULLING)
    over = False
    try:
        if st.failure is None:
            over = await _follow(worker, st, rid, prefill, max(claim_s, 5.0))
    except TransferError as e:
        st.failure = e
    except Exception as e:  # the prefill worker is gone (a Ray error): generate() learns it from its handoff
        st.failure = TransferError("unreachable", f"the stream's prefill worker failed: {type(e).__name__}")
    # Wait a while for generate() to take it over, else give the blocks back — at once when the
    # stream's lease is over already (its generate() came and went: a stage() that came late).
    loop = asyncio.get_running_loop()
    until = loop.time() + claim_s
    while True:
        st.nudged.clear()  # before the check: a claim after it wakes the wait below
        if st.claimed or over or ho.abort_requested or loop.time() >= until:
            break
        try:  # a claim wakes it at once (it was a 10 ms poll, on the first token's path); an abort within 10 ms
            await asyncio.wait_for(st.nudged.wait(), min(0.01, until - loop.time()))
        except asyncio.TimeoutError:
            pass
    if not st.claimed:
        await worker.free_staging(rid)
    return st


async def _follow(worker, st: Staging, rid: str, prefill: Any, claim_s: float) -> bool:
    """Take pieces until the stream ends; each is read and checked before the next. True when
    the stream was over before anything of it was seen (its lease ended)."""
    began = asyncio.get_running_loop().time()
    while not st.ho.abort_requested and not st.abandoned:
        upd = await prefill.kv_stream.remote(rid, st.pieces, st.epoch, STREAM_POLL_S, st.held)
        if upd.handoff is None:
            if upd.done:
                return st.pieces == 0 and st.epoch == 0  # over: its lease ended
            if asyncio.get_running_loop().time() - began > claim_s:
                return False  # it never began: generate() decides
            continue  # not begun yet: our call came before the prefill's
        if upd.epoch != st.epoch:  # the prefill was preempted: what landed is void
            st.epoch, st.pieces, st.landed, st.run, st.run_layers = upd.epoch, 0, st.held, 0, 0
        if not st.transport:
            check_header(upd.handoff, worker.layout)
            st.transport = upd.handoff.endpoint.transport
        for p in upd.pieces:
            await land_piece(worker, st, upd.handoff, p)
            st.pieces += 1
        if upd.done:  # its last piece (the prefill's last step's blocks) was in this update
            return False
    return False


async def land_piece(worker, st: Staging, h: KVHandoff, p: StreamPiece) -> None:
    """Read and check one piece. Pieces come in context order; a run of blocks the prefill was
    still computing comes in consecutive layer groups, and counts as landed once its last has."""
    n = worker.layout.num_layers
    layers = p.layers if p.layers is not None else range(n)
    if p.first != st.landed or layers.start != st.run_layers or (st.run_layers and len(p.block_ids) != st.run):
        raise TransferError("truncated", f"piece at block {p.first}, layer {layers.start}: {st.landed} blocks "
                                         f"and {st.run_layers} layers of the next landed before it")
    if p.first + len(p.block_ids) > len(st.dst):
        raise TransferError("header", f"piece past the context's {len(st.dst)} blocks")
    piece = h.piece(p.first, len(p.block_ids), p.checksum)  # h lists every published block
    dst = st.dst[p.first:p.first + len(p.block_ids)]
    await worker._read(piece, dst, None, st.ho, p.layers)
    await asyncio.to_thread(verify_landed, worker.engine.kv.storage, worker.layout, piece, dst, p.layers)
    if layers.stop == n:
        st.landed, st.run, st.run_layers = p.first + len(p.block_ids), 0, 0
    else:
        st.run, st.run_layers = len(p.block_ids), layers.stop
    worker.pieces_landed += 1
