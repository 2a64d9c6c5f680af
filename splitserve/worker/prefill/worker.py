"""The prefill worker: an Engine in prefill role (DESIGN.md §1 step 5).

`prefill(req)` runs chunked prefill (reusing this worker's prefix cache), samples the first
token and returns a `PrefillResult`: either the request already finished (EOS or max_tokens 1)
or a `KVHandoff` — first token, source blocks pinned under a lease, this worker's transport
endpoint, header and checksum. The blocks stay pinned until the reader acknowledges (`ack`) or
the lease lapses; a background task frees lapsed leases. Plain Python; `control.actors` wraps it in a
Ray actor.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass
from typing import Sequence

from splitserve.config import EngineConfig
from splitserve.worker.kv_worker import KVWorker
from splitserve.kv_transfer.base import KVHandoff, StreamUpdate, TransferHeader, TransportEndpoint
from splitserve.kv_transfer.head_slices import RankSource
from splitserve.engine.parallel.pipeline import on_all_stages
from splitserve.engine.parallel.rank_calls import on_all_ranks
from splitserve.engine.parallel.shard import Shard
from splitserve.kv_transfer.stage_slices import StageSource
from splitserve.worker import rank_kv, spans, stage_kv
from splitserve.kv_transfer.regions import kv_checksum
from splitserve.worker.prefill.leases import LeaseTable
from splitserve.worker.prefill.stream import KVStream
from splitserve.types import ConfigError, KVProgress, Request, TokenChunk

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillResult:
    chunk: TokenChunk  # the first token (finished already if finish_reason is set)
    handoff: KVHandoff | None  # None when the request finished during prefill
    done_at: float  # time.time() when the first token was sampled, to measure its delivery


class PrefillWorker(KVWorker):
    serves_kv = True

    def __init__(self, config: EngineConfig, transports: Sequence[str], lease_s: float = 30.0,
                 host: str | None = None, transport_options: dict | None = None, node_id: str = "",
                 start_ranks=None, reader_stages: int = 1) -> None:
        # Every transport this worker offers; the router picks one per handoff (by locality).
        super().__init__(config, transports, transport_options, host, node_id, start_ranks)
        # The pipeline stages of the decode workers reading its handoffs (the app's decode_pp): a
        # reader of several processes may be a TP group or stages, which its count cannot tell.
        self.reader_stages = reader_stages
        self.leases = LeaseTable(lease_s)
        self._reaper: asyncio.Task | None = None
        self._prefilling: set[str] = set()  # prefill() calls in progress
        self._releasing: dict[str, asyncio.Task] = {}  # acknowledged leases whose blocks are being freed
        self.streams: dict[str, KVStream] = {}  # streamed handoffs, from their prefill's start to their lease's end
        self._ended: collections.OrderedDict[str, None] = collections.OrderedDict()  # streams over (bounded)
        self._abandoned: collections.OrderedDict[str, None] = collections.OrderedDict()  # callers gone (bounded)

    def held(self) -> int:
        return super().held() + len(self._prefilling) + len(self.leases) + len(self._releasing)

    def endpoint(self, transport: str | None) -> TransportEndpoint:
        """The endpoint a reader pulls this handoff through (None: this worker's first)."""
        if transport is None:
            return next(iter(self.endpoints.values()))
        if transport not in self.endpoints:
            raise ConfigError(f"KV transport {transport!r} is not offered by this worker; it offers "
                              f"{', '.join(self.endpoints)}")
        return self.endpoints[transport]

    async def prefill(self, req: Request, transport: str | None = None, outputs: tuple[int, ...] = (),
                      reader_ranks: int = 1, stream: bool = False) -> PrefillResult:
        """`outputs`: tokens the request already generated elsewhere (it migrated): computed as
        context, and the token sampled here is the one after them. `reader_ranks`: the
        tensor-parallel size of the decode worker that reads the handoff (more than 1, or more
        than one rank here: the handoff carries every rank's part, head_slices.RankSource).
        `stream`: publish the prompt's blocks as they are computed (`kv_stream`), where the
        handoff is one rank's to one rank (not by stage: a pipeline-parallel source or reader).
        A pipeline-parallel worker, or one whose readers are (`reader_stages`), hands off by
        stage (stage_slices.StageSource per stage)."""
        endpoint = self.endpoint(transport)
        self._ensure_reaper()
        self._prefilling.add(req.request_id)
        one_to_one = reader_ranks == 1 and self.engine.tp.size == 1 and not self._by_stage
        st = self._open_stream(req, endpoint, outputs) if stream and one_to_one else None
        span = spans.prefill(req, endpoint.transport, st is not None)
        try:
            result = await self._prefill(req, endpoint, tuple(outputs), reader_ranks, st)
            if result.handoff is not None and req.request_id in self._abandoned:  # nobody will read it
                await self.abandon(req.request_id)
            spans.prefilled(span, result.chunk, result.handoff)
            return result
        except BaseException as e:
            spans.failed(span, e)
            raise
        finally:
            span.end()
            self._prefilling.discard(req.request_id)

    async def _prefill(self, req: Request, endpoint: TransportEndpoint, outputs: tuple[int, ...],
                       reader_ranks: int, st: KVStream | None) -> PrefillResult:
        try:
            q = await self.loop.submit(req, prefill_only=True, outputs=outputs, stream_kv=st is not None)
            while isinstance(item := await q.get(), KVProgress):
                await self._publish(st, item)
        except BaseException as e:  # cancelled (the caller is gone) or refused
            await self._close_stream(st)
            if not isinstance(e, ConfigError):
                await self.loop.abort(req.request_id)
            raise
        if isinstance(item, Exception):
            await self._close_stream(st)
            await self.loop.abort(req.request_id)
            raise item
        done_at = time.time()
        if item.kv_blocks is None:
            await self._close_stream(st)
            return PrefillResult(item, None, done_at)
        try:
            return PrefillResult(item, await self._handoff(req, item, endpoint, reader_ranks, done_at, st), done_at)
        except BaseException:  # cancelled or failed after the blocks were detached: nobody will ack
            # (a lease _handoff granted before failing, it ended on its way out)
            await self._close_stream(st)
            await self.loop.call(self.engine.release_detached, req.request_id)
            raise

    # -- a streamed handoff -----------------------------------------------------------------
    def _open_stream(self, req: Request, endpoint: TransportEndpoint, outputs) -> KVStream:
        """A stream, and the lease its reader reads under from the first piece to the ack."""
        lease = self.leases.grant(req.request_id)
        header = TransferHeader(req.request_id, self.layout.model_fingerprint, self.layout.dtype,
                                self.layout.block_size, self.layout.num_layers, 0, lease.epoch)
        opening = KVHandoff(req.request_id, -1, None, len(req.prompt_token_ids) + len(outputs), 0, (), endpoint,
                            lease.lease_id, lease.expires_at, header, 0, lease.token)
        st = self.streams[req.request_id] = KVStream(opening)
        return st

    async def _publish(self, st: KVStream, p: KVProgress) -> None:
        """New complete blocks, or new layers of the blocks a step is computing: checksummed off
        the engine thread (the prefill goes on), then readable under the stream's lease. A new
        epoch (preempted) voids the earlier ones. Nothing is published before the reader said
        which blocks it holds."""
        st.latest = p
        async with st.publishing:
            if st.done or st.held is None or p is not st.latest:  # a newer one publishes it all
                return
            if p.epoch != st.epoch:
                st.restart(p.epoch)
                self._allow(st, ())
            await self._add_due(st, p.block_ids, p.computing, p.layers)

    async def _add_due(self, st: KVStream, complete, computing=(), layers: int = 0) -> bool:
        """Under st.publishing: publish what is due (KVStream.due); False if the stream ended
        or restarted meanwhile."""
        epoch, n = st.epoch, self.layout.num_layers
        st.cover_held(tuple(complete))
        for blocks, lay in st.due(tuple(complete), tuple(computing), layers, n):
            checksum = await asyncio.to_thread(kv_checksum, self.engine.kv.storage, self.layout, blocks, lay)
            if st.done or st.epoch != epoch:
                return False
            st.add(blocks, lay, checksum, n)
            self._allow(st, st.blocks + st.run)
        return True

    def _allow(self, st: KVStream, blocks) -> None:
        """The stream's token may read `blocks` now (none: nothing). `allow` replaces a grant in
        one step: revoking first left a moment in which a transport's serving thread found no
        grant and refused a read of blocks published long before ("lease_expired")."""
        token = st.opening.lease_token
        for t in self.transports.values():
            if blocks:
                t.allow(token, blocks)
            else:
                t.revoke(token)

    async def _close_stream(self, st: KVStream | None) -> None:
        """The stream ends without a handoff (the request failed or finished in its prefill):
        its lease ends, so nothing of it is read any more."""
        if st is None:
            return
        self._drop_stream(st)
        lease = self.leases.settle(st.lease_id)
        for t in self.transports.values():
            t.revoke(st.opening.lease_token)
        if lease is None:
            await self._reap()

    async def kv_stream(self, request_id: str, have: int = 0, epoch: int = 0, wait_s: float = 1.0,
                        held: int = 0) -> StreamUpdate:
        """A reader's view of a streamed handoff: what is new after its `have` pieces of `epoch`,
        once there is some (or after `wait_s`). `held`: the context's leading blocks the reader
        holds already, not sent (its first call's counts). Renews the stream's lease: its reader
        is alive. A stream not begun yet (the reader's call came first: Ray orders neither) is
        waited for; one that is over says so (`done`, no handoff)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while (st := self.streams.get(request_id)) is None:
            if request_id in self._ended:
                return StreamUpdate(None, (), 0, True)
            if loop.time() >= deadline:
                return StreamUpdate(None, (), 0, False)
            await asyncio.sleep(0.002)
        self.leases.renew(st.lease_id)
        if st.held is None:
            st.held = max(0, held)
            if st.latest is not None:  # what was computed before this call (a cached prefix at once)
                await self._publish(st, st.latest)
        return await st.wait(have, epoch, max(0.0, deadline - loop.time()))

    async def _handoff(self, req: Request, chunk: TokenChunk, endpoint: TransportEndpoint,
                       reader_ranks: int, computed_at: float, st: KVStream | None = None) -> KVHandoff:
        blocks = chunk.kv_blocks
        checksum, ranks, stages, streamed = 0, (), (), 0
        lease = self.leases.get(st.lease_id) if st is not None else None
        if lease is not None:  # its reader gets a whole term from here, as for a fresh lease: the
            self.leases.renew(lease.lease_id)  # stream's renewals stopped when its last piece was read
            streamed, checksum = await self._last_piece(st, tuple(blocks))
        elif self._by_stage:  # every stage's layers checksummed, layer by layer
            stages = await self._stage_sources(blocks)
        elif reader_ranks > 1 or self.engine.tp.size > 1:  # sliced: every rank's heads checksummed instead
            ranks = await self._rank_sources(blocks)
        else:  # off the engine thread (prefills keep running): detached blocks are written by no one
            checksum = await asyncio.to_thread(kv_checksum, self.engine.kv.storage, self.layout, blocks)
        if st is not None and lease is None:  # its lease lapsed mid-stream: the handoff starts afresh
            await self._close_stream(st)
            st = None
        lease = lease or self.leases.grant(req.request_id)
        for t in self.transports.values():  # its reader may read these blocks, and only while leased
            t.allow(lease.token, blocks)
        if st is not None:
            st.close()  # no more pieces: the reader reads the rest with the handoff
        if self._others is not None:  # and those of the other ranks' (or stages') caches
            try:
                await self.loop.call(self._others, self.engine, rank_kv.allow, lease.token, blocks)
            except BaseException:  # cancelled or failed: no reader gets this lease (the caller frees the blocks)
                self.leases.settle(lease.lease_id)
                for t in self.transports.values():
                    t.revoke(lease.token)
                raise
        header = TransferHeader(req.request_id, self.layout.model_fingerprint, self.layout.dtype,
                                self.layout.block_size, self.num_layers, len(blocks), lease.epoch)
        return KVHandoff(req.request_id, chunk.token_ids[0], chunk.logprobs[0] if chunk.logprobs else None,
                         chunk.num_prompt_tokens, chunk.num_cached_tokens, tuple(blocks), endpoint,
                         lease.lease_id, lease.expires_at, header, checksum, lease.token, ranks, computed_at,
                         streamed, stages)

    async def _last_piece(self, st: KVStream, blocks: tuple[int, ...]) -> tuple[int, int]:
        """The stream's end: (how many leading blocks the handoff says streamed, the checksum
        of the rest). With its reader following, what was not published yet — the last step's
        blocks, or their last layers — is the last piece, pulled by its staging while this
        handoff travels, and nothing is left; else the whole context goes with the handoff."""
        storage = self.engine.kv.storage
        async with st.publishing:  # no publication runs meanwhile
            if st.held is not None and await self._add_due(st, blocks) and st.blocks == blocks:
                return len(blocks), kv_checksum(storage, self.layout, ())
        return 0, await asyncio.to_thread(kv_checksum, storage, self.layout, blocks)

    async def _rank_sources(self, blocks) -> tuple[RankSource, ...]:
        """Every rank's part of the handoff: its endpoints, its KV heads, a checksum per head
        (on the engine thread: the other ranks take theirs between steps)."""
        e, size = self.engine, self.engine.tp.size
        if size == 1:  # a tensor-parallel reader of this one rank: off the engine thread
            sums = [await asyncio.to_thread(rank_kv.checksums, e, blocks)]
        else:
            sums = await self.loop.call(on_all_ranks, e, rank_kv.checksums, blocks)
        heads = [Shard.of(e.model_config, r, size, e.config.expert_parallel).kv_heads for r in range(size)]
        return tuple(RankSource(r, heads[r], self.rank_endpoints[r], sums[r]) for r in range(size))

    @property
    def _by_stage(self) -> bool:
        """Whether handoffs go by stage: this worker or its readers are pipeline-parallel."""
        return self.engine.pp is not None or self.reader_stages > 1

    @property
    def num_layers(self) -> int:
        """The whole model's cache layers, a draft head's included (a stage's cache, `layout`,
        holds only its own)."""
        return self.engine.cache_layers

    @property
    def _others(self):
        """How a call reaches the other processes' caches: on_all_stages (pipeline-parallel),
        on_all_ranks (tensor-parallel), or None (one process)."""
        if self.engine.pp is not None:
            return on_all_stages
        return on_all_ranks if self.engine.tp.size > 1 else None

    async def _stage_sources(self, blocks) -> tuple[StageSource, ...]:
        """Every stage's part of the handoff: its endpoints, its layers, a checksum per layer (on
        the engine thread: the other stages take theirs between steps; one stage: off it)."""
        e = self.engine
        if e.pp is None:
            parts = [await asyncio.to_thread(stage_kv.checksums, e, blocks)]
        else:
            parts = await self.loop.call(on_all_stages, e, stage_kv.checksums, blocks)
        return tuple(StageSource(s, layers, self.stage_endpoints[s], sums) for s, (layers, sums) in enumerate(parts))

    async def ack(self, lease_id: str) -> bool:
        """The reader is done. True if the lease was live (its copy is good); the blocks are freed
        either way (soon, or by the reaper for a lapsed lease). Answered without waiting for
        this engine: freeing takes its thread, which may be inside a prefill step of seconds,
        and the reader's request must not wait for that to start decoding."""
        lease = self.leases.settle(lease_id)
        if lease is None:
            await self._reap()
            return False
        rid = lease.request_id
        self._forget_stream(rid, lease_id)
        # registered at once (check_invariants counts these blocks as being freed); the task
        # runs only after the revokes below, at this coroutine's return
        self._releasing[rid] = asyncio.get_running_loop().create_task(self._release(rid, lease.token))
        for t in self.transports.values():
            t.revoke(lease.token)  # nothing reads these blocks from now on
        return True

    async def _release(self, request_id: str, token: bytes) -> None:
        try:
            await self.loop.call(self._free, request_id, token)
        except Exception:  # the engine has stopped: the worker is replaced, its memory with it
            log.warning("could not free the blocks of a finished handoff", exc_info=True)
        finally:
            self._releasing.pop(request_id, None)

    async def renew(self, lease_id: str) -> bool:
        return self.leases.renew(lease_id)

    async def abandon(self, request_id: str) -> None:
        """Its caller gave up on this request's prefill and may never learn its handoff (a
        cancel that raced the result: Ray then reports the call cancelled, result and all).
        Whatever it still leases ends now — nobody will acknowledge it — and a prefill of it
        still running ends its lease as it returns, instead of pinning the blocks until it lapses."""
        _remember(self._abandoned, request_id)
        for lease in self.leases.take(request_id):
            await self._end(lease)

    def _ensure_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.leases.ttl_s / 4))
            await self._reap()

    async def _reap(self) -> None:
        for lease in self.leases.expire():
            try:
                await self._end(lease)
            except Exception:  # the engine stopped: the worker is replaced, its memory with it
                log.warning("could not free the blocks of a lapsed lease", exc_info=True)

    def _forget_stream(self, request_id: str, lease_id: str) -> None:
        st = self.streams.get(request_id)
        if st is not None and st.lease_id == lease_id:  # its lease is over: so is the stream
            self._drop_stream(st)

    def _drop_stream(self, st: KVStream) -> None:
        st.close()
        self.streams.pop(st.request_id, None)
        _remember(self._ended, st.request_id)  # bounded: readers ask within seconds of the end

    async def _end(self, lease) -> None:
        """A lease is over: its token reads nothing more, then its blocks are free."""
        self._forget_stream(lease.request_id, lease.lease_id)
        for t in self.transports.values():
            t.revoke(lease.token)
        await self.loop.call(self._free, lease.request_id, lease.token)

    def _free(self, request_id: str, token: bytes) -> None:
        """On the engine thread: the other ranks' transports forget the token (rank 0's did
        already), then the blocks are free."""
        if self._others is not None:
            self._others(self.engine, rank_kv.revoke, token)
        self.engine.release_detached(request_id)

    async def check_invariants(self) -> dict:
        """Raises if the block invariant is broken (also: blocks detached for a handoff that no
        lease covers, which nothing would ever free; a transport letting more tokens read than
        there are leases); returns the counts for the caller's checks."""
        def check() -> dict:
            unleased = (set(self.engine.detached_requests()) - self.leases.request_ids() - self._prefilling
                        - set(self._releasing))
            if unleased:
                raise AssertionError(f"blocks detached with no lease for requests {sorted(unleased)}")
            stray = set(self.streams) - self.leases.request_ids() - self._prefilling
            if stray:
                raise AssertionError(f"streams with neither a prefill nor a lease: {sorted(stray)}")
            return self.engine.block_counts()

        def check_rank_grants() -> None:  # other ranks (stages) forget an acked lease's token as its blocks are freed
            if self._others is None:
                return
            over = max(self._others(self.engine, rank_kv.granted)) - len(self.leases) - len(self._releasing)
            if over > 0:
                raise AssertionError(f"{over} lease tokens more than there are leases can read a rank's KV")

        grants = max((t.granted() for t in self.transports.values()), default=0)
        if grants > len(self.leases):
            raise AssertionError(f"{grants} lease tokens can read KV, {len(self.leases)} leases are live")
        await self.loop.call(check_rank_grants)
        return {**await self.loop.call(check), "leases": len(self.leases), "grants": grants}


def _remember(ids: collections.OrderedDict, request_id: str) -> None:
    ids[request_id] = None
    while len(ids) > 4096:  # bounded: the newest matter, within seconds
        ids.popitem(last=False)
