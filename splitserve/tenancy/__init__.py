"""Tenants at the edge (issue: tenants and security): API keys and who they belong to
(`keys.py`), and each tenant's request and token rate limits (`limits.py`). Pure Python, no Ray:
both ingresses (HTTP, gRPC) and the tests share it through `ingress.frontend.Frontend`."""

from splitserve.tenancy.keys import ApiKey, KeyRing, Tenant, Unauthenticated, load_keys
from splitserve.tenancy.limits import RateLimiter, TokenBucket

__all__ = ["ApiKey", "KeyRing", "RateLimiter", "Tenant", "TokenBucket", "Unauthenticated", "load_keys"]
