"""Runs an Engine inside an asyncio program (a Ray actor) without blocking it.

Every engine call goes through one dedicated thread, so the engine is never touched by two
threads at once and the event loop never waits on a forward pass. A background task steps the
engine while it has work and routes each TokenChunk to its request's queue; an exception in a
step is delivered to every waiting request instead of dying silently.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from splitserve.engine.engine import Engine
from splitserve.types import FinishReason, Request, TokenChunk


class EngineLoop:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._exec = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self._queues: dict[str, asyncio.Queue] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run fn on the engine thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._exec, functools.partial(fn, *args, **kwargs))

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def submit(self, req: Request, **kwargs: Any) -> asyncio.Queue:
        """Add a request; its chunks arrive on the returned queue."""
        self._ensure_running()
        q: asyncio.Queue = asyncio.Queue()
        self._queues[req.request_id] = q
        try:
            await self.call(self.engine.add_request, req, **kwargs)
        except BaseException:
            self._queues.pop(req.request_id, None)
            raise
        self.wake()
        return q

    def watch(self, request_id: str) -> asyncio.Queue:
        """A queue for a request that enters the engine some other way (e.g. pulled KV)."""
        self._ensure_running()
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        return q

    def forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def wake(self) -> None:
        self._ensure_running()
        self._wake.set()

    async def abort(self, request_id: str) -> None:
        """Stop the request in the engine; a consumer still waiting gets a final ABORT chunk."""
        q = self._queues.pop(request_id, None)
        await self.call(self.engine.abort, request_id)
        if q is not None:
            q.put_nowait(TokenChunk(request_id, (), finish_reason=FinishReason.ABORT))

    async def _run(self) -> None:
        while True:
            if not self.engine.has_unfinished():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                chunks: list[TokenChunk] = await self.call(self.engine.step)
            except Exception as e:  # deliver, don't die: every waiter learns what happened
                for q in list(self._queues.values()):
                    q.put_nowait(e)
                await asyncio.sleep(0.01)
                continue
            for c in chunks:
                q = self._queues.get(c.request_id)
                if q is not None:
                    q.put_nowait(c)
                    if c.finished or c.kv_blocks is not None:
                        self._queues.pop(c.request_id, None)
            await asyncio.sleep(0)  # let new requests and aborts in between steps

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._exec.shutdown(wait=False, cancel_futures=True)
