"""The ingress as a Ray Serve application over a real 1 prefill + 1 decode cluster: the openai SDK
over Serve's HTTP proxy (greedy text equals the single engine's, streaming, timing headers,
/metrics), a client generated from the protos over Serve's gRPC proxy (streaming, reflection,
INVALID_ARGUMENT, RESOURCE_EXHAUSTED with retry-after), and both workers drained afterwards."""

import asyncio
import re
import socket

import grpc
import httpx
import pytest

from splitserve import LLM, SamplingParams
from tests.integration.serve_helpers import sees_both_pools
from splitserve.ingress.grpc_service import SERVICE_NAME
from splitserve.v1 import generation_pb2 as pb
from splitserve.v1 import generation_pb2_grpc as pb_grpc

openai = pytest.importorskip("openai")
serve_app = pytest.importorskip("splitserve.cli.app")

PROMPT = "Requests enter through the Serve proxies"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class AppWorkers:
    """The deployed app's workers, found through its Controller's registry."""

    def __init__(self, name):
        self.name = name

    def check_invariants(self):
        import ray

        from splitserve.control import controller

        snap = ray.get(controller.find(self.name).snapshot.remote())
        return ray.get([w.handle.check_invariants.remote() for w in snap.workers])


@pytest.fixture(scope="module")
def deployed(ray_session, tiny_checkpoint):
    from ray import serve
    from ray.serve.config import gRPCOptions

    from splitserve.control.launch import wait_ready
    from splitserve.control import controller
    from splitserve.deploy import build_app

    model = str(tiny_checkpoint("llama"))
    http_port, grpc_port = free_port(), free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": http_port},
                grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=[serve_app.GRPC_SERVICER]))
    args = {"model": model, "transport": "tcp", "disagg_min_tokens": 0, "max_inflight": 3, "served_model_name": "tiny",
            "engine": {"num_kv_blocks": 256}, "name": "serve-app-test", "max_tokens_default": 7}
    serve.run(build_app(args), name="serve-app-test", route_prefix="/")
    wait_ready(controller.find("serve-app-test"))
    try:
        sees_both_pools(f"http://127.0.0.1:{http_port}")
        yield model, AppWorkers("serve-app-test"), f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}"
    finally:
        serve.shutdown()  # the test session's Ray lives on


def reference(model: str, n: int) -> str:
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return LLM(model, num_kv_blocks=256).generate([PROMPT], sp)[0].outputs[0].text


def test_http_through_serve(deployed):
    model, cluster, url, _ = deployed
    ref = reference(model, 10)

    async def go():
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x")
        raw = await c.completions.with_raw_response.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0,
                                                           extra_body={"ignore_eos": True})
        s = await c.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
        streamed = "".join([ev.choices[0].text async for ev in s if ev.choices])
        async with httpx.AsyncClient(base_url=url) as h:
            bad = await h.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "temperature": "hot"})
            metrics = (await h.get("/metrics")).text
            open_ended = await h.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "ignore_eos": True})
        return raw, streamed, bad, metrics, open_ended

    raw, streamed, bad, metrics, open_ended = asyncio.run(go())
    assert open_ended.json()["usage"]["completion_tokens"] == 7  # the app's max_tokens_default
    assert raw.parse().choices[0].text == ref and streamed == ref
    assert float(raw.headers["x-splitserve-first-token-ms"]) > 0
    assert float(raw.headers["x-splitserve-transfer-ms"]) > 0  # disaggregated: the KV moved
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
    assert 'splitserve_pool_size{role="prefill"} 1.0' in metrics
    assert "splitserve_kv_transfer_bytes_total" in metrics


def test_grpc_through_serve(deployed):
    model, cluster, _, target = deployed
    ref = reference(model, 10)
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    async def go():
        async with grpc.aio.insecure_channel(target) as ch:
            stub = pb_grpc.GenerationStub(ch)
            req = pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(temperature=0, max_tokens=10,
                                                                             ignore_eos=True))
            msgs = [m async for m in stub.Generate(req)]
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                async for _ in stub.Generate(pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(top_p=2))):
                    pass
            refl = reflection_pb2_grpc.ServerReflectionStub(ch)
            async for r in refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])):
                services = [s.name for s in r.list_services_response.service]
                break
            long = pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(max_tokens=60, ignore_eos=True))

            async def one():
                try:
                    return len([m async for m in stub.Generate(long)])
                except grpc.aio.AioRpcError as e:
                    return e

            burst = await asyncio.gather(*[one() for _ in range(8)])
            return msgs, bad.value, services, burst

    msgs, bad, services, burst = asyncio.run(go())
    assert len(msgs) >= 2 and "".join(m.text for m in msgs) == ref and msgs[-1].finish_reason == "length"
    assert msgs[-1].timings.transfer_s > 0
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in bad.details()
    assert SERVICE_NAME in services
    refused = [e for e in burst if isinstance(e, grpc.aio.AioRpcError)]
    assert refused and len(refused) < len(burst), burst  # max_inflight=3
    assert all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for e in refused)
    # Serve 2.60's gRPC proxy drops trailing metadata on errors; the details say when to retry.
    assert all(re.search(r"retry in \d+ s", e.details()) for e in refused), [e.details() for e in refused]
    for s in cluster.check_invariants():
        assert s["in_use"] == 0 and s.get("leases", 0) == 0, s
