"""The HTTP ingress's OpenAPI 3.1 document, served at /openapi.json: what `protocol` accepts
(the same bounds: MAX_N, MAX_PROMPTS, the sampling ranges) and every answer a route can give —
the OpenAI shapes, the error object, and the statuses our errors use. Fuzzers read it
(tests/unit/test_fuzz_http.py, benchmarks/fuzz_http.py); so can a client generator."""

from __future__ import annotations

from typing import Any

from splitserve.ingress.protocol import MAX_N, MAX_PROMPTS

_ERRORS = {400: "the request is malformed or out of range", 401: "no valid API key",
           403: "a key without the permission (/metrics: an operator key)", 404: "no such model",
           413: "the body is too large", 429: "the tenant's rate limit", 503: "no capacity now, or workers are lost"}
_SAMPLING: dict[str, Any] = {
    "temperature": {"type": "number", "minimum": 0, "maximum": 100},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": -1},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 2},
    "seed": {"type": "integer", "minimum": -(1 << 63), "maximum": (1 << 63) - 1},
    "min_tokens": {"type": "integer", "minimum": 0},
    "stop": {"oneOf": [{"type": "string", "minLength": 1},
                       {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 16}]},
    "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}},
    "ignore_eos": {"type": "boolean"},
    "include_stop_str_in_output": {"type": "boolean"},
    "skip_special_tokens": {"type": "boolean"},
    "n": {"type": "integer", "minimum": 1, "maximum": MAX_N},
    "best_of": {"type": "integer", "minimum": 1, "maximum": MAX_N, "description": "must equal n"},
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "user": {"type": "string"},
    "priority": {"type": "string", "enum": ["critical", "standard", "sheddable"],
                 "description": "capped by the API key's priority"},
    "ttft_slo_ms": {"type": "number", "exclusiveMinimum": 0},
    "tpot_slo_ms": {"type": "number", "exclusiveMinimum": 0},
    # structured output (ingress/structured.py): at most one constraint per request
    "response_format": {"oneOf": [
        {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
        {"type": "object", "required": ["type", "json_schema"], "properties": {
            "type": {"const": "json_schema"},
            "json_schema": {"type": "object", "required": ["name"], "properties": {
                "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                "schema": {"type": "object"}, "strict": {"type": "boolean"}}}}}]},
    "structured_outputs": {"type": "object", "minProperties": 1, "maxProperties": 1,
                           "description": "vLLM's extension: exactly one of these",
                           "properties": {"json": {"type": ["object", "string"]},
                                          "regex": {"type": "string", "minLength": 1},
                                          "choice": {"type": "array", "items": {"type": "string", "minLength": 1},
                                                     "minItems": 1, "maxItems": 256},
                                          "grammar": {"type": "string", "minLength": 1},
                                          "json_object": {"const": True}}},
    "logit_bias": {"type": "object", "maxProperties": 300, "propertyNames": {"pattern": "^[0-9]+$"},
                   "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                   "description": "token id -> bias; ids within the model's vocabulary"},
}
_TOKENS = {"type": "integer", "minimum": 1, "description": "at most the model's context minus the prompt"}
_FUNCTION = {"type": "object", "required": ["name"],
             "properties": {"name": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"},
                            "description": {"type": "string"}, "parameters": {"type": "object"}}}
_TOOLS: dict[str, Any] = {
    "tools": {"type": "array", "maxItems": 128, "items": {"type": "object", "required": ["type", "function"],
                                                          "properties": {"type": {"const": "function"},
                                                                         "function": _FUNCTION}}},
    "tool_choice": {"oneOf": [{"enum": ["none", "auto", "required"]},
                              {"type": "object", "required": ["type", "function"],
                               "properties": {"type": {"const": "function"}, "function": {
                                   "type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}]},
    "parallel_tool_calls": {"type": "boolean"},
}
_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _schemas(model_name: str) -> dict[str, Any]:
    usage = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
             "properties": {k: {"type": "integer"} for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}
    return {
        "CompletionRequest": {
            "type": "object", "required": ["model", "prompt"],
            "properties": {"model": {"type": "string", "enum": [model_name]},
                           "prompt": {"oneOf": [{"type": "string", "minLength": 1},
                                                {"type": "array", "items": {"type": "string", "minLength": 1},
                                                 "minItems": 1, "maxItems": MAX_PROMPTS},
                                                _IDS,
                                                {"type": "array", "items": _IDS, "minItems": 1,
                                                 "maxItems": MAX_PROMPTS}]},
                           "max_tokens": _TOKENS, "echo": {"type": "boolean"},
                           "logprobs": {"type": "integer", "minimum": 0, "maximum": 5}, **_SAMPLING}},
        "ChatRequest": {
            "type": "object", "required": ["model", "messages"],
            "properties": {"model": {"type": "string", "enum": [model_name]},
                           "messages": {"type": "array", "minItems": 1, "items": _ref("Message")},
                           "max_tokens": _TOKENS, "max_completion_tokens": _TOKENS,
                           "logprobs": {"type": "boolean"},
                           "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20}, **_SAMPLING,
                           **_TOOLS}},
        "ResponsesRequest": {
            "type": "object", "required": ["model", "input"],
            "description": "the subset of OpenAI's Responses API the openai-agents SDK uses (ingress/responses.py)",
            "properties": {"model": {"type": "string", "enum": [model_name]},
                           "input": {"oneOf": [{"type": "string", "minLength": 1},
                                               {"type": "array", "minItems": 1, "items": {"type": "object"}}]},
                           "instructions": {"type": "string"}, "max_output_tokens": _TOKENS,
                           "temperature": _SAMPLING["temperature"], "top_p": _SAMPLING["top_p"],
                           "tools": {"type": "array", "items": {"type": "object", "required": ["type", "name"],
                                                                "properties": {"type": {"const": "function"},
                                                                               **_FUNCTION["properties"]}}},
                           "tool_choice": {"oneOf": [{"enum": ["none", "auto", "required"]}, {"type": "object"}]},
                           "parallel_tool_calls": {"type": "boolean"}, "stream": {"type": "boolean"},
                           "store": {"type": "boolean"}, "previous_response_id": {"type": "string"},
                           "text": {"type": "object"}, "metadata": {"type": "object"}}},
        "Message": {
            "type": "object", "required": ["role", "content"],
            "properties": {"tool_call_id": {"type": "string"}, "tool_calls": {"type": "array", "items": {"type": "object"}},
                           "role": {"type": "string", "enum": ["system", "user", "assistant", "developer", "tool"]},
                           "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {
                               "type": "object", "required": ["type", "text"],
                               "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]}}},
        "Completion": _answer("text_completion", {"text": {"type": "string"}}, usage),
        "ChatCompletion": _answer("chat.completion", {"message": {
            "type": "object", "required": ["role", "content"],
            "properties": {"role": {"const": "assistant"}, "content": {"type": ["string", "null"]},
                           "tool_calls": {"type": "array", "items": {"type": "object"}}}}}, usage),
        "Response": {"type": "object", "required": ["id", "object", "output", "status"],
                     "properties": {"id": {"type": "string"}, "object": {"const": "response"},
                                    "status": {"type": "string"}, "output": {"type": "array"}}},
        "Models": {"type": "object", "required": ["object", "data"],
                   "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": {
                       "type": "object", "required": ["id", "object"],
                       "properties": {"id": {"type": "string"}, "object": {"const": "model"}}}}}},
        "Status": {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}},
        "Error": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                           "param": {"type": ["string", "null"]}, "code": {"type": ["string", "integer", "null"]}}}}},
    }


def _answer(kind: str, content: dict[str, Any], usage: dict[str, Any]) -> dict[str, Any]:
    """A completion object (`kind`: its "object" value) whose choices carry `content` (the text,
    or the message)."""
    choice = {"type": "object", "required": ["index", *content, "finish_reason"],
              "properties": {"index": {"type": "integer"}, **content, "finish_reason": {"type": ["string", "null"]}}}
    return {"type": "object", "required": ["id", "object", "created", "model", "choices"],
            "properties": {"id": {"type": "string"}, "object": {"const": kind}, "created": {"type": "integer"},
                           "model": {"type": "string"}, "choices": {"type": "array", "items": choice},
                           "usage": usage}}


def _answers(ok: dict[str, Any], errors: tuple[int, ...]) -> dict[str, Any]:
    out = {"200": {"description": "OK", "content": ok}}
    for status in errors:
        out[str(status)] = {"description": _ERRORS[status], "content": {"application/json": {"schema": _ref("Error")}}}
    return out


def _generate(request: str, answer: str, summary: str) -> dict[str, Any]:
    stream = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}},
              "description": "each server-sent event: data: <chunk JSON>; the last one data: [DONE]"}
    return {"post": {
        "summary": summary, "security": [{"bearer": []}],
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {**_answers({"application/json": {"schema": _ref(answer)}, "text/event-stream": {"schema": stream}},
                                 (400, 401, 404, 413, 429, 503)),
                      "500": {"description": "a failure of ours (never the request's)",
                              "content": {"application/json": {"schema": _ref("Error")}}}}}}


def document(model_name: str) -> dict[str, Any]:
    """The OpenAPI document of a server that serves `model_name`."""
    json_of = lambda name: {"application/json": {"schema": _ref(name)}}  # noqa: E731
    return {
        "openapi": "3.1.0",
        "info": {"title": "splitserve", "version": "1",
                 "description": f"OpenAI-compatible API serving {model_name!r}"},
        "components": {"schemas": _schemas(model_name),
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "paths": {
            "/v1/completions": _generate("CompletionRequest", "Completion", "Text completion"),
            "/v1/chat/completions": _generate("ChatRequest", "ChatCompletion", "Chat completion"),
            "/v1/responses": _generate("ResponsesRequest", "Response", "A response (the Responses API's subset)"),
            "/v1/models": {"get": {"summary": "The served model", "security": [{"bearer": []}],
                                   "responses": _answers(json_of("Models"), (401,))}},
            "/metrics": {"get": {"summary": "Prometheus metrics (every tenant's: an operator key)",
                                 "security": [{"bearer": []}, {}],
                                 "responses": _answers({"text/plain": {"schema": {"type": "string"}}}, (401, 403))}},
            "/health": {"get": {"summary": "Liveness", "responses": _answers(json_of("Status"), ())}},
            "/ready": {"get": {"summary": "Readiness", "responses": _answers(json_of("Status"), (503,))}},
            "/openapi.json": {"get": {"summary": "This document", "security": [{"bearer": []}],
                                      "responses": _answers({"application/json": {"schema": {"type": "object"}}},
                                                            (401,))}},
        },
    }
