"""/v1/responses' stored conversations in Redis, so that a `previous_response_id` made on one
ingress replica continues on any other. Each is one key (JSON of its chat messages) that
expires after `ttl_s`: Redis bounds the store by time, each replica's own LRU (the local
`ResponseStore`) by count. A write goes to both; a read tries this replica's memory first, then
Redis. While Redis is away, each replica continues only the responses it stored itself."""

from __future__ import annotations

import json

from splitserve.ingress.responses import ResponseStore
from splitserve.ingress.shared.redis_link import RedisLink

TTL_S = 3600  # a stored response is forgotten an hour after it was made (OpenAI keeps them 30 days)


class SharedResponseStore(ResponseStore):
    def __init__(self, link: RedisLink, ttl_s: int = TTL_S, **local) -> None:
        super().__init__(**local)
        self.link, self.ttl_s = link, ttl_s

    def _key(self, tenant: str, response_id: str) -> str:
        return self.link.key("responses", tenant, response_id)

    async def get(self, tenant: str, response_id: str) -> tuple[dict, ...] | None:
        conv = self.get_local(tenant, response_id)
        if conv is not None:
            return conv
        raw = await self.link.call(lambda c: c.get(self._key(tenant, response_id)))
        if raw is None:  # not there, or Redis away
            return None
        conv = tuple(json.loads(raw))
        self.put_local(tenant, response_id, list(conv))
        return conv

    async def put(self, tenant: str, response_id: str, conversation: list[dict]) -> None:
        self.put_local(tenant, response_id, conversation)
        data = json.dumps(conversation, separators=(",", ":"))
        await self.link.call(lambda c: c.set(self._key(tenant, response_id), data, ex=self.ttl_s))
