"""The gRPC ingress with a client generated from the protos: a streamed generation (greedy, equal
to the HTTP API's), health, reflection, and bad input → INVALID_ARGUMENT / NOT_FOUND,
admission → RESOURCE_EXHAUSTED with retry-after, never INTERNAL."""

import asyncio
import math

import grpc
import httpx
import pytest

from splitserve.config import EngineConfig
from splitserve.router.admission import Admission, AdmissionConfig
from splitserve.orchestrator.local_backend import LocalBackend
from splitserve.ingress.grpc_service import SERVICE_NAME, GenerationService, serve
from splitserve.ingress.http import OpenAIServer
from splitserve.v1 import generation_pb2 as pb
from splitserve.v1 import generation_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def http_server(tiny_checkpoint):
    backend = LocalBackend(EngineConfig(model=str(tiny_checkpoint("llama")), num_kv_blocks=256), model_name="tiny")
    return OpenAIServer(backend, admission=Admission(AdmissionConfig(max_inflight=4)))


async def with_grpc(http_server, fn):
    """Run fn(stub) against a gRPC server sharing the HTTP server's frontend."""
    server, port = await serve(GenerationService(http_server.front), "127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            return await fn(pb_grpc.GenerationStub(ch))
    finally:
        await server.stop(None)


def run(http_server, fn):
    return asyncio.run(with_grpc(http_server, fn))


def test_generate_streams_the_same_greedy_text_as_http(http_server):
    async def go(stub):
        req = pb.GenerateRequest(text="Paris is the capital",
                                 sampling=pb.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2))
        msgs = [m async for m in stub.Generate(req)]
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=http_server.app), base_url="http://t") as h:
            r = await h.post("/v1/completions", json={"model": "tiny", "prompt": "Paris is the capital", "max_tokens": 12,
                                                      "temperature": 0, "ignore_eos": True})
        return msgs, r

    msgs, r = run(http_server, go)
    ids = [i for m in msgs for i in m.token_ids]
    assert len(ids) == 12 and len(msgs) >= 2  # streamed, not one final message
    assert "".join(m.text for m in msgs) == r.json()["choices"][0]["text"]
    assert all(len(m.logprobs) == len(m.token_ids) for m in msgs)
    assert all(len(lp.top) == 2 and lp.logprob <= 0 for m in msgs for lp in m.logprobs)
    last = msgs[-1]
    assert last.finish_reason == "length" and not any(m.finish_reason for m in msgs[:-1])
    assert last.usage.completion_tokens == 12 and last.usage.prompt_tokens == r.json()["usage"]["prompt_tokens"]
    assert last.timings.first_token_s > 0 and last.timings.decode_s > 0 and last.timings.prefill_s > 0
    # The HTTP response carries the same breakdown as headers and as a usage extension.
    assert float(r.headers["x-splitserve-first-token-ms"]) > 0 and float(r.headers["x-splitserve-queue-ms"]) >= 0
    assert set(r.json()["usage"]["splitserve_timings_ms"]) >= {"queue", "prefill", "first_token", "decode"}


def test_token_ids_stop_and_health(http_server):
    async def go(stub):
        health = await stub.Health(pb.HealthRequest())
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7, 8]),
                                 sampling=pb.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        plain = [m async for m in stub.Generate(req)]
        text = "".join(m.text for m in plain)
        stop = text.strip()[:2]
        req.sampling.stop.append(stop)
        stopped = [m async for m in stub.Generate(req)]
        return health, text, stop, stopped

    health, text, stop, stopped = run(http_server, go)
    assert health.ready and health.model == "tiny"
    assert stopped[-1].finish_reason == "stop"
    assert "".join(m.text for m in stopped) == text[:text.index(stop)]


BAD = [
    ("nan temperature", pb.GenerateRequest(text="x", sampling=pb.SamplingParams(temperature=math.nan)),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("temperature out of range", pb.GenerateRequest(text="x", sampling=pb.SamplingParams(temperature=-1)),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("max_tokens 0", pb.GenerateRequest(text="x", sampling=pb.SamplingParams(max_tokens=0)),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("no prompt", pb.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT),
    ("empty text", pb.GenerateRequest(text=""), grpc.StatusCode.INVALID_ARGUMENT),
    ("token id past the vocabulary", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 10**9])),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("prompt beyond the context", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 100_000)),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("top_p 0", pb.GenerateRequest(text="x", sampling=pb.SamplingParams(top_p=0)), grpc.StatusCode.INVALID_ARGUMENT),
    ("logprobs 99", pb.GenerateRequest(text="x", sampling=pb.SamplingParams(logprobs=99)),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("unknown priority", pb.GenerateRequest(text="x", priority=42), grpc.StatusCode.INVALID_ARGUMENT),
    ("negative SLO", pb.GenerateRequest(text="x", ttft_slo_ms=-5), grpc.StatusCode.INVALID_ARGUMENT),
    ("unknown model", pb.GenerateRequest(text="x", model="gpt-9"), grpc.StatusCode.NOT_FOUND),
    ("regex that does not compile", pb.GenerateRequest(text="x", sampling=pb.SamplingParams(regex="(open")),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("unsupported JSON schema", pb.GenerateRequest(text="x", sampling=pb.SamplingParams(json_schema='{"type": "strang"}')),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("logit_bias out of range", pb.GenerateRequest(text="x", sampling=pb.SamplingParams(logit_bias={5: 101})),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("logit_bias outside the vocabulary", pb.GenerateRequest(text="x", sampling=pb.SamplingParams(logit_bias={10**6: 1})),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("request_id of 129 characters", pb.GenerateRequest(text="x", request_id="r" * 129),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("a million stop_token_ids", pb.GenerateRequest(text="x", sampling=pb.SamplingParams(stop_token_ids=range(10**6))),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("a 9 MiB message", pb.GenerateRequest(text="x" * (9 << 20)), grpc.StatusCode.RESOURCE_EXHAUSTED),
]


@pytest.mark.parametrize("req,code", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_gets_its_status_not_internal(http_server, req, code):
    async def go(stub):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in stub.Generate(req):
                pass
        return e.value

    err = run(http_server, go)
    assert err.code() == code, (err.code(), err.details())
    assert err.details()


def test_overload_is_resource_exhausted_with_retry_after(http_server):
    async def go(stub):
        req = pb.GenerateRequest(text="load", sampling=pb.SamplingParams(max_tokens=40, ignore_eos=True))

        async def one():
            try:
                return len([m async for m in stub.Generate(req)])
            except grpc.aio.AioRpcError as e:
                return e

        return await asyncio.gather(*[one() for _ in range(8)])

    out = run(http_server, go)
    refused = [e for e in out if isinstance(e, grpc.aio.AioRpcError)]
    assert refused and len(refused) < len(out)  # max_inflight=4: some served, some refused
    assert all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for e in refused)
    assert all(int(dict(e.trailing_metadata())["retry-after"]) >= 1 for e in refused)
    assert http_server.admission.inflight == 0


def test_structured_output_over_grpc(http_server):
    """The proto's constraint fields reach the engine: every answer fits its constraint."""
    import json
    import re

    async def go(stub):
        out = []
        for s in (pb.SamplingParams(regex="[0-9]{2}-[a-z]{3}", temperature=1.0, seed=4, max_tokens=20),
                  pb.SamplingParams(choice=pb.Choices(options=["left", "right"]), max_tokens=10),
                  pb.SamplingParams(json_schema=json.dumps({"type": "object", "properties": {"x": {"type": "boolean"}},
                                                            "required": ["x"], "additionalProperties": False}),
                                    temperature=0.8, seed=1, max_tokens=20)):
            msgs = [m async for m in stub.Generate(pb.GenerateRequest(text="Answer:", sampling=s))]
            out.append(("".join(m.text for m in msgs), msgs[-1].finish_reason))
        return out

    (regex, r1), (choice, r2), (js, r3) = run(http_server, go)
    assert re.fullmatch("[0-9]{2}-[a-z]{3}", regex) and choice in ("left", "right")
    assert isinstance(json.loads(js)["x"], bool) and (r1, r2, r3) == ("stop", "stop", "stop")


def test_server_reflection_lists_the_service(http_server):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    async def go():
        server, port = await serve(GenerationService(http_server.front), "127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = reflection_pb2_grpc.ServerReflectionStub(ch)
                reqs = [reflection_pb2.ServerReflectionRequest(list_services="")]
                async for r in stub.ServerReflectionInfo(iter(reqs)):
                    return [s.name for s in r.list_services_response.service]
        finally:
            await server.stop(None)

    assert SERVICE_NAME in asyncio.run(go())


def test_a_reused_request_id_does_not_collide(http_server):
    async def go(stub):
        req = pb.GenerateRequest(text="same id twice", request_id="client-1",
                                 sampling=pb.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))

        async def one():
            return [m async for m in stub.Generate(req)]

        return await asyncio.gather(one(), one())

    a, b = run(http_server, go)
    assert [m.text for m in a] and "".join(m.text for m in a) == "".join(m.text for m in b)
    assert {m.request_id for m in a + b} == {"client-1"}  # echoed, while the engine ids differ
    assert a[-1].finish_reason == b[-1].finish_reason == "length"
    assert http_server.admission.inflight == 0


def test_engine_loop_refuses_an_id_already_running(http_server):
    """The mechanism under every ingress: a second submit with a live id fails at once and the
    first request still completes (its queue is not replaced)."""
    from splitserve.types import ConfigError, Request, SamplingParams

    loop = http_server.backend.loop

    async def go():
        req = Request("dup-1", (5, 6, 7), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
        q = await loop.submit(req)
        with pytest.raises(ConfigError, match="already running"):
            await loop.submit(req)
        chunks = []
        while not (chunks and chunks[-1].finished):
            chunks.append(await q.get())
        return chunks

    chunks = asyncio.run(go())
    assert sum(len(c.token_ids) for c in chunks) == 5 and chunks[-1].finish_reason.value == "length"
    http_server.backend.engine.check_invariants()
