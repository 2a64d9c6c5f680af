"""The ingress replicas whose streams a decode worker serves, watched (issue 30).

A stream's consumer is an ingress replica's process. Killed, it can no longer tell the worker to
stop, and Ray does not stop a streaming call whose caller died: the request would decode to its
`max_tokens` for nobody, holding its slot and blocks. So each stream names its caller (the
replica's actor handle; None for a driver, such as the offline `Cluster`), and the worker pings
each distinct caller every `interval_s` — a handful of replicas, not one ping per stream. A
caller whose ping fails twice in a row (a busy replica answers late, it does not fail) is gone:
each of its streams is aborted here, and frees what it holds as any abort does.

The worker knows no Ray: a caller is an object with a `__ray_ready__.remote()` awaitable (an
actor handle), hashed and compared as the actor it names.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

log = logging.getLogger(__name__)


class Callers:
    def __init__(self, abort: Callable[[str], Awaitable[None]], interval_s: float = 1.0, timeout_s: float = 10.0) -> None:
        self._abort = abort
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self._streams: dict[Any, set[str]] = {}  # caller -> its request ids here
        self._failures: dict[Any, int] = {}
        self._watch: asyncio.Task | None = None
        self.gone = 0  # callers found dead, for tests and logs

    def add(self, caller: Any, request_id: str) -> None:
        if caller is None:
            return
        self._streams.setdefault(caller, set()).add(request_id)
        if self._watch is None or self._watch.done():
            self._watch = asyncio.get_running_loop().create_task(self._watch_forever())

    def remove(self, caller: Any, request_id: str) -> None:
        ids = self._streams.get(caller)
        if ids is None:
            return
        ids.discard(request_id)
        if not ids:
            del self._streams[caller]
            self._failures.pop(caller, None)

    async def _watch_forever(self) -> None:
        while self._streams:
            await asyncio.sleep(self.interval_s)
            await asyncio.gather(*(self._check(c) for c in list(self._streams)))

    async def _check(self, caller: Any) -> None:
        try:
            await asyncio.wait_for(caller.__ray_ready__.remote(), self.timeout_s)
            self._failures.pop(caller, None)
            return
        except asyncio.TimeoutError:  # busy, not gone
            return
        except Exception as e:  # its actor died (or the call failed: twice in a row, it is gone)
            self._failures[caller] = self._failures.get(caller, 0) + 1
            if self._failures[caller] < 2:
                return
            why = type(e).__name__
        ids = self._streams.pop(caller, set())
        self._failures.pop(caller, None)
        self.gone += 1
        log.warning("an ingress replica is gone (%s): aborting its %d streams here", why, len(ids))
        for rid in ids:
            await self._abort(rid)

    def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
