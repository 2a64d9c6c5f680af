"""Tracing's own parts (tracing.py, ingress/request_span.py) in one process: the config from
flags and the standard OTEL_* variables; the HTTP ingress's request span — a child of the
client's `traceparent`, returned in the answer, with tokenize and admission under it — for a
plain and a streamed answer, exported to an OTLP receiver (tests/otlp_receiver.py); and,
tracing off, the caller's `traceparent` echoed. (Across processes:
tests/integration/test_tracing_cluster.py.)"""

import asyncio
import secrets

import httpx
import pytest

from splitserve import tracing
from splitserve.config import EngineConfig
from splitserve.ingress.http import OpenAIServer
from splitserve.orchestrator.local_backend import LocalBackend
from splitserve.tracing import TraceConfig
from splitserve.types import ConfigError
from tests.otlp_receiver import OTLPReceiver


def test_the_config_takes_flags_over_the_otel_variables():
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317", "OTEL_TRACES_SAMPLER_ARG": "0.25",
           "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
    assert TraceConfig.resolve(env=env) == TraceConfig("http://collector:4317", 0.25, "http/protobuf")
    assert TraceConfig.resolve("http://here:4317", 0.5, env=env) == TraceConfig("http://here:4317", 0.5, "http/protobuf")
    assert TraceConfig.resolve(env={**env, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:1"}).endpoint == "http://t:1"
    assert not TraceConfig.resolve(env={**env, "OTEL_SDK_DISABLED": "true"}).enabled
    assert not TraceConfig.resolve(env={}).enabled and TraceConfig.resolve(env={}).sample_ratio == 1.0
    assert TraceConfig.resolve(env={"OTEL_TRACES_SAMPLER": "always_on", "OTEL_TRACES_SAMPLER_ARG": "0.1"}).sample_ratio == 1.0
    for bad in (dict(sample_ratio=1.5), dict(sample_ratio=True), dict(protocol="thrift"), dict(endpoint=" ")):
        with pytest.raises(ConfigError):
            TraceConfig(**{"endpoint": "http://x:1", **bad})
    with pytest.raises(ConfigError, match="OTEL_TRACES_SAMPLER_ARG"):
        TraceConfig.resolve(env={"OTEL_TRACES_SAMPLER_ARG": "lots"})


def test_the_http_exporter_posts_to_the_traces_path():
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    e = tracing._exporter(TraceConfig("http://collector:4318", 1.0, "http/protobuf"))
    assert isinstance(e, OTLPSpanExporter) and e._endpoint == "http://collector:4318/v1/traces"


@pytest.fixture(scope="module")
def backend(tiny_checkpoint):
    return LocalBackend(EngineConfig(model=str(tiny_checkpoint("llama")), num_kv_blocks=64), model_name="tiny")


def post(server, body, traceparent):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app), base_url="http://t") as h:
            return await h.post("/v1/completions", json=body, headers={"traceparent": traceparent})

    return asyncio.run(go())


@pytest.mark.parametrize("stream", [False, True])
def test_the_request_span_is_the_clients_child_and_comes_back(backend, stream):
    receiver = OTLPReceiver().start()
    tracing.setup(TraceConfig(receiver.endpoint), "splitserve-ingress", "test")
    try:
        trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
        r = post(OpenAIServer(backend), {"model": "tiny", "prompt": "traced", "max_tokens": 3, "stream": stream},
                 f"00-{trace_id}-{parent}-01")
        assert r.status_code == 200
        _, got_trace, root_id, flags = r.headers["traceparent"].split("-")
        assert (got_trace, flags) == (trace_id, "01") and root_id != parent
        tracing.flush()
        spans = {s.name: s for s in receiver.wait_for(trace_id, {"POST /v1/completions", "tokenize", "admission"})}
    finally:
        tracing.shutdown()
        receiver.stop()
    root = spans["POST /v1/completions"]
    assert (root.span_id, root.parent_id, root.service) == (root_id, parent, "splitserve-ingress")
    assert root.attributes["http.response.status_code"] == 200 and root.attributes["gen_ai.request.model"] == "tiny"
    assert spans["tokenize"].parent_id == root_id and spans["admission"].parent_id == root_id
    assert spans["admission"].attributes["splitserve.admitted"] is True


def test_tracing_off_echoes_the_callers_traceparent(backend):
    from opentelemetry.trace import NoOpTracer

    assert isinstance(tracing.tracer(), NoOpTracer)  # off: every span is the no-op one
    sent = f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"
    r = post(OpenAIServer(backend), {"model": "tiny", "prompt": "untraced", "max_tokens": 2}, sent)
    assert r.status_code == 200 and r.headers["traceparent"] == sent


def test_a_grpc_call_is_traced_under_its_traceparent_metadata(backend):
    """gRPC: the call's `traceparent` metadata is the request span's parent, and the span's own
    comes back in the trailing metadata."""
    import grpc

    from splitserve.ingress.grpc_service import GenerationService, serve
    from splitserve.v1 import generation_pb2 as pb
    from splitserve.v1 import generation_pb2_grpc as pb_grpc

    receiver = OTLPReceiver().start()
    tracing.setup(TraceConfig(receiver.endpoint), "splitserve-ingress", "test")
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)

    async def go():
        server, port = await serve(GenerationService(OpenAIServer(backend).front), "127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                call = pb_grpc.GenerationStub(ch).Generate(
                    pb.GenerateRequest(text="traced call", sampling=pb.SamplingParams(max_tokens=3)),
                    metadata=(("traceparent", f"00-{trace_id}-{parent}-01"),))
                msgs = [m async for m in call]
                return msgs, dict(await call.trailing_metadata())
        finally:
            await server.stop(None)

    try:
        msgs, trailing = asyncio.run(go())
        assert msgs and msgs[-1].finish_reason
        _, got_trace, root_id, _ = trailing["traceparent"].split("-")
        assert got_trace == trace_id and root_id != parent
        tracing.flush()
        spans = {s.name: s for s in receiver.wait_for(trace_id, {"splitserve.v1.Generation/Generate", "admission"})}
    finally:
        tracing.shutdown()
        receiver.stop()
    root = spans["splitserve.v1.Generation/Generate"]
    assert (root.span_id, root.parent_id) == (root_id, parent) and root.attributes["rpc.method"] == "Generate"
    assert spans["admission"].parent_id == root_id
