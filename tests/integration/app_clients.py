"""Real client libraries against a served app (issue 29): `instructor`, `langchain-openai` and the
`openai-agents` SDK, each as its own documentation says to use it, pointed at our endpoint. The
same checks run against the in-process server (test_structured_demo.py) and over the 1P+1D split
(test_http_cluster.py). Each returns what it got so the caller can check where it ran."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pydantic


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    country: str = pydantic.Field(max_length=24)


WEATHER_PARAMS = {"type": "object", "additionalProperties": False, "required": ["city"],
                  "properties": {"city": {"type": "string", "maxLength": 32}}}


def http_client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=120)


def sdk(app) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://t/v1", api_key="unused", http_client=http_client(app))


async def instructor_extracts(app, model: str) -> City:
    """instructor's default (tools) mode: a named tool choice carrying the model's schema."""
    import instructor

    client = instructor.from_openai(sdk(app))
    city = await client.chat.completions.create(
        model=model, response_model=City, max_retries=0, temperature=0, max_tokens=80,
        messages=[{"role": "user", "content": "Name a big city and its country."}])
    assert isinstance(city, City), city
    return city


def _chat(app, model: str):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=model, base_url="http://t/v1", api_key="unused", temperature=0, max_tokens=80,
                      http_async_client=http_client(app), max_retries=0)


async def langchain_structured(app, model: str) -> City:
    """`with_structured_output` (langchain-openai's default method: json_schema)."""
    city = await _chat(app, model).with_structured_output(City).ainvoke("Name a big city and its country.")
    assert isinstance(city, City), city
    return city


async def langchain_tools(app, model: str) -> dict:
    """`bind_tools` with a tool the model must call: LangChain's parsed call, valid arguments."""
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        return "sunny"

    msg = await _chat(app, model).bind_tools([get_weather], tool_choice="get_weather").ainvoke("Weather in Lima?")
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather" and call["id"], msg
    jsonschema.validate(call["args"], WEATHER_PARAMS)
    return call


async def agent_runs_a_tool(app, model: str) -> tuple[list[str], str]:
    """An openai-agents Agent with a function tool against /v1/responses: the first turn must call
    the tool (tool_choice required; the SDK resets it to auto afterwards), the tool runs, and the
    agent's next turn answers from its result. Returns (the cities the tool was called with, the
    final output)."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # the SDK would otherwise export traces to OpenAI
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        asked.append(city)
        return json.dumps({"city": city, "temperature_c": 19, "sky": "clear"})

    agent = Agent(name="weather", instructions="Answer weather questions with the get_weather tool.",
                  tools=[get_weather], model=OpenAIResponsesModel(model=model, openai_client=sdk(app)),
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=80))
    result = await Runner.run(agent, "What is the weather in Lima?", max_turns=4)
    assert asked, "the agent never called its tool"
    assert isinstance(result.final_output, str) and result.final_output, result
    return asked, result.final_output
