"""Structured output under data-parallel attention (engine/parallel/dp_engine.py): a request's
grammar lives on the replica that holds it — that replica builds its matcher from its own
tokenizer and masks its rows in its own step. Two replicas (two local processes), JSON-schema and
forced-tool-call requests among unconstrained ones, spread over both: every constrained output
validates (`jsonschema`) and every greedy token equals one engine's (D=1) for the same requests.
A grammar that does not compile for the model, or tokens that do not fit it, are the ConfigError
one engine raises, at add time and before any replica holds the request; the group serves on."""

import json

import jsonschema
import pytest

from splitserve import LLM, SamplingParams
from splitserve.text.grammar import choice_spec, json_schema_spec
from splitserve.text.tool_calls import FORMATS, Tool
from splitserve.types import ConfigError, FinishReason, GrammarKind, GrammarSpec, Request
from tests.unit.test_dp_attention import drained
from tests.unit.test_structured_output import SCHEMA

SHAPE = "qwen3_moe"
ARGS = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["unit", "days"], "additionalProperties": False}
TOOL = Tool("get_forecast", "The weather forecast", json.dumps(ARGS, sort_keys=True))
HERMES = FORMATS["hermes"]
# what the app gives tool_choice: required (text/tool_calls.py), one call
TOOL_CALL = HERMES.grammar([TOOL], False)
# passes the edge's check (no tokenizer there), but names a special token this model lacks
NOT_FOR_THIS_MODEL = GrammarSpec(GrammarKind.GRAMMAR, 'start: <|nothere|> "a"')


@pytest.fixture(scope="module")
def dp(tiny_checkpoint):
    with LLM(str(tiny_checkpoint(SHAPE)), num_kv_blocks=128, data_parallel_size=2) as llm:
        yield llm


@pytest.fixture(scope="module")
def one(tiny_checkpoint):
    with LLM(str(tiny_checkpoint(SHAPE)), num_kv_blocks=256) as llm:
        yield llm


def requests() -> list[Request]:
    """Schema, tool call, free, three times over; equal prompt lengths, so the front (fewest
    context tokens, ties to the lower replica) alternates replicas and each kind lands on both."""
    kinds = [("schema", SamplingParams(temperature=0.0, max_tokens=200, grammar=json_schema_spec(SCHEMA))),
             ("tool", SamplingParams(temperature=0.0, max_tokens=200, grammar=TOOL_CALL)),
             ("free", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))]
    return [Request(f"{name}-{i}", (5 + i, 6, 7, 8 + i, 9, 10), params)
            for i in range(3) for name, params in kinds]


def run(engine, reqs, where=None):
    """Run requests to the end: request id -> (tokens, finish reason); `where` collects each
    request's replica as the front placed it."""
    for r in reqs:
        engine.add_request(r)
        if where is not None:
            where[r.request_id] = engine.replica_of(r.request_id)
    got: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    reasons = {}
    while engine.has_unfinished():
        for c in engine.step():
            got.setdefault(c.request_id, []).extend(c.token_ids)
            if c.finish_reason is not None:
                reasons[c.request_id] = c.finish_reason
    return got, reasons


def test_constrained_rows_on_both_replicas_validate_and_equal_one_engines_tokens(dp, one):
    where: dict[str, int] = {}
    got, reasons = run(dp.engine, requests(), where)
    ref, ref_reasons = run(one.engine, requests())
    assert got == ref and reasons == ref_reasons  # greedy: token for token

    for kind in ("schema", "tool"):  # each constrained kind served on both replicas
        assert {r for rid, r in where.items() if rid.startswith(kind)} == {0, 1}, where
    # replica 1 compiled both grammars itself (replica 0 compiles every one first, at the front)
    assert dp.engine.on_all_replicas(_compiles)[1] >= 2

    for rid, tokens in got.items():
        text = dp.tokenizer.decode(tokens)
        if rid.startswith("schema"):
            assert reasons[rid] is FinishReason.STOP, text  # the grammar ended it, before max_tokens
            jsonschema.validate(json.loads(text), SCHEMA)
        elif rid.startswith("tool"):
            assert reasons[rid] is FinishReason.STOP, text
            content, calls = HERMES.parse(text)
            assert content == "" and [c.name for c in calls] == ["get_forecast"], text
            jsonschema.validate(json.loads(calls[0].arguments), ARGS)
    drained(dp)


def test_a_grammar_that_does_not_compile_is_one_engines_error_and_the_group_serves_on(dp, one):
    bad = SamplingParams(temperature=0.0, max_tokens=4, grammar=NOT_FOR_THIS_MODEL)
    with pytest.raises(ConfigError, match="does not compile for this model") as single:
        one.engine.add_request(Request("bad", (5, 6, 7), bad))
    with pytest.raises(ConfigError) as at_prepare:  # what the serving loop calls, off the engine thread
        dp.engine.prepare(bad)
    assert str(at_prepare.value) == str(single.value)

    # a running request on replica 0: the next would go to replica 1
    dp.engine.add_request(Request("busy", (5, 6, 7, 8), SamplingParams(temperature=0.0, max_tokens=6,
                                                                       ignore_eos=True)))
    assert dp.engine.replica_of("busy") == 0
    with pytest.raises(ConfigError) as at_add:
        dp.engine.add_request(Request("bad", (5, 6, 7), bad))
    assert str(at_add.value) == str(single.value) and dp.engine.replica_of("bad") is None

    yes_no = SamplingParams(temperature=0.0, max_tokens=10, grammar=choice_spec(["yes", "no"]))
    with pytest.raises(ConfigError, match="do not fit its grammar"):  # a moved stream's tokens
        dp.engine.add_request(Request("moved", (5, 6, 7), yes_no), outputs=tuple(dp.tokenizer.encode("maybe")))
    assert dp.engine.replica_of("moved") is None

    fine = Request("fine", (5, 6, 7), yes_no)
    got, reasons = run(dp.engine, [fine])
    assert dp.tokenizer.decode(got["fine"]) in ("yes", "no") and reasons["fine"] is FinishReason.STOP
    assert not dp.engine.has_unfinished()
    drained(dp)


def _compiles(engine) -> int:
    """Grammars this replica compiled (module-level: run on every replica by name)."""
    masks = engine.sampler.masks
    return 0 if masks is None else masks.compiles
