"""State the ingress replicas share through Redis (`--redis-url`; DESIGN.md §4
"Router state"): the tenants' rate-limit buckets, the in-flight load each replica has
placed, and /v1/responses' stored conversations. Every use degrades to the replica's own view when Redis is away, and picks the shared
one up again when it is back; without a URL nothing here runs. No Ray, no torch."""

from splitserve.ingress.shared.redis_link import RedisLink
from splitserve.ingress.shared.placed_load import SharedLoad
from splitserve.ingress.shared.response_store import SharedResponseStore
from splitserve.ingress.shared.tenant_limits import SharedRateLimiter

__all__ = ["RedisLink", "SharedLoad", "SharedRateLimiter", "SharedResponseStore"]
