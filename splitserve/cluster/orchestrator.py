"""One request's path through the pools (DESIGN.md §1 steps 4–8 and "Failure paths"): one
coroutine per request (`RequestRun`) owns prefill → handoff → decode, and whatever replaces them.

  1. `plan` places the request (the policy's placement over the Directory's views; the one
     placement path) and hands admission both workers' load.
  2. `stream` runs it. Disaggregated: the prefill worker computes the prompt and returns the
     first token and a `KVHandoff`; the decode worker's pull starts at once, while the first
     token goes to the caller. Aggregated: the decode worker prefills it itself.
  3. A prefill worker that fails or does not answer within `prefill_timeout_s` leaves placement
     and the request is placed again (on another prefill worker, or aggregated when none is
     left); a request the engine refuses (ConfigError) fails at once, as every worker would.
  4. A decode worker that dies, fails, or sends nothing for `inactivity_timeout_s` mid-stream
     leaves placement and the request migrates: it is placed again with the tokens already
     delivered as part of its context, and the new worker continues right after them (seeded
     sampling too: the engine fast-forwards the request's generator by the tokens it is given).
     The caller's stream goes on with no token lost or repeated, up to `migration_limit` times.
  5. However the caller leaves (finish, stop string, disconnect), closing the stream aborts the
     request where it runs; the decode worker settles the lease, so both sides free once.

Errors a caller sees are ours (`ServiceUnavailable`), never Ray's text (actor ids, pids,
addresses).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from splitserve.cluster.directory import Directory, Route
from splitserve.kv_transfer.base import TransferError
from splitserve.router.admission import Plan
from splitserve.router.policy import NoCapacity
from splitserve.types import ConfigError, Request, ServiceUnavailable, TokenChunk

log = logging.getLogger(__name__)
ABORT_WAIT_S = 2.0  # how long an abort sent to a worker is waited for (a stalled one may never answer)


@dataclass
class RequestTrace:
    """Where one request ran and how its tokens travelled (tests, benchmarks)."""

    request_id: str
    started_at: float = 0.0  # time.time()
    prefill_worker: str | None = None
    decode_worker: str | None = None  # the last one
    transport: str | None = None
    prefill_done_to_first_token_s: float | None = None  # prefill worker sampled → the caller has it
    first_to_second_token_s: float | None = None
    migrations: int = 0
    migration_gaps_s: list[float] = field(default_factory=list)  # last token before → first token after


class _DecodeLost(Exception):
    """The decode worker stopped serving this request (died, failed, or went silent)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class Orchestrator:
    def __init__(self, directory: Directory, traces: int = 4096, migration_limit: int = 3,
                 inactivity_timeout_s: float = 30.0, prefill_timeout_s: float = 120.0) -> None:
        self.directory = directory
        self.migration_limit = migration_limit
        self.inactivity_timeout_s, self.prefill_timeout_s = inactivity_timeout_s, prefill_timeout_s
        self.traces: collections.deque[RequestTrace] = collections.deque(maxlen=traces)  # recent only
        self.prefill_failures = 0
        self.migrations = 0

    def plan(self, req: Request) -> Plan:
        route = self.directory.place(req)
        d = self.directory
        first = route.prefill or route.decode
        return Plan(first.id, d.stats(first.id), route.decode.id, d.stats(route.decode.id), route.cached_tokens,
                    route)

    async def stream(self, req: Request, plan: Plan | None = None) -> AsyncIterator[TokenChunk]:
        """The request's chunks: the first token as soon as the prefill worker has it, then the
        decode worker's. Closing the iterator early releases the request on every worker."""
        route: Route = plan.route if plan is not None else self.plan(req).route
        trace = RequestTrace(req.request_id, time.time())
        self.traces.append(trace)
        run = RequestRun(self, req, route, trace)
        try:
            async for chunk in run.chunks():
                yield chunk
        finally:
            run.close()


class RequestRun:
    """One request, from its first placement to its last token: owns the route in use (and so
    its pending counts) and the tokens delivered so far, which a migration carries over."""

    def __init__(self, o: Orchestrator, req: Request, route: Route, trace: RequestTrace) -> None:
        self.o, self.req, self.route, self.trace = o, req, route, trace
        self.delivered: list[int] = []
        self._lost_at: float | None = None  # when the last token before a migration was delivered

    def close(self) -> None:
        self.route.close()

    def _replace(self, route: Route) -> None:
        self.route.close()
        self.route = route

    def _place(self, req: Request, why: str) -> Route:
        try:
            return self.o.directory.place(req)
        except NoCapacity:
            raise ServiceUnavailable(f"{why}, and no other worker can take this request now") from None

    async def chunks(self) -> AsyncIterator[TokenChunk]:
        while True:
            try:
                async for chunk in self._attempt():
                    yield chunk
                return
            except _DecodeLost as lost:
                self._migrate(lost.why)

    async def _attempt(self) -> AsyncIterator[TokenChunk]:
        """The request on its current route, continuing after what was delivered already."""
        result, prefill = await self._prefilled()
        gen = None
        if result is not None:
            self.trace.prefill_worker, self.trace.transport = str(prefill.id), self.route.transport
            self.trace.prefill_done_to_first_token_s = time.time() - result.done_at
            if result.handoff is None:  # finished during prefill (EOS, max_tokens)
                self._deliver(result.chunk)
                yield result.chunk
                return
            # The pull starts now, while the first token is on its way to the caller.
            gen = self._start_decode(result.handoff, prefill.handle)
            self._deliver(result.chunk)
            yield result.chunk
        try:
            async for chunk in self._decode(gen, time.monotonic()):
                yield chunk
        except _DecodeLost:
            if result is not None and result.handoff is not None:
                # Free its source blocks now, and before the request may be prefilled there again.
                await _bounded(prefill.handle.ack.remote(result.handoff.lease_id))
            raise

    def _context(self) -> Request:
        """The request as placement sees it: its prompt, and what it has generated so far."""
        return dataclasses.replace(self.req, prompt_token_ids=self.req.prompt_token_ids + tuple(self.delivered))

    async def _prefilled(self):
        """(PrefillResult, its worker) — or (None, None) when the request runs aggregated. A
        prefill worker that fails leaves placement and the request is placed again."""
        while self.route.prefill is not None:
            prefill = self.route.prefill
            result = await self._prefill(prefill)
            if result is not None:
                return result, prefill
            self._replace(self._place(self._context(), "its prefill worker failed"))
        return None, None

    async def _prefill(self, worker):
        ref = worker.handle.prefill.remote(self.req, self.route.transport, tuple(self.delivered))
        try:
            result = await asyncio.wait_for(_awaitable(ref), self.o.prefill_timeout_s)
        except asyncio.CancelledError:  # the caller left: stop the prefill (and its lease) now
            _cancel(ref)
            raise
        except ConfigError as e:  # the request is at fault, not the worker: all would refuse it
            raise getattr(e, "cause", e) from None  # (Ray's wrapper carries the remote traceback)
        except Exception as e:  # the actor died, its engine failed, or it did not answer in time
            _cancel(ref)
            log.warning("prefill of %s on %s failed (%s); placing it again", self.req.request_id, worker.id,
                        type(e).__name__)
            self.o.prefill_failures += 1
            self.o.directory.mark_failed(worker.id)
            return None
        self.route.confirm(worker.id)
        return result

    def _start_decode(self, handoff, prefill_handle):
        """The decode worker's stream; `outputs` as of now (with a handoff: before its first token)."""
        d = self.route.decode
        self.trace.decode_worker = str(d.id)
        return d.handle.generate.options(num_returns="streaming").remote(self.req, handoff, prefill_handle,
                                                                         tuple(self.delivered))

    async def _decode(self, gen, first_at: float) -> AsyncIterator[TokenChunk]:
        decode = self.route.decode
        finished = False
        try:
            if gen is None:
                gen = self._start_decode(None, None)
            async for chunk in _within(gen, self.o.inactivity_timeout_s):
                self.route.confirm(decode.id)
                if chunk.token_ids and self.trace.first_to_second_token_s is None and self.delivered:
                    self.trace.first_to_second_token_s = time.monotonic() - first_at
                self._deliver(chunk)
                finished = chunk.finished
                yield chunk
                if finished:
                    return
            raise _DecodeLost("its stream ended early")
        except (ConfigError, TransferError) as e:  # the request's own failure: moving it would not help
            raise getattr(e, "cause", None) or e from None
        except _DecodeLost:
            self.o.directory.mark_failed(decode.id)
            raise
        except Exception as e:  # died, or its engine failed: the request moves on
            log.warning("decode worker %s lost %s (%s)", decode.id, self.req.request_id, type(e).__name__)
            self.o.directory.mark_failed(decode.id)
            raise _DecodeLost("failed" if not _is_actor_death(e) else "was lost") from None
        finally:
            if not finished:  # bounded: a stalled worker gets the abort when it resumes
                await _bounded(decode.handle.abort.remote(self.req.request_id))

    def _deliver(self, chunk: TokenChunk) -> None:
        if chunk.token_ids and self._lost_at is not None:  # the first token after a migration
            self.trace.migration_gaps_s.append(time.monotonic() - self._lost_at)
            self._lost_at = None
        self.delivered.extend(chunk.token_ids)

    def _migrate(self, why: str) -> None:
        """Place the request again, with the tokens delivered so far as part of its context."""
        what = f"the decode worker serving this request {why}"
        if self.trace.migrations >= self.o.migration_limit:
            raise ServiceUnavailable(f"{what}; it had moved {self.trace.migrations} times already, the limit")
        self._lost_at = self._lost_at or time.monotonic()
        # Placed by its whole context, as a new request of that length would be: through a
        # prefill worker when the policy says the context is worth it (decode batches then do not
        # stall on it), else on a decode worker that computes what its prefix cache lacks.
        self._replace(self._place(self._context(), what))
        self.trace.migrations += 1
        self.o.migrations += 1
        log.info("request %s migrates to %s after %d tokens (%s)", self.req.request_id, self.route.decode.id,
                 len(self.delivered), why)


async def _within(gen, timeout_s: float) -> AsyncIterator[TokenChunk]:
    """A decode stream's chunks, each within `timeout_s` of the one before (else _DecodeLost)."""
    it = gen.__aiter__()
    while True:
        try:
            ref = await asyncio.wait_for(it.__anext__(), timeout_s)
            chunk = await asyncio.wait_for(_awaitable(ref), timeout_s)
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            raise _DecodeLost(f"sent nothing for {timeout_s:g} s") from None
        yield chunk


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


def _cancel(ref) -> None:
    try:
        import ray

        ray.cancel(ref)  # an async actor method gets CancelledError and aborts its engine request
    except Exception:  # not a Ray ref (tests), or already finished
        pass
