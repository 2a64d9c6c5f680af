"""An OTLP trace receiver for tests (no collector here): a gRPC TraceService on a free port that
keeps every span it is sent, with the `service.name` of the resource that sent it."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    instance: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    attributes: dict
    status_code: int


class OTLPReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "OTLPReceiver":
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None)

    def Export(self, request, context):  # noqa: N802 (the OTLP method name)
        got = []
        for rs in request.resource_spans:
            res = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(ReceivedSpan(res.get("service.name", ""), res.get("service.instance.id", ""), s.name,
                                            s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.kind,
                                            {a.key: _value(a.value) for a in s.attributes}, s.status.code))
        with self._lock:
            self.spans.extend(got)
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, names: set[str], within_s: float = 20.0) -> list[ReceivedSpan]:
        """The trace's spans once every name in `names` is among them (a hang guard, not a bound)."""
        deadline = time.monotonic() + within_s
        while True:
            spans = self.trace(trace_id)
            if names <= {s.name for s in spans} or time.monotonic() > deadline:
                return spans
            time.sleep(0.1)


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    return getattr(v, kind) if kind else None
