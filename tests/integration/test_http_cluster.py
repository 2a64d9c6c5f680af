"""The HTTP ingress over the disaggregated cluster: the openai SDK gets the same greedy text as
the single engine, streaming works, a stop string ends the request early on every worker."""


import httpx
import pytest

from splitserve import LLM, SamplingParams
from splitserve.orchestrator import Cluster
from splitserve.ingress.http import OpenAIServer

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
            return full, streamed

        full, streamed = cluster.run(go())  # on the router's own loop
        assert full.choices[0].text == ref
        assert streamed == ref[: ref.find(ref[5:8])]
        for s in cluster.check_invariants():
            assert s["in_use"] == 0 and s.get("leases", 0) == 0, s
