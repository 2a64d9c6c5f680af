"""Per-tenant rate limits: a token bucket for requests per second and one for tokens per minute
(a request is charged its prompt tokens plus the most it may generate, as OpenAI's limits
count). A request either fits both buckets and is charged, or is refused with the time until it
would fit (HTTP 429 + Retry-After). These buckets are one ingress replica's; with Redis, every
replica charges the same ones (`ingress/shared/tenant_limits.py`), and these decide while Redis is away."""

from __future__ import annotations

import time
from typing import Callable

from splitserve.tenancy.keys import Tenant


class TokenBucket:
    """`rate` units a second, holding at most `burst` (full at start)."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not rate > 0 or not burst > 0:
            raise ValueError("a token bucket needs a positive rate and burst")
        self.rate, self.burst, self._clock = rate, burst, clock
        self._level, self._at = burst, clock()

    def level(self) -> float:
        now = self._clock()
        self._level, self._at = min(self.burst, self._level + (now - self._at) * self.rate), now
        return self._level

    def wait_for(self, amount: float, paid: float = 0.0) -> float:
        """Seconds until `amount` fits (0: now). More than the burst never fits: its wait is the
        time to fill the whole bucket, after which it is admitted alone (`take` allows that).
        `paid`: the part of this charge already taken (`Frontend.prepay`), so the rest fits
        exactly when the whole would have."""
        return max(0.0, (min(amount + paid, self.burst) - paid - self.level()) / self.rate)

    def take(self, amount: float) -> None:
        self._level = self.level() - amount  # may go below 0 for an oversize request: it waits longer next

    def give(self, amount: float) -> None:
        self._level = min(self.burst, self.level() + amount)


class RateLimiter:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[tuple[str, str], TokenBucket] = {}

    @staticmethod
    def limits(tenant: Tenant) -> list[tuple[str, float, float]]:
        """(kind, units a second, burst) of each limit the tenant has: a second's requests (at
        least one) may come at once; a minute's tokens."""
        out = []
        if tenant.requests_per_s is not None:
            out.append(("requests", tenant.requests_per_s, max(1.0, tenant.requests_per_s)))
        if tenant.tokens_per_min is not None:
            out.append(("tokens", tenant.tokens_per_min / 60.0, tenant.tokens_per_min))
        return out

    def _bucket(self, tenant: Tenant, kind: str) -> TokenBucket | None:
        for k, rate, burst in self.limits(tenant):
            if k == kind:
                b = self._buckets.get((tenant.name, kind))
                if b is None:
                    b = self._buckets[(tenant.name, kind)] = TokenBucket(rate, burst, self._clock)
                return b
        return None

    async def charge(self, tenant: Tenant, requests: int, tokens: int, tokens_paid: int = 0) -> float:
        """`charge_now`, as the Frontend calls every limiter (a shared one asks Redis)."""
        return self.charge_now(tenant, requests, tokens, tokens_paid)

    def charge_now(self, tenant: Tenant, requests: int, tokens: int, tokens_paid: int = 0) -> float:
        """Charge `tenant` for `requests` requests and `tokens` tokens more (of a charge of which
        `tokens_paid` were taken before); 0.0 if charged, else the seconds until they would fit
        (nothing is charged then)."""
        want = [(b, n, paid) for b, n, paid in ((self._bucket(tenant, "requests"), requests, 0),
                                                (self._bucket(tenant, "tokens"), tokens, tokens_paid))
                if b is not None and n > 0]  # a charge of none of a kind leaves that bucket alone
        wait = max((b.wait_for(n, paid) for b, n, paid in want), default=0.0)
        if wait > 0:
            return wait
        for b, n, _ in want:
            b.take(n)
        return 0.0

    def refund(self, tenant: Tenant, requests: int, tokens: int) -> None:
        """Give back a charge whose requests never ran (admission refused them)."""
        for kind, n in (("requests", requests), ("tokens", tokens)):
            b = self._bucket(tenant, kind)
            if b is not None and n > 0:
                b.give(n)
