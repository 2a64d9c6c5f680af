"""A request's output constraint as a grammar (issue 29: structured output): the `GrammarSpec`
a request carries, checked and translated into llguidance's grammar. No tokenizer and no torch
here, so the ingress refuses a bad schema, regex or grammar (400) before anything is placed; the
engine (`engine/grammar.py`) compiles the same translation against the model's tokenizer.

Why llguidance, not xgrammar (benchmarks/grammar_masks.py, results/grammar_masks/, on this
2-core CPU with the demo model's 49,152-token vocabulary, a 6-property JSON schema, one step =
fill every row's mask + apply it to the logits): p50 0.09 / 2.2 / 9.1 ms at batch 1 / 32 / 128
against xgrammar's 0.23 / 6.4 / 25 ms; a schema compiles in ~1 ms against ~14 ms; it validates a
grammar without a tokenizer; and importing it loads neither torch nor transformers (xgrammar
loads both), which an ingress replica must not.
"""

from __future__ import annotations

import json
from typing import Any

from splitserve.types import ConfigError, GrammarKind, GrammarSpec

# How generated JSON is spaced: one space after ':' and ',' (what models write unprompted); no
# free whitespace, so a model cannot pad its answer with newlines until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# A grammar's compile budget: llguidance's lexer fuel (~50k units per ms) and grammar size.
LIMITS = {"initial_lexer_fuel": 5_000_000, "max_grammar_size": 200_000}
MAX_CHOICES = 256


def _llg():
    import llguidance

    return llguidance


def limits():
    return _llg().LLParserLimits(**LIMITS)


def json_schema_spec(schema: Any) -> GrammarSpec:
    """A JSON Schema (a mapping, or its JSON text) as a spec; its text is canonical
    (`canonical_schema`), so equal schemas share a compiled grammar."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ConfigError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise ConfigError(f"a JSON schema must be an object, got {type(schema).__name__}")
    return GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(canonical_schema(schema), separators=(",", ":")))


def canonical_schema(node: Any, in_properties: bool = False) -> Any:
    """A JSON Schema with its keywords sorted, except the names of an object's `properties`:
    the grammar writes an object's properties in the order the schema lists them (a
    "reasoning" before its "answer"), so that order is the caller's. Data (const, enum,
    default, examples) is left as it is."""
    if isinstance(node, list):
        return [canonical_schema(x) for x in node]
    if not isinstance(node, dict):
        return node
    keys = list(node) if in_properties else sorted(node)
    return {k: node[k] if not in_properties and k in _DATA_KEYWORDS
            else canonical_schema(node[k], not in_properties and k == "properties") for k in keys}


_DATA_KEYWORDS = ("const", "enum", "default", "examples")


def choice_spec(choices: Any) -> GrammarSpec:
    if (not isinstance(choices, list) or not choices or len(choices) > MAX_CHOICES
            or not all(isinstance(c, str) and c for c in choices)):
        raise ConfigError(f"choice must be a list of 1 to {MAX_CHOICES} non-empty strings")
    return GrammarSpec(GrammarKind.CHOICE, json.dumps(choices))


def to_llguidance(spec: GrammarSpec) -> str:
    """The llguidance grammar of a spec (not yet checked: `check` does)."""
    llg = _llg()
    m = llg.LLMatcher
    if spec.kind is GrammarKind.JSON_SCHEMA:
        return m.grammar_from_json_schema(spec.text, overrides=JSON_OPTIONS)
    if spec.kind is GrammarKind.JSON_OBJECT:
        return m.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    if spec.kind is GrammarKind.REGEX:
        return m.grammar_from_regex(spec.text)
    if spec.kind is GrammarKind.CHOICE:
        alternatives = " | ".join(json.dumps(c) for c in json.loads(spec.text))
        return m.grammar_from_lark(f"start: {alternatives}")
    text = spec.text
    if "::=" in text:  # GBNF / EBNF, as vLLM's and llama.cpp's grammars are written
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            text = gbnf_to_lark(text)
        except Exception as e:  # noqa: BLE001 (the converter's own error types vary)
            raise ConfigError(f"the grammar does not parse: {_first_line(e)}") from None
    return m.grammar_from_lark(text)


def check(spec: GrammarSpec) -> str:
    """The spec's llguidance grammar; ConfigError, in our words, when it does not compile or goes
    past the compile budget (an unsupported JSON Schema keyword is named)."""
    try:
        grammar = to_llguidance(spec)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"the {_what(spec)} is not valid: {_first_line(e)}") from None
    error = _llg().LLMatcher.validate_grammar(grammar, None, limits=limits())
    if error:
        raise ConfigError(f"the {_what(spec)} is not supported: {_first_line(error)}")
    return grammar


def _what(spec: GrammarSpec) -> str:
    return {GrammarKind.JSON_SCHEMA: "JSON schema", GrammarKind.REGEX: "regex",
            GrammarKind.GRAMMAR: "grammar"}.get(spec.kind, spec.kind.value)


def _first_line(e: object) -> str:
    """The library's message on one line, bounded."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text[:300]
