"""Runs an Engine inside an asyncio program (a Ray actor, the HTTP server) without blocking it.

Every engine call goes through one dedicated thread, so the engine is never touched by two
threads at once and the event loop never waits on a forward pass. New requests do not wait for
the step in progress: they are checked at once (`Engine.check_request` reads only config),
put in an inbox, and the engine thread takes them in right before its next step. After each
step the engine thread also leaves a stats snapshot, which admission reads without waiting.
A background task steps the engine while it has work and routes each TokenChunk to its
request's queue; an exception in a step is delivered to every waiting request. An engine whose
steps fail `max_step_failures` times in a row is broken, not busy: the loop stops, says why
(`failure`, which the worker reports to health probes, so the Controller replaces it) and
refuses new work. At most `max_requests` requests wait here at once (`EngineBusy` beyond).
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from splitserve.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.parallel.dp_engine import DataParallelEngine
from splitserve.types import ConfigError, FinishReason, KVProgress, Request, SamplingParams, TokenChunk

GRAMMAR_COMPILE_S = 10.0  # a structured-output grammar that takes longer to compile is refused


class EngineBusy(RuntimeError):
    """This engine already has as many requests as it takes; place the request elsewhere."""


class EngineFailed(RuntimeError):
    """This engine's steps fail again and again: it takes no more work."""


class EngineLoop:
    def __init__(self, engine: Engine, max_step_failures: int = 3, max_requests: int = 4096) -> None:
        self.engine = engine
        self.max_step_failures, self.max_requests = max_step_failures, max_requests
        self.failure: str | None = None  # why this engine stopped, once it has
        self._exec = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self._queues: dict[str, asyncio.Queue] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._inbox: list[tuple[Request, dict]] = []
        self._inbox_lock = threading.Lock()
        self.latest_stats = engine.stats()
        self._aloop: asyncio.AbstractEventLoop | None = None
        engine.kv_progress = self._progress  # a streamed prefill's blocks, to its request's queue

    @classmethod
    def start(cls, config: EngineConfig, **engine_kw: Any) -> "EngineLoop":
        """An engine for `config`, warmed up (no cold first request, and a first step-time fit
        for admission) and on its loop: how every server-side engine starts. `engine_kw`: the
        Engine's (its ranks' launcher). With data_parallel_size > 1 the engine is the front of D
        replicas (engine/parallel/dp_engine.py), `start_ranks` the launcher of replicas 1..D-1."""
        if config.data_parallel_size > 1:
            engine = DataParallelEngine(config, start_replicas=engine_kw.pop("start_ranks", None), **engine_kw)
        else:
            engine = Engine(config, **engine_kw)
        engine.warmup()
        return cls(engine)

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run fn on the engine thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._exec, functools.partial(fn, *args, **kwargs))

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._aloop = asyncio.get_running_loop()
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def prepare(self, params: SamplingParams) -> None:
        """Compile a request's grammar (structured output) off the event loop and the engine
        thread, within GRAMMAR_COMPILE_S; the engine then only copies the cached result."""
        if params.grammar is None:
            return
        try:
            await asyncio.wait_for(asyncio.to_thread(self.engine.prepare, params), GRAMMAR_COMPILE_S)
        except asyncio.TimeoutError:
            raise ConfigError(f"the request's {params.grammar.kind.value} did not compile within "
                              f"{GRAMMAR_COMPILE_S:g} s; simplify it") from None

    async def submit(self, req: Request, **kwargs: Any) -> asyncio.Queue:
        """Add a request; its chunks arrive on the returned queue."""
        await self.prepare(req.params)
        self._ensure_running()
        self.check_running()
        if len(self._queues) >= self.max_requests:
            raise EngineBusy(f"this engine has {len(self._queues)} requests already")
        if req.request_id in self._queues:  # replacing its queue would strand the running one
            raise ConfigError(f"request id {req.request_id!r} is already running")
        self.engine.check_request(req, tuple(kwargs.get("outputs", ())))  # bad input fails here, now
        q: asyncio.Queue = asyncio.Queue()
        self._queues[req.request_id] = q
        with self._inbox_lock:
            self._inbox.append((req, kwargs))
        self.wake()
        return q

    def watch(self, request_id: str) -> asyncio.Queue:
        """A queue for a request that enters the engine some other way (e.g. pulled KV)."""
        self._ensure_running()
        self.check_running()
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        return q

    def check_running(self) -> None:
        """Raises EngineFailed once the engine has stopped."""
        if self.stopped() is not None:
            raise EngineFailed(f"this engine has stopped: {self.failure}")

    def stopped(self) -> str | None:
        """Why this engine has stopped, or None. A rank of its tensor-parallel group (a stage, a
        data-parallel replica) that exited stops it now, even while idle: its next step would
        only fail inside a collective."""
        ranks = getattr(self.engine, "ranks", None)  # a parallel engine's other processes
        groups = [getattr(self.engine, g, None) for g in ("tp", "dp")]
        lost = next((g.failure for g in groups if g is not None and g.failure is not None), None) \
            or (ranks.lost() if ranks is not None else None)
        if self.failure is None and lost is not None:
            self.failure = lost
            if self._wake is not None:
                self._wake.set()  # the serving loop sees it and ends
        return self.failure

    @property
    def num_active(self) -> int:
        """Requests with a consumer here (submitted or watched, not finished): in flight even
        when the last stats snapshot does not show them yet."""
        return len(self._queues)

    def has(self, request_id: str) -> bool:
        return request_id in self._queues

    def forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def wake(self) -> None:
        self._ensure_running()
        self._wake.set()

    async def abort(self, request_id: str) -> None:
        """Stop the request in the engine; a consumer still waiting gets a final ABORT chunk."""
        q = self._queues.pop(request_id, None)
        with self._inbox_lock:
            self._inbox = [(r, kw) for r, kw in self._inbox if r.request_id != request_id]
        await self.call(self.engine.abort, request_id)
        if q is not None:
            q.put_nowait(TokenChunk(request_id, (), finish_reason=FinishReason.ABORT))

    def _progress(self, p: KVProgress) -> None:
        """On the engine thread, mid-step: a streamed prefill's progress goes to its queue now
        (ahead of the step's chunks), so its blocks can move while the step computes."""
        self._aloop.call_soon_threadsafe(self._deliver, p)

    def _deliver(self, p: KVProgress) -> None:
        q = self._queues.get(p.request_id)
        if q is not None:
            q.put_nowait(p)

    def _take_inbox_and_step(self) -> tuple[list[TokenChunk], list[tuple[str, Exception]]]:
        """On the engine thread: admit what arrived, step, leave a stats snapshot."""
        with self._inbox_lock:
            inbox, self._inbox = self._inbox, []
        failed = []
        for req, kwargs in inbox:
            try:
                self.engine.add_request(req, **kwargs)
            except Exception as e:  # e.g. a duplicate id: that request fails, the others go on
                failed.append((req.request_id, e))
        chunks = self.engine.step() if self.engine.has_unfinished() else []
        self.latest_stats = self.engine.stats()
        return chunks, failed

    async def _run(self) -> None:
        failures = 0
        while self.failure is None:
            if not self.engine.has_unfinished() and not self._inbox:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                chunks, failed = await self.call(self._take_inbox_and_step)
                failures = 0
            except Exception as e:  # deliver, don't die: every waiter learns what happened
                failures += 1
                group = _process_group(self.engine)
                why = None
                if group is not None:
                    # a rank or stage failed mid-step: the others wait in a collective of that
                    # step, so the next step's would meet theirs out of order — done at once
                    why = f"a step of its {group} group failed with {type(e).__name__}"
                elif failures >= self.max_step_failures:
                    why = f"{failures} engine steps in a row failed, the last with {type(e).__name__}"
                if why is not None:
                    e = EngineFailed(f"this engine has stopped: {why}")
                for rid, q in list(self._queues.items()):
                    if why is not None or not self.engine.is_pulling(rid):  # a pull was not in that step
                        q.put_nowait(e)
                if why is not None:
                    self.failure = why
                if group is not None:  # then the reason names the member that exited, once that shows
                    self.failure = await self._member_lost(why)
                await asyncio.sleep(0.01 * 2 ** failures)
                continue
            for rid, e in failed:
                q = self._queues.pop(rid, None)
                if q is not None:
                    q.put_nowait(e)
            for c in chunks:
                q = self._queues.get(c.request_id)
                if q is not None:
                    q.put_nowait(c)
                    if c.finished or c.kv_blocks is not None:
                        self._queues.pop(c.request_id, None)
            await asyncio.sleep(0)  # let new requests and aborts in between steps
        # stopped between steps (a rank of its group exited): whoever waits and has not heard it yet hears it now
        stopped = EngineFailed(f"this engine has stopped: {self.failure}")
        for q in list(self._queues.values()):
            if q.empty():
                q.put_nowait(stopped)

    async def _member_lost(self, why: str, wait_s: float = 2.0) -> str:
        """`why`, with the rank or stage that exited when one did: a peer's death reaches this
        process's collective before its launcher reports the process gone."""
        ranks = getattr(self.engine, "ranks", None)
        deadline = time.monotonic() + wait_s
        while ranks is not None:
            lost = ranks.lost()
            if lost is not None:
                return f"{why}: {lost}"
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.05)
        return why

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        # after the step in progress: the engine's close then runs alone (under tensor parallelism
        # it sends the ranks their last broadcast, which must not cross a step's collectives)
        self._exec.shutdown(wait=True, cancel_futures=True)


def _process_group(engine) -> str | None:
    """The kind of process group an engine's steps span ("pipeline-parallel",
    "tensor-parallel", "data-parallel"), or None for one process."""
    if getattr(engine, "pp", None) is not None:
        return "pipeline-parallel"
    if isinstance(engine, DataParallelEngine):
        return "data-parallel"
    tp = getattr(engine, "tp", None)
    return "tensor-parallel" if tp is not None and tp.size > 1 else None
