"""Structured output at the edge (issue 29): a request body's constraint as a `GrammarSpec`, checked
here (text/grammar.py, no tokenizer, no torch) so a bad schema is a 400 before anything is placed.

Accepted, on chat and completions alike:
  * OpenAI's `response_format`: `{"type": "text"}`, `{"type": "json_object"}`,
    `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": bool}}`;
  * vLLM's `structured_outputs`: one of `json` (a schema, or its JSON text), `regex`, `choice`
    (a list of strings), `grammar` (Lark or GBNF/EBNF), `json_object: true`; and vLLM's older
    top-level `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.
At most one constraint per request. `strict` is accepted either way: every constraint here is
enforced token by token.
"""

from __future__ import annotations

import re
from typing import Any

from splitserve.text import grammar as grammars
from splitserve.types import ConfigError, GrammarKind, GrammarSpec, MAX_LOGIT_BIAS

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class StructuredError(ValueError):
    """A bad constraint: the parameter it is in, and why (the protocol makes it a 400)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def grammar_of(body: dict) -> GrammarSpec | None:
    """The body's output constraint, checked; None without one."""
    found = [(name, body[name]) for name in ("response_format", "structured_outputs", *_GUIDED)
             if body.get(name) is not None]
    found = [(n, v) for n, v in found if not (n == "response_format" and isinstance(v, dict) and v.get("type") == "text")]
    if not found:
        return None
    if len(found) > 1:
        raise StructuredError(found[1][0], f"only one output constraint per request; {found[0][0]} is set too")
    name, value = found[0]
    if name == "response_format":
        spec = _response_format(value)
    elif name == "structured_outputs":
        spec = _structured_outputs(value, name)
    else:
        spec = _structured_outputs({_GUIDED[name]: value}, name)
    try:
        grammars.check(spec)
    except ConfigError as e:
        raise StructuredError(name, str(e)) from None
    return spec


def _response_format(rf: Any) -> GrammarSpec:
    where = "response_format"
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise StructuredError(where, "expected {\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}")
    if rf["type"] == "json_object":
        return GrammarSpec(GrammarKind.JSON_OBJECT)
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise StructuredError(f"{where}.json_schema", "is required with type json_schema: {\"name\": ..., \"schema\": {...}}")
    if not isinstance(js.get("name"), str) or not _NAME.match(js["name"]):
        raise StructuredError(f"{where}.json_schema.name", "must be 1 to 64 letters, digits, '_' or '-'")
    if js.get("strict") is not None and not isinstance(js["strict"], bool):
        raise StructuredError(f"{where}.json_schema.strict", "must be a boolean")
    schema = js.get("schema", {"type": "object"})  # OpenAI: an absent schema is any object
    return _spec(grammars.json_schema_spec, schema, f"{where}.json_schema.schema")


def _structured_outputs(so: Any, where: str) -> GrammarSpec:
    if not isinstance(so, dict):
        raise StructuredError(where, "expected an object with one of json, regex, choice, grammar, json_object")
    given = [k for k in ("json", "regex", "choice", "grammar", "json_object") if so.get(k) not in (None, False)]
    if len(given) != 1:
        raise StructuredError(where, "set exactly one of json, regex, choice, grammar, json_object")
    key = given[0]
    value = so[key]
    if key == "json":
        return _spec(grammars.json_schema_spec, value, f"{where}.json")
    if key == "choice":
        return _spec(grammars.choice_spec, value, f"{where}.choice")
    if key == "json_object":
        if value is not True:
            raise StructuredError(f"{where}.json_object", "must be true")
        return GrammarSpec(GrammarKind.JSON_OBJECT)
    if not isinstance(value, str) or not value:
        raise StructuredError(f"{where}.{key}", "must be a non-empty string")
    kind = GrammarKind.REGEX if key == "regex" else GrammarKind.GRAMMAR
    return _spec(lambda v: GrammarSpec(kind, v), value, f"{where}.{key}")


def _spec(make, value: Any, param: str) -> GrammarSpec:
    try:
        return make(value)
    except ConfigError as e:
        raise StructuredError(param, str(e)) from None


def logit_bias_of(body: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias`: {"token id": bias in [-100, 100]}, at most MAX_LOGIT_BIAS entries."""
    lb = body.get("logit_bias")
    if lb is None:
        return ()
    if not isinstance(lb, dict):
        raise StructuredError("logit_bias", "expected an object mapping token ids to biases")
    if len(lb) > MAX_LOGIT_BIAS:
        raise StructuredError("logit_bias", f"at most {MAX_LOGIT_BIAS} tokens may be biased, got {len(lb)}")
    out = []
    for k, v in lb.items():
        if not (isinstance(k, str) and k.isdigit()):
            raise StructuredError("logit_bias", f"{k!r} is not a token id")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise StructuredError("logit_bias", f"the bias of token {k} must be a number in [-100, 100], got {v!r}")
        out.append((int(k), float(v)))
    return tuple(out)
