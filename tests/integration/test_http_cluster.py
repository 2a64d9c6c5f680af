"""The HTTP ingress over the disaggregated cluster: the openai SDK gets the same greedy text as
the single engine, streaming works, a stop string ends the request early on every worker."""

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve import LLM, SamplingParams
from splitserve.orchestrator import Cluster
from splitserve.ingress.http import OpenAIServer
from tests.integration import app_clients

openai = pytest.importorskip("openai")


def test_openai_sdk_over_the_cluster(ray_session, tiny_checkpoint):
    model = str(tiny_checkpoint("llama"))
    prompt = "The KV cache moves between workers"
    ref = LLM(model, num_kv_blocks=256).generate([prompt], SamplingParams(temperature=0, max_tokens=12,
                                                                          ignore_eos=True))[0].outputs[0].text
    with Cluster.start(model=model, transport="tcp", disagg_min_tokens=0, num_kv_blocks=256) as cluster:
        app = OpenAIServer(cluster.backend).app

        async def go():
            http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
            c = openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=http)
            full = await c.completions.create(model=cluster.backend.model_name, prompt=prompt, max_tokens=12, temperature=0,
                                              extra_body={"ignore_eos": True})
            s = await c.completions.create(model=cluster.backend.model_name, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                           stop=[ref[5:8]], extra_body={"ignore_eos": True})
            streamed = "".join([ev.choices[0].text async for ev in s if ev.choices])
            return full, streamed, (await http.get("/metrics")).text

        full, streamed, metrics = cluster.run(go())  # on the router's own loop
        assert full.choices[0].text == ref
        assert streamed == ref[: ref.find(ref[5:8])]
        # both went through the prefill worker: every phase of the split on /metrics, the KV by transport
        seen = {(s.name, tuple(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(metrics) for s in f.samples}
        for phase in ("queue", "prefill", "transfer", "exposed_transfer", "first_token", "inter_token", "e2e"):
            key = ("splitserve_request_phase_seconds_count",
                   (("phase", phase), ("route", "disaggregated"), ("tenant", "default")))
            assert seen.get(key) == 2, (phase, sorted(k for k in seen if "phase" in k[0]))
        assert seen[("splitserve_kv_transfer_bytes_total", (("transport", "tcp"),))] > 0
        for s in cluster.check_invariants():
            assert s["in_use"] == 0 and s.get("leases", 0) == 0, s


def test_structured_output_and_tools_over_the_split(ray_session, demo_model_dir):
    """Issue 29 across the split, with the demo model: every prompt prefilled on the prefill
    worker (which samples the first token under the request's grammar) and decoded on the decode
    worker (which rebuilds the matcher from it): the SDK's pydantic parse, 3 sampled json_schema
    answers valid against the schema, a required tool call valid against its parameters (whole and
    streamed), and an openai-agents Agent's multi-turn tool use. (32 sampled answers and every
    client library of app_clients.py against the in-process server: test_structured_demo.py.)"""
    import json

    import jsonschema
    import pydantic

    class Planet(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        moons: int = pydantic.Field(ge=0, le=200)

    schema = Planet.model_json_schema()
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}, "required": ["city"],
        "additionalProperties": False}}}
    with Cluster.start(model=str(demo_model_dir), prefill=1, decode=1, transport="tcp", disagg_min_tokens=0,
                       num_kv_blocks=512, name="structured-split") as cluster:
        app = OpenAIServer(cluster.backend).app
        name = cluster.backend.model_name

        async def go():
            http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
            c = openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=http)
            ask = [{"role": "user", "content": "Name a planet and how many moons it has."}]

            async def streamed_call():
                streamed = await c.chat.completions.create(
                    model=name, messages=[{"role": "user", "content": "Weather in Quito?"}], tools=[weather],
                    stream=True, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                    temperature=1.0, seed=4, max_tokens=60)
                args, reasons = "", []
                async for ev in streamed:
                    for ch in ev.choices:
                        reasons.append(ch.finish_reason)
                        for d in ch.delta.tool_calls or []:
                            args += d.function.arguments or ""
                return args, reasons

            # all at once, as clients send them: the workers batch their steps (one after another, each
            # request would pay for its steps alone)
            return await asyncio.gather(
                c.chat.completions.parse(model=name, messages=ask, response_format=Planet, temperature=0,
                                         max_tokens=60),
                c.chat.completions.create(
                    model=name, messages=ask, n=3, temperature=1.0, seed=9, max_tokens=60,
                    response_format={"type": "json_schema", "json_schema": {"name": "planet", "schema": schema}}),
                c.chat.completions.create(
                    model=name, messages=[{"role": "user", "content": "Weather in Lima?"}], tools=[weather],
                    tool_choice="required", temperature=0, max_tokens=60),
                streamed_call(),
                app_clients.agent_runs_a_tool(app, name))

        parsed, sampled, called, (args, reasons), (asked, final) = cluster.run(go())
        assert isinstance(parsed.choices[0].message.parsed, Planet), parsed.choices[0].message.content
        for ch in sampled.choices:
            assert ch.finish_reason == "stop", ch.message.content
            jsonschema.validate(json.loads(ch.message.content), schema)
        call = called.choices[0].message.tool_calls[0]
        assert called.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), weather["function"]["parameters"])
        assert reasons[-1] == "tool_calls"
        jsonschema.validate(json.loads(args), weather["function"]["parameters"])  # the streamed deltas, assembled
        assert asked and final
        traces = list(cluster.timings)  # 6 above, at least 2 from the agent (its call, then the answer)
        assert len(traces) >= 8 and all(t.prefill_worker and t.decode_worker for t in traces), traces
        for s in cluster.check_invariants():
            assert s["in_use"] == 0 and s.get("leases", 0) == 0, s
