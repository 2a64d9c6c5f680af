"""Tool calls in a model's own words (issue 29): how each model family writes a call, read back
into typed calls, and the grammar that makes a forced call (`tool_choice: required` or a named
function) always parse and validate against the function's parameter schema.

Formats, chosen by name (`--tool-call-parser`) or from the chat template:
  * `hermes` — Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one per call;
  * `llama3_json` — Llama 3.x: the answer is `{"name": ..., "parameters": {...}}` (after an optional
    `<|python_tag|>`), calls separated by `;`;
  * `mistral` — `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.
A model whose template says nothing of tools gets them described in a system message in the
`hermes` format, which this module then reads back.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

from splitserve.text.grammar import JSON_OPTIONS, canonical_schema
from splitserve.types import ConfigError, GrammarKind, GrammarSpec

MAX_TOOLS = 128
MAX_TOOLS_BYTES = 64 * 1024  # the tools' JSON, all together


@dataclass(frozen=True)
class Tool:
    """One function a request offers: its name, description and parameters' JSON Schema."""

    name: str
    description: str = ""
    parameters: str = '{"type": "object"}'  # JSON text, canonical (grammar.canonical_schema: properties in the caller's order)

    def as_openai(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": json.loads(self.parameters)}}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = ""

    def with_id(self) -> "ToolCall":
        return self if self.id else ToolCall(self.name, self.arguments, f"call_{uuid.uuid4().hex[:24]}")


class ToolFormat:
    """How one family writes calls (`open` marks where calls begin)."""

    name = ""
    open = ""

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(the text before the calls, the calls); no calls: (text, [])."""
        raise NotImplementedError

    def grammar(self, tools: Sequence[Tool], parallel: bool) -> GrammarSpec:
        """Output that is one call (or several, `parallel`) of `tools`, valid against their schemas."""
        raise NotImplementedError


class FirstCallOnly(ToolFormat):
    """`parallel_tool_calls: false`: a forced call's grammar allows one call; under
    `tool_choice: auto` the model may still write several, and the first is the answer."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt, self.name, self.open = fmt, fmt.name, fmt.open

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        content, calls = self.fmt.parse(text)
        return content, calls[:1]

    def grammar(self, tools: Sequence[Tool], parallel: bool) -> GrammarSpec:
        return self.fmt.grammar(tools, False)


def _call_schema(tools: Sequence[Tool], args_key: str) -> dict[str, Any]:
    one = [{"type": "object", "additionalProperties": False, "required": ["name", args_key],
            "properties": {"name": {"const": t.name}, args_key: closed(json.loads(t.parameters))}} for t in tools]
    return one[0] if len(one) == 1 else {"anyOf": one}


def closed(schema: Any, may_close: bool = True) -> Any:
    """`schema` with every object that lists its properties and says nothing of others closed
    to them (additionalProperties false). A forced call is the function's declared arguments:
    most tool schemas (OpenAI's examples among them) leave additionalProperties out, and a model
    held to a grammar that allows more keys can invent keys until max_tokens, never ending the
    call. vLLM's default backend (xgrammar's strict mode) reads such schemas the same way; an
    object that says additionalProperties, patternProperties or unevaluatedProperties, or lists
    no properties (a free dict), keeps what it says; so does one that takes part in an anyOf /
    oneOf / allOf, on either side (closing the branches of an allOf would refuse every object
    that has more than one branch's keys), though objects nested further in are closed."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: closed(sub) for name, sub in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [closed(sub, may_close=key == "prefixItems") for sub in value]
        elif key in _SCHEMA_ONE:
            out[key] = [closed(sub) for sub in value] if isinstance(value, list) else closed(value)
    if may_close and isinstance(out.get("properties"), dict) and not (_OPEN_KEYS | _COMBINED) & out.keys():
        out["additionalProperties"] = False
    return out


# where a JSON schema holds schemas: name -> schema maps, lists, and single ones (items: either)
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalItems", "additionalProperties", "not", "if", "then", "else", "contains",
               "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_OPEN_KEYS = {"additionalProperties", "patternProperties", "unevaluatedProperties"}
_COMBINED = {"anyOf", "oneOf", "allOf"}


def _json(schema: dict[str, Any]) -> str:
    """A call schema as a grammar's %json: spaced as response_format's JSON is (no free
    whitespace — a model could otherwise pad a forced call with blanks until max_tokens)."""
    return json.dumps({**schema, "x-guidance": JSON_OPTIONS})


def _as_call(obj: Any, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class Hermes(ToolFormat):
    name = "hermes"
    open = "<tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        start = text.find(self.open)
        if start < 0:
            return text, []
        calls = []
        for body in self._CALL.findall(text[start:]):
            try:
                call = _as_call(json.loads(body), "arguments")
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []  # not a call after all: the text stays text
            calls.append(call)
        return text[:start].rstrip(), calls

    def grammar(self, tools: Sequence[Tool], parallel: bool) -> GrammarSpec:
        schema = _json(_call_schema(tools, "arguments"))
        call = f'"<tool_call>\\n" %json {schema} "\\n</tool_call>"'
        return GrammarSpec(GrammarKind.GRAMMAR, f"start: call{'+' if parallel else ''}\ncall: {call}")


class Llama3Json(ToolFormat):
    name = "llama3_json"
    open = "{"

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        for part in body.split(";"):
            try:
                call = _as_call(json.loads(part), "parameters")
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        return "", calls

    def grammar(self, tools: Sequence[Tool], parallel: bool) -> GrammarSpec:
        schema = _json(_call_schema(tools, "parameters"))
        rest = '("; " call)*' if parallel else ""
        return GrammarSpec(GrammarKind.GRAMMAR, f"start: call {rest}\ncall: %json {schema}")


class Mistral(ToolFormat):
    name = "mistral"
    open = "[TOOL_CALLS]"

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        start = text.find(self.open)
        if start < 0:
            return text, []
        try:
            items = json.loads(text[start + len(self.open):].strip())
        except json.JSONDecodeError:
            return text, []
        items = items if isinstance(items, list) else [items]
        calls = [_as_call(i, "arguments") for i in items]
        if not calls or None in calls:
            return text, []
        return text[:start].rstrip(), calls

    def grammar(self, tools: Sequence[Tool], parallel: bool) -> GrammarSpec:
        one = _call_schema(tools, "arguments")
        schema = {"type": "array", "items": one, "minItems": 1, **({} if parallel else {"maxItems": 1})}
        return GrammarSpec(GrammarKind.GRAMMAR, f'start: "[TOOL_CALLS]" %json {_json(schema)}')


FORMATS = {f.name: f for f in (Hermes(), Llama3Json(), Mistral())}


def format_for(template: str | None, name: str | None = None) -> ToolFormat:
    """The format by name, else the one the chat template writes, else hermes."""
    if name:
        if name not in FORMATS:
            raise ConfigError(f"unknown tool-call parser {name!r}; known: {', '.join(FORMATS)}")
        return FORMATS[name]
    t = template or ""
    if "[TOOL_CALLS]" in t:
        return FORMATS["mistral"]
    if "<|python_tag|>" in t or "ipython" in t:
        return FORMATS["llama3_json"]
    return FORMATS["hermes"]


def template_knows_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def describe_tools(tools: Sequence[Tool]) -> str:
    """A system message offering `tools` to a model whose template does not render them."""
    listing = "\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in tools)
    return ("You can call functions to help answer. The functions, as JSON schemas:\n<tools>\n"
            f"{listing}\n</tools>\nTo call one, answer with only\n<tool_call>\n"
            '{"name": "<function name>", "arguments": {<the arguments, as JSON>}}\n</tool_call>\n'
            "once per call; otherwise answer normally.")


def tools_of(raw: Any) -> tuple[Tool, ...]:
    """OpenAI's `tools` (function tools only), checked; ConfigError says what is wrong."""
    if not isinstance(raw, list) or not raw:
        raise ConfigError("expected a non-empty list of tools")
    if len(raw) > MAX_TOOLS:
        raise ConfigError(f"at most {MAX_TOOLS} tools per request, got {len(raw)}")
    if len(json.dumps(raw)) > MAX_TOOLS_BYTES:
        raise ConfigError(f"the tools take more than {MAX_TOOLS_BYTES} bytes of JSON")
    tools, names = [], set()
    for i, t in enumerate(raw):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", fn["name"]):
            raise ConfigError(f"[{i}]: expected {{\"type\": \"function\", \"function\": {{\"name\": ..., \"parameters\": ...}}}} "
                              "with a name of 1 to 64 letters, digits, '_', '.' or '-'")
        if fn["name"] in names:
            raise ConfigError(f"[{i}]: function {fn['name']!r} is offered twice")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise ConfigError(f"[{i}].function.parameters: must be a JSON Schema of an object")
        names.add(fn["name"])
        tools.append(Tool(fn["name"], str(fn.get("description") or ""), json.dumps(canonical_schema(params))))
    return tuple(tools)


def chat_inputs(messages: Sequence[dict[str, Any]], tools: Sequence[Tool] | None,
                template: str | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and template arguments that render a chat with tools: the model's own
    template where it renders tools, else the hermes wording in a system message, with earlier
    calls and their results written as the model would have written and read them."""
    if template_knows_tools(template):
        return list(messages), ({"tools": [t.as_openai() for t in tools]} if tools else {})
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.get("tool_calls"):
            calls = "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                            "arguments": c["function"]["arguments"]}) + "\n</tool_call>"
                              for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (m["content"] + "\n" if m["content"] else "") + calls})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools:
        offer = describe_tools(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + offer}
        else:
            out.insert(0, {"role": "system", "content": offer})
    return out, {}
