"""One request's life on the pools, owned by one coroutine (DESIGN.md §1 steps 5–8 and "Failure
paths"): `RequestRun` holds the route in use (and so its pending counts), the tokens delivered
so far and the workers that failed this request, and replaces the route when a worker is lost.

  * Prefill: a prefill worker that fails, or does not answer within `prefill_timeout_s`, is
    excluded and the request placed again (at most `PREFILL_ATTEMPTS` times, each retry under its
    own engine id, `<id>.r<n>`); a request the
    engine refuses (ConfigError) fails at once, as every worker would refuse it.
  * Decode: a decode worker that dies, fails, ends the stream unasked, or sends nothing for
    `inactivity_timeout_s` (before its first token, which may wait for a whole prompt computed
    there: `prefill_timeout_s`) and then leaves a ping unanswered as long (stalled; one that answers
    is busy, not lost: its stream waits) is excluded (one that only stalled is taken again when
    no other can, its stalled attempt aborted) and the request migrates: placed again by its whole
    context (prompt + delivered tokens; through a prefill worker when the policy finds it worth
    it) with the delivered tokens as `outputs`, so the new worker continues right after them
    (seeded sampling too: the engine fast-forwards the request's generator). Up to
    `migration_limit` moves, each under its own engine id (`<id>~<move>`); past the limit, or
    with no worker left, `ServiceUnavailable`.
  * However the caller leaves, closing the stream (each level closed by `aclosing`, at once)
    aborts the request where it still runs; the decode worker settles the lease.
  * Traced (tracing.py): each prefill call, each decode stream and each migration is a span of
    the request's trace (a child of the ingress's request span), and the worker's own span is
    a child of the call's (the `Request` it is sent carries that span's `traceparent`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from contextlib import aclosing, contextmanager
from typing import Any, AsyncIterator, Iterator, NamedTuple

from opentelemetry.trace import SpanKind, Status, StatusCode

from splitserve import tracing

from splitserve.router.directory import Route
from splitserve.orchestrator.trace import RequestTrace
from splitserve.kv_transfer.base import TransferError
from splitserve.router.policy import NoCapacity
from splitserve.types import (ConfigError, FinishReason, MoveKind, MoveReason, Request, ServiceUnavailable, TokenChunk,
                              WorkerId)

log = logging.getLogger(__name__)
PREFILL_ATTEMPTS = 3  # prefill workers one request may fail on before it gives up
PLACE_WAIT_S = 5.0  # how long a request placed again waits for a worker to come back into placement
LATE_RESULT_WAIT_S = 60.0  # how long an abandoned prefill's result is waited for, to release it
ABORT_WAIT_S = 2.0  # how long an abort sent to a worker is waited for (a stalled one may never answer)


class DecodeLost(Exception):
    """The decode worker stopped serving this request (died, failed, went silent)."""

    def __init__(self, why: str, worker_may_run: bool, reason: MoveReason) -> None:
        super().__init__(why)
        self.why, self.reason = why, reason
        self.worker_may_run = worker_may_run  # it may still be working on it: tell it to stop


class Prefilled(NamedTuple):
    result: Any  # PrefillResult
    worker: Any  # the WorkerRecord that computed it


class RequestRun:
    def __init__(self, o, req: Request, route: Route, trace: RequestTrace) -> None:
        if req.prompt_hashes is None and route.hashes is not None:  # the engines reuse the ingress's hashes
            req = dataclasses.replace(req, prompt_hashes=route.hashes)
        self.o, self.req, self.route, self.trace = o, req, route, trace
        self.delivered: list[int] = []
        self.failed: set[WorkerId] = set()  # workers this request must not be placed on again
        self.stalled: set[WorkerId] = set()  # went silent on it: taken again only when no other can
        self._prefill_failures = 0
        self._last_at: float | None = None  # when the last token was delivered
        self._lost_at: float | None = None  # the last delivery before a migration
        self._root = req.traceparent  # the ingress's request span: every span here is its child

    def close(self) -> None:
        self.route.close()

    async def chunks(self) -> AsyncIterator[TokenChunk]:
        while True:
            try:
                async with aclosing(self._attempt()) as attempt:
                    async for chunk in attempt:
                        yield chunk
                return
            except DecodeLost as lost:
                await self._migrate(lost)

    # -- one attempt: (prefill →) decode on the current route -----------------------------------
    async def _attempt(self) -> AsyncIterator[TokenChunk]:
        pre = await self._prefilled()
        if pre is not None:
            r = pre.result
            self.trace.prefill_worker, self.trace.transport = str(pre.worker.id), self.route.transport
            self.trace.prefill_done_to_first_token_s = time.time() - r.done_at
            if r.chunk.phases is not None:
                self.trace.prefill_s = r.chunk.phases.prefill_s
            if r.handoff is None:  # finished during prefill (EOS, max_tokens)
                self._deliver(r.chunk)
                yield r.chunk
                return
        handoff = pre.result.handoff if pre is not None else None
        try:
            with self._call("decode_call", {"splitserve.worker": str(self.route.decode.id),
                                            "splitserve.route": "disaggregated" if pre else "aggregated"}) as req:
                # The pull starts now, while the first token is on its way to the caller.
                gen = self._start_decode(req, handoff, pre.worker.handle if pre else None)
                async with aclosing(self._decode(gen, pre.result.chunk if pre else None)) as chunks:
                    async for chunk in chunks:
                        yield chunk
        except DecodeLost:
            if pre is not None:  # free its source blocks now, before it may be prefilled there again
                await _bounded(pre.worker.handle.ack.remote(pre.result.handoff.lease_id))
            raise

    async def _prefilled(self) -> Prefilled | None:
        """The prefill result and its worker, or None when the request runs aggregated."""
        while self.route.prefill is not None:
            worker = self.route.prefill
            result = await self._prefill(worker)
            if result is not None:
                return Prefilled(result, worker)
            self._prefill_failures += 1
            self.failed.add(worker.id)
            if self._prefill_failures >= PREFILL_ATTEMPTS:
                raise ServiceUnavailable(f"{self._prefill_failures} prefill workers failed this request")
            self._replace(await self._place("its prefill worker failed"))
            # under an engine id of its own, as a migration: what the failed attempt left on its
            # decode worker (a staging still landing, a stream) never meets the retry there
            self.req = dataclasses.replace(self.req, request_id=f"{self.trace.request_id}.r{self._prefill_failures}")
        return None

    async def _prefill(self, worker):
        """Its PrefillResult, or None when the worker failed (it leaves placement)."""
        reader = self.route.decode.info
        readers = 1 + len(reader.ranks) if reader is not None else 1  # its tensor-parallel size
        stream = self._streams(worker, readers)
        with self._call("prefill_call", {"splitserve.worker": str(worker.id), "splitserve.kv.streamed": stream,
                                         "splitserve.kv.transport": self.route.transport or ""}) as req:
            ref = worker.handle.prefill.remote(req, self.route.transport, tuple(self.delivered), readers, stream)
            if not stream:
                return await self._prefill_result(worker, ref)
            return await self._streamed_prefill(worker, ref, req)

    async def _streamed_prefill(self, worker, ref, req: Request):
        # its decode worker lands the KV as the prefill publishes it (worker/decode/streamed.py)
        decode = self.route.decode.handle
        _in_background(_quietly(decode.stage.remote(req, worker.handle, tuple(self.delivered))))
        result = None
        try:
            result = await self._prefill_result(worker, ref)
        finally:
            if result is None or result.handoff is None:  # nothing to land: what it staged goes back now
                _fire(decode.drop_staging.remote(self.req.request_id))
        return result

    def _streams(self, worker, readers: int) -> bool:
        """Whether this prefill streams its KV: on, one rank to one rank, and a long context."""
        least = self.o.kv_streaming_min_tokens
        ranks = worker.info.ranks if worker.info is not None else ()
        return (least is not None and readers == 1 and not ranks
                and len(self.req.prompt_token_ids) + len(self.delivered) >= least)

    async def _prefill_result(self, worker, ref):
        try:
            result = await asyncio.wait_for(_awaitable(ref), self.o.prefill_timeout_s)
        except asyncio.CancelledError:  # the caller left: stop the prefill (and its lease) now
            _abandon(ref, worker, self.req.request_id)
            raise
        except ConfigError as e:  # the request is at fault, not the worker: all would refuse it
            raise getattr(e, "cause", e) from None  # (Ray's wrapper carries the remote traceback)
        except Exception as e:  # the actor died, its engine failed, or it did not answer in time
            _abandon(ref, worker, self.req.request_id)
            log.warning("prefill of %s on %s failed (%s); placing it again", self.req.request_id, worker.id,
                        type(e).__name__)
            self.o.prefill_failures += 1
            self.o.count_move(MoveKind.RETRY, MoveReason.SILENT if isinstance(e, asyncio.TimeoutError)
                              else MoveReason.DIED if _is_actor_death(e) else MoveReason.FAILED)
            silent = isinstance(e, asyncio.TimeoutError)  # slow, not failing: placed on when no other can be
            (self.o.directory.mark_silent if silent else self.o.directory.mark_failed)(worker.id)
            return None
        self.route.confirm(worker.id)
        return result

    def _start_decode(self, req: Request, handoff, prefill_handle):
        """The decode worker's stream; `outputs` as of now (with a handoff: before its first token)."""
        d = self.route.decode
        self.trace.decode_worker = str(d.id)
        return d.handle.generate.options(num_returns="streaming").remote(req, handoff, prefill_handle,
                                                                         tuple(self.delivered), caller=self.o.caller)

    @contextmanager
    def _call(self, name: str, attributes: dict) -> Iterator[Request]:
        """A span of this request's trace around a call to a worker; the request to send it,
        carrying the span's context (unchanged while tracing is off)."""
        span = tracing.tracer().start_span(name, tracing.parent(self._root), SpanKind.CLIENT, attributes=attributes)
        try:
            here = tracing.traceparent_of(span)
            yield dataclasses.replace(self.req, traceparent=here) if here else self.req
        except (GeneratorExit, asyncio.CancelledError):  # the caller left: not a failure
            raise
        except BaseException as e:
            span.set_status(Status(StatusCode.ERROR, type(e).__name__))
            raise
        finally:
            span.end()

    async def _decode(self, gen, first: TokenChunk | None) -> AsyncIterator[TokenChunk]:
        """The decode stream's chunks (after `first`, the prefill worker's token). Whatever ends
        it early — the caller leaving, the worker going silent — tells the worker to stop."""
        decode, stop_worker, stalled = self.route.decode, True, False
        try:
            if first is not None:
                self._deliver(first)
                yield first
            last_at = time.monotonic()
            # its first chunk may wait for a whole prompt to be computed there (aggregated, migrated,
            # or a failed transfer recomputed): a long prefill on a busy CPU is slow, not silent
            first_s = max(self.o.inactivity_timeout_s, self.o.prefill_timeout_s)
            async with aclosing(_within(gen, self.o.inactivity_timeout_s, lambda: self._answers(decode),
                                        first_s)) as chunks:
                async for chunk in chunks:
                    self.route.confirm(decode.id)
                    if chunk.finish_reason is FinishReason.ABORT:  # nobody here asked for that
                        raise DecodeLost("ended the stream", worker_may_run=False, reason=MoveReason.ENDED)
                    if chunk.token_ids:
                        self._record_gap(time.monotonic() - last_at, first is not None)
                        last_at = time.monotonic()
                    self._record_transfer(chunk)
                    self._deliver(chunk)
                    yield chunk
                    if chunk.finished:
                        stop_worker = False
                        return
            raise DecodeLost("ended the stream early", worker_may_run=False, reason=MoveReason.ENDED)
        except Exception as e:
            lost = _classify(e)
            stop_worker = stalled = lost.worker_may_run
            log.warning("decode worker %s lost %s (%s)", decode.id, self.req.request_id, lost.why)
            (self.stalled if lost.worker_may_run else self.failed).add(decode.id)
            (self.o.directory.mark_silent if lost.worker_may_run else self.o.directory.mark_failed)(decode.id)
            raise lost from None
        finally:
            if stalled:  # it gets the abort when it resumes; the request moves on now
                _fire(decode.handle.abort.remote(self.req.request_id))
            elif stop_worker:  # the caller left: stopped before its slot is given back (bounded)
                await _bounded(decode.handle.abort.remote(self.req.request_id))

    async def _answers(self, worker) -> bool:
        """Whether a decode worker whose stream went quiet still answers a ping in time: its
        process runs (busy with other streams, or a slow machine), so the stream is waited for.
        Moving it would only add its recompute to that load, and count against its moves."""
        try:
            await asyncio.wait_for(_awaitable(worker.handle.__ray_ready__.remote()), self.o.inactivity_timeout_s)
            return True
        except Exception:  # stopped (no answer in time) or gone
            return False

    def _record_gap(self, gap: float, after_prefill: bool) -> None:
        """A token chunk's gap after the one before: the first after the prefill worker's token
        (the hand-over's share of it), then the decode's own (the first 64)."""
        t = self.trace
        if after_prefill and t.first_to_second_token_s is None:
            t.first_to_second_token_s = gap
        elif len(t.inter_token_s) < 64:
            t.inter_token_s.append(gap)

    def _record_transfer(self, chunk: TokenChunk) -> None:
        p = chunk.phases
        if p is not None and p.transfer_s is not None:
            t = self.trace
            t.transfer_s, t.transfer_bytes, t.exposed_transfer_s = p.transfer_s, p.transfer_bytes, p.exposed_transfer_s

    # -- deliveries and moves -------------------------------------------------------------------
    def _deliver(self, chunk: TokenChunk) -> None:
        if not chunk.token_ids:
            return
        now = time.monotonic()
        if self._lost_at is not None:  # the first token after a migration
            self.trace.migration_gaps_s.append(now - self._lost_at)
            self._lost_at = None
        self._last_at = now
        self.delivered.extend(chunk.token_ids)

    async def _migrate(self, lost: DecodeLost) -> None:
        what = f"the decode worker serving this request {lost.why}"
        with self._call("migration", {"splitserve.migration.reason": lost.reason.value,
                                      "splitserve.migration.detail": lost.why,
                                      "splitserve.worker": str(self.route.decode.id),
                                      "splitserve.tokens_delivered": len(self.delivered)}):
            if self.trace.migrations >= self.o.migration_limit:
                raise ServiceUnavailable(f"{what}; it had moved {self.trace.migrations} times already, the limit")
            await self._move(what, lost.why)
            self.o.count_move(MoveKind.MIGRATION, lost.reason)

    async def _move(self, what: str, why: str) -> None:
        if self._lost_at is None:  # the gap the client sees: from the last token it got
            self._lost_at = self._last_at or time.monotonic()
        self._replace(await self._place(what))
        self.trace.migrations += 1
        # Each move runs under its own engine id: an abort sent to a worker that went silent on
        # this request can never meet the attempt that replaced it, on that worker or another.
        self.req = dataclasses.replace(self.req, request_id=f"{self.trace.request_id}~{self.trace.migrations}")
        self.trace.migrated_after.append(len(self.delivered))
        self.o.migrations += 1
        log.info("request %s migrates to %s after %d tokens (%s)", self.req.request_id, self.route.decode.id,
                 len(self.delivered), why)

    async def _place(self, why: str) -> Route:
        """Placed again by its whole context, as a new request of that length would be: through a
        prefill worker when the policy finds it worth it, else on a decode worker that computes
        what its prefix cache lacks; never on a worker that failed it, and on one that only went
        silent on it (slow, not broken: a survivor busy with a lost worker's streams) only when
        no other can take it. With none to take it now, it waits up to PLACE_WAIT_S for one (a
        survivor whose call just failed is out of placement until it answers, not gone)."""
        context = dataclasses.replace(self.req, prompt_token_ids=self.req.prompt_token_ids + tuple(self.delivered),
                                      prompt_hashes=None)  # hashed whole by the placement
        deadline = time.monotonic() + PLACE_WAIT_S
        while True:
            for exclude in (self.failed | self.stalled, self.failed):
                try:
                    return self.o.directory.place(context, exclude=frozenset(exclude))
                except NoCapacity:
                    pass
            if time.monotonic() >= deadline:
                raise ServiceUnavailable(f"{why}, and no other worker can take this request now") from None
            await asyncio.sleep(0.05)

    def _replace(self, route: Route) -> None:
        self.route.close()
        self.route = route


def _classify(e: Exception) -> DecodeLost:
    """A decode stream's failure: the request's own (raised as is) or the worker's (DecodeLost)."""
    if isinstance(e, DecodeLost):
        return e
    if isinstance(e, (ConfigError, TransferError)):  # moving the request would not help
        raise getattr(e, "cause", None) or e from None
    if _is_actor_death(e):
        return DecodeLost("was lost", worker_may_run=False, reason=MoveReason.DIED)
    # it aborted it itself
    return DecodeLost(f"failed ({type(e).__name__})", worker_may_run=False, reason=MoveReason.FAILED)


async def _within(gen, timeout_s: float, answers, first_s: float | None = None) -> AsyncIterator[TokenChunk]:
    """A decode stream's chunks. One `timeout_s` late (until its first token: `first_s`, default
    `timeout_s`): `await answers()` asks its worker; one that answers is waited for again, one
    that does not is stalled (DecodeLost)."""
    it = gen.__aiter__()
    wait_s = timeout_s if first_s is None else first_s
    while True:
        try:
            ref = await _patiently(it.__anext__(), wait_s, answers)
            chunk = await _patiently(_awaitable(ref), wait_s, answers)
        except StopAsyncIteration:
            return
        if chunk.token_ids:
            wait_s = timeout_s
        yield chunk


async def _patiently(aw, timeout_s: float, answers) -> Any:
    """`aw`'s result, however late, while its worker answers (see `_within`)."""
    task = asyncio.ensure_future(aw)
    try:
        while not (await asyncio.wait({task}, timeout=timeout_s))[0]:
            if not task.done() and not await answers():
                raise DecodeLost(f"sent nothing for {timeout_s:g} s and did not answer", worker_may_run=True,
                                 reason=MoveReason.SILENT)
        return task.result()
    finally:
        task.cancel()  # (nothing when it is done) the stream is left: stop waiting for it


async def _awaitable(ref: Any) -> Any:
    return await ref


def _is_actor_death(e: BaseException) -> bool:
    try:
        import ray

        return isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError))
    except ImportError:
        return False


async def _bounded(ref: Any) -> None:
    """Wait for a call to a worker, but not long: it may be gone or stalled."""
    try:
        await asyncio.wait_for(_awaitable(ref), ABORT_WAIT_S)
    except Exception:  # gone or stalled: nothing more to do there now
        pass


_background: set[asyncio.Task] = set()  # work nobody waits for, referenced until it settles


def _in_background(coro) -> None:
    task = asyncio.ensure_future(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)


def _fire(ref: Any) -> None:
    _in_background(_bounded(ref))


async def _quietly(ref: Any) -> None:
    """Wait for a long call nobody needs the answer of (a staging runs as long as its stream)."""
    try:
        await _awaitable(ref)
    except Exception:  # its worker is gone: the request's own path finds out and moves on
        pass


def _abandon(ref, worker, request_id: str) -> None:
    """Stop a prefill nobody waits for any more; a result that arrives anyway has its lease
    acknowledged at once (its blocks would otherwise stay pinned until the lease lapses). A
    result that never arrives — the cancel raced it, and Ray then reports the call cancelled
    though it finished — leaves the worker to end the request's lease itself (`abandon`)."""
    import ray

    if isinstance(ref, ray.ObjectRef):  # (ray.cancel of anything else starts a local Ray: a fake's call)
        try:
            ray.cancel(ref)  # an async actor method gets CancelledError and frees what it holds
        except Exception:  # already finished
            pass

    async def release_late() -> None:
        try:
            result = await asyncio.wait_for(_awaitable(ref), LATE_RESULT_WAIT_S)
        except BaseException:  # cancelled, failed or stalled: whatever it leased ends there
            await _bounded(worker.handle.abandon.remote(request_id))
            return
        if getattr(result, "handoff", None) is not None:
            await _bounded(worker.handle.ack.remote(result.handoff.lease_id))

    _in_background(release_late())
