"""API keys and the tenants they name. A key file (`serve --api-keys FILE`, `api_keys:` in the
config or the Serve app args) is YAML:

    keys:
      - key: sk-alpha-0123456789      # or key_sha256: <hex>, so the file need not hold secrets
        tenant: alpha
        priority: standard            # the highest priority this key may use (default: standard)
        requests_per_s: 5             # optional token-bucket limits, per tenant
        tokens_per_min: 200000
        max_inflight: 64              # optional: at most this many of its requests in flight at once
        cache_group: shared           # optional: tenants naming one group share prefix-cache blocks
        operator: false               # optional: this key may read /metrics (every tenant's counters)
    metrics_open: false               # optional: /metrics without a key

`SPLITSERVE_API_KEY` adds one key (tenant `default`). Only SHA-256 digests of keys are kept
(and travel in the app's config to the ingress replicas); a presented key is hashed and looked
up, so no comparison leaks its bytes.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from splitserve.types import ConfigError, Priority

ENV_KEY = "SPLITSERVE_API_KEY"


class Unauthenticated(Exception):
    """No key, or one this server does not know (HTTP 401, gRPC UNAUTHENTICATED)."""


@dataclass(frozen=True)
class Tenant:
    """Who a request comes from, as its key says: the most it may ask for and what keeps its
    cached prompts apart from everyone else's."""

    name: str
    max_priority: Priority = Priority.CRITICAL  # the highest it may use (an open server: any)
    cache_salt: str | None = None  # None: the shared prefix cache (an open server)
    requests_per_s: float | None = None
    tokens_per_min: float | None = None
    max_inflight: int | None = None  # its engine requests in flight at once, on each ingress replica

    def cap(self, priority: Priority) -> Priority:
        """`priority`, but no higher than this tenant may use (a client cannot promote itself)."""
        return Priority(max(int(priority), int(self.max_priority)))


OPEN = Tenant("default")  # every request of a server without keys


@dataclass(frozen=True)
class ApiKey:
    sha256: str  # hex digest of the key
    tenant: Tenant
    operator: bool = False  # may read /metrics, which holds every tenant's counters

    @classmethod
    def from_entry(cls, entry: Any, where: str) -> "ApiKey":
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{where}: each key is a mapping (key or key_sha256, tenant, ...)")
        unknown = set(entry) - {"key", "key_sha256", "tenant", "priority", "requests_per_s", "tokens_per_min",
                                "max_inflight", "cache_group", "operator"}
        if unknown:
            raise ConfigError(f"{where}: unknown fields {sorted(unknown)}")
        if ("key" in entry) == ("key_sha256" in entry):
            raise ConfigError(f"{where}: give exactly one of key, key_sha256")
        digest = _digest(entry["key"], where) if "key" in entry else _hex_digest(entry["key_sha256"], where)
        tenant = entry.get("tenant")
        if not isinstance(tenant, str) or not tenant:
            raise ConfigError(f"{where}: tenant must be a non-empty string")
        try:
            priority = Priority[str(entry.get("priority", "standard")).upper()]
        except KeyError:
            raise ConfigError(f"{where}: priority must be critical, standard or sheddable") from None
        limits = {name: _rate(entry.get(name), f"{where}: {name}") for name in ("requests_per_s", "tokens_per_min")}
        group = entry.get("cache_group", tenant)
        if not isinstance(group, str) or not group:
            raise ConfigError(f"{where}: cache_group must be a non-empty string")
        inflight = entry.get("max_inflight")
        if inflight is not None and (not isinstance(inflight, int) or isinstance(inflight, bool) or inflight < 1):
            raise ConfigError(f"{where}: max_inflight must be an integer >= 1, got {inflight!r}")
        operator = entry.get("operator", False)
        if not isinstance(operator, bool):
            raise ConfigError(f"{where}: operator must be true or false")
        return cls(digest, Tenant(tenant, priority, f"tenant:{group}", **limits, max_inflight=inflight), operator)


@dataclass(frozen=True)
class KeyRing:
    """The keys a server accepts; empty: the server is open (every request is `OPEN`)."""

    keys: tuple[ApiKey, ...] = ()
    metrics_open: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_digest", {k.sha256: k.tenant for k in self.keys})
        object.__setattr__(self, "_operators", frozenset(k.sha256 for k in self.keys if k.operator))
        tenants: dict[str, Tenant] = {}
        for k in self.keys:  # one tenant, one set of limits and one salt, whichever key it uses
            if tenants.setdefault(k.tenant.name, k.tenant) != k.tenant:
                raise ConfigError(f"tenant {k.tenant.name!r}: its keys disagree on its limits or cache group")

    @property
    def open(self) -> bool:
        return not self.keys

    def tenant(self, authorization: str | None) -> Tenant:
        """The tenant of an `Authorization: Bearer KEY` value; raises Unauthenticated."""
        if self.open:
            return OPEN
        scheme, _, key = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthenticated("missing API key: send Authorization: Bearer <key>")
        tenant = self._by_digest.get(hashlib.sha256(key.strip().encode()).hexdigest())
        if tenant is None:
            raise Unauthenticated("invalid API key")
        return tenant

    def is_operator(self, authorization: str | None) -> bool:
        """Whether an `Authorization: Bearer KEY` value holds an operator key."""
        _, _, key = (authorization or "").strip().partition(" ")
        return hashlib.sha256(key.strip().encode()).hexdigest() in self._operators

    def with_env(self, env: Mapping[str, str] = os.environ) -> "KeyRing":
        """These keys plus `SPLITSERVE_API_KEY`'s (tenant `default`), if set."""
        key = env.get(ENV_KEY)
        if not key:
            return self
        extra = ApiKey.from_entry({"key": key, "tenant": "default"}, ENV_KEY)
        return KeyRing(self.keys + (extra,), self.metrics_open)

    def to_options(self) -> dict:
        """As `from_options` reads it (digests only): how the keys travel in an app's config."""
        return {"keys": [{"key_sha256": k.sha256, "tenant": k.tenant.name, "priority": k.tenant.max_priority.name.lower(),
                          "cache_group": k.tenant.cache_salt.removeprefix("tenant:"), "operator": k.operator,
                          **{n: getattr(k.tenant, n) for n in ("requests_per_s", "tokens_per_min", "max_inflight")
                             if getattr(k.tenant, n) is not None}} for k in self.keys],
                "metrics_open": self.metrics_open}

    @classmethod
    def from_options(cls, options: Any, where: str = "api_keys") -> "KeyRing":
        """From a key file's path, its parsed content (a mapping with `keys:`), or None (open)."""
        if options is None:
            return cls()
        if isinstance(options, KeyRing):
            return options
        if isinstance(options, (str, Path)):
            return load_keys(options)
        if not isinstance(options, Mapping) or set(options) - {"keys", "metrics_open"}:
            raise ConfigError(f"{where}: expected a mapping with keys: (and optionally metrics_open:)")
        entries = options.get("keys") or []
        if not isinstance(entries, list):
            raise ConfigError(f"{where}: keys must be a list")
        metrics_open = options.get("metrics_open", False)
        if not isinstance(metrics_open, bool):
            raise ConfigError(f"{where}: metrics_open must be true or false")
        keys = tuple(ApiKey.from_entry(e, f"{where}: keys[{i}]") for i, e in enumerate(entries))
        if len({k.sha256 for k in keys}) != len(keys):
            raise ConfigError(f"{where}: a key is listed twice")
        return cls(keys, metrics_open)


def load_keys(path: str | Path) -> KeyRing:
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"api keys file {path}: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"api keys file {path}: not YAML ({e})") from None
    return KeyRing.from_options(data, f"api keys file {path}")


def _digest(key: Any, where: str) -> str:
    if not isinstance(key, str) or len(key) < 8 or key != key.strip():
        raise ConfigError(f"{where}: key must be a string of at least 8 characters without surrounding spaces")
    return hashlib.sha256(key.encode()).hexdigest()


def _hex_digest(h: Any, where: str) -> str:
    if not isinstance(h, str) or len(h) != 64 or any(c not in "0123456789abcdef" for c in h.lower()):
        raise ConfigError(f"{where}: key_sha256 must be 64 hex digits")
    return h.lower()


def _rate(v: Any, where: str) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v != v or v == float("inf"):
        raise ConfigError(f"{where} must be a positive number, got {v!r}")
    return float(v)
