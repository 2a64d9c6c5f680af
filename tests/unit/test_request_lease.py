"""One owner per request at the ingress (issue 11, item 3): whatever happens to a request —
client gone before its SSE body starts, gone mid-stream, handler cancelled, a response dropped
without ever being sent, backend error — its admission slot, its outstanding load and its
backend stream are given back exactly once. Backend failures reach clients in the OpenAI error
shape (HTTP) or as a gRPC status, in our words.

The backend here is a scripted fake (no engine, no Ray); the ASGI app is called directly so a
test decides exactly when the client goes away."""

import asyncio
import gc
import json

import grpc
import pytest

from splitserve.router.admission import Admission, AdmissionConfig, Plan
from splitserve.ingress.grpc_service import GenerationService, RpcFailure, serve
from splitserve.ingress.http import OpenAIServer
from splitserve.text.tokenizer import Tokenizer
from splitserve.types import FinishReason, ServiceUnavailable, TokenChunk
from splitserve.v1 import generation_pb2 as pb
from splitserve.v1 import generation_pb2_grpc as pb_grpc

LEAKY = "actor 8f3a pid=4242 at 10.1.2.3: ObjectRef lost"  # what must never reach a client
LOST = "the workers serving this request were lost; please retry"


class ScriptedBackend:
    """Streams `n_tokens` tokens per request (one chunk each), or raises `error` before chunk
    `fail_at`. Counts backend streams opened and closed, and plans made and abandoned."""

    model_name = "fake"
    max_model_len = 4096

    def __init__(self, tokenizer: Tokenizer, n_tokens: int = 3, error: Exception | None = None,
                 fail_at: int = 0, delay_s: float = 0.0) -> None:
        self.tokenizer, self.vocab_size = tokenizer, tokenizer.vocab_size
        self.n_tokens, self.error, self.fail_at, self.delay_s = n_tokens, error, fail_at, delay_s
        self.opened = self.closed = self.planned = self.abandoned = 0

    def ready(self) -> bool:
        return True

    async def plan(self, req) -> Plan:
        self.planned += 1
        return Plan("w0", None, "w0", None)

    def abandon(self, plan: Plan) -> None:
        self.abandoned += 1

    def worker_views(self) -> list:
        return []

    def moves(self):
        return ()

    def autoscale_report(self):
        return None

    async def generate(self, req, plan=None):
        self.opened += 1
        try:
            for i in range(self.n_tokens):
                if self.error is not None and i == self.fail_at:
                    raise self.error
                await asyncio.sleep(self.delay_s)
                last = i == self.n_tokens - 1
                yield TokenChunk(req.request_id, (5 + i % 3,), finish_reason=FinishReason.LENGTH if last else None)
        finally:
            self.closed += 1


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return Tokenizer(tiny_checkpoint("llama"))


def make_server(tokenizer, max_inflight=8, **script) -> tuple[OpenAIServer, ScriptedBackend]:
    backend = ScriptedBackend(tokenizer, **script)
    return OpenAIServer(backend, admission=Admission(AdmissionConfig(max_inflight=max_inflight))), backend


def assert_all_given_back(srv: OpenAIServer, backend: ScriptedBackend, n: int) -> None:
    assert srv.admission.inflight == 0, f"{srv.admission.inflight} admission slots leaked"
    assert srv.admission.outstanding["w0"] == (0, 0)
    assert backend.opened == backend.closed  # every backend stream that ran was closed
    assert backend.abandoned == backend.planned == n  # every plan given back, once


BODY = {"model": "fake", "prompt": "hello there", "max_tokens": 16, "stream": True}


def scope(spec: str = "2.4") -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": spec}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
            "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
            "client": ("127.0.0.1", 1234), "server": ("test", 80)}


def receiver(body: dict, stays: bool = False):
    """The request body, then the client's disconnect (`stays`: a client that waits for its
    answer, whose disconnect never comes)."""
    msgs = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive():
        if msgs:
            return msgs.pop(0)
        if stays:
            await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    return receive


async def gone_at_start(app) -> None:
    """ASGI 2.4: the server's send fails once the client is gone, here on the response start, so
    Starlette never iterates the body."""
    async def send(msg):
        if msg["type"] == "http.response.start":
            raise OSError("connection reset by peer")

    with pytest.raises(Exception):
        await app(scope("2.4"), receiver(BODY), send)


async def disconnect_first(app) -> None:
    """ASGI < 2.4: Starlette listens for the disconnect while it streams; here it is already
    there, so the stream task is cancelled before it begins."""
    async def send(msg):
        await asyncio.sleep(0)

    await app(scope("2.3"), receiver(BODY), send)


async def cancelled_at_start(app) -> None:
    """The server cancels the handler while the response start is being written."""
    started = asyncio.Event()

    async def send(msg):
        started.set()
        await asyncio.Event().wait()  # a client that never reads

    task = asyncio.create_task(app(scope("2.4"), receiver(BODY), send))
    await started.wait()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def gone_mid_stream(app) -> None:
    """The first event reached the client, then it went away: the body was started and its
    backend streams are live."""
    async def send(msg):
        if msg["type"] == "http.response.body" and msg["body"].startswith(b"data: "):
            raise OSError("broken pipe")

    with pytest.raises(Exception):
        await app(scope("2.4"), receiver(BODY), send)


@pytest.mark.parametrize("vanish", [gone_at_start, disconnect_first, cancelled_at_start, gone_mid_stream])
def test_200_streams_whose_clients_vanish_give_every_slot_back(tokenizer, vanish):
    srv, backend = make_server(tokenizer, max_inflight=256, n_tokens=50, delay_s=0.001)

    async def go():
        await asyncio.gather(*[vanish(srv.app) for _ in range(200)])
        assert_all_given_back(srv, backend, 200)  # at once: nothing waits for the garbage collector
        got = []  # the server still admits: no 429 for slots held by clients long gone

        async def send(msg):
            got.append(msg)

        await srv.app({**scope(), "path": "/metrics", "method": "GET", "raw_path": b"/metrics"},
                      receiver({}), send)
        return b"".join(m.get("body", b"") for m in got).decode()

    metrics = asyncio.run(go())
    line = [ln for ln in metrics.splitlines() if ln.startswith('splitserve_requests_total{status="abort",tenant="default"}')]
    assert line and float(line[0].split()[-1]) == 200  # each recorded once


def test_a_response_dropped_without_being_sent_gives_its_slot_back(tokenizer):
    """A middleware (or a server) that builds the response and never calls it."""
    srv, backend = make_server(tokenizer)

    async def go():
        from starlette.requests import Request

        req = Request(scope(), receiver(BODY))
        resp = await srv.completions(req)
        assert srv.admission.inflight == 1
        del resp
        gc.collect()
        assert_all_given_back(srv, backend, 1)

    asyncio.run(go())


def test_a_small_admission_limit_survives_many_vanished_clients(tokenizer):
    srv, backend = make_server(tokenizer, max_inflight=2)

    async def go():
        for _ in range(20):  # sequential: each one is admitted only if the ones before gave back
            await gone_at_start(srv.app)
        assert srv.admission.inflight == 0 and backend.planned == 20

    asyncio.run(go())


# -- failures in the OpenAI error shape ----------------------------------------------------------
async def post(app, body: dict) -> tuple[int, dict, bytes]:
    out = []

    async def send(msg):
        out.append(msg)

    await app(scope(), receiver(body, stays=True), send)
    start = next(m for m in out if m["type"] == "http.response.start")
    headers = {k.decode(): v.decode() for k, v in start["headers"]}
    return start["status"], headers, b"".join(m.get("body", b"") for m in out if m["type"] == "http.response.body")


def sse_events(raw: bytes) -> list:
    return [json.loads(p[6:]) if p != b"data: [DONE]" else "[DONE]" for p in raw.split(b"\n\n") if p]


@pytest.mark.parametrize("error,status,kind,message", [
    (ServiceUnavailable(LOST), 503, "service_unavailable", LOST),
    (RuntimeError(LEAKY), 500, "server_error", None),
])
@pytest.mark.parametrize("fail_at", [0, 2])  # before any token, and mid-stream
def test_backend_failures_answer_in_the_openai_error_shape(tokenizer, error, status, kind, message, fail_at):
    srv, backend = make_server(tokenizer, n_tokens=5, error=error, fail_at=fail_at)

    async def go():
        plain = await post(srv.app, {**BODY, "stream": False, "n": 2})
        streamed = await post(srv.app, BODY)
        return plain, streamed

    (code, headers, body), (scode, _, sbody) = asyncio.run(go())
    err = json.loads(body)["error"]
    assert code == status and headers["content-type"] == "application/json"
    assert err["type"] == kind and set(err) == {"message", "type", "param", "code"}
    events = sse_events(sbody)
    assert scode == 200 and events[-1] == "[DONE]"
    assert events[-2] == {"error": err}  # the same error, as the stream's last event
    assert all("choices" in e for e in events[:-2])  # the tokens before it, nothing after it
    if message is not None:
        assert err["message"] == message
    else:  # our words, not the exception's
        assert "actor" not in err["message"] and "pid" not in err["message"] and "10.1.2.3" not in err["message"]
    assert_all_given_back(srv, backend, 3)


# -- gRPC ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("error,code,message", [
    (ServiceUnavailable(LOST), grpc.StatusCode.UNAVAILABLE, LOST),
    (RuntimeError(LEAKY), grpc.StatusCode.INTERNAL, None),
])
def test_grpc_backend_failures_are_a_status_in_our_words(tokenizer, error, code, message):
    srv, backend = make_server(tokenizer, n_tokens=5, error=error, fail_at=2)

    async def go():
        server, port = await serve(GenerationService(srv.front), "127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                got = []
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for m in pb_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(text="hello")):
                        got.append(m)
                return got, e.value
        finally:
            await server.stop(None)

    got, err = asyncio.run(go())
    assert err.code() == code and len(got) >= 1
    if message is not None:
        assert err.details() == message
    else:
        assert "actor" not in err.details() and "10.1.2.3" not in err.details()
    assert_all_given_back(srv, backend, 1)


def test_grpc_stream_abandoned_mid_way_gives_everything_back(tokenizer):
    """The caller stops reading (cancel): the generator is closed while the backend streams."""
    srv, backend = make_server(tokenizer, n_tokens=50, delay_s=0.001)
    service = GenerationService(srv.front)

    async def go():
        gen = service.generate(pb.GenerateRequest(text="hello"))
        await gen.__anext__()
        assert srv.admission.inflight == 1 and backend.opened == 1
        await gen.aclose()
        assert_all_given_back(srv, backend, 1)
        with pytest.raises(RpcFailure) as e:  # and a refusal before any response holds nothing
            srv.admission.inflight = 10**6
            await service.generate(pb.GenerateRequest(text="hello")).__anext__()
        srv.admission.inflight = 0
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED

    asyncio.run(go())


def test_grpc_call_cancelled_by_its_client_gives_everything_back(tokenizer):
    srv, backend = make_server(tokenizer, n_tokens=10_000, delay_s=0.001)

    async def go():
        server, port = await serve(GenerationService(srv.front), "127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                call = pb_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(text="hello"))
                await call.read()
                call.cancel()
            for _ in range(200):  # the server learns of the cancel on its own time
                if srv.admission.inflight == 0:
                    break
                await asyncio.sleep(0.01)
            assert_all_given_back(srv, backend, 1)
        finally:
            await server.stop(None)

    asyncio.run(go())
