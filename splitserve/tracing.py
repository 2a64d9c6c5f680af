"""OpenTelemetry traces, in every process (DESIGN.md §4): one trace per request, its spans
exported by the processes that did the work — the ingress replica (the request, its
tokenizing, admission and placement, each prefill and decode call, each migration), the
prefill worker (its prefill) and the decode worker (its KV landing, its decode) — each under
its own resource (`service.name` by role, `service.instance.id` per process).

The context crosses every Ray call inside the `Request` (`Request.traceparent`, the W3C
`traceparent` of the span the callee's span is a child of) and both APIs as the W3C
`traceparent` header / gRPC metadata, accepted and returned.

Off by default: without an endpoint nothing is set up and every span is the API's no-op one.
`TraceConfig.resolve` takes the flags over the standard `OTEL_*` variables. A process's
provider is its own (not the global one): a library in the same process that traces with the
global provider neither sends to our endpoint nor changes our sampling.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from splitserve.types import ConfigError

PROTOCOLS = ("grpc", "http/protobuf")
_PROPAGATOR = TraceContextTextMapPropagator()
_NOOP = trace.NoOpTracer()


@dataclasses.dataclass(frozen=True)
class TraceConfig:
    """Where a process's spans go: `endpoint` (None: tracing off), the share of requests traced
    (`sample_ratio`; a request whose caller sampled it is traced whatever the ratio), and the
    OTLP `protocol` ("grpc" or "http/protobuf")."""

    endpoint: str | None = None
    sample_ratio: float = 1.0
    protocol: str = "grpc"

    def __post_init__(self) -> None:
        if self.endpoint is not None and (not isinstance(self.endpoint, str) or not self.endpoint.strip()):
            raise ConfigError(f"the OTLP traces endpoint must be a URL, got {self.endpoint!r}")
        if isinstance(self.sample_ratio, bool) or not isinstance(self.sample_ratio, (int, float)) \
                or not 0.0 <= self.sample_ratio <= 1.0:
            raise ConfigError(f"the trace sample ratio must be a number in [0, 1], got {self.sample_ratio!r}")
        if self.protocol not in PROTOCOLS:
            raise ConfigError(f"the OTLP traces protocol must be one of {', '.join(PROTOCOLS)}, got {self.protocol!r}")

    @property
    def enabled(self) -> bool:
        return self.endpoint is not None

    @classmethod
    def resolve(cls, endpoint: str | None = None, sample_ratio: float | None = None,
                env: Mapping[str, str] = os.environ) -> "TraceConfig":
        """The flags, else the standard OTEL_* variables (OTEL_SDK_DISABLED=true turns it off)."""
        if env.get("OTEL_SDK_DISABLED", "").lower() == "true":
            return cls()
        endpoint = endpoint or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
        if sample_ratio is None:
            sample_ratio = _ratio_from_env(env)
        return cls(endpoint or None, sample_ratio, protocol)


def _ratio_from_env(env: Mapping[str, str]) -> float:
    if env.get("OTEL_TRACES_SAMPLER", "parentbased_traceidratio") not in ("traceidratio", "parentbased_traceidratio"):
        return 1.0
    arg = env.get("OTEL_TRACES_SAMPLER_ARG")
    try:
        return float(arg) if arg else 1.0
    except ValueError:
        raise ConfigError(f"OTEL_TRACES_SAMPLER_ARG must be a number in [0, 1], got {arg!r}") from None


_provider = None  # this process's TracerProvider, once set up


def setup(cfg: TraceConfig | None, service: str, instance: str) -> None:
    """Export this process's spans as `service` / `instance` (once per process; later calls,
    and a config with no endpoint, change nothing)."""
    global _provider
    if cfg is None or not cfg.enabled or _provider is not None:
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    provider = TracerProvider(resource=Resource.create({"service.name": service, "service.instance.id": instance}),
                              sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)))
    provider.add_span_processor(BatchSpanProcessor(_exporter(cfg), schedule_delay_millis=500))
    _provider = provider


def _exporter(cfg: TraceConfig):
    if cfg.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        endpoint = cfg.endpoint.removeprefix("http://")
        return OTLPSpanExporter(endpoint=endpoint, insecure=not cfg.endpoint.startswith("https://"))
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HTTPExporter

    url = cfg.endpoint if cfg.endpoint.rstrip("/").endswith("/v1/traces") else cfg.endpoint.rstrip("/") + "/v1/traces"
    return HTTPExporter(endpoint=url)


def tracer() -> trace.Tracer:
    """This process's tracer: the no-op one while tracing is off."""
    return _provider.get_tracer("splitserve") if _provider is not None else _NOOP


def parent(traceparent: str | None) -> Context | None:
    """The context a W3C `traceparent` names (None: a root)."""
    if not traceparent:
        return None
    return _PROPAGATOR.extract({"traceparent": traceparent})


def traceparent_of(span: trace.Span) -> str | None:
    """The W3C `traceparent` of `span` (None for a no-op span)."""
    if not span.get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent")


def shutdown() -> None:
    """Export what is buffered and stop tracing in this process (it may be set up again)."""
    global _provider
    if _provider is not None:
        _provider.shutdown()
        _provider = None


def flush(timeout_s: float = 5.0) -> None:
    """Export what is buffered now (a process about to stop, a test about to look)."""
    if _provider is not None:
        _provider.force_flush(int(timeout_s * 1000))


__all__ = ["TraceConfig", "setup", "tracer", "parent", "traceparent_of", "flush", "shutdown", "PROTOCOLS"]
