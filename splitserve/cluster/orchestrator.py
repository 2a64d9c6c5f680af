"""One request's path through the pools (DESIGN.md §1 steps 4–8): one coroutine per request owns
prefill → handoff → decode.

  1. `plan` places the request (the policy's placement over the Directory's views; the one
     placement path) and hands admission both workers' load.
  2. `stream` runs it. Disaggregated: the prefill worker computes the prompt and returns the
     first token and a `KVHandoff`; the decode worker's pull starts at once, while the first
     token goes to the caller. Aggregated: the decode worker prefills it itself.
  3. A prefill worker that fails before its handoff leaves placement and the request is placed
     again (on another prefill worker, or aggregated when none is left); a request the engine
     refuses (ConfigError) fails at once, as every worker would refuse it.
  4. However the caller leaves (finish, stop string, disconnect), closing the stream aborts the
     request where it runs; the decode worker settles the lease, so both sides free once.

Errors a caller sees are ours (`WorkerLost`), never Ray's text (actor ids, pids, addresses).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from splitserve.cluster.directory import Directory, Route
from splitserve.router.admission import Plan
from splitserve.types import ConfigError, Request, TokenChunk

log = logging.getLogger(__name__)


class WorkerLost(RuntimeError):
    """The worker serving a request went away mid-request."""


@dataclass
class RequestTrace:
    """Where one request ran and how its first tokens travelled (tests, benchmarks)."""

    request_id: str
    started_at: float = 0.0  # time.time()
    prefill_worker: str | None = None
    decode_worker: str | None = None
    transport: str | None = None
    prefill_done_to_first_token_s: float | None = None  # prefill worker sampled → the caller has it
    first_to_second_token_s: float | None = None


class Orchestrator:
    def __init__(self, directory: Directory, traces: int = 4096) -> None:
        self.directory = directory
        self.traces: collections.deque[RequestTrace] = collections.deque(maxlen=traces)  # recent only
        self.prefill_failures = 0

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
        async for chunk in self._run(req, route, trace):
            yield chunk

    async def _run(self, req: Request, route: Route, trace: RequestTrace) -> AsyncIterator[TokenChunk]:
        """Owns `route` and any route it is replaced by: the one in use is closed however this ends."""
        try:
            result, prefill = None, None
            while route.prefill is not None:
                prefill = route.prefill
                result = await self._prefill(req, route)
                if result is not None:
                    break
                route.close()
                route = self.directory.place(req)  # the failed worker is out of placement now
            trace.decode_worker = str(route.decode.id)
            if result is None:  # aggregated
                async for chunk in self._decode(req, route, None, None, trace, None):
                    yield chunk
                return
            trace.prefill_worker, trace.transport = str(prefill.id), route.transport
            trace.prefill_done_to_first_token_s = time.time() - result.done_at
            if result.handoff is None:  # finished during prefill (EOS, max_tokens 1)
                yield result.chunk
                return
            # The pull starts now, while the first token is on its way to the caller.
            decode = self._start_decode(req, route, result.handoff, prefill.handle)
            first_at = time.monotonic()
            async for chunk in self._decode(req, route, decode, result.chunk, trace, first_at):
                yield chunk
        finally:
            route.close()

    async def _prefill(self, req: Request, route: Route):
        """The prefill worker's PrefillResult, or None when that worker failed (it leaves
        placement)."""
        worker = route.prefill
        ref = worker.handle.prefill.remote(req, route.transport)
        try:
            result = await ref
        except asyncio.CancelledError:  # the caller left: stop the prefill (and its lease) now
            _cancel(ref)
            raise
        except ConfigError as e:  # the request is at fault, not the worker: all would refuse it
            raise getattr(e, "cause", e) from None  # (Ray's wrapper carries the remote traceback)
        except Exception as e:  # the actor died or its engine failed: place it again
            log.warning("prefill of %s on %s failed (%s); placing it again", req.request_id, worker.id,
                        type(e).__name__)
            self.prefill_failures += 1
            self.directory.mark_failed(worker.id)
            return None
        route.confirm(worker.id)
        return result

    def _start_decode(self, req: Request, route: Route, handoff, prefill_handle):
        return route.decode.handle.generate.options(num_returns="streaming").remote(req, handoff, prefill_handle)

    async def _decode(self, req: Request, route: Route, gen, first: TokenChunk | None, trace: RequestTrace,
                      first_at: float | None) -> AsyncIterator[TokenChunk]:
        decode = route.decode
        finished = False
        try:
            if first is not None:
                yield first
            if gen is None:
                gen = self._start_decode(req, route, None, None)
            async for ref in gen:
                chunk = await ref
                route.confirm(decode.id)
                if first_at is not None and chunk.token_ids and trace.first_to_second_token_s is None:
                    trace.first_to_second_token_s = time.monotonic() - first_at
                finished = chunk.finished
                yield chunk
                if finished:
                    return
        except ConfigError:
            raise
        except Exception as e:
            if _is_actor_death(e):
                self.directory.mark_failed(decode.id)
                raise WorkerLost("the decode worker serving this request was lost") from None
            raise getattr(e, "cause", None) or e from None
        finally:
            if not finished and gen is not None:
                await _quietly(decode.handle.abort.remote(req.request_id))


def _is_actor_death(e: BaseException) -> bool:
    try:
        import ray

        return isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError))
    except ImportError:
        return False


async def _quietly(ref: Any) -> None:
    try:
        await ref
    except Exception:  # the worker is gone: nothing left to abort there
        pass


def _cancel(ref) -> None:
    import ray

    try:
        ray.cancel(ref)  # an async actor method gets CancelledError and aborts its engine request
    except Exception:  # not a Ray ref (tests), or already finished
        pass
