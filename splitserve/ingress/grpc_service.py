"""The gRPC ingress (DESIGN.md §1 step 1): `splitserve.v1.Generation` from
protos/splitserve/v1/generation.proto (Python code generated at build time into splitserve.v1).

`GenerationService` is transport-neutral: it turns a `GenerateRequest` into the same validated
options the HTTP API builds (the proto is mapped onto an OpenAI completion body and goes through
`protocol.parse_completion`, so both ingresses accept and refuse exactly the same things), then
admits and drives the request through the shared `Frontend`, under one `RequestLease` that
owns its admission slot and backend stream until the call ends, however it ends (finished,
failed, cancelled by the caller). Failures are `RpcFailure`s with the gRPC status the caller
should see: INVALID_ARGUMENT (bad input), NOT_FOUND (unknown model), RESOURCE_EXHAUSTED
(admission; "retry-after" in the trailing metadata), UNAVAILABLE (not ready, or its workers
were lost), INTERNAL (anything else, in general words: `frontend.failure`). Two hosts run it:
`serve()` below (a standalone grpc.aio server with reflection, for the in-process server) and
the Ray Serve ingress deployment (Serve's gRPC proxy, reflection on).
"""

from __future__ import annotations

from typing import Any, AsyncIterator

import grpc

from splitserve.ingress.frontend import Choice, Frontend, failure
from splitserve.ingress.lease import RequestLease
from splitserve.ingress.request_span import RequestSpan
from splitserve.ingress.protocol import MAX_BODY_BYTES, MAX_REQUEST_ID_CHARS, APIError, parse_completion
from splitserve.v1 import generation_pb2 as pb
from splitserve.v1 import generation_pb2_grpc as pb_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
_STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED, 404: grpc.StatusCode.NOT_FOUND,
           413: grpc.StatusCode.INVALID_ARGUMENT,
           429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE}
_PRIORITY = {pb.PRIORITY_CRITICAL: "critical", pb.PRIORITY_STANDARD: "standard", pb.PRIORITY_SHEDDABLE: "sheddable"}
_OPTIONAL = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
             "seed", "min_tokens", "logprobs")


class RpcFailure(Exception):
    def __init__(self, code: grpc.StatusCode, details: str, retry_after_s: float | None = None) -> None:
        super().__init__(details)
        self.code, self.details, self.retry_after_s = code, details, retry_after_s

    def __reduce__(self):  # crosses processes under Ray Serve (replica → gRPC proxy)
        return type(self), (self.code, self.details, self.retry_after_s)

    @classmethod
    def of(cls, e: APIError) -> "RpcFailure":
        return cls(_STATUS.get(e.status, grpc.StatusCode.INTERNAL), e.message, e.retry_after_s)

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return () if self.retry_after_s is None else (("retry-after", str(int(self.retry_after_s))),)


def completion_body(req: pb.GenerateRequest, served_model: str) -> dict[str, Any]:
    """The OpenAI completion body this request means (set fields only)."""
    s = req.sampling
    body: dict[str, Any] = {"model": req.model or served_model,
                            "max_tokens": s.max_tokens if s.HasField("max_tokens") else None}
    which = req.WhichOneof("input")
    if which == "text":
        body["prompt"] = req.text
    elif which == "token_ids":
        body["prompt"] = list(req.token_ids.ids)
    for name in _OPTIONAL:
        if s.HasField(name):
            body[name] = getattr(s, name)
    if s.stop:
        body["stop"] = list(s.stop)
    if s.stop_token_ids:
        body["stop_token_ids"] = list(s.stop_token_ids)
    body["ignore_eos"] = s.ignore_eos
    constraint = s.WhichOneof("constraint")
    if constraint is not None:  # the same checks as HTTP's vLLM-style structured_outputs
        value = getattr(s, constraint)
        body["structured_outputs"] = {"json" if constraint == "json_schema" else constraint:
                                      list(value.options) if constraint == "choice" else value}
    if s.logit_bias:
        body["logit_bias"] = {str(k): v for k, v in s.logit_bias.items()}
    if req.priority != pb.PRIORITY_UNSPECIFIED:
        body["priority"] = _PRIORITY.get(req.priority, f"unknown ({req.priority})")
    for name in ("ttft_slo_ms", "tpot_slo_ms"):
        if req.HasField(name):
            body[name] = getattr(req, name)
    if req.user:
        body["user"] = req.user
    return body


class GenerationService:
    def __init__(self, front: Frontend) -> None:
        self.front = front

    def health(self) -> pb.HealthResponse:
        return pb.HealthResponse(ready=bool(self.front.backend.ready()), model=self.front.backend.model_name)

    async def generate(self, request: pb.GenerateRequest, authorization: str | None = None
                       ) -> AsyncIterator[pb.GenerateResponse]:
        """The responses of one generation; raises RpcFailure before the first one if refused,
        or after some if the generation failed. `authorization`: the call's `authorization`
        metadata ("Bearer KEY"), required when the server has keys."""
        front = self.front
        try:
            tenant = front.tenant(authorization)
            if len(request.request_id) > MAX_REQUEST_ID_CHARS:
                raise APIError(400, f"'request_id': at most {MAX_REQUEST_ID_CHARS} characters", "request_id")
            if not front.backend.ready():
                raise APIError(503, "not ready: workers are still loading")
            parsed = parse_completion(completion_body(request, front.backend.model_name), [front.backend.model_name],
                                      front.defaults)
            paid = await front.prepay(tenant, parsed.options.params.n)
            (prompt,) = await front.encode_all(parsed.prompts[:1])
            opts = parsed.options.for_tenant(tenant)
            # Engine ids are always fresh (a client reusing its request_id while the first call
            # runs must not collide with it on the workers); the client's id is only echoed.
            rid, choices, reqs = front.requests(opts, [prompt])
        except APIError as e:
            raise RpcFailure.of(e) from None
        echo_id = request.request_id or rid
        try:
            async with RequestLease(front, opts, reqs, choices, paid) as lease:
                async for _ in lease.streams[0]:
                    msg = _delta(choices[0], echo_id)
                    if msg is not None:
                        yield msg
        except Exception as e:  # refused (admission) or failed; the lease has given everything back
            raise RpcFailure.of(failure(e)) from None


    async def generate_traced(self, request: pb.GenerateRequest, metadata, trailing: list
                              ) -> AsyncIterator[pb.GenerateResponse]:
        """`generate` under the call's request span (ingress/request_span.py): a child of the
        call's `traceparent` metadata, whose own `traceparent` is added to `trailing` (the
        call's trailing metadata). `metadata`: the call's invocation metadata."""
        rs = RequestSpan("splitserve.v1.Generation/Generate", metadata_value(metadata, "traceparent"), {
            "rpc.system": "grpc", "rpc.service": "splitserve.v1.Generation", "rpc.method": "Generate",
            "gen_ai.operation.name": "text_completion", "gen_ai.request.model": self.front.backend.model_name})
        if rs.traceparent:
            trailing.append(("traceparent", rs.traceparent))
        try:
            async for msg in self.generate(request, metadata_value(metadata, "authorization")):
                yield msg
        except RpcFailure as f:
            rs.fail(f)
            raise
        finally:
            rs.detach()
            rs.end()


def _delta(c: Choice, rid: str) -> pb.GenerateResponse | None:
    """What the choice added since the last message: new token ids, logprobs and text (holding
    back what a stop string might still claim); on the last one, finish reason, usage, timings."""
    t = c.text
    text = c.take_text()
    sent = c.ids_sent
    ids, c.ids_sent = t.token_ids[sent:], len(t.token_ids)
    if not ids and not text and not t.finished:
        return None
    msg = pb.GenerateResponse(token_ids=ids, text=text, request_id=rid)
    if t.params.logprobs is not None:
        msg.logprobs.extend(pb.TokenLogprob(logprob=lp.logprob, top=[pb.TopLogprob(token_id=i, logprob=v)
                                                                      for i, v in lp.top])
                            for lp in t.logprobs[sent:])
    if t.finished:
        msg.finish_reason = t.finish_reason.value
        msg.usage.CopyFrom(pb.Usage(prompt_tokens=len(c.prompt_ids), completion_tokens=len(t.token_ids),
                                    cached_tokens=t.num_cached_tokens))
        times = c.timings()
        msg.timings.CopyFrom(pb.Timings(**{f"{k}_s": v for k, v in times.items()}))
    return msg


class _Servicer(pb_grpc.GenerationServicer):
    """grpc.aio host of the service (the standalone server)."""

    def __init__(self, service: GenerationService) -> None:
        self.service = service

    async def Generate(self, request, context):  # noqa: N802 (gRPC method name)
        trailing: list = []
        try:
            async for msg in self.service.generate_traced(request, context.invocation_metadata(), trailing):
                yield msg
            context.set_trailing_metadata(tuple(trailing))
        except RpcFailure as f:
            context.set_trailing_metadata(f.trailing_metadata() + tuple(trailing))
            await context.abort(f.code, f.details)

    async def Health(self, request, context):  # noqa: N802
        return self.service.health()


def metadata_value(metadata, key: str) -> str | None:
    """The `key` value of a call's metadata (keys arrive lower-cased), or None."""
    return next((v for k, v in metadata or () if k.lower() == key), None)


def authorization(metadata) -> str | None:
    return metadata_value(metadata, "authorization")


async def serve(service: GenerationService, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """Start a grpc.aio server for `service` with server reflection; returns it started and the
    port it listens on (`port` 0: a free one)."""
    from grpc_reflection.v1alpha import reflection

    # a message is bounded like an HTTP body: gRPC's default would take 2 GiB before our checks
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_BODY_BYTES)])
    pb_grpc.add_GenerationServicer_to_server(_Servicer(service), server)
    reflection.enable_server_reflection((SERVICE_NAME, reflection.SERVICE_NAME), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"gRPC: cannot listen on {host}:{port}")
    await server.start()
    return server, bound
