"""The tenants' token buckets in Redis, so that every ingress replica charges the same ones: one
Lua script refills and checks all of a request's buckets and takes from them only when all have
room (atomic, so replicas never both take the last token). The buckets are the local limiter's
(`tenancy/limits.py`: the same rates and bursts); while Redis is away the replica's local
buckets decide (each replica then admits its own share: R replicas admit up to R times the
rate), and the shared ones decide again once it is back. Time is the replicas' clock, passed to
the script, so tests can drive it."""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from splitserve.ingress.shared.redis_link import RedisLink
from splitserve.tenancy.keys import Tenant
from splitserve.tenancy.limits import RateLimiter

# KEYS: one hash per bucket (level, at); ARGV: now, then rate, burst, amount, paid for each key
# (paid: what this charge took before, as `TokenBucket.wait_for` counts it).
_CHARGE = """
local now, wait, levels = tonumber(ARGV[1]), 0, {}
for i, key in ipairs(KEYS) do
  local rate, burst, amount, paid = tonumber(ARGV[4*i-2]), tonumber(ARGV[4*i-1]), tonumber(ARGV[4*i]), tonumber(ARGV[4*i+1])
  local s = redis.call('HMGET', key, 'level', 'at')
  local level, at = tonumber(s[1]) or burst, tonumber(s[2]) or now
  level = math.min(burst, level + math.max(0, now - at) * rate)
  levels[i] = level
  local need = math.min(amount + paid, burst) - paid
  if level < need then wait = math.max(wait, (need - level) / rate) end
end
if wait > 0 then return tostring(wait) end
for i, key in ipairs(KEYS) do
  local rate, burst, amount = tonumber(ARGV[4*i-2]), tonumber(ARGV[4*i-1]), tonumber(ARGV[4*i])
  redis.call('HSET', key, 'level', tostring(levels[i] - amount), 'at', tostring(now))
  redis.call('EXPIRE', key, math.ceil(burst / rate) + 60)
end
return '0'
"""
_REFUND = """
local now = tonumber(ARGV[1])
for i, key in ipairs(KEYS) do
  local rate, burst, amount = tonumber(ARGV[4*i-2]), tonumber(ARGV[4*i-1]), tonumber(ARGV[4*i])
  local s = redis.call('HMGET', key, 'level', 'at')
  if s[1] then
    local level = math.min(burst, tonumber(s[1]) + math.max(0, now - tonumber(s[2])) * rate + amount)
    redis.call('HSET', key, 'level', tostring(level), 'at', tostring(now))
  end
end
return 0
"""


class SharedRateLimiter:
    def __init__(self, link: RedisLink, local: RateLimiter | None = None, clock: Callable[[], float] = time.time) -> None:
        self.link, self._clock = link, clock
        self.local = local or RateLimiter()
        self._charge = link.client.register_script(_CHARGE)
        self._refund = link.client.register_script(_REFUND)
        self._background: set[asyncio.Task] = set()

    def _args(self, tenant: Tenant, requests: int, tokens: int, tokens_paid: int = 0) -> tuple[list[str], list[float]]:
        keys, argv = [], [self._clock()]
        for kind, rate, burst in self.local.limits(tenant):
            amount, paid = (requests, 0) if kind == "requests" else (tokens, tokens_paid)
            if amount > 0:  # a charge of none of a kind leaves that bucket alone
                keys.append(self.link.key("limit", tenant.name, kind))
                argv += [rate, burst, amount, paid]
        return keys, argv

    async def charge(self, tenant: Tenant, requests: int, tokens: int, tokens_paid: int = 0) -> float:
        keys, argv = self._args(tenant, requests, tokens, tokens_paid)
        if not keys:
            return 0.0
        answer = await self.link.call(lambda _: self._charge(keys=keys, args=argv))
        if answer is None:  # Redis away: this replica's own buckets
            return self.local.charge_now(tenant, requests, tokens, tokens_paid)
        return float(answer)

    def refund(self, tenant: Tenant, requests: int, tokens: int) -> None:
        """Give back a charge whose requests never ran; sent in the background (it runs while a
        refused request unwinds, maybe cancelled)."""
        keys, argv = self._args(tenant, requests, tokens)
        if not keys:
            return
        if not self.link.up:
            self.local.refund(tenant, requests, tokens)
            return
        task = asyncio.ensure_future(self.link.call(lambda _: self._refund(keys=keys, args=argv)))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
