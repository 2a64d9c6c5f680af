"""One replica's connection to Redis, and whether Redis is there: every call goes through
`call`, which answers None instead of raising when Redis is away (refused, timed out, gone
mid-call) or answers an error (OOM, READONLY, NOPERM), so a caller falls back to its local view and never fails a request. While Redis is
away, calls are not attempted; a background probe (PING every `retry_s`) notices it back and
runs the `on_up` callbacks (a user republishes what it owns there)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

log = logging.getLogger(__name__)

TIMEOUT_S = 0.25  # a call on the request path waits no longer than this for Redis


class RedisLink:
    def __init__(self, url: str, prefix: str = "splitserve", retry_s: float = 0.5, client: Any = None) -> None:
        """`prefix`: the app's namespace (apps sharing one Redis keep apart); `client`: a
        redis.asyncio client to use instead of one made from `url`."""
        if client is None:
            import redis.asyncio as aioredis

            client = aioredis.Redis.from_url(url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S,
                                             retry_on_timeout=False)
        self.url, self.prefix, self.retry_s = url, prefix, retry_s
        self.client = client
        self.up = True  # until a call says otherwise
        self.refusals: dict[str, int] = {}  # error replies by kind (OOM, READONLY, ...)
        self._on_up: list[Callable[[], Awaitable[None]]] = []
        self._probe: asyncio.Task | None = None

    def key(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    def on_up(self, fn: Callable[[], Awaitable[None]]) -> None:
        self._on_up.append(fn)

    async def call(self, fn: Callable[[Any], Awaitable[Any]]) -> Any:
        """fn(client)'s answer, or None when Redis is away (then nothing is attempted until the
        probe finds it back)."""
        if not self.up:
            return None
        try:
            return await fn(self.client)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # refused, timed out, reset, or Redis answered an error
            if _is_redis_down(e):
                self._down(e)
                return None
            if _is_error_reply(e):  # OOM, READONLY, NOPERM...: Redis is there but will not do it
                self._refused(e)
                return None
            raise

    def _refused(self, e: Exception) -> None:
        """An error reply degrades this one call (the caller falls back to its local view) without
        taking Redis for gone: a PING would still answer, and the next call may succeed. Logged
        once per kind of reply."""
        kind = type(e).__name__  # redis-py's class per reply: OutOfMemoryError, ReadOnlyError, NoPermissionError...
        if kind not in self.refusals:
            log.warning("Redis at %s refused a call (%s): this replica limits and routes on its own view for "
                        "such calls", _safe(self.url), kind)
        self.refusals[kind] = self.refusals.get(kind, 0) + 1

    def _down(self, e: Exception) -> None:
        if self.up:
            log.warning("Redis at %s is unreachable (%s): each replica routes and limits on its own view "
                        "until it is back", _safe(self.url), type(e).__name__)
        self.up = False
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._until_up())

    async def _until_up(self) -> None:
        while True:
            await asyncio.sleep(self.retry_s)
            try:
                await self.client.ping()
            except asyncio.CancelledError:
                raise
            except Exception:
                continue
            self.up = True
            log.warning("Redis at %s is back: shared router state resumes", _safe(self.url))
            for fn in self._on_up:
                try:
                    await fn()
                except Exception as e:  # one user's resync failing must not stop the others'
                    log.warning("resync after Redis came back failed: %s", type(e).__name__)
            return

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
        try:
            await self.client.aclose()
        except Exception:  # already gone
            pass


def _is_redis_down(e: Exception) -> bool:
    import redis.exceptions as rex

    return isinstance(e, (rex.ConnectionError, rex.TimeoutError, OSError, asyncio.TimeoutError))


def _is_error_reply(e: Exception) -> bool:
    import redis.exceptions as rex

    return isinstance(e, rex.RedisError)


def _safe(url: str) -> str:
    """The URL without its password, for logs."""
    head, sep, tail = url.rpartition("@")
    return f"{head.split('://')[0]}://***@{tail}" if sep else url
