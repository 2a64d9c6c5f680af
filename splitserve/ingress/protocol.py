"""The OpenAI-compatible request surface (DESIGN.md §1 step 1): JSON bodies of
/v1/completions and /v1/chat/completions turned into small typed requests, or an `APIError`
carrying the OpenAI error shape and the right HTTP status. Nothing here does I/O, so the HTTP
and gRPC ingresses and the tests share exactly this validation.

Bad input is always a 4xx with a message naming the parameter: wrong types (a bool is not an
integer), NaN or out-of-range numbers, unknown models (404), unsupported parameters.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from splitserve.ingress.structured import StructuredError, grammar_of, logit_bias_of
from splitserve.tenancy.keys import OPEN, Tenant
from splitserve.text.tool_calls import Tool, tools_of
from splitserve.types import ConfigError, Priority, SamplingParams

Prompt = str | tuple[int, ...]

# One API request fans out into prompts × n engine requests before admission sees any of them:
# bounded, so a body cannot turn into thousands of requests.
MAX_BODY_BYTES = 8 << 20  # an HTTP body, and a gRPC message (the in-process server, and Serve's proxy: cli.serve)
MAX_N = 128
MAX_PROMPTS = 256
MAX_FANOUT = 256
# Every other list and string a request carries is bounded too, before any work is spent on it
# (a million stop_token_ids would cost every co-batched request a set of them per step).
MAX_STOP = 16  # stop strings
MAX_STOP_CHARS = 1024  # each
MAX_STOP_TOKEN_IDS = 256
MAX_MESSAGES = 4096
MAX_USER_CHARS = 256
MAX_REQUEST_ID_CHARS = 128  # gRPC's request_id, echoed in every message


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None,
                 code: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after
        self.message = message
        self.param = param
        self.type = type_ or {400: "invalid_request_error", 401: "invalid_request_error", 403: "permission_error",
                              404: "not_found_error",
                              413: "invalid_request_error",
                              429: "rate_limit_error", 503: "service_unavailable"}.get(status, "server_error")
        self.code = code

    @property
    def retry_after_s(self) -> int | None:
        """For a 429 or 503: whole seconds to wait, at least 1 (HTTP Retry-After, gRPC retry-after)."""
        return max(1, math.ceil(self.retry_after or 1)) if self.status in (429, 503) else None

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class RequestDefaults:
    """What a request that omits them gets. `sampling`: the model's recommended sampling
    parameters (generation_config.json). `max_tokens`: the most a chat completion (or a request
    with `max_tokens: null`) generates — the server's default, else the model's `max_new_tokens`;
    None: up to the context. Legacy completions keep OpenAI's 16 unless the server sets one."""

    sampling: Mapping[str, float] = dataclasses.field(default_factory=dict)
    max_tokens: int | None = None
    completion_max_tokens: int = 16

    @classmethod
    def of(cls, sampling: Mapping[str, float], model_max_tokens: int | None,
           server_max_tokens: int | None) -> "RequestDefaults":
        return cls(dict(sampling), server_max_tokens or model_max_tokens, server_max_tokens or 16)


NO_DEFAULTS = RequestDefaults()


@dataclass(frozen=True)
class RequestOptions:
    """What every generation request carries besides its prompt."""

    model: str
    params: SamplingParams
    stream: bool
    include_usage: bool
    user: str | None
    priority: Priority
    ttft_slo_ms: float | None
    tpot_slo_ms: float | None
    max_tokens_given: bool = False  # the client set max_tokens (a default fills what the context leaves)
    tenant: Tenant = OPEN

    def for_tenant(self, tenant: Tenant) -> "RequestOptions":
        """These options as `tenant` may have them: its priority at most."""
        return dataclasses.replace(self, tenant=tenant, priority=tenant.cap(self.priority))


@dataclass(frozen=True)
class CompletionRequest:
    prompts: tuple[Prompt, ...]
    options: RequestOptions
    echo: bool


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools and what it asks of them (`tool_choice`)."""

    tools: tuple[Tool, ...]
    choice: str = "auto"  # auto | required | none | function (a named one)
    function: str | None = None
    parallel: bool = True

    @property
    def forced(self) -> tuple[Tool, ...]:
        """The tools the answer must call one of (required, or a named function); () for auto."""
        if self.choice == "required":
            return self.tools
        return tuple(t for t in self.tools if t.name == self.function) if self.choice == "function" else ()


@dataclass(frozen=True)
class ChatRequest:
    messages: tuple[dict[str, Any], ...]
    options: RequestOptions
    logprobs: bool
    tools: ToolRequest | None = None  # None: no tools offered (or tool_choice none)


def _bad(param: str, msg: str) -> APIError:
    return APIError(400, f"'{param}': {msg}", param)


def _get(body: dict, name: str, kinds: tuple[type, ...], default: Any = None) -> Any:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in kinds:
        raise _bad(name, f"expected {' or '.join(k.__name__ for k in kinds)}, got a boolean")
    if not isinstance(v, kinds):
        raise _bad(name, f"expected {' or '.join(k.__name__ for k in kinds)}, got {type(v).__name__}")
    if isinstance(v, float) and not math.isfinite(v):
        raise _bad(name, f"must be a finite number, got {v}")
    return v


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP:
        raise _bad("stop", f"expected a non-empty string or a list of at most {MAX_STOP} non-empty strings")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise _bad("stop", f"each stop string is at most {MAX_STOP_CHARS} characters")
    return tuple(stop)


def _int_list(v: Any, name: str, most: int | None = None) -> tuple[int, ...]:
    """`most`: how many it may hold (None: a prompt's ids, bounded by the context later)."""
    if not isinstance(v, list):
        raise _bad(name, "expected a list of integers")
    if most is not None and len(v) > most:
        raise _bad(name, f"at most {most} entries, got {len(v)}")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise _bad(name, "expected a list of integers")
    return tuple(v)


def _user(body: dict) -> str | None:
    user = _get(body, "user", (str,))
    if user is not None and len(user) > MAX_USER_CHARS:
        raise _bad("user", f"at most {MAX_USER_CHARS} characters")
    return user


_NUM = (int, float)
_UNSUPPORTED = ("suffix", "functions", "function_call")  # the latter two: legacy; tools replace them


def _options(body: dict, served: Sequence[str], logprobs: int | None, max_tokens: int | None,
             max_tokens_given: bool, defaults: Mapping[str, float]) -> RequestOptions:
    """`defaults`: RequestDefaults.sampling."""
    model = _get(body, "model", (str,))
    if model is None:
        raise _bad("model", "is required")
    if model not in served:
        raise APIError(404, f"The model '{model}' does not exist; served: {', '.join(served)}", "model",
                       code="model_not_found")
    for name in _UNSUPPORTED:
        if body.get(name) not in (None, [], {}):
            raise _bad(name, "is not supported")
    n = _get(body, "n", (int,), 1)
    if not 1 <= n <= MAX_N:
        raise _bad("n", f"must be between 1 and {MAX_N}, got {n}")
    best_of = _get(body, "best_of", (int,), n)
    if best_of != n:
        raise _bad("best_of", "only best_of == n is supported")
    stream = _get(body, "stream", (bool,), False)
    so = _get(body, "stream_options", (dict,), {})
    if so and not stream:
        raise _bad("stream_options", "is only allowed with stream: true")
    def sampled(name: str, fallback: float) -> float:  # the body's, else the model's recommendation
        return float(_get(body, name, _NUM, defaults.get(name, fallback)))

    try:
        grammar, logit_bias = grammar_of(body), logit_bias_of(body)
    except StructuredError as e:
        raise _bad(e.param, str(e)) from None

    try:
        params = SamplingParams(
            n=n, temperature=sampled("temperature", 1.0), top_p=sampled("top_p", 1.0),
            top_k=int(_get(body, "top_k", (int,), defaults.get("top_k", 0))), min_p=sampled("min_p", 0.0),
            presence_penalty=float(_get(body, "presence_penalty", _NUM, 0.0)),
            frequency_penalty=float(_get(body, "frequency_penalty", _NUM, 0.0)),
            repetition_penalty=sampled("repetition_penalty", 1.0),
            seed=_get(body, "seed", (int,)), max_tokens=max_tokens, min_tokens=_get(body, "min_tokens", (int,), 0),
            stop=_stop(body), stop_token_ids=_int_list(body.get("stop_token_ids") or [], "stop_token_ids",
                                                         MAX_STOP_TOKEN_IDS),
            ignore_eos=_get(body, "ignore_eos", (bool,), False),
            include_stop_str_in_output=_get(body, "include_stop_str_in_output", (bool,), False),
            logprobs=logprobs, skip_special_tokens=_get(body, "skip_special_tokens", (bool,), True),
            grammar=grammar, logit_bias=logit_bias)
    except ConfigError as e:
        raise APIError(400, str(e), str(e).split(" ", 1)[0]) from None
    return RequestOptions(model, params, stream, bool(_get(so, "include_usage", (bool,), False)),
                          _user(body), _priority(body), _slo(body, "ttft_slo_ms"),
                          _slo(body, "tpot_slo_ms"), max_tokens_given)


def _priority(body: dict) -> Priority:
    p = _get(body, "priority", (str,), "standard")
    try:
        return Priority[p.upper()]
    except KeyError:
        raise _bad("priority", "expected critical, standard or sheddable") from None


def _slo(body: dict, name: str) -> float | None:
    v = _get(body, name, _NUM)
    if v is not None and v <= 0:
        raise _bad(name, "must be positive")
    return None if v is None else float(v)


def _max_tokens(body: dict, *names: str) -> int | None:
    for name in names:
        v = _get(body, name, (int,))
        if v is not None:
            if v < 1:
                raise _bad(name, f"must be at least 1, got {v}")
            return v
    return None


def _prompts(body: dict) -> tuple[Prompt, ...]:
    p = body.get("prompt")
    if isinstance(p, str) and p:
        return (p,)
    if isinstance(p, list) and p:
        if all(isinstance(x, str) and x for x in p):
            return tuple(p)
        if all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            return (tuple(p),)
        if all(isinstance(x, list) and x for x in p):
            return tuple(_int_list(x, "prompt") for x in p)
    raise _bad("prompt", "expected a non-empty string, list of strings, list of token ids or list of such lists")


def parse_completion(body: Any, served: Sequence[str], defaults: RequestDefaults = NO_DEFAULTS) -> CompletionRequest:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    lp = _get(body, "logprobs", (int,))
    if lp is not None and not 0 <= lp <= 5:
        raise _bad("logprobs", "must be between 0 and 5")
    prompts = _prompts(body)
    if len(prompts) > MAX_PROMPTS:
        raise _bad("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}")
    given = _max_tokens(body, "max_tokens")
    fallback = defaults.max_tokens if "max_tokens" in body else defaults.completion_max_tokens  # null: the open default
    opts = _options(body, served, lp, given or fallback, given is not None, defaults.sampling)
    if len(prompts) * opts.params.n > MAX_FANOUT:
        raise _bad("n", f"prompts × n is at most {MAX_FANOUT} per request, got {len(prompts) * opts.params.n}")
    return CompletionRequest(prompts, opts, bool(_get(body, "echo", (bool,), False)))


def parse_chat(body: Any, served: Sequence[str], defaults: RequestDefaults = NO_DEFAULTS) -> ChatRequest:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "expected a non-empty list of messages")
    if len(msgs) > MAX_MESSAGES:
        raise _bad("messages", f"at most {MAX_MESSAGES} messages, got {len(msgs)}")
    want = _get(body, "logprobs", (bool,), False)
    top = _get(body, "top_logprobs", (int,))
    if top is not None and (not want or not 0 <= top <= 20):
        raise _bad("top_logprobs", "needs logprobs: true and must be between 0 and 20")
    given = _max_tokens(body, "max_completion_tokens", "max_tokens")
    opts = _options(body, served, (top or 0) if want else None, given or defaults.max_tokens, given is not None,
                    defaults.sampling)
    tools = _tools(body)
    if tools is not None and tools.forced and opts.params.grammar is not None:
        raise _bad("tool_choice", "a forced tool call cannot be combined with response_format or structured_outputs")
    return ChatRequest(tuple(_message(m, i) for i, m in enumerate(msgs)), opts, want, tools)


def _tools(body: dict) -> ToolRequest | None:
    raw, choice = body.get("tools"), body.get("tool_choice")
    if raw in (None, []):
        if choice not in (None, "none"):
            raise _bad("tool_choice", "needs tools")
        return None
    try:
        tools = tools_of(raw)
    except ConfigError as e:
        raise _bad("tools", str(e)) from None
    parallel = _get(body, "parallel_tool_calls", (bool,), True)
    if choice is None or choice in ("auto", "required"):
        return ToolRequest(tools, choice or "auto", None, parallel)
    if choice == "none":
        return None
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(name, str):
        raise _bad("tool_choice", "expected none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}")
    if name not in {t.name for t in tools}:
        raise _bad("tool_choice", f"names function {name!r}, which is not among the tools")
    return ToolRequest(tools, "function", name, parallel)


def _message(m: Any, i: int) -> dict[str, Any]:
    if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer", "tool"):
        raise _bad(f"messages[{i}]", "each message needs a role of system, user, assistant, developer or tool")
    extra: dict[str, Any] = {}
    if m["role"] == "assistant" and m.get("tool_calls"):
        extra["tool_calls"] = _calls(m["tool_calls"], i)
        if m.get("content") is None:
            return {"role": "assistant", "content": "", **extra}
    if m["role"] == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise _bad(f"messages[{i}].tool_call_id", "a tool message needs the id of the call it answers")
        extra["tool_call_id"] = m["tool_call_id"]
    content = m.get("content")
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise _bad(f"messages[{i}].content", "only text content parts are supported")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise _bad(f"messages[{i}].content", "expected a string or a list of text parts")
    return {"role": m["role"], "content": content, **extra}


def _calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """An assistant message's tool calls, in OpenAI's shape (arguments: JSON text of an object)."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise _bad(where, "expected a list of tool calls")
    out = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise _bad(where, "each call needs function.name and function.arguments (a JSON string)")
        try:
            args = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            raise _bad(where, f"the arguments of {fn['name']!r} are not JSON") from None
        out.append({"id": str(c.get("id") or ""), "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out
