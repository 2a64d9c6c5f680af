"""Tool calling (issue 29): each family's call format read back into calls, the grammar of a
forced call accepting exactly valid calls, tools rendered for a template that knows them and for
one that does not, and bad tool requests as 400s naming the parameter."""

import json

import llguidance
import pytest

from splitserve.ingress.protocol import APIError, parse_chat
from splitserve.text.grammar import check
from splitserve.text.tool_calls import FORMATS, FirstCallOnly, Tool, chat_inputs, format_for, tools_of

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def tools():
    return tools_of([WEATHER, TIME])


@pytest.mark.parametrize("name,text,content", [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
               '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', "Let me look."),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                    '{"name": "get_time", "parameters": {}}', ""),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                '{"name": "get_time", "arguments": {}}]', ""),
])
def test_each_format_reads_its_calls_back(name, text, content):
    got_content, calls = FORMATS[name].parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    # parallel_tool_calls: false under tool_choice auto: the first call is the answer
    first = FirstCallOnly(FORMATS[name])
    assert first.parse(text) == (content, calls[:1]) and first.open == FORMATS[name].open


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_text_that_only_looks_like_a_call_stays_text(name):
    fmt = FORMATS[name]
    for text in ("The weather is fine.", fmt.open + " not json", fmt.open + '{"nom": 1}'):
        assert fmt.parse(text) == (text, [])


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return llguidance.LLTokenizer(str(tiny_checkpoint("llama") / "tokenizer.json"))


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("parallel", [False, True])
def test_a_forced_call_grammar_accepts_valid_calls_and_nothing_else(tokenizer, name, parallel):
    fmt = FORMATS[name]
    grammar = check(fmt.grammar(tools(), parallel))
    good = {"hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>',
            "llama3_json": '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}',
            "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}]'}[name]
    bad = good.replace('"c"', '"k"')  # unit outside its enum
    unknown = good.replace("get_weather", "get_rain")
    padded = good.replace('{"name"', '{ \n  "name"')  # free whitespace: a model could pad until max_tokens

    def accepts(text):
        m = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        return m.consume_tokens(tokenizer.tokenize_str(text)) and m.is_accepting()

    assert accepts(good) and not accepts(bad) and not accepts(unknown) and not accepts(padded)
    assert fmt.parse(good)[1][0].name == "get_weather"


def test_declared_arguments_only_unless_the_schema_says_otherwise(tokenizer):
    """Argument objects that list their properties and say nothing of others take no others,
    nested ones too (a model held to a grammar that allowed them was seen inventing keys until
    max_tokens); an object that says additionalProperties, or a free dict, keeps what it says;
    the schema's own data (an enum's values) is never touched."""
    params = {"type": "object", "properties": {
        "city": {"type": "string"}, "at": {"type": "object", "properties": {"day": {"type": "integer"}}},
        "opts": {"type": "object", "properties": {"x": {"type": "integer"}}, "additionalProperties": True},
        "meta": {"type": "object"}, "kind": {"enum": [{"properties": {}}]}}, "required": ["city"]}
    open_tool = tools_of([{"type": "function", "function": {"name": "f", "parameters": params}}])
    grammar = check(FORMATS["hermes"].grammar(open_tool, False))

    def accepts(args):
        text = '<tool_call>\n{"name": "f", "arguments": ' + json.dumps(args) + "}\n</tool_call>"
        m = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        return m.consume_tokens(tokenizer.tokenize_str(text)) and m.is_accepting()

    assert accepts({"city": "Oslo", "at": {"day": 3}})
    assert not accepts({"city": "Oslo", "country": "NO"}) and not accepts({"city": "Oslo", "at": {"day": 3, "h": 1}})
    assert accepts({"city": "Oslo", "opts": {"x": 1, "y": 2}, "meta": {"any": "thing"}})
    assert accepts({"city": "Oslo", "kind": {"properties": {}}})
    assert params["properties"]["at"].keys() == {"type", "properties"}  # the caller's schema left as it was
    # properties in the order the tool lists them (a model writes them so; sorted, "at" would go first)
    assert not accepts({"at": {"day": 3}, "city": "Oslo"})


def test_the_format_follows_the_template_unless_named():
    assert format_for("{% if tools %}<tool_call>{% endif %}").name == "hermes"
    assert format_for("... [TOOL_CALLS] ...").name == "mistral"
    assert format_for("<|python_tag|> ipython").name == "llama3_json"
    assert format_for(None).name == "hermes"
    assert format_for("[TOOL_CALLS]", "hermes").name == "hermes"


def test_tools_render_through_a_template_that_knows_them_and_one_that_does_not():
    msgs = [{"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "content": "12 C", "tool_call_id": "call_1"}]
    same, kw = chat_inputs(msgs, tools(), "{% for t in tools %}{{ t }}{% endfor %}")
    assert same == msgs and [t["function"]["name"] for t in kw["tools"]] == ["get_weather", "get_time"]
    plain, kw = chat_inputs(msgs, tools(), "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert kw == {} and plain[0]["role"] == "system" and "get_weather" in plain[0]["content"]
    assert "<tool_call>" in plain[2]["content"] and json.loads(plain[2]["content"].split("\n")[1])["name"] == "get_weather"
    assert plain[3] == {"role": "user", "content": "<tool_response>\n12 C\n</tool_response>"}


def body(**extra):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER, TIME], **extra}


def test_tool_choice_parses():
    assert parse_chat(body(), ["m"]).tools.choice == "auto"
    assert parse_chat(body(tool_choice="none"), ["m"]).tools is None
    req = parse_chat(body(tool_choice={"type": "function", "function": {"name": "get_time"}},
                          parallel_tool_calls=False), ["m"])
    assert [t.name for t in req.tools.forced] == ["get_time"] and req.tools.parallel is False
    assert [t.name for t in parse_chat(body(tool_choice="required"), ["m"]).tools.forced] == ["get_weather", "get_time"]
    msgs = [{"role": "user", "content": "x"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "noon"}]
    parsed = parse_chat(body(messages=msgs), ["m"]).messages
    assert parsed[1]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": {}}
    assert parsed[2]["tool_call_id"] == "c1"


@pytest.mark.parametrize("extra,param,words", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not among the tools"),
    ({"tool_choice": "sometimes"}, "tool_choice", "expected none"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools",
     "JSON Schema of an object"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "expected"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "offered twice"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER] * 129}, "tools", "at most 128"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "cannot be combined"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "needs the id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]},
     "messages[0].tool_calls", "not JSON"),
])
def test_bad_tool_requests_are_400s(extra, param, words):
    with pytest.raises(APIError) as e:
        parse_chat(body(**extra), ["m"])
    assert e.value.status == 400 and e.value.param == param and words in e.value.message, e.value.message


def test_tool_names_and_sizes_are_bounded():
    with pytest.raises(Exception, match="64 letters"):
        tools_of([{"type": "function", "function": {"name": "has space"}}])
    assert Tool("f").as_openai()["function"]["parameters"] == {"type": "object"}
