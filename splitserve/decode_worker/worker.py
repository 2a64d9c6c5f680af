"""The decode worker: an Engine in decode role (DESIGN.md §1 steps 6–8).

`generate(req, handoff, prefill)` pulls the prompt's KV from the prefill worker through the
transport, verifies it (header, checksum, lease still live at acknowledgement) and joins the
request to its continuous batch; it then yields TokenChunks as they come. Without a handoff it
prefills locally (aggregated path). When the pull fails and the policy is `recompute`, the
prompt is computed here and the output continues exactly (the first token is kept); with
`fail` a TransferError reaches the caller. Whatever happens, both sides' blocks are freed: the
lease is always settled, and a caller that goes away aborts the request here.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from typing import Any, AsyncIterator, Sequence

from splitserve.config import EngineConfig
from splitserve.worker.kv_worker import KVWorker
from splitserve.engine.kv_cache import OutOfBlocks
from splitserve.kv_transfer.base import KVHandoff, TransferError, TransferState
from splitserve.kv_transfer.verify import check_header, verify_landed
from splitserve.types import FinishReason, PhaseTimes, Request, TokenChunk

log = logging.getLogger(__name__)
POLICIES = ("recompute", "fail")


class DecodeWorker(KVWorker):
    def __init__(self, config: EngineConfig, transports: Sequence[str], on_transfer_failure: str = "recompute",
                 transport_options: dict | None = None, fault: str | None = None, host: str | None = None,
                 node_id: str = "") -> None:
        if on_transfer_failure not in POLICIES:
            raise ValueError(f"on_transfer_failure must be one of {POLICIES}, got {on_transfer_failure!r}")
        super().__init__(config, transports, transport_options, host, node_id)
        self._streams = 0  # generate() calls in progress: a draining worker waits for them
        self.transfers_by_transport: dict[str, int] = {}
        self.policy = on_transfer_failure
        # Test hooks: "flip" corrupts landed data, "slow" starts the read after the lease lapsed,
        # "kill_prefill" kills the prefill actor before reading, "hold" keeps a pull in flight.
        self.fault = fault
        self.transfer_failures: dict[str, int] = {}
        self._aborted: set[str] = set()  # aborts that arrive during a handoff
        self._handoffs: set[str] = set()  # requests landing pulled KV (add_pulled → kv_ready)
        self._early_aborts: collections.OrderedDict[str, None] = collections.OrderedDict()

    async def generate(self, req: Request, handoff: KVHandoff | None = None, prefill: Any = None
                       ) -> AsyncIterator[TokenChunk]:
        rid = req.request_id
        finished = False
        self._streams += 1
        try:
            if self._early_aborts.pop(rid, None) is not None:  # aborted before it got here
                if handoff is not None:
                    await self._settle(handoff, prefill)
                finished = True
                yield TokenChunk(rid, (), finish_reason=FinishReason.ABORT)
                return
            started = time.monotonic()
            q = await (self._admit_pulled(req, handoff, prefill) if handoff else self.loop.submit(req))
            phases = None
            if handoff is not None:
                moved = len(handoff.block_ids) * self.layout.num_layers * 2 * self.layout.block_bytes
                phases = PhaseTimes(transfer_s=time.monotonic() - started, transfer_bytes=moved)
            while True:
                item = await q.get()
                if isinstance(item, Exception):
                    raise item
                if phases is not None:  # the transfer's time rides on the first chunk after it
                    item, phases = dataclasses.replace(item, phases=phases.merged(item.phases)), None
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams -= 1
            if not finished:
                await self.loop.abort(rid)

    def held(self) -> int:
        return super().held() + self._streams

    async def _admit_pulled(self, req: Request, h: KVHandoff, prefill: Any) -> asyncio.Queue:
        """Land the handoff's KV; an abort that arrives meanwhile is honoured once no transfer
        can write into the blocks any more."""
        rid = req.request_id
        self._handoffs.add(rid)
        try:
            return await self._land(req, h, prefill)
        finally:
            self._handoffs.discard(rid)
            if rid in self._aborted:
                self._aborted.discard(rid)
                await self.loop.abort(rid)

    async def _land(self, req: Request, h: KVHandoff, prefill: Any) -> asyncio.Queue:
        rid = req.request_id
        try:
            dst = await self.loop.call(self.engine.add_pulled, req, h.first_token)
        except OutOfBlocks:  # no room to land it now: the scheduler will compute it when it can
            await self._settle(h, prefill)
            return await self.loop.submit(req, outputs=(h.first_token,))
        q = self.loop.watch(rid)
        if rid in self._aborted:  # before any byte moved
            await self._settle(h, prefill)
            return q
        try:
            await self._pull(h, dst, prefill)
        except TransferError as e:
            if e.kind == "aborted":
                return q
            self.transfer_failures[e.kind] = self.transfer_failures.get(e.kind, 0) + 1
            if self.policy == "fail":
                self._aborted.add(rid)  # freed as the handoff ends
                raise
            log.warning("KV pull for %s failed (%s): recomputing locally", rid, e)
            await self.loop.call(self.engine.kv_failed, rid)
            self.loop.wake()
            return q
        if rid not in self._aborted:
            await self.loop.call(self.engine.kv_ready, rid)
            self.loop.wake()
        return q

    async def _pull(self, h: KVHandoff, dst: list[int], prefill: Any) -> None:
        """Read, then settle the lease, then verify. Raises TransferError; never leaves a
        transfer writing into blocks the engine may hand to someone else."""
        try:
            check_header(h, self.layout)
            if self.fault == "slow":
                await asyncio.sleep(max(0.0, h.lease_expires_at - time.time()) + 0.2)
            if self.fault == "kill_prefill" and prefill is not None:
                import ray

                ray.kill(prefill)
                await asyncio.sleep(0.2)
            await self._read(h, dst, prefill)
        finally:
            live = await self._settle(h, prefill)
        if not live:
            raise TransferError("lease_expired", f"lease {h.lease_id} lapsed before the read was acknowledged")
        if self.fault == "flip":
            self.engine.kv.storage.view(-1)[self.layout.offset(0, 0, dst[0]) // self.layout.element_size] += 1.0
        await self.loop.call(verify_landed, self.engine.kv.storage, self.layout, h, dst)

    async def _read(self, h: KVHandoff, dst: list[int], prefill: Any) -> None:
        transport = self.transports.get(h.endpoint.transport)
        if transport is None:
            raise TransferError("unreachable", f"handoff over {h.endpoint.transport!r}; this worker reads "
                                f"{list(self.transports)}")
        kind = h.endpoint.transport
        self.transfers_by_transport[kind] = self.transfers_by_transport.get(kind, 0) + 1
        handle = transport.read(h, dst)
        renew_every = max(0.05, (h.lease_expires_at - time.time()) / 3)
        next_renew = time.monotonic() + renew_every
        try:
            deadline = time.monotonic() + (10.0 if self.fault == "hold" else 0.0)
            while (st := transport.poll(handle)).state is TransferState.PENDING or time.monotonic() < deadline:
                if h.request_id in self._aborted:
                    break  # release() below stops the transfer before the blocks are freed
                if prefill is not None and time.monotonic() > next_renew:
                    prefill.renew.remote(h.lease_id)  # fire and forget: keep the blocks pinned
                    next_renew = time.monotonic() + renew_every
                await asyncio.sleep(0.0005)
        finally:
            transport.release(handle)
            # A released transfer may still be moving its last segment: the blocks are only
            # safe to free once the mover has stopped.
            deadline = time.monotonic() + 5.0
            while transport.poll(handle).state is TransferState.PENDING and time.monotonic() < deadline:
                await asyncio.sleep(0.001)
        if h.request_id in self._aborted:
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
            log.warning("acknowledging lease %s failed: %s", h.lease_id, e)
            return False

    async def abort(self, request_id: str) -> None:
        """Abort wherever the request is; during a handoff, once the transfer has stopped; before
        its stream began here (Ray does not order an async actor's calls), when it begins."""
        if request_id in self._handoffs:
            self._aborted.add(request_id)
        elif self.loop.has(request_id):
            await self.loop.abort(request_id)
        else:
            self._early_aborts[request_id] = None
            while len(self._early_aborts) > 4096:  # bounded: most belong to requests long finished
                self._early_aborts.popitem(last=False)

    async def check_invariants(self) -> dict:
        counts = await self.loop.call(self.engine.block_counts)
        return {**counts, "transfer_failures": dict(self.transfer_failures),
                "transfers_by_transport": dict(self.transfers_by_transport)}

