"""The in-flight load each router replica has placed, shared: every `interval_s` a replica
writes its pending counts (what it placed on each worker that the worker's own reports do not
show yet, `router/pending.Pending`) to its hash in Redis and reads the other live replicas'
back, so that replicas placing a burst at once spread it as one router would. A replica's hash
lapses `ttl_s` after its last write (a replica that stopped counts for nothing). Redis away:
`others` is empty (each replica's own view) until a round trip succeeds again."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from splitserve.ingress.shared.redis_link import RedisLink

log = logging.getLogger(__name__)


class SharedLoad:
    def __init__(self, link: RedisLink, router_id: str, interval_s: float = 0.05, ttl_s: float = 2.0) -> None:
        self.link, self.router_id, self.interval_s, self.ttl_s = link, router_id, interval_s, ttl_s
        self.others: dict[str, int] = {}  # worker id -> what the other replicas placed there, pending
        self._routers = link.key("load", "routers")

    def _key(self, router_id: str) -> str:
        return self.link.key("load", router_id)

    async def exchange(self, mine: dict[str, int]) -> set[str]:
        """Publish `mine`, read the others'; the workers whose shared count changed."""
        got = await self.link.call(lambda r: self._round_trip(r, mine))
        others = got if got is not None else {}
        changed = {w for w in set(others) | set(self.others) if others.get(w, 0) != self.others.get(w, 0)}
        self.others = others
        return changed

    async def _round_trip(self, r, mine: dict[str, int]) -> dict[str, int]:
        now, key = time.time(), self._key(self.router_id)
        pipe = r.pipeline(transaction=True)
        pipe.delete(key)
        if mine:
            pipe.hset(key, mapping=mine)
            pipe.expire(key, max(1, int(self.ttl_s + 0.999)))
        pipe.zadd(self._routers, {self.router_id: now})
        pipe.zremrangebyscore(self._routers, "-inf", now - self.ttl_s)
        pipe.zrange(self._routers, 0, -1)
        routers = [x.decode() if isinstance(x, bytes) else x for x in (await pipe.execute())[-1]]
        others = [rid for rid in routers if rid != self.router_id]
        if not others:
            return {}
        pipe = r.pipeline(transaction=False)
        for rid in others:
            pipe.hgetall(self._key(rid))
        total: dict[str, int] = {}
        for counts in await pipe.execute():
            for w, n in counts.items():
                w = w.decode() if isinstance(w, bytes) else w
                total[w] = total.get(w, 0) + int(n)
        return total

    async def run(self, mine: Callable[[], dict[str, int]], changed: Callable[[set[str]], None]) -> None:
        """Until cancelled: exchange every interval, telling `changed` which workers' shared
        counts moved."""
        while True:
            try:
                moved = await self.exchange(mine())
                if moved:
                    changed(moved)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # never let one bad round end the sharing
                log.warning("sharing the in-flight load failed: %s", type(e).__name__)
            await asyncio.sleep(self.interval_s)

    async def leave(self) -> None:
        """This replica stops: its counts go now rather than at their ttl."""
        await self.link.call(lambda r: r.pipeline(transaction=False).delete(self._key(self.router_id))
                             .zrem(self._routers, self.router_id).execute())
