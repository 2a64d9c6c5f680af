"""The OpenAI-compatible HTTP ingress (DESIGN.md §1 step 1): /v1/completions and
/v1/chat/completions (JSON or SSE streaming), /v1/models, /metrics, /health, /ready, and the
OpenAPI document of them all at /openapi.json (`openapi.py`).

Per request: parse and validate (`protocol`), tokenize once, then the shared `Frontend` fans
prompts × n out into engine requests; a `RequestLease` admits and owns them, and this module
answers in OpenAI's shapes. A JSON answer is computed inside the lease; a streamed one hands
the lease to its `LeasedStreamingResponse`, which gives everything back when the ASGI call
ends, however it ends (also when the client left before the body started). A client that
disconnects closes the streams, which aborts its requests in the backend. Every failure the
caller caused is a 4xx in the OpenAI error shape; lost workers are a 503, anything else a 500,
in the same shape (streamed: an `error` event, then `[DONE]`). Each response carries its
timing breakdown: `x-splitserve-<phase>-ms` headers on JSON responses, and
`usage.splitserve_timings_ms` (JSON, and the streamed usage chunk).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import time
import weakref
from typing import Any, AsyncIterator

import anyio
from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from splitserve.text.detokenizer import RequestText
from splitserve.metrics import Metrics
from splitserve.router.admission import Admission
from splitserve.ingress.backend import Backend
from splitserve.ingress.frontend import Choice, Frontend, Prepaid, failure, worst_timings
from splitserve.ingress.lease import RequestLease
from splitserve.ingress.request_span import RequestSpan
from splitserve.ingress.openapi import document
from splitserve.ingress.protocol import (MAX_BODY_BYTES, APIError, ChatRequest, RequestOptions, parse_chat,
                                         parse_completion)
from splitserve.ingress.responses import (ResponseStore, as_messages, call_item, chat_body, message_item, new_id,
                                          output_items, previous, response_object, usage_of)
from splitserve.text import grammar as grammars
from splitserve.text.tool_calls import FirstCallOnly, ToolCall, ToolFormat, chat_inputs, format_for
from splitserve.tenancy import KeyRing, RateLimiter, Tenant
from splitserve.types import ConfigError

MAX_JSON_DEPTH = 400  # what no real request nears, and far below Python's recursion limit


def error_response(e: APIError) -> JSONResponse:
    headers = {"Retry-After": str(e.retry_after_s)} if e.retry_after_s is not None else {}
    if e.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(e.to_dict(), status_code=e.status, headers=headers or None)


async def read_json(request: HTTPRequest) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise APIError(413, f"request body larger than {MAX_BODY_BYTES} bytes")
    body = bytearray()  # appended in place: a body in many small parts costs linear time
    async for part in request.stream():
        body += part
        if len(body) > MAX_BODY_BYTES:
            raise APIError(413, f"request body larger than {MAX_BODY_BYTES} bytes")
    return parse_json(bytes(body))


def parse_json(body: bytes | str) -> Any:
    """A JSON body, nested at most MAX_JSON_DEPTH deep (deeper: a 400, never a RecursionError's 500)."""
    too_deep = APIError(400, f"the JSON body is nested more than {MAX_JSON_DEPTH} levels deep")
    try:
        value = json.loads(body)
    except RecursionError:
        raise too_deep from None
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}") from None
    if json_depth(value) > MAX_JSON_DEPTH:
        raise too_deep
    return value


def json_depth(value: Any) -> int:
    """How deep a parsed JSON value nests (iteratively: no recursion limit to hit)."""
    if not isinstance(value, (dict, list)):
        return 0
    deepest, todo = 0, [(value, 1)]
    while todo:  # containers only: a prompt of 10^5 token ids is one isinstance each, not a push and pop
        v, d = todo.pop()
        deepest = max(deepest, d)
        todo.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v) if isinstance(x, (dict, list)))
    return deepest


def _traced(path: str, operation: str):
    """The handler under its request's root span (ingress/request_span.py), whose context the
    answer returns in `traceparent`; a streamed answer's span ends with its lease."""
    def wrap(handler):
        @functools.wraps(handler)
        async def run(self, request: HTTPRequest) -> Response:
            rs = RequestSpan(f"POST {path}", request.headers.get("traceparent"), {
                "http.request.method": "POST", "url.path": path, "gen_ai.operation.name": operation,
                "gen_ai.request.model": self.backend.model_name})
            try:
                resp = await handler(self, request)
            except BaseException as e:
                rs.fail(e)
                rs.end()
                raise
            finally:
                rs.detach()
            if rs.traceparent:
                resp.headers["traceparent"] = rs.traceparent
            if isinstance(resp, LeasedStreamingResponse):
                resp.lease.span = rs
            else:
                rs.end(resp.status_code)
            return resp

        return run

    return wrap


class OpenAIServer:
    """`keys`: the API keys every route but /health and /ready requires (/metrics too, unless
    the key file opens it); none: the server is open."""

    def __init__(self, backend: Backend, metrics: Metrics | None = None, admission: Admission | None = None,
                 keys: KeyRing | None = None, limiter: RateLimiter | None = None,
                 max_tokens_default: int | None = None, tool_call_parser: str | None = None,
                 responses: ResponseStore | None = None) -> None:
        self.front = Frontend(backend, metrics, admission, keys, limiter, max_tokens_default)
        # how this model writes tool calls: the named parser, else the one its template writes
        self.tool_format = format_for(backend.tokenizer.chat_template, tool_call_parser)
        # /v1/responses' conversations, for previous_response_id (shared through Redis: ingress/shared)
        self.stored = responses or ResponseStore()
        self.backend, self.metrics, self.admission = backend, self.front.metrics, self.front.admission
        self.app = Starlette(routes=[
            Route("/metrics", self.prometheus, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/responses", self.responses, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/ready", self.ready, methods=["GET"]),
            Route("/openapi.json", self.openapi, methods=["GET"]),
        ])
        self._document = document(backend.model_name)

    def _tenant(self, request: HTTPRequest) -> Tenant:
        return self.front.tenant(request.headers.get("authorization"))

    # -- endpoints ------------------------------------------------------------------------------
    async def models(self, request: HTTPRequest) -> JSONResponse:
        try:
            self._tenant(request)
        except APIError as e:
            return error_response(e)
        return JSONResponse({"object": "list", "data": [{"id": self.backend.model_name, "object": "model",
                                                          "owned_by": "splitserve",
                                                          "max_model_len": self.backend.max_model_len}]})

    async def prometheus(self, request: HTTPRequest) -> Response:
        """Every tenant's counters: an operator key's to read (or anyone's with metrics_open, or
        on a server without keys)."""
        keys = self.front.keys
        try:
            if not keys.metrics_open and not keys.open:
                self._tenant(request)
                if not keys.is_operator(request.headers.get("authorization")):
                    raise APIError(403, "reading /metrics needs an operator key (operator: true in the key file): "
                                        "it holds every tenant's counters", code="permission_denied")
        except APIError as e:
            return error_response(e)
        self.front.export_worker_gauges()
        return Response(self.metrics.exposition(), media_type="text/plain; version=0.0.4")

    async def openapi(self, request: HTTPRequest) -> JSONResponse:
        try:
            self._tenant(request)
        except APIError as e:
            return error_response(e)
        return JSONResponse(self._document)

    async def health(self, _: HTTPRequest) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def ready(self, _: HTTPRequest) -> JSONResponse:
        if not self.backend.ready():
            return error_response(APIError(503, "not ready: workers are still loading"))
        return JSONResponse({"status": "ready"})

    @_traced("/v1/completions", "text_completion")
    async def completions(self, request: HTTPRequest) -> Response:
        try:
            tenant = self._tenant(request)
            req = parse_completion(await read_json(request), [self.backend.model_name], self.front.defaults)
            paid = await self.front.prepay(tenant, len(req.prompts) * req.options.params.n)
            prompts = await self.front.encode_all(req.prompts)
        except APIError as e:
            return error_response(e)
        return await self._serve(request, "text_completion", req.options.for_tenant(tenant), prompts, paid,
                                 echo=req.echo)

    @_traced("/v1/chat/completions", "chat")
    async def chat(self, request: HTTPRequest) -> Response:
        try:
            tenant = self._tenant(request)
            req = parse_chat(await read_json(request), [self.backend.model_name], self.front.defaults)
            paid = await self.front.prepay(tenant, req.options.params.n)
            opts, prompts, tools = await asyncio.to_thread(self._chat_prompt, req, tenant)  # off the loop
        except APIError as e:
            return error_response(e)
        return await self._serve(request, "chat.completion", opts, prompts, paid, echo=False, tools=tools)

    def _chat_prompt(self, req: ChatRequest, tenant: Tenant) -> tuple[RequestOptions, list, ToolFormat | None]:
        """A chat's options (a forced tool call as its grammar), its prompt, and how its calls
        are read back (None: no tools offered)."""
        tools = req.tools.tools if req.tools else None
        msgs, extra = chat_inputs(req.messages, tools, self.backend.tokenizer.chat_template)
        try:
            ids = self.backend.tokenizer.encode_chat(msgs, **extra)
        except ConfigError as e:
            raise APIError(400, str(e), "messages") from None
        prompts = [self.front.check_ids(tuple(ids), "messages")]
        if not tools:
            return req.options.for_tenant(tenant), prompts, None
        fmt = self.tool_format if req.tools.parallel else FirstCallOnly(self.tool_format)
        return self._forced_call(req, fmt).for_tenant(tenant), prompts, fmt

    @_traced("/v1/responses", "chat")
    async def responses(self, request: HTTPRequest) -> Response:
        """POST /v1/responses (ingress/responses.py): the chat path, answered as output items."""
        try:
            tenant = self._tenant(request)
            body = await read_json(request)
            chat, conversation = chat_body(body, await previous(body, self.stored, tenant.name))
            stream = body.get("stream", False)
            if not isinstance(stream, bool):
                raise APIError(400, "'stream': must be a boolean", "stream")
            req = parse_chat(chat, [self.backend.model_name], self.front.defaults)
            paid = await self.front.prepay(tenant, req.options.params.n)
            opts, prompts, tools = await asyncio.to_thread(self._chat_prompt, req, tenant)  # off the loop
            _, choices, reqs = self.front.requests(opts, prompts)
        except APIError as e:
            return error_response(e)
        choices[0].tools = tools
        turn = ResponseTurn(new_id("resp"), body, chat, conversation, choices[0], tools, tenant.name)
        try:
            async with RequestLease(self.front, opts, reqs, choices, paid) as lease:
                if stream:
                    return LeasedStreamingResponse(lease, self._response_events(turn, lease))
                if not await _run_to_end(request, lease.streams):
                    return Response(status_code=499)
        except Exception as e:  # refused or failed; the lease has given everything back
            return error_response(failure(e))
        return JSONResponse(await self._finish_turn(turn, turn.final_output()))

    async def _finish_turn(self, turn: "ResponseTurn", output: list[dict]) -> dict:
        c = turn.choice
        done = "incomplete" if c.text.finish_reason is not None and c.text.finish_reason.value == "length" else "completed"
        obj = response_object(turn.id, turn.body, turn.chat, output,
                              usage_of(len(c.prompt_ids), len(c.text.token_ids), c.text.num_cached_tokens), done)
        if turn.body.get("store", True) is not False:
            await self.stored.put(turn.tenant, turn.id, list(turn.conversation) + as_messages(output))
        return obj

    async def _response_events(self, turn: "ResponseTurn", lease: RequestLease) -> AsyncIterator[bytes]:
        """The typed events of a streamed response: created; the message's text deltas as they
        come (held back where a tool call may begin); each call, name then arguments; completed."""
        seq = iter(range(1 << 62))

        def event(kind: str, **fields: Any) -> bytes:
            return _sse({"type": kind, "sequence_number": next(seq), **fields})

        yield event("response.created", response=response_object(turn.id, turn.body, turn.chat, [], None, "in_progress"))
        try:
            async for _ in lease.streams[0]:
                for e in turn.text_events(turn.choice.take_text(), event):
                    yield e
        except Exception as e:  # as in chat: an error event, never a broken stream
            yield _sse({"type": "error", "sequence_number": next(seq), **failure(e).to_dict()["error"]})
            return
        for e in turn.final_events(event):
            yield e
        yield event("response.completed", response=await self._finish_turn(turn, turn.output))

    def _forced_call(self, req: ChatRequest, fmt: ToolFormat) -> RequestOptions:
        """A chat's options, with tool_choice required (or a named function) as a grammar that
        only a valid call of those tools satisfies."""
        if req.tools is None or not req.tools.forced:
            return req.options
        spec = fmt.grammar(req.tools.forced, req.tools.parallel)
        try:
            grammars.check(spec)
        except ConfigError as e:
            raise APIError(400, f"'tools': the functions' parameters cannot constrain a call: {e}", "tools") from None
        params = dataclasses.replace(req.options.params, grammar=spec)
        return dataclasses.replace(req.options, params=params)

    # -- shared ---------------------------------------------------------------------------------
    async def _serve(self, request: HTTPRequest, kind: str, opts: RequestOptions, prompts, paid: Prepaid,
                     echo: bool, tools: ToolFormat | None = None) -> Response:
        try:
            rid, choices, reqs = self.front.requests(opts, prompts)
        except APIError as e:
            return error_response(e)
        for c in choices:
            c.tools = tools
        try:
            async with RequestLease(self.front, opts, reqs, choices, paid) as lease:
                if opts.stream:
                    return LeasedStreamingResponse(lease, self._sse(kind, rid, opts, lease))
                if not await _run_to_end(request, lease.streams):
                    return Response(status_code=499)  # nginx's "client closed request": nobody reads it
        except Exception as e:  # refused or failed; the lease has given everything back
            return error_response(failure(e))
        timings = worst_timings(choices)
        headers = {f"x-splitserve-{k.replace('_', '-')}-ms": f"{v * 1e3:.1f}" for k, v in timings.items()}
        return JSONResponse(self._full_body(kind, rid, opts, choices, echo), headers=headers)

    async def _sse(self, kind: str, rid: str, opts: RequestOptions, lease: RequestLease) -> AsyncIterator[bytes]:
        """The events of one streamed answer. Only its pumps are its own: the streams and the
        slots belong to the lease, which the response closes after this ends."""
        created, queue, choices = int(time.time()), asyncio.Queue(), lease.choices

        async def pump(i: int) -> None:
            try:
                async for _ in lease.streams[i]:
                    await queue.put(i)
            except Exception as e:  # surfaced as an error event, never a broken stream
                await queue.put(e)
            await queue.put(None)

        tasks = [asyncio.create_task(pump(i)) for i in range(len(lease.streams))]
        live, failed = len(tasks), False
        try:
            while live and not failed:
                item = await queue.get()
                if item is None:
                    live -= 1
                elif isinstance(item, Exception):
                    # As in a JSON answer, one failed choice ends the whole answer; the lease
                    # aborts the others.
                    failed = True
                    yield _sse(failure(item).to_dict())
                else:
                    for event in self._deltas(kind, rid, created, choices[item]):
                        yield _sse(event)
            if opts.include_usage and not failed:
                yield _sse({"id": rid, "object": _chunk_kind(kind), "created": created, "model": opts.model,
                            "choices": [], "usage": _usage(choices)})
            yield b"data: [DONE]\n\n"
        finally:  # done, failed, or the client went away: nobody iterates a stream after this
            for t in tasks:
                t.cancel()
            with anyio.CancelScope(shield=True):  # a second cancel must not leave a pump running
                await asyncio.gather(*tasks, return_exceptions=True)

    def _deltas(self, kind: str, rid: str, created: int, c: Choice) -> list[dict]:
        """The chunks this choice's new output makes: its new text; at its end in a chat with
        tools, the calls it made — for each, its name first, then its arguments — and
        finish_reason tool_calls."""
        t = c.text
        new = c.take_text()
        reason = t.finish_reason.value if t.finished else None
        calls: list[ToolCall] = []
        if t.finished and c.tools is not None:
            content, calls = c.tools.parse(t.text)
            if calls:  # the text before the calls, past what was streamed already
                new, reason = content[len(t.text) - len(new):], ("tool_calls" if reason == "stop" else reason)
        if not new and reason is None:
            return []
        wrap = lambda choice: {"id": rid, "object": _chunk_kind(kind), "created": created,  # noqa: E731
                               "model": self.backend.model_name, "choices": [choice]}
        if kind != "chat.completion":
            return [wrap({"index": c.index, "text": new, "finish_reason": reason})]
        out = [wrap({"index": c.index, "delta": {"role": "assistant", "content": new}, "finish_reason": None})] if new else []
        for i, call in enumerate(calls):
            call = call.with_id()
            head = {"index": i, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
            out.append(wrap({"index": c.index, "delta": {"tool_calls": [head]}, "finish_reason": None}))
            args = {"index": i, "function": {"arguments": call.arguments}}
            out.append(wrap({"index": c.index, "delta": {"tool_calls": [args]}, "finish_reason": None}))
        if reason is not None:
            out.append(wrap({"index": c.index, "delta": {}, "finish_reason": reason}))
        return out

    def _full_body(self, kind, rid, opts, choices: list[Choice], echo: bool) -> dict:
        out = []
        for c in choices:
            t = c.text
            reason = t.finish_reason.value if t.finish_reason else None
            if kind == "chat.completion":
                message, reason = _message(c, reason)
                out.append({"index": c.index, "message": message,
                            "logprobs": _chat_logprobs(t, self.backend.tokenizer), "finish_reason": reason})
            else:
                prefix = self.backend.tokenizer.decode(c.prompt_ids) if echo else ""
                out.append({"index": c.index, "text": prefix + t.text, "logprobs": _cmpl_logprobs(t, self.backend.tokenizer),
                            "finish_reason": reason, "stop_reason": t.stop_reason})
        return {"id": rid, "object": kind, "created": int(time.time()), "model": opts.model, "choices": out,
                "usage": _usage(choices)}


class ResponseTurn:
    """One /v1/responses answer being built: its text streamed so far and its output items."""

    def __init__(self, rid: str, body: dict, chat: dict, conversation: list, choice: Choice,
                 tools: ToolFormat | None, tenant: str) -> None:
        self.id, self.body, self.chat, self.conversation = rid, body, chat, conversation
        self.choice, self.tools, self.tenant = choice, tools, tenant
        self.streamed, self.message_id, self.output = "", None, []

    def final_output(self) -> list[dict]:
        content, calls = self.tools.parse(self.choice.text.text) if self.tools else (self.choice.text.text, [])
        self.output = output_items(content, calls)
        return self.output

    def _open_message(self, event) -> list[bytes]:
        if self.message_id is not None:
            return []
        self.message_id = new_id("msg")
        return [event("response.output_item.added", output_index=0, item=message_item(self.message_id, "", "in_progress")),
                event("response.content_part.added", item_id=self.message_id, output_index=0, content_index=0,
                      part={"type": "output_text", "text": "", "annotations": []})]

    def text_events(self, new: str, event) -> list[bytes]:
        if not new:
            return []
        out = self._open_message(event)
        self.streamed += new
        out.append(event("response.output_text.delta", item_id=self.message_id, output_index=0, content_index=0,
                         delta=new, logprobs=[]))
        return out

    def final_events(self, event) -> list[bytes]:
        text = self.choice.text.text
        content, calls = self.tools.parse(text) if self.tools else (text, [])
        out = self.text_events(content[len(self.streamed):] if calls else text[len(self.streamed):], event)
        if not calls:
            out += self._open_message(event)  # an empty answer is still one (empty) message
        self.output = []
        if self.message_id is not None:
            part = {"type": "output_text", "text": self.streamed, "annotations": [], "logprobs": []}
            item = message_item(self.message_id, self.streamed, "completed")
            out += [event("response.output_text.done", item_id=self.message_id, output_index=0, content_index=0,
                          text=self.streamed, logprobs=[]),
                    event("response.content_part.done", item_id=self.message_id, output_index=0, content_index=0,
                          part=part),
                    event("response.output_item.done", output_index=0, item=item)]
            self.output.append(item)
        for call in calls:
            call, index, item_id = call.with_id(), len(self.output), new_id("fc")
            out += [event("response.output_item.added", output_index=index,
                          item={**call_item(item_id, call, "in_progress"), "arguments": ""}),
                    event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                          delta=call.arguments),
                    event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                          arguments=call.arguments),
                    event("response.output_item.done", output_index=index, item=call_item(item_id, call, "completed"))]
            self.output.append(call_item(item_id, call, "completed"))
        return out


class LeasedStreamingResponse(StreamingResponse):
    """An SSE answer that owns its request's lease. Starlette may never start the body (the
    client left before the response started: a failed send, a disconnect seen first, a cancel)
    or never finish it, and then no code in the body runs; so the lease is closed when this
    response's ASGI call ends, however it ends — or, for a response dropped without ever being
    called, when it is collected (nothing can have started then: releasing the slots is all)."""

    def __init__(self, lease: RequestLease, body: AsyncIterator[bytes]) -> None:
        super().__init__(body, media_type="text/event-stream")
        self.lease = lease.hand_over()
        weakref.finalize(self, lease.release)  # a no-op once the lease is closed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:  # the body first: its own cleanup stops its pumps, so nobody iterates a stream
                with anyio.CancelScope(shield=True):
                    await self.body_iterator.aclose()
            finally:
                await self.lease.aclose()


async def _run_to_end(request: HTTPRequest, streams: list[AsyncIterator[None]]) -> bool:
    """Drive every stream to its end; False if the client left first. A failing stream raises
    (the caller's lease then aborts the others). Not every server cancels a handler whose
    client left (uvicorn does not): watch for it, so nobody's tokens are generated for nobody."""
    tasks = [asyncio.ensure_future(_drain(s)) for s in streams]
    gone = asyncio.ensure_future(_until_disconnected(request))
    work = asyncio.gather(*tasks)
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done() and gone.exception() is None:
            return False
        await work  # (a receive() that failed says nothing about the client: keep waiting)
        return True
    finally:  # done, failed, cancelled or abandoned: nobody iterates a stream once this returns
        for t in (*tasks, gone):
            t.cancel()
        await asyncio.gather(*tasks, gone, work, return_exceptions=True)


async def _until_disconnected(request: HTTPRequest) -> None:
    """Returns once the client has gone. The body has been read, so the next ASGI message is
    the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _drain(stream: AsyncIterator[None]) -> None:
    async for _ in stream:
        pass


def _message(c: Choice, reason: str | None) -> tuple[dict, str | None]:
    """A chat choice's message, and its finish reason: tool_calls when it called tools."""
    text = c.text.text
    calls = c.tools.parse(text)[1] if c.tools is not None else []
    if not calls:
        return {"role": "assistant", "content": text}, reason
    content = c.tools.parse(text)[0]
    return ({"role": "assistant", "content": content or None,
             "tool_calls": [{"id": k.id, "type": "function", "function": {"name": k.name, "arguments": k.arguments}}
                            for k in (call.with_id() for call in calls)]},
            "tool_calls" if reason == "stop" else reason)


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _chunk_kind(kind: str) -> str:
    return "chat.completion.chunk" if kind == "chat.completion" else "text_completion"


def _usage(choices: list[Choice]) -> dict:
    # Each prompt counts once however many samples (n) continue it — identical prompts included.
    prompt = sum(len(c.prompt_ids) for c in {c.prompt_index: c for c in choices}.values())
    completion = sum(len(c.text.token_ids) for c in choices)
    cached = sum(c.text.num_cached_tokens for c in choices)
    timings = {k: round(v * 1e3, 1) for k, v in worst_timings(choices).items()}
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}, "splitserve_timings_ms": timings}


def _cmpl_logprobs(t: RequestText, tok) -> dict | None:
    if t.params.logprobs is None:
        return None
    toks = [tok.decode([lp.token_id], skip_special_tokens=False) for lp in t.logprobs]
    return {"tokens": toks, "token_logprobs": [lp.logprob for lp in t.logprobs],
            "top_logprobs": [{tok.decode([i], skip_special_tokens=False): v for i, v in lp.top} for lp in t.logprobs],
            "text_offset": _offsets(toks)}


def _chat_logprobs(t: RequestText, tok) -> dict | None:
    if t.params.logprobs is None:
        return None

    def entry(i: int, v: float) -> dict:
        s = tok.decode([i], skip_special_tokens=False)
        return {"token": s, "logprob": v, "bytes": list(s.encode())}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
                        for lp in t.logprobs]}


def _offsets(toks: list[str]) -> list[int]:
    out, pos = [], 0
    for s in toks:
        out.append(pos)
        pos += len(s)
    return out
