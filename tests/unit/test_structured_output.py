"""Structured output in the engine and at the edge (issue 29): a grammar constrains every sampled
token, a complete grammar finishes the row, the constraint survives a handoff and a migration
(a second engine continues from the tokens already accepted, exactly), logit_bias moves logits,
and bad constraints are 400s naming the parameter. Outputs are checked with `jsonschema`."""

import json

import jsonschema
import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.ingress.protocol import APIError, parse_chat, parse_completion
from splitserve.text.grammar import check, choice_spec, json_schema_spec
from splitserve.types import ConfigError, FinishReason, GrammarKind, GrammarSpec, Request
from tests.engine_checks import assert_engine_drained

SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["n", "kind", "ok", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    with LLM(str(tiny_checkpoint("llama")), num_kv_blocks=128, max_num_batched_tokens=64) as llm:
        yield llm


@pytest.fixture(autouse=True)
def drained_after(llm):
    yield
    assert_engine_drained(llm.engine)


def run(engine, reqs, outputs=None):
    """Run requests to the end on one engine: request id -> (tokens, finish reason)."""
    for r in reqs:
        engine.add_request(r, outputs=tuple((outputs or {}).get(r.request_id, ())))
    got = {r.request_id: [] for r in reqs}
    reasons = {}
    while engine.has_unfinished():
        for c in engine.step():
            got[c.request_id] += c.token_ids
            if c.finish_reason is not None:
                reasons[c.request_id] = c.finish_reason
    return got, reasons


def test_sampled_json_always_validates_and_a_complete_grammar_finishes_the_row(llm):
    spec = json_schema_spec(SCHEMA)
    params = SamplingParams(temperature=1.0, seed=7, n=1, max_tokens=120, grammar=spec)
    outs = llm.generate([[5, 6, 7, 8 + i] for i in range(16)], params)
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text  # the grammar ended it, well before max_tokens
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert len({o.outputs[0].text for o in outs}) > 1  # sampled, not one fixed answer


def test_choice_regex_and_grammar_constrain_greedy_and_sampled_rows(llm):
    choice = SamplingParams(temperature=1.0, seed=1, max_tokens=20, grammar=choice_spec(["yes", "no", "maybe"]))
    regex = SamplingParams(temperature=0.0, max_tokens=30, grammar=GrammarSpec(GrammarKind.REGEX, r"[0-9]{3}-[a-z]{2}"))
    lark = SamplingParams(temperature=0.7, seed=2, max_tokens=30,
                          grammar=GrammarSpec(GrammarKind.GRAMMAR, 'root ::= "(" [0-9] ")" | "<" [a-c] ">"'))
    free = SamplingParams(temperature=0.0, max_tokens=8)
    outs = llm.generate([[9, 10, 11]] * 4, [choice, regex, lark, free])
    assert outs[0].outputs[0].text in ("yes", "no", "maybe")
    import re

    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", outs[1].outputs[0].text)
    assert re.fullmatch(r"\([0-9]\)|<[a-c]>", outs[2].outputs[0].text)
    assert all(o.outputs[0].finish_reason == "stop" for o in outs[:3])
    # the unconstrained row in the same batches is what it is alone
    assert outs[3].outputs[0].token_ids == llm.generate([[9, 10, 11]], free)[0].outputs[0].token_ids


def test_logprobs_stop_strings_n_and_max_tokens_work_under_a_grammar(llm):
    spec = GrammarSpec(GrammarKind.REGEX, r"[0-9]{3}-[a-z]{2}")
    with_lp = llm.generate([[9, 10, 11]], SamplingParams(temperature=0.0, max_tokens=30, grammar=spec, logprobs=2))
    c = with_lp[0].outputs[0]
    assert len(c.logprobs) == len(c.token_ids) > 0
    assert all(lp.token_id == tok and lp.logprob > float("-inf") for lp, tok in zip(c.logprobs, c.token_ids))
    full = c.text
    stopped = llm.generate([[9, 10, 11]], SamplingParams(temperature=0.0, max_tokens=30, grammar=spec,
                                                          stop=[full[2:4]]))[0].outputs[0]
    assert stopped.text == full[:2] and stopped.finish_reason == "stop"  # a stop string inside the grammar's text
    cut = llm.generate([[9, 10, 11]], SamplingParams(temperature=0.0, max_tokens=2, grammar=spec))[0].outputs[0]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 2
    several = llm.generate([[9, 10, 11]], SamplingParams(temperature=1.0, seed=3, n=6, max_tokens=30, grammar=spec))
    import re

    assert len(several[0].outputs) == 6
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2}", o.text) for o in several[0].outputs)


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 11)])
@pytest.mark.parametrize("moved_after", [1, 5])
def test_a_constrained_stream_continues_exactly_on_another_engine(tiny_checkpoint, llm, temperature, seed, moved_after):
    """The handoff (1 token: the prefill worker's first) and a migration (5 delivered): a second
    engine builds its matcher from the tokens already accepted and continues as one would have."""
    params = SamplingParams(temperature=temperature, seed=seed, max_tokens=100, grammar=json_schema_spec(SCHEMA))
    whole, _ = run(llm.engine, [Request("whole", (3, 4, 5, 6), params)])
    tokens = whole["whole"]
    assert len(tokens) > moved_after
    with LLM(str(tiny_checkpoint("llama")), num_kv_blocks=128) as other:
        rest, reasons = run(other.engine, [Request("moved", (3, 4, 5, 6), params)],
                            outputs={"moved": tokens[:moved_after]})
        other.engine.check_invariants()
    assert tokens[:moved_after] + rest["moved"] == tokens and reasons["moved"] is FinishReason.STOP


def test_tokens_that_do_not_fit_the_grammar_are_refused_when_a_stream_moves(llm):
    params = SamplingParams(temperature=0.0, max_tokens=10, grammar=choice_spec(["yes", "no"]))
    bad = llm.tokenizer.encode("maybe")
    with pytest.raises(ConfigError, match="do not fit its grammar"):
        llm.engine.add_request(Request("r", (3, 4), params), outputs=tuple(bad))


def test_logit_bias_moves_logits(llm):
    free = llm.generate([[20, 21, 22]], SamplingParams(temperature=0.0, max_tokens=4))[0].outputs[0].token_ids
    forced = llm.generate([[20, 21, 22]], SamplingParams(temperature=0.0, max_tokens=4, logit_bias={77: 100}))
    assert list(forced[0].outputs[0].token_ids) == [77] * 4
    banned = llm.generate([[20, 21, 22]], SamplingParams(temperature=0.0, max_tokens=4,
                                                          logit_bias={free[0]: -100}))
    assert banned[0].outputs[0].token_ids[0] != free[0]
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        llm.engine.check_request(Request("r", (1, 2), SamplingParams(logit_bias={10**6: 1.0})))


def test_a_batch_without_grammar_does_no_mask_work(llm, monkeypatch):
    masks = llm.engine.grammar_masks()
    calls = []
    monkeypatch.setattr(masks, "apply", lambda *a: calls.append(a))
    llm.generate([[1, 2, 3]] * 3, SamplingParams(temperature=0.5, seed=3, max_tokens=4))
    assert calls == []


def test_masks_filled_during_the_forward_pass_sample_as_masks_filled_after(llm, monkeypatch):
    """The step's grammar masks are filled on their own thread while the model runs, and sample
    exactly what masks filled after the forward pass do (seeded, a mixed batch)."""
    import threading

    masks, engine = llm.engine.grammar_masks(), llm.engine
    spec = json_schema_spec({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=16, grammar=spec if s != 2 else None) for s in range(3)]
    threads, fill = [], masks._fill

    def watched(matchers):
        threads.append(threading.current_thread().name)
        return fill(matchers)

    monkeypatch.setattr(masks, "_fill", watched)
    ahead = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert threads and all(t.startswith("grammar-masks") for t in threads), threads
    threads.clear()
    monkeypatch.setattr(engine, "_masks_ahead", lambda sched: None)
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert threads and "grammar-masks" not in "".join(threads)
    assert ahead == after


def test_properties_are_written_in_the_order_the_schema_lists_them(tiny_checkpoint):
    """The grammar writes an object's properties in the schema's order, so the spec keeps that
    order (a "reasoning" before its "answer" is the point of such a schema; sorted, "answer"
    would come first), while the order of keywords, which means nothing, is canonical."""
    import llguidance

    tokenizer = llguidance.LLTokenizer(str(tiny_checkpoint("llama") / "tokenizer.json"))
    schema = {"type": "object", "properties": {"reasoning": {"type": "string"}, "answer": {"type": "integer"}},
              "required": ["reasoning", "answer"]}
    spec = json_schema_spec(schema)
    assert spec == json_schema_spec({"required": ["reasoning", "answer"], "properties": schema["properties"],
                                     "type": "object"})
    assert spec != json_schema_spec({**schema, "properties": dict(reversed(schema["properties"].items()))})
    grammar = check(spec)

    def accepts(text):
        m = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        return m.consume_tokens(tokenizer.tokenize_str(text)) and m.is_accepting()

    assert accepts('{"reasoning": "two and two", "answer": 4}')
    assert not accepts('{"answer": 4, "reasoning": "two and two"}')


def test_compiled_grammars_are_cached_by_spec(llm):
    masks = llm.engine.grammar_masks()
    spec = json_schema_spec({"type": "object", "properties": {"zz": {"type": "integer"}}, "required": ["zz"]})
    before = masks.compiles
    llm.generate([[1, 2]] * 3, SamplingParams(temperature=0.0, max_tokens=20, grammar=spec))
    equal = json_schema_spec(json.dumps({"required": ["zz"], "type": "object", "properties": {"zz": {"type": "integer"}}}))
    llm.generate([[1, 2]], SamplingParams(temperature=0.0, max_tokens=20, grammar=equal))
    assert masks.compiles == before + 1
    assert 0 < llm.engine.stats().grammar_compile_s < 10  # measured, for admission's TTFT


# ------------------------------------------------------------------------ the edge


def chat(**extra):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


def test_response_format_and_vllm_extensions_parse_into_one_spec():
    js = {"type": "json_schema", "json_schema": {"name": "Person", "schema": SCHEMA, "strict": True}}
    assert parse_chat(chat(response_format=js), ["m"]).options.params.grammar == json_schema_spec(SCHEMA)
    assert parse_chat(chat(response_format={"type": "json_object"}), ["m"]).options.params.grammar.kind is GrammarKind.JSON_OBJECT
    assert parse_chat(chat(response_format={"type": "text"}), ["m"]).options.params.grammar is None
    body = {"model": "m", "prompt": "x", "structured_outputs": {"choice": ["a", "b"]}}
    assert parse_completion(body, ["m"]).options.params.grammar == choice_spec(["a", "b"])
    body = {"model": "m", "prompt": "x", "guided_regex": "[0-9]+", "logit_bias": {"5": -100, "7": 2.5}}
    p = parse_completion(body, ["m"]).options.params
    assert p.grammar == GrammarSpec(GrammarKind.REGEX, "[0-9]+") and p.logit_bias == ((5, -100.0), (7, 2.5))


@pytest.mark.parametrize("extra,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strang"}}}},
     "response_format", "strang"),
    # an unsupported keyword is named; a remote $ref is never fetched
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}}}},
     "response_format", 'Unimplemented keys: ["not"]'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "https://e.x/s.json"}}}},
     "response_format", "does not fetch"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}},
     "response_format.json_schema.name", "letters"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
    ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "regex"),
    ({"structured_outputs": {"grammar": "root ::= ( \"a\""}}, "structured_outputs", "grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"guided_json": "{not json"}, "guided_json.json", "not valid JSON"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "only one"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "not a token id"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "at most 300"),
    ({"structured_outputs": {"json": {"type": "string", "pattern": "[a-"}}}, "structured_outputs", "regex"),
])
def test_bad_constraints_are_400s_naming_the_parameter(extra, param, words):
    with pytest.raises(APIError) as e:
        parse_chat(chat(**extra), ["m"])
    assert e.value.status == 400 and e.value.param == param and words in e.value.message, e.value.message


def test_grammar_text_is_bounded():
    with pytest.raises(ConfigError, match="at most 65536"):
        GrammarSpec(GrammarKind.REGEX, "a" * 70_000)
    with pytest.raises(ConfigError, match="not supported"):
        check(json_schema_spec({"$ref": "#/nowhere"}))


def test_the_grammar_library_loads_no_torch():
    """The edge checks constraints with llguidance; an ingress replica never loads torch."""
    import subprocess
    import sys

    code = ("import sys\nimport splitserve.ingress.structured as s\n"
            "s.grammar_of({'response_format': {'type': 'json_object'}})\nprint('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


def test_bitmask_unpacking_matches_a_reference():
    from splitserve.engine.grammar import unpack

    rng = torch.Generator().manual_seed(0)
    mask = torch.randint(-(2**31), 2**31 - 1, (3, 4), generator=rng, dtype=torch.int64).to(torch.int32)
    ref = torch.tensor([[(int(mask[r, t // 32]) >> (t % 32)) & 1 for t in range(120)] for r in range(3)]).bool()
    assert torch.equal(unpack(mask, 120), ref)
    assert not unpack(mask, 130)[:, 128:].any()  # logits past the tokenizer's words: never allowed


def test_a_grammar_over_the_compile_budget_is_a_400(tiny_checkpoint, monkeypatch):
    """A grammar that does not compile within the budget (here a 0.05 s budget, and a compiler
    slowed by a wrapper) is refused as bad input, not a 5xx, and the engine serves on."""
    import asyncio
    import time

    import httpx

    from splitserve.config import EngineConfig
    from splitserve.ingress.http import OpenAIServer
    from splitserve.orchestrator.local_backend import LocalBackend
    from splitserve.worker import engine_loop

    backend = LocalBackend(EngineConfig(model=str(tiny_checkpoint("llama")), num_kv_blocks=64), model_name="tiny")
    real = backend.loop.engine.prepare

    def slow(params):
        time.sleep(0.3)
        return real(params)

    monkeypatch.setattr(engine_loop, "GRAMMAR_COMPILE_S", 0.05)
    monkeypatch.setattr(backend.loop.engine, "prepare", slow)
    body = {"model": "tiny", "prompt": "x", "max_tokens": 4, "structured_outputs": {"regex": "[0-9]{3}"}}

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=OpenAIServer(backend).app),
                                     base_url="http://t") as h:
            refused = await h.post("/v1/completions", json=body)
            fine = await h.post("/v1/completions", json={**body, "structured_outputs": None})
            return refused, fine

    try:
        refused, fine = asyncio.run(go())
    finally:
        backend.loop.close()
    assert refused.status_code == 400, refused.text
    assert "did not compile within 0.05 s" in refused.json()["error"]["message"]
    assert fine.status_code == 200
