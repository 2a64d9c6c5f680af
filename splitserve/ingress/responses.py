"""The Responses API (`POST /v1/responses`, issue 29): the subset the openai-agents SDK and the
OpenAI SDK's `responses.create` use, served by the chat path. A body becomes the chat request it
means — `instructions` a system message, `input` text or items (messages, `function_call`,
`function_call_output`), function `tools` and `tool_choice`, `text.format` (json_schema,
json_object) as response_format, `max_output_tokens` — and the chat answer becomes `output` items:
a message with output_text, or function_call items. `store` (default true) keeps each response's
conversation in a bounded store so that `previous_response_id` continues it.

Not supported (a 400 naming the field): built-in tools (web search, file search, computer use,
code interpreter, MCP), `background`, `conversation`, reasoning settings other than none,
`truncation: auto`, n > 1, and `GET` / `DELETE` of stored responses.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from typing import Any

from splitserve.ingress.protocol import APIError

MAX_STORED = 1024  # responses kept for previous_response_id (an LRU); older ones are forgotten
_UNSUPPORTED = ("background", "conversation", "prompt", "include")


def _bad(param: str, msg: str) -> APIError:
    return APIError(400, f"'{param}': {msg}", param)


class ResponseStore:
    """Each stored response's whole conversation (its input, then its output as chat messages),
    by tenant and id: one tenant cannot continue another's response. In this replica's memory,
    an LRU of `size`; ingress/shared/response_store.py shares them through Redis."""

    def __init__(self, size: int = MAX_STORED) -> None:
        self._items: OrderedDict[tuple[str, str], tuple[dict, ...]] = OrderedDict()
        self._size, self._lock = size, threading.Lock()

    async def get(self, tenant: str, response_id: str) -> tuple[dict, ...] | None:
        return self.get_local(tenant, response_id)

    async def put(self, tenant: str, response_id: str, conversation: list[dict]) -> None:
        self.put_local(tenant, response_id, conversation)

    def get_local(self, tenant: str, response_id: str) -> tuple[dict, ...] | None:
        with self._lock:
            conv = self._items.get((tenant, response_id))
            if conv is not None:
                self._items.move_to_end((tenant, response_id))
            return conv

    def put_local(self, tenant: str, response_id: str, conversation: list[dict]) -> None:
        with self._lock:
            self._items[(tenant, response_id)] = tuple(conversation)
            while len(self._items) > self._size:
                self._items.popitem(last=False)


async def previous(body: Any, store: ResponseStore, tenant: str) -> tuple[dict, ...]:
    """The stored conversation a request continues (`previous_response_id`), or none."""
    prev = body.get("previous_response_id") if isinstance(body, dict) else None
    if prev is None:
        return ()
    conv = await store.get(tenant, prev) if isinstance(prev, str) and len(prev) <= 128 else None
    if conv is None:
        raise APIError(404, f"no stored response {str(prev)[:128]!r} (responses are kept for a while, "
                            f"the last {MAX_STORED} on each server)", "previous_response_id", code="not_found")
    return conv


def chat_body(body: Any, prior: tuple[dict, ...] = ()) -> tuple[dict, list[dict]]:
    """(the chat completion body this response request means, its conversation so far), after
    the `prior` conversation it continues."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    for name in _UNSUPPORTED:
        if body.get(name) not in (None, [], {}):
            raise _bad(name, "is not supported")
    if body.get("truncation", "disabled") != "disabled":
        raise _bad("truncation", "only 'disabled' is supported")
    reasoning = body.get("reasoning")
    if reasoning not in (None, {}) and (not isinstance(reasoning, dict) or reasoning.get("effort") not in (None, "none")):
        raise _bad("reasoning", "this model does not reason; leave it unset")
    messages: list[dict] = list(prior)
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _bad("instructions", "must be a string")
        messages = [{"role": "system", "content": instructions}] + [m for m in messages if m["role"] != "system"]
    messages += _messages(body.get("input"))
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    for ours, theirs in (("max_tokens", "max_output_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                         ("parallel_tool_calls", "parallel_tool_calls"), ("user", "user"), ("seed", "seed")):
        if body.get(theirs) is not None:
            chat[ours] = body[theirs]
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if fmt is not None:
        chat["response_format"] = _format(fmt)
    return chat, [m for m in messages]


def _messages(items: Any) -> list[dict]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise _bad("input", "expected a string or a non-empty list of items")
    out: list[dict] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise _bad(f"input[{i}]", "expected an item object")
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": item.get("role"), "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else json.dumps(output)})
        else:
            raise _bad(f"input[{i}].type", f"{kind!r} items are not supported (message, function_call, "
                                           "function_call_output are)")
    return out


def _text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text")
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise _bad(f"input[{i}].content", "expected a string or input_text / output_text parts")


def _tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise _bad("tools", "expected a list of tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise _bad(f"tools[{i}]", f"only function tools are supported, not {kind!r}")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _format(fmt: Any) -> dict:
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise _bad("text.format", "expected type text, json_object or json_schema")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    js = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
    return {"type": "json_schema", "json_schema": js}


# ------------------------------------------------------------------------------- answers


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_items(content: str, calls: list) -> list[dict]:
    """A chat answer (its text, its calls) as Responses output items."""
    items: list[dict] = []
    if content or not calls:
        items.append(message_item(new_id("msg"), content, "completed"))
    for call in calls:
        items.append(call_item(new_id("fc"), call.with_id(), "completed"))
    return items


def message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(item_id: str, call, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": status}


def response_object(rid: str, body: dict, chat: dict, output: list[dict], usage: dict | None, status: str) -> dict:
    fmt = (body.get("text") or {}).get("format") or {"type": "text"} if isinstance(body.get("text"), dict) else {"type": "text"}
    return {
        "id": rid, "object": "response", "created_at": time.time(), "status": status, "model": body.get("model"),
        "output": output, "instructions": body.get("instructions"), "metadata": body.get("metadata") or {},
        "parallel_tool_calls": bool(chat.get("parallel_tool_calls", True)),
        "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
        "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"), "previous_response_id": body.get("previous_response_id"),
        "store": body.get("store", True), "text": {"format": fmt}, "truncation": "disabled",
        "error": None, "incomplete_details": None if status != "incomplete" else {"reason": "max_output_tokens"},
        "usage": usage,
    }


def usage_of(prompt_tokens: int, output_tokens: int, cached: int) -> dict:
    return {"input_tokens": prompt_tokens, "output_tokens": output_tokens, "total_tokens": prompt_tokens + output_tokens,
            "input_tokens_details": {"cached_tokens": cached}, "output_tokens_details": {"reasoning_tokens": 0}}


def as_messages(output: list[dict]) -> list[dict]:
    """Output items as the chat messages a later turn reads (previous_response_id)."""
    text = "".join(p["text"] for it in output if it["type"] == "message" for p in it["content"])
    calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in output if it["type"] == "function_call"]
    return [{"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}]
