"""Jump-forward proposals (engine/speculative/forced.py): a grammar-constrained request is proposed
the tokens its grammar forces. On the demo model with a forced tool call (the grammar serving
builds for `tool_choice: required`, text/tool_calls.py): the forced tokens spell the text the
grammar forces, are proposed and accepted, and the output equals the non-speculative engine's
and validates against the tool's schema — with forced tokens alone and beside the n-gram
proposer's guesses."""

from __future__ import annotations

import json

import jsonschema
import pytest
from greedy_parity import drained

from splitserve import LLM, SamplingParams
from splitserve.engine.speculative.forced import with_forced
from splitserve.text.tool_calls import FORMATS, Tool, chat_inputs

ARGS = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}
TOOL = Tool("get_weather", "Current weather in a city", json.dumps(ARGS, sort_keys=True))
GRAMMAR = FORMATS["hermes"].grammar([TOOL], True)  # what http.py gives tool_choice: required


class Nothing:
    """A proposer that never guesses: every proposal is the grammar's forced tokens."""

    def new_state(self):
        return None

    def propose(self, tokens, state, k):
        return []


def test_a_guess_is_kept_where_it_agrees_with_the_forced_tokens():
    assert with_forced([1, 2], [1, 2, 3, 4], 4) == ([1, 2, 3, 4], 2)  # agrees, runs past them
    assert with_forced([1, 2], [1, 9, 3], 4) == ([1, 2], 2)  # contradicts them: wrong at its 2nd token
    assert with_forced([1, 2], [1], 4) == ([1, 2], 2)  # shorter than they are
    assert with_forced([], [5, 6], 4) == ([5, 6], 0)
    assert with_forced([1, 2, 3, 4, 5], [], 3) == ([1, 2, 3], 3)  # at most the room


@pytest.fixture(scope="module")
def tool_llm(demo_model_dir):
    llm = LLM(str(demo_model_dir), num_kv_blocks=96)
    tok = llm.tokenizer
    prompts = []
    for cities in ("Paris and London", "Rome and Oslo"):
        msgs, extra = chat_inputs([{"role": "user", "content": f"Get the weather in celsius for {cities}."}], [TOOL],
                                  tok.chat_template)
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, **extra)
        prompts.append(tok.encode(text, add_special_tokens=False))
    return llm, prompts


def test_forced_tokens_spell_what_the_grammar_forces(tool_llm):
    llm, _ = tool_llm
    m = llm.engine.grammar_masks().matcher(GRAMMAR)
    forced = m.forced()
    # the call's JSON is compact (no whitespace to choose): forced up to the first argument's value
    assert llm.tokenizer.decode(forced) == '<tool_call>\n{"name": "get_weather", "arguments": {"city":'
    assert m.valid_prefix(forced) == len(forced)
    for t in forced:
        m.accept(t)
    assert m.forced() == []  # the city's name: the model's choice, nothing forced


def run(llm, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=64, grammar=GRAMMAR)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].text)
            for o in llm.generate(prompts, params)]


def assert_valid_calls(outs):
    for _, _, text in outs:
        _, calls = FORMATS["hermes"].parse(text)
        assert calls and all(c.name == "get_weather" for c in calls)
        for c in calls:
            jsonschema.validate(json.loads(c.arguments), ARGS)


def test_forced_tokens_are_proposed_accepted_and_the_call_is_exact(tool_llm, demo_model_dir):
    plain_llm, prompts = tool_llm
    before = plain_llm.engine.stats().steps_total
    want = run(plain_llm, prompts)
    plain_steps = plain_llm.engine.stats().steps_total - before
    assert_valid_calls(want)
    llm = LLM(str(demo_model_dir), num_kv_blocks=96, speculative={"method": "ngram", "k": 4})
    llm.engine.speculator.proposer = Nothing()
    assert run(llm, prompts) == want
    s = llm.engine.stats()
    assert s.spec_proposed_tokens_total > 0
    # the forced tokens are the tokenizer's canonical ones, which this model picks under the mask
    assert s.spec_accepted_tokens_total == s.spec_proposed_tokens_total
    assert s.steps_total < plain_steps
    drained(llm)
    # beside the n-gram proposer's guesses (kept where they agree with the forced tokens)
    llm = LLM(str(demo_model_dir), num_kv_blocks=96, speculative={"method": "ngram", "k": 4})
    assert run(llm, prompts) == want
    assert llm.engine.stats().spec_accepted_tokens_total > 0
    drained(llm)
    drained(plain_llm)
