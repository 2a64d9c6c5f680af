"""Structured output as a user sees it (issue 29): the demo model (a real instruct model) served
in-process, driven by the official `openai` SDK — `chat.completions.parse` with a pydantic model,
32 sampled json_schema answers at temperature 1.0 (each checked with `jsonschema`), and a streamed
json_object answer — and by `instructor`, `langchain-openai` and the `openai-agents` SDK
(app_clients.py; the same checks run over the 1P+1D split in test_http_cluster.py)."""

import asyncio
import json

import httpx
import jsonschema
import pytest

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

from splitserve.config import EngineConfig  # noqa: E402
from splitserve.ingress.http import OpenAIServer  # noqa: E402
from splitserve.orchestrator.local_backend import LocalBackend  # noqa: E402
from tests.integration import app_clients  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    country: str = pydantic.Field(max_length=24)
    population_millions: int = pydantic.Field(ge=0, le=100)


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["animal", "legs", "can_fly"],
          "properties": {"animal": {"type": "string", "maxLength": 16},
                         "legs": {"type": "integer", "minimum": 0, "maximum": 8},
                         "can_fly": {"type": "boolean"}}}


@pytest.fixture(scope="module")
def server(demo_model_dir):
    backend = LocalBackend(EngineConfig(model=str(demo_model_dir), num_kv_blocks=1024), model_name=MODEL)
    yield OpenAIServer(backend)
    backend.loop.close()


def client(server):
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app), base_url="http://test")
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http)


def ask(content):
    return [{"role": "user", "content": content}]


def test_the_sdk_parses_a_pydantic_answer(server):
    async def go():
        return await client(server).chat.completions.parse(
            model=MODEL, messages=ask("Name a big city, its country and its population in millions."),
            response_format=City, temperature=0, max_tokens=80)

    r = asyncio.run(go())
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop", msg.content
    assert isinstance(msg.parsed, City), msg.content
    City.model_validate_json(msg.content)  # the text itself, not only the SDK's reading of it


def test_32_sampled_json_schema_answers_all_validate(server):
    async def go():
        return await client(server).chat.completions.create(
            model=MODEL, messages=ask("Describe an animal as JSON."), n=32, temperature=1.0, seed=5, max_tokens=80,
            response_format={"type": "json_schema", "json_schema": {"name": "animal", "schema": SCHEMA, "strict": True}})

    r = asyncio.run(go())
    assert len(r.choices) == 32
    answers = [c.message.content for c in r.choices]
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    assert len(set(answers)) > 1  # sampled: not one answer 32 times


def test_a_streamed_json_object_answer_assembles_into_json(server):
    async def go():
        s = await client(server).chat.completions.create(
            model=MODEL, messages=ask("Give a JSON object with a greeting."), stream=True, temperature=0,
            max_tokens=60, response_format={"type": "json_object"})
        parts, reason = [], None
        async for ev in s:
            if ev.choices:
                parts.append(ev.choices[0].delta.content or "")
                reason = ev.choices[0].finish_reason or reason
        return "".join(parts), reason

    text, reason = asyncio.run(go())
    assert reason == "stop" and isinstance(json.loads(text), dict), text


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 32}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}}


def test_a_required_tool_call_parses_and_validates(server):
    async def go():
        return await client(server).chat.completions.create(
            model=MODEL, messages=ask("What is the weather in Paris?"), tools=[WEATHER], tool_choice="required",
            temperature=0, max_tokens=80)

    c = asyncio.run(go()).choices[0]
    assert c.finish_reason == "tool_calls", c.message
    (call,) = c.message.tool_calls
    assert call.id and call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_streamed_tool_call_deltas_assemble_into_a_valid_call(server):
    async def go():
        s = await client(server).chat.completions.create(
            model=MODEL, messages=ask("Weather in Oslo, please."), tools=[WEATHER], stream=True, temperature=1.0,
            seed=3, max_tokens=80, tool_choice={"type": "function", "function": {"name": "get_weather"}})
        calls, reasons = {}, []
        async for ev in s:
            for ch in ev.choices:
                reasons.append(ch.finish_reason)
                for d in ch.delta.tool_calls or []:
                    entry = calls.setdefault(d.index, {"name": None, "arguments": ""})
                    if d.function.name:  # the name comes first, alone
                        assert entry["name"] is None and entry["arguments"] == ""
                        entry["name"] = d.function.name
                    entry["arguments"] += d.function.arguments or ""
        return calls, reasons

    calls, reasons = asyncio.run(go())
    assert reasons[-1] == "tool_calls" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])


def test_a_tool_result_goes_back_to_the_model(server):
    """The call and its result round-trip through the chat template (the demo model's does not
    know tools: both are written as the model was told to write and read them)."""
    async def go():
        c = client(server)
        first = await c.chat.completions.create(model=MODEL, messages=ask("Weather in Rome?"), tools=[WEATHER],
                                                tool_choice="required", temperature=0, max_tokens=80)
        call = first.choices[0].message.tool_calls[0]
        msgs = ask("Weather in Rome?") + [
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21, "sky": "clear"})}]
        return await c.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], temperature=0, max_tokens=40)

    r = asyncio.run(go())
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > 50  # the offer, the call and its result are all in the prompt


def test_the_responses_api_answers_formats_and_calls_tools(server):
    """/v1/responses through the SDK's responses.create: text, a json_schema answer, a forced
    function call, and its output sent back with previous_response_id (the stored conversation)."""
    tool = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
            "parameters": WEATHER["function"]["parameters"], "strict": True}

    async def go():
        c = client(server)
        text = await c.responses.create(model=MODEL, input="Say hello.", instructions="Be brief.", max_output_tokens=20,
                                        temperature=0)
        js = await c.responses.create(model=MODEL, input="Describe an animal.", temperature=0, max_output_tokens=80,
                                      text={"format": {"type": "json_schema", "name": "animal", "schema": SCHEMA}})
        called = await c.responses.create(model=MODEL, input="Weather in Kyiv?", tools=[tool], tool_choice="required",
                                          temperature=0, max_output_tokens=80)
        call = next(o for o in called.output if o.type == "function_call")
        after = await c.responses.create(model=MODEL, previous_response_id=called.id, tools=[tool], max_output_tokens=30,
                                         temperature=0, input=[{"type": "function_call_output", "call_id": call.call_id,
                                                                "output": json.dumps({"temperature_c": 3})}])
        return text, js, called, call, after

    text, js, called, call, after = asyncio.run(go())
    assert text.status in ("completed", "incomplete") and text.output_text and text.usage.output_tokens > 0
    jsonschema.validate(json.loads(js.output_text), SCHEMA)
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    assert after.usage.input_tokens > called.usage.input_tokens  # the stored conversation came along


def test_a_streamed_response_comes_as_typed_events(server):
    async def go():
        s = await client(server).responses.create(model=MODEL, input="Name three colors.", stream=True,
                                                  max_output_tokens=24, temperature=0)
        return [ev async for ev in s]

    events = asyncio.run(go())
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and "response.output_text.done" in kinds
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_instructor_extracts_a_pydantic_model(server):
    city = asyncio.run(app_clients.instructor_extracts(server.app, MODEL))
    assert city.name and city.country


def test_langchain_structured_output_and_bound_tools(server):
    async def go():
        return (await app_clients.langchain_structured(server.app, MODEL),
                await app_clients.langchain_tools(server.app, MODEL))

    city, call = asyncio.run(go())
    assert city.name and call["args"]["city"]


def test_an_openai_agents_agent_runs_its_function_tool(server):
    asked, final = asyncio.run(app_clients.agent_runs_a_tool(server.app, MODEL))
    assert len(asked) >= 1 and all(isinstance(c, str) and c for c in asked), asked
