"""One request's path through the pools (DESIGN.md §1 steps 4–8): `plan` places it (the
policy's placement over the Directory's views; the one placement path) and hands admission both
workers' load; `stream` runs it as a `RequestRun` (request_run.py), which owns it from then on:
prefill → handoff → decode, placing it again when a prefill worker fails and migrating it when a
decode worker is lost.

Errors a caller sees are ours (`ServiceUnavailable`, ConfigError), never Ray's text (actor ids,
pids, addresses).
"""

from __future__ import annotations

import collections
import time
from contextlib import aclosing
from typing import AsyncIterator

from splitserve.router.directory import Directory, Route
from splitserve.orchestrator.request_run import RequestRun
from splitserve.control.autoscale.window import RequestSample
from splitserve.orchestrator.trace import RequestTrace
from splitserve.router.admission import Plan
from splitserve.types import MoveCount, MoveKind, MoveReason, Request, TokenChunk

__all__ = ["Orchestrator", "RequestTrace"]


class Orchestrator:
    def __init__(self, directory: Directory, traces: int = 4096, migration_limit: int = 3,
                 inactivity_timeout_s: float = 30.0, prefill_timeout_s: float = 120.0,
                 kv_streaming_min_tokens: int | None = None) -> None:
        self.directory = directory
        # contexts this long or longer stream their KV during the prefill (None: none does)
        self.kv_streaming_min_tokens = kv_streaming_min_tokens
        self.migration_limit = migration_limit
        self.inactivity_timeout_s, self.prefill_timeout_s = inactivity_timeout_s, prefill_timeout_s
        self.traces: collections.deque[RequestTrace] = collections.deque(maxlen=traces)  # recent only
        self.prefill_failures = 0
        self.migrations = 0
        self._moves: collections.Counter[tuple[MoveKind, MoveReason]] = collections.Counter()
        # finished requests' latencies, for the Controller's autoscaler (the backend sends them)
        self.samples: collections.deque[RequestSample] = collections.deque(maxlen=10_000)
        # this replica's actor, named on every decode stream: a worker aborts the streams of a
        # replica that died (worker/decode/callers.py); None in a driver (the offline Cluster)
        self.caller = _this_actor()

    def count_move(self, kind: MoveKind, reason: MoveReason) -> None:
        self._moves[kind, reason] += 1

    def moves(self) -> tuple[MoveCount, ...]:
        """Requests moved off a worker so far, by kind and reason (totals: /metrics counts them)."""
        return tuple(MoveCount(k, r, n) for (k, r), n in sorted(self._moves.items()))

    def plan(self, req: Request) -> Plan:
        route = self.directory.place(req)
        d = self.directory
        first = route.prefill or route.decode
        return Plan(first.id, d.stats(first.id), route.decode.id, d.stats(route.decode.id), route.cached_tokens,
                    route, d.wait_s(first.id))

    async def stream(self, req: Request, plan: Plan | None = None) -> AsyncIterator[TokenChunk]:
        """The request's chunks: the first token as soon as the prefill worker has it, then the
        decode worker's. Closing the iterator early releases the request on every worker."""
        route: Route = plan.route if plan is not None else self.plan(req).route
        trace = RequestTrace(req.request_id, time.time())
        self.traces.append(trace)
        run = RequestRun(self, req, route, trace)
        start, first, tokens = time.monotonic(), None, 0
        try:
            async with aclosing(run.chunks()) as chunks:
                async for chunk in chunks:
                    if chunk.token_ids and first is None:
                        first = time.monotonic()
                    tokens += len(chunk.token_ids)
                    yield chunk
        finally:
            run.close()
            self.samples.append(_sample(start, first, tokens))


def _sample(start: float, first: float | None, tokens: int) -> RequestSample:
    end = time.monotonic()
    tpot = (end - first) / (tokens - 1) if first is not None and tokens > 1 else None
    return RequestSample(time.time(), None if first is None else first - start, tpot)


def _this_actor():
    """The Ray actor this process is (an ingress replica), or None (a driver, or no Ray)."""
    try:
        import ray

        if not ray.is_initialized():
            return None
        return ray.get_runtime_context().current_actor
    except Exception:  # a driver: Ray says it is no actor
        return None
