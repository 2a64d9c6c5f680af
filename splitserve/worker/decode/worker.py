"""The decode worker: an Engine in decode role (DESIGN.md §1 steps 6–8).

`generate(req, handoff, prefill)` lands the prompt's KV pulled from the prefill worker (the
handoff state machine, `handoff.py`: allocate → pull → verify → ready, or recompute, or
aborted), then yields TokenChunks as the continuous batch produces them. Without a handoff it
computes the prompt itself: the aggregated path, and a migrated request (`outputs`: the tokens
another worker already streamed; generation continues right after them, seeded sampling
included). A failed pull recomputes locally with policy `recompute` (the first token is kept);
with `fail` a TransferError reaches the caller. Whatever happens, the lease is settled exactly
once and a caller that goes away aborts the request here — one that closes the stream, and one
whose process died (`callers.py`: each stream's ingress replica, watched).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from typing import Any, AsyncIterator, Sequence

from splitserve.config import EngineConfig
from splitserve.worker.decode import streamed
from splitserve.worker.decode.callers import Callers
from splitserve.worker.decode.handoff import FINAL, Handoff, HandoffState
from splitserve.engine.kv_cache import OutOfBlocks
from splitserve.kv_transfer.base import KVHandoff, TransferError, TransferState
from splitserve.kv_transfer.head_slices import sliced_kind
from splitserve.kv_transfer.verify import check_header, verify_landed
from splitserve.engine.parallel import kv_slices
from splitserve.engine.parallel.pipeline import on_all_stages
from splitserve.engine.parallel.rank_calls import on_all_ranks
from splitserve.worker import rank_kv, spans, stage_kv
from splitserve.types import ConfigError, FinishReason, PhaseTimes, Request, TokenChunk
from splitserve.worker.kv_worker import KVWorker

log = logging.getLogger(__name__)
ON_TRANSFER_FAILURE = ("recompute", "fail")
S = HandoffState


class DecodeWorker(KVWorker):
    def __init__(self, config: EngineConfig, transports: Sequence[str], on_transfer_failure: str = "recompute",
                 transport_options: dict | None = None, host: str | None = None, node_id: str = "",
                 start_ranks=None) -> None:
        if on_transfer_failure not in ON_TRANSFER_FAILURE:
            raise ValueError(f"on_transfer_failure must be one of {ON_TRANSFER_FAILURE}, got {on_transfer_failure!r}")
        super().__init__(config, transports, transport_options, host, node_id, start_ranks)
        self._streams = 0  # generate() calls in progress: a draining worker waits for them
        self.transfers_by_transport: dict[str, int] = {}
        self.policy = on_transfer_failure
        self.transfer_failures: dict[str, int] = {}
        self.handoffs: dict[str, Handoff] = {}  # landing now
        self.staged: dict[str, streamed.Staging] = {}  # streamed handoffs landing ahead of their generate()
        self.claim_s = 30.0  # how long a staging whose stream ended waits for its generate()
        self.pieces_landed = 0  # streamed pieces landed and checked ahead of their handoff
        self.prefix_blocks_kept = 0  # streamed handoffs' blocks found in the prefix cache here, not moved
        self._kept: dict[str, int] = {}  # of a landing that just ended READY: until its generate() reports it
        self._acks: dict[str, asyncio.Task] = {}  # acknowledgements not waited for: until the request ends
        self.handoff_outcomes: collections.Counter[HandoffState] = collections.Counter()
        self._early_aborts: collections.OrderedDict[str, bool] = collections.OrderedDict()
        # Ids whose staging was dropped (or which run here unstaged): a stage() of theirs that Ray
        # delivers late must not reserve blocks under an id the engine is about to admit.
        self._unstaged: collections.OrderedDict[str, bool] = collections.OrderedDict()
        self.callers = Callers(self.abort)  # the ingress replicas streaming from here, watched
        self.callers_met = 0  # introductions received (`meet`), for tests and logs

    async def generate(self, req: Request, handoff: KVHandoff | None = None, prefill: Any = None,
                       outputs: tuple[int, ...] = (), caller: Any = None) -> AsyncIterator[TokenChunk]:
        """`caller`: the ingress replica consuming the stream (its actor handle; None: a driver),
        watched so that its death aborts the request here."""
        rid = req.request_id
        finished = False
        self._streams += 1
        self.callers.add(caller, rid)
        span = spans.decode(req, handoff, outputs)
        try:
            if self._early_aborts.pop(rid, False):  # aborted before it got here
                if handoff is not None:
                    await self._settle(handoff, prefill)
                finished = True
                yield TokenChunk(rid, (), finish_reason=FinishReason.ABORT)
                return
            started = time.monotonic()
            outputs = tuple(outputs)
            if handoff is not None and (handoff.streamed or rid in self.staged):
                q = await self._admit_streamed(req, handoff, prefill, outputs)
            elif handoff is not None:
                q = await self._admit_pulled(req, handoff, prefill, outputs)
            else:  # computed here (placed again without a prefill worker): a staging of before goes first
                await self._stop_staging(rid)
                q = await self.loop.submit(req, outputs=outputs)
            if q is None:  # aborted during the handoff: its blocks are free already
                finished = True
                yield TokenChunk(rid, (), finish_reason=FinishReason.ABORT)
                return
            phases, emitted = None, 0
            if handoff is not None:
                moved = (len(handoff.block_ids) - self._kept.pop(rid, 0)) * self.engine.cache_layers \
                    * 2 * self.layout.block_bytes
                exposed = time.time() - handoff.computed_at if handoff.computed_at else None
                phases = PhaseTimes(transfer_s=time.monotonic() - started, transfer_bytes=moved,
                                    exposed_transfer_s=exposed, transport=handoff.endpoint.transport)
                spans.kv_transfer(span, handoff, phases)
            while True:
                item = await q.get()
                if isinstance(item, Exception):
                    raise item
                if phases is not None:  # the transfer's time rides on the first chunk after it
                    item, phases = dataclasses.replace(item, phases=phases.merged(item.phases)), None
                finished, emitted = item.finished, emitted + len(item.token_ids)
                if finished:
                    await self._acked(rid)  # its source blocks are free once it ends, as before
                    spans.finished(span, item, emitted)
                yield item
                if finished:
                    return
        except BaseException as e:
            spans.failed(span, e)
            raise
        finally:
            span.end()
            self._kept.pop(rid, None)  # (a landing that ended READY as an abort came)
            self._streams -= 1
            self.callers.remove(caller, rid)
            if not finished:
                await self.loop.abort(rid)

    async def meet(self, caller: Any) -> None:
        """An ingress replica introduces itself as it learns of this worker (router/directory.py):
        its handle (the `caller` its streams will name) reaches this process before any stream
        of it does. Nothing is kept: receiving it is the point — under Ray the first handle of
        an actor class to arrive loads that class here (Ray Serve's modules: 0.4 s measured),
        which the first stream's arguments would otherwise wait for."""
        self.callers_met += 1

    def held(self) -> int:
        return super().held() + self._streams + len(self.staged)

    async def _close_handoff(self, request_id: str, ho: Handoff) -> None:
        """However a landing ended: one failed or cancelled midway ends ABORTED (its blocks
        freed; an earlier end is kept), it leaves the table, its outcome is counted."""
        try:
            if ho.state not in FINAL:
                await _uncancelled(self.loop.call(ho.finish, self.engine, S.ABORTED))
        finally:
            if self.handoffs.get(request_id) is ho:
                del self.handoffs[request_id]
            self.handoff_outcomes[ho.state] += 1

    # -- a streamed handoff (streamed.py) --------------------------------------------------------
    async def stage(self, req: Request, prefill: Any, outputs: tuple[int, ...] = ()) -> None:
        """Start landing a streamed handoff while its prompt is being computed (the
        orchestrator calls it with the prefill). Returns when the stream has ended here."""
        rid = req.request_id
        if self.engine.pp is not None:  # its stages land whole handoffs only (the pieces' layers are stage 0's)
            return
        if rid in self.handoffs or self._early_aborts.get(rid) or rid in self._unstaged or self.loop.has(rid):
            return  # generate() got here first, its staging was dropped, or the request is over already
        await streamed.stage(self, req, prefill, tuple(outputs), self.claim_s)

    async def drop_staging(self, request_id: str) -> None:
        """The orchestrator will not claim this staging (its prefill failed, or the request ended
        there): it stops, and gives its blocks back once no transfer writes them."""
        _remember(self._unstaged, request_id)
        st = self.staged.get(request_id)
        if st is not None and not st.claimed:
            st.ho.request_abort()

    async def _stop_staging(self, request_id: str) -> None:
        """Until an unclaimed staging of this id (an earlier attempt's) has given its blocks back."""
        await self.drop_staging(request_id)
        st = self.staged.get(request_id)
        if st is not None and not st.claimed:
            await st.ended.wait()

    async def free_staging(self, request_id: str) -> None:
        """The staging's own way out, unclaimed: its reserved blocks go (no transfer runs now)."""
        st = self.staged.get(request_id)
        if st is None or st.claimed:
            return
        del self.staged[request_id]
        await self._close_handoff(request_id, st.ho)

    async def _admit_streamed(self, req: Request, h: KVHandoff, prefill: Any, outputs: tuple[int, ...]
                              ) -> asyncio.Queue | None:
        """Land a streamed handoff: the staging's pieces (waited for, or taken now if stage()
        never came), then the tail. Every way out ends the state machine once."""
        rid = req.request_id
        st = self.staged.get(rid)
        if st is not None and not st.claimed and st.ho.abort_requested:  # dropped, on its way out
            await self._stop_staging(rid)  # (a failed attempt's: this one stages afresh)
            st = self.staged.get(rid)
        if st is None:
            st = await streamed.stage(self, req, prefill, outputs, 0.0, claimed=True)
        else:
            st.abandoned = not h.streamed  # nothing was streamed after all: the whole pull follows
            st.claim()
            await st.ended.wait()
        try:
            return await self._land_streamed(req, h, prefill, st, outputs)
        finally:
            self.staged.pop(rid, None)
            await self._close_handoff(rid, st.ho)

    async def _land_streamed(self, req: Request, h: KVHandoff, prefill: Any, st: streamed.Staging,
                             outputs: tuple[int, ...]) -> asyncio.Queue | None:
        ho, context = st.ho, (*outputs, h.first_token)
        if not st.dst:  # no blocks were reserved: as an allocation that failed
            await self._settle(h, prefill)
            return await self._recompute(req, context, ho)
        room = h.streamed >= st.held or await self._unshare(st)  # else the prefill sends what is held here
        await self.loop.call(ho.adopt, self.engine, req, context)  # the request's blocks now
        q = self.loop.watch(req.request_id)
        if ho.abort_requested or not room:
            await self._settle(h, prefill)
            return await self._end(ho, S.ABORTED if ho.abort_requested else S.RECOMPUTE, q)
        kind = h.endpoint.transport
        self.transfers_by_transport[kind] = self.transfers_by_transport.get(kind, 0) + 1
        try:
            if st.failure is not None:
                raise st.failure
            if st.landed != h.streamed and h.streamed:
                raise TransferError("truncated", f"{st.landed} blocks of the stream landed, {h.streamed} were published")
            await self._pull_tail(h, st.dst, prefill, ho)
        except TransferError as e:
            await self._settle(h, prefill)
            if e.kind == "aborted" or ho.abort_requested:
                return await self._end(ho, S.ABORTED, q)
            self.transfer_failures[e.kind] = self.transfer_failures.get(e.kind, 0) + 1
            if self.policy == "fail":
                raise
            log.warning("streamed KV for %s failed (%s): recomputing locally", req.request_id, e)
            return await self._end(ho, S.RECOMPUTE, q)
        self.prefix_blocks_kept += st.held
        if st.held:
            self._kept[req.request_id] = st.held
        return await self._end(ho, S.READY, q)

    async def _unshare(self, st: streamed.Staging) -> bool:
        """Fresh blocks for the held ones, which the handoff carries after all (it streamed
        nothing: stage() came too late, or the prefill does not stream); False if none free."""
        try:
            r = await self.loop.call(self.engine.unshare_reserved, st.ho.request_id)
        except OutOfBlocks:
            return False
        st.dst, st.held = list(r.blocks), 0
        return True

    async def _pull_tail(self, h: KVHandoff, dst: list[int], prefill: Any, ho: Handoff) -> None:
        """The blocks after the pieces (all of them when none were streamed), then the ack,
        then their check."""
        n = len(h.block_ids)
        check_header(h, self.layout)
        if n == h.streamed:  # every block came in a piece, checked once it had landed: whether the
            self._ack_soon(h, prefill)  # lease was still live changes nothing, so the request
            ho.move(S.VERIFYING)  # does not wait for the ack's answer (a round trip to the prefill)
            return
        tail = h.piece(h.streamed, n - h.streamed, h.checksum)
        try:
            await self._read(tail, dst[h.streamed:], prefill, ho)
        finally:
            live = await self._settle(h, prefill)
        if not live:
            raise TransferError("lease_expired", f"lease {h.lease_id} lapsed before the read was acknowledged")
        ho.move(S.VERIFYING)
        await asyncio.to_thread(verify_landed, self.engine.kv.storage, self.layout, tail, dst[h.streamed:])

    def _ack_soon(self, h: KVHandoff, prefill: Any) -> None:
        rid = h.request_id
        task = self._acks[rid] = asyncio.get_running_loop().create_task(self._settle(h, prefill))

        def answered(_: asyncio.Task) -> None:
            if self._acks.get(rid) is task:
                del self._acks[rid]

        task.add_done_callback(answered)

    async def _acked(self, request_id: str) -> None:
        """Until the ack sent for this request's handoff has been answered (never raises)."""
        task = self._acks.get(request_id)
        if task is not None:
            await asyncio.shield(task)

    # -- the handoff ----------------------------------------------------------------------------
    async def _admit_pulled(self, req: Request, h: KVHandoff, prefill: Any, outputs: tuple[int, ...]
                            ) -> asyncio.Queue | None:
        """Land the handoff's KV: the request's queue, or None if it was aborted meanwhile. Every
        way out ends the state machine, so the blocks are handed over or freed exactly once."""
        rid = req.request_id
        ho = self.handoffs[rid] = Handoff(rid)
        try:
            return await self._land(req, h, prefill, ho, outputs)
        finally:
            await self._close_handoff(rid, ho)

    async def _land(self, req: Request, h: KVHandoff, prefill: Any, ho: Handoff, outputs: tuple[int, ...]
                    ) -> asyncio.Queue | None:
        rid = req.request_id
        try:
            await self.loop.prepare(req.params)  # its grammar compiled off the engine thread
            dst = await self.loop.call(ho.allocate, self.engine, req, (*outputs, h.first_token))
        except BaseException as e:  # nothing was allocated; the source blocks go now, not when the lease lapses
            await self._settle(h, prefill)
            if not isinstance(e, OutOfBlocks):
                raise
            return await self._recompute(req, (*outputs, h.first_token), ho)  # the scheduler computes it
        q = self.loop.watch(rid)
        if ho.abort_requested:  # before any byte moved
            await self._settle(h, prefill)
            return await self._end(ho, S.ABORTED, q)
        ho.move(S.PULLING)
        try:
            await self._pull(h, dst, prefill, ho)
        except TransferError as e:
            if e.kind == "aborted":
                return await self._end(ho, S.ABORTED, q)
            self.transfer_failures[e.kind] = self.transfer_failures.get(e.kind, 0) + 1
            if self.policy == "fail":
                raise  # ends ABORTED on the way out
            log.warning("KV pull for %s failed (%s): recomputing locally", rid, e)
            return await self._end(ho, S.RECOMPUTE, q)
        return await self._end(ho, S.READY, q)

    async def _end(self, ho: Handoff, outcome: HandoffState, q: asyncio.Queue) -> asyncio.Queue | None:
        final = await self.loop.call(ho.finish, self.engine, outcome)
        if final is S.ABORTED:
            self.loop.forget(ho.request_id)
            return None
        self.loop.wake()
        return q

    async def _recompute(self, req: Request, outputs: tuple[int, ...], ho: Handoff) -> asyncio.Queue | None:
        if await self.loop.call(ho.finish, self.engine, S.RECOMPUTE) is S.ABORTED:
            return None
        if ho.abort_requested:  # came while finish ran: nothing was submitted, nothing to free
            return None
        # No await between the check and submit: a later abort finds the request in the loop.
        return await self.loop.submit(req, outputs=outputs)

    async def _pull(self, h: KVHandoff, dst: list[int], prefill: Any, ho: Handoff) -> None:
        """Read, then settle the lease, then verify. Raises TransferError; never leaves a
        transfer writing into blocks the engine may hand to someone else."""
        staged = bool(h.stages)  # a pipeline-parallel source or reader
        sliced = bool(h.ranks) and not staged  # a tensor-parallel source or reader
        try:
            if staged:  # each stage here pulls its layers from the source stages holding them, and checks them
                check_header(h, self._whole_layout)
                await self._read_staged(h, dst, prefill, ho)
            elif self.engine.pp is not None:
                raise TransferError("header", "this decode worker is pipeline-parallel: it reads handoffs that carry "
                                              "every source stage's layers only")
            elif sliced:  # each rank here pulls its KV heads from the source ranks holding them, and checks them
                check_header(h, self.layout, heads_may_differ=True)
                await self._read_sliced(h, dst, prefill, ho)
            elif self.engine.tp.size > 1:
                raise TransferError("header", "this decode worker is tensor-parallel: it reads handoffs that "
                                              "carry every source rank's part only")
            else:
                check_header(h, self.layout)
                kind = h.endpoint.transport
                self.transfers_by_transport[kind] = self.transfers_by_transport.get(kind, 0) + 1
                await self._read(h, dst, prefill, ho)
        finally:
            live = await self._settle(h, prefill)
        if not live:
            raise TransferError("lease_expired", f"lease {h.lease_id} lapsed before the read was acknowledged")
        ho.move(S.VERIFYING)
        if sliced or staged:
            return  # every head (layer) was checked as it landed
        # Off the engine thread: running decodes keep stepping while a long prompt's KV is
        # checked. Nothing writes these blocks meanwhile (they join the batch only once READY);
        # an abort now frees them, and then the verdict is never used.
        await asyncio.to_thread(verify_landed, self.engine.kv.storage, self.layout, h, dst)

    async def _read_sliced(self, h: KVHandoff, dst: list[int], prefill: Any, ho: Handoff) -> None:
        """The heterogeneous-TP pull: the plan of which heads each rank here takes from which
        source rank; with one rank here in a thread, with several on the engine thread (every
        rank pulls at once; the decode steps wait meanwhile). The lease is renewed meanwhile;
        an abort is seen once no rank writes the blocks any more."""
        e = self.engine
        ep = e.config.expert_parallel  # both pools run one engine configuration
        try:
            plan = kv_slices.plan(e.model_config, len(h.ranks), e.tp.size, ep, ep)
        except (ConfigError, AssertionError) as err:
            raise TransferError("header", f"no slice plan from {len(h.ranks)} source ranks to {e.tp.size}: {err}")
        kind = sliced_kind(h.endpoint.transport)
        self.transfers_by_transport[kind] = self.transfers_by_transport.get(kind, 0) + 1
        renewing = asyncio.ensure_future(self._renew(h, prefill))
        try:
            if e.tp.size == 1:  # to its end even if cancelled: the blocks it writes are freed only after it
                await _uncancelled(asyncio.to_thread(rank_kv.pull, e, h, plan, dst, kind, self.kv_secret))
            else:  # on the engine thread: whatever frees the blocks runs there after it
                await self.loop.call(on_all_ranks, e, rank_kv.pull, h, plan, dst, kind, self.kv_secret)
        finally:
            renewing.cancel()
        if ho.abort_requested:
            raise TransferError("aborted", "the request was aborted during the transfer")

    @property
    def _whole_layout(self):
        """This worker's layout as the whole model's (a stage's cache holds only its layers)."""
        return dataclasses.replace(self.layout, num_layers=self.engine.cache_layers)

    async def _read_staged(self, h: KVHandoff, dst: list[int], prefill: Any, ho: Handoff) -> None:
        """The pull by stage: each stage here (one engine: itself) takes its layers from the
        source stages holding them; one engine in a thread, stages on the engine thread (every
        stage pulls at once; the decode steps wait meanwhile). The lease is renewed meanwhile;
        an abort is seen once no stage writes the blocks any more."""
        e = self.engine
        if e.tp.size > 1:
            raise TransferError("header", "a tensor-parallel decode worker reads no handoff by stage: the layers of "
                                          "pipeline stages cut by heads are not built")
        kind = sliced_kind(h.endpoint.transport)
        self.transfers_by_transport[kind] = self.transfers_by_transport.get(kind, 0) + 1
        renewing = asyncio.ensure_future(self._renew(h, prefill))
        try:
            if e.pp is None:  # to its end even if cancelled: the blocks it writes are freed only after it
                await _uncancelled(asyncio.to_thread(stage_kv.pull, e, h, dst, kind, self.kv_secret))
            else:  # on the engine thread: whatever frees the blocks runs there after it
                await self.loop.call(on_all_stages, e, stage_kv.pull, h, dst, kind, self.kv_secret)
        finally:
            renewing.cancel()
        if ho.abort_requested:
            raise TransferError("aborted", "the request was aborted during the transfer")

    async def _renew(self, h: KVHandoff, prefill: Any) -> None:
        """Keep the source blocks pinned while a pull runs (fire and forget)."""
        if prefill is None:
            return
        every = max(0.05, (h.lease_expires_at - time.time()) / 3)
        while True:
            await asyncio.sleep(every)
            prefill.renew.remote(h.lease_id)

    async def _read(self, h: KVHandoff, dst: list[int], prefill: Any, ho: Handoff, layers: range | None = None) -> None:
        transport = self.transports.get(h.endpoint.transport)
        if transport is None:
            raise TransferError("unreachable", f"handoff over {h.endpoint.transport!r}; this worker reads "
                                f"{list(self.transports)}")
        handle = transport.read(h, dst, layers)
        renewing = asyncio.ensure_future(self._renew(h, prefill))
        try:
            while (st := transport.poll(handle)).state is TransferState.PENDING:
                if ho.abort_requested:
                    break  # release() below stops the transfer before the blocks are freed
                await asyncio.sleep(0.0005)
        finally:
            renewing.cancel()
            transport.release(handle)
            await _uncancelled(_stopped(transport, handle, h.request_id))
        if ho.abort_requested:
            raise TransferError("aborted", "the request was aborted during the transfer")
        if st.state is TransferState.FAILED:
            raise st.reason or TransferError("internal", "transfer failed without a reason")

    async def _settle(self, h: KVHandoff, prefill: Any) -> bool:
        """Acknowledge the lease (frees the source blocks). A dead prefill worker counts as a
        lapsed lease: its memory may be gone or reused."""
        if prefill is None:
            return True
        try:
            return bool(await prefill.ack.remote(h.lease_id))
        except Exception as e:  # the prefill actor died: nothing to free there any more
            log.warning("acknowledging lease %s failed: %s", h.lease_id, type(e).__name__)
            return False

    # -- control --------------------------------------------------------------------------------
    async def abort(self, request_id: str) -> None:
        """Abort wherever the request is: during a handoff, the state machine frees it once no
        transfer can write its blocks; before its stream began here (Ray does not order an
        async actor's calls), when it begins."""
        ho = self.handoffs.get(request_id)
        if ho is not None:
            st = self.staged.get(request_id)
            if st is not None and not st.claimed:  # only staged: its generate() may still come, and
                _remember(self._early_aborts, request_id)  # must end at once then (the staging is gone)
            if ho.request_abort():  # it has already entered the engine
                await self.loop.abort(request_id)
        elif self.loop.has(request_id):
            await self.loop.abort(request_id)
        else:
            _remember(self._early_aborts, request_id)

    async def check_invariants(self) -> dict:
        counts = await self.loop.call(self.engine.block_counts)
        return {**counts, "handoffs": len(self.handoffs), "staged": len(self.staged), "pieces_landed": self.pieces_landed,
                "prefix_blocks_kept": self.prefix_blocks_kept, "callers_met": self.callers_met,
                "transfer_failures": dict(self.transfer_failures),
                "transfers_by_transport": dict(self.transfers_by_transport)}


def _remember(ids: collections.OrderedDict, request_id: str) -> None:
    ids[request_id] = True
    while len(ids) > 4096:  # bounded: most belong to requests long finished
        ids.popitem(last=False)


async def _stopped(transport, handle, request_id: str) -> None:
    """Until a released transfer has stopped moving bytes (a NIXL read already posted cannot be
    recalled): only then may its blocks be freed, however long that takes. Every transport ends
    a released read."""
    waited = time.monotonic()
    while transport.poll(handle).state is TransferState.PENDING:
        if time.monotonic() - waited > 5.0:
            log.warning("a released KV read for %s is still in flight", request_id)
            waited = time.monotonic()
        await asyncio.sleep(0.001)


async def _uncancelled(aw) -> None:
    """Run `aw` to the end even if this task is cancelled meanwhile (then re-raise the cancel):
    cleanup that frees blocks must not stop halfway."""
    task = asyncio.ensure_future(aw)
    cancelled = False
    while True:
        try:
            await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
