"""The ingress as a Ray Serve application over a real 1 prefill + 1 decode cluster: the openai SDK
over Serve's HTTP proxy (greedy text equals the single engine's, streaming, timing headers,
/metrics; the decode pool speculating), a client generated from the protos over Serve's gRPC proxy (streaming, reflection,
INVALID_ARGUMENT, RESOURCE_EXHAUSTED with retry-after), and both workers drained afterwards."""

import asyncio
import re
import socket
from pathlib import Path

import grpc
import httpx
import pytest

from splitserve import LLM, SamplingParams
from splitserve.cli import app as serve_app
from tests.integration.serve_helpers import sees_both_pools
from splitserve.ingress.grpc_service import SERVICE_NAME
from splitserve.v1 import generation_pb2 as pb
from splitserve.v1 import generation_pb2_grpc as pb_grpc
from tests.loopback import free_port
from tests.prometheus_server import PrometheusServer

openai = pytest.importorskip("openai")

PROMPT = "Requests enter through the Serve proxies"


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
            "engine": {"num_kv_blocks": 256}, "name": "serve-app-test", "max_tokens_default": 7,
            # the autoscaler on, held at one worker a pool: its targets are on /metrics (the dashboard's)
            "autoscale": {"prefill": {"min": 1, "max": 1}, "decode": {"min": 1, "max": 1}},
            # speculating (exact: greedy text is still the single engine's), so the dashboard's speculation
            # panels have series; suffix from 1-grams: the tenant's earlier requests give proposals at once
            "speculative": {"method": "suffix", "k": 4, "min_n": 1}}
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
    # the part of it on the critical path: from the prefill's last pass to the KV verified
    assert float(raw.headers["x-splitserve-exposed-transfer-ms"]) > 0
    assert "splitserve_kv_exposed_transfer_seconds_count" in metrics
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
    assert 'splitserve_pool_size{role="prefill"} 1.0' in metrics
    assert "splitserve_kv_transfer_bytes_total" in metrics
    # the ingress replica introduced itself to the decode worker as it learned of it: its handle's
    # class (Ray Serve's) was loaded there before the first stream, not by that stream's arguments
    assert [w["callers_met"] for w in cluster.check_invariants() if "callers_met" in w] == [1]  # one replica


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
    assert msgs[-1].timings.transfer_s > 0 and msgs[-1].timings.exposed_transfer_s > 0
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in bad.details()
    assert SERVICE_NAME in services
    refused = [e for e in burst if isinstance(e, grpc.aio.AioRpcError)]
    assert refused and len(refused) < len(burst), burst  # max_inflight=3
    assert all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for e in refused)
    # Serve 2.60's gRPC proxy drops trailing metadata on errors; the details say when to retry.
    assert all(re.search(r"retry in \d+ s", e.details()) for e in refused), [e.details() for e in refused]
    for s in cluster.check_invariants():
        assert s["in_use"] == 0 and s.get("leases", 0) == 0, s


class Tricklers:
    """Connections to a TCP KV server that never finish its challenge, each sending a byte now
    and then (under any per-recv timeout), kept up from a thread until stopped."""

    def __init__(self, address: str, n: int) -> None:
        import threading

        host, port = address.rsplit(":", 1)
        self.target, self.n, self.dropped, self.opened = (host, int(port)), n, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import time

        live: list[socket.socket] = []
        try:
            while not self._stop.is_set():
                while len(live) < self.n:  # the server dropped some: open new ones
                    s = socket.create_connection(self.target, timeout=5.0)
                    s.setblocking(False)
                    live.append(s)
                    self.opened += 1
                for s in list(live):
                    try:
                        s.send(b"x")
                        while s.recv(4096):
                            pass
                        live.remove(s)  # b"": the server closed it
                        s.close()
                        self.dropped += 1
                    except BlockingIOError:
                        pass
                    except OSError:
                        live.remove(s)
                        s.close()
                        self.dropped += 1
                time.sleep(0.2)
        finally:
            for s in live:
                s.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def _p99(gaps: list[float]) -> float:
    gaps = sorted(gaps)
    return gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))]


def test_abuse_is_refused_fast_while_a_stream_goes_on(deployed):
    """Issue 31's abuse cases against the served app, through Serve's proxies, while a
    well-formed stream runs and 300 connections trickle bytes at the prefill worker's TCP KV
    server: a 100 MB gRPC message (RESOURCE_EXHAUSTED at the proxy), a million stop_token_ids,
    JSON 10^5 levels deep, a 2 MB body in 100-byte parts (each a 400). The stream ends with the
    same greedy text as unloaded, requests started meanwhile are handed off over TCP (no
    transfer failed), and nothing is left held. Its inter-token latency p99, loaded against
    unloaded, and each refusal's time are printed, not asserted. (A client SLO looser than the
    server's: tests/unit/test_admission.py.)"""
    import time

    import ray

    from splitserve.control import controller
    from splitserve.types import Role

    _, workers, url, target = deployed
    snap = ray.get(controller.find(workers.name).snapshot.remote())
    (prefill,) = snap.role(Role.PREFILL)
    (kv_address,) = [e.address for e in prefill.info.endpoints if e.transport == "tcp"]
    stream_body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 300, "ignore_eos": True, "temperature": 0,
                   "stream": True}

    async def stream(h: httpx.AsyncClient) -> tuple[str, list[float]]:
        text, arrivals = [], []
        async with h.stream("POST", "/v1/completions", json=stream_body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.monotonic())
                    text.append(__import__("json").loads(line[6:])["choices"][0]["text"])
        return "".join(text), [b - a for a, b in zip(arrivals, arrivals[1:])]

    async def timed(coro):
        began = time.monotonic()
        out = await coro
        return out, time.monotonic() - began

    async def big_grpc():
        async with grpc.aio.insecure_channel(target) as ch:
            try:
                async for _ in pb_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(text="x" * (100 << 20))):
                    pass
            except grpc.aio.AioRpcError as e:
                return e.code()
        return "answered"

    async def small_parts(h: httpx.AsyncClient):
        body = b'{"model": "tiny", "prompt": "x", "user": "' + b"u" * (2 << 20) + b'"}'

        async def parts():
            for i in range(0, len(body), 100):
                yield body[i:i + 100]

        return (await h.post("/v1/completions", content=parts(), headers={"content-type": "application/json"})).status_code

    def post(h: httpx.AsyncClient, raw: bytes):
        return h.post("/v1/completions", content=raw, headers={"content-type": "application/json"})

    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=120) as h:
            quiet_text, quiet_gaps = await stream(h)
            tricklers = Tricklers(kv_address, 300)
            try:
                loaded = asyncio.ensure_future(stream(h))
                abuse = await asyncio.gather(
                    timed(big_grpc()),
                    timed(post(h, b'{"model": "tiny", "prompt": "x", "stop_token_ids": '
                               + str(list(range(10**6))).encode() + b"}")),
                    timed(post(h, b'{"model": "tiny", "prompt": "x", "user": ' + b"[" * 10**5 + b"]" * 10**5 + b"}")),
                    timed(small_parts(h)))
                handed = [await h.post("/v1/completions", json={  # one by one: the app's max_inflight is 3
                    "model": "tiny", "prompt": f"{PROMPT} {i}", "max_tokens": 4, "ignore_eos": True}) for i in range(4)]
                loaded_text, loaded_gaps = await loaded
            finally:
                tricklers.stop()
        return quiet_text, quiet_gaps, abuse, handed, loaded_text, loaded_gaps, tricklers

    quiet_text, quiet_gaps, abuse, handed, loaded_text, loaded_gaps, tricklers = asyncio.run(go())
    (grpc_code, t_grpc), (stops, t_stops), (deep, t_deep), (parts_status, t_parts) = abuse
    print(f"\nrefused in: 100 MB gRPC {t_grpc:.2f} s, 1M stop_token_ids {t_stops:.2f} s, 10^5-deep JSON {t_deep:.2f} s, "
          f"2 MB in 100-byte parts {t_parts:.2f} s; tricklers: {tricklers.opened} opened, {tricklers.dropped} dropped")
    print(f"stream ITL p99: unloaded {_p99(quiet_gaps) * 1e3:.1f} ms, under abuse {_p99(loaded_gaps) * 1e3:.1f} ms "
          f"({len(loaded_gaps) + 1} chunks)")
    assert grpc_code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert stops.status_code == 400 and stops.json()["error"]["param"] == "stop_token_ids", stops.text
    assert deep.status_code == 400 and "deep" in deep.json()["error"]["message"], deep.text
    assert parts_status == 400
    assert tricklers.dropped > 0  # the KV server dropped tricklers meanwhile (its handshake deadline)
    assert loaded_text == quiet_text and len(quiet_gaps) >= 100
    assert all(r.status_code == 200 for r in handed), [r.text for r in handed]
    decode = [s for s in workers.check_invariants() if "transfer_failures" in s]
    assert decode and all(s["transfer_failures"] == {} for s in decode), decode
    for s in workers.check_invariants():
        assert s["in_use"] == 0 and s.get("leases", 0) == 0, s


DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "splitserve" / "dashboards" / "splitserve.json"


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every query of the shipped dashboard, its variables as Grafana
    would fill them: each custom variable's current value, $__rate_interval a minute."""
    import json

    doc = json.loads(DASHBOARD.read_text())
    values = {v["name"]: v["current"]["value"] for v in doc["templating"]["list"] if v["type"] == "custom"}
    out = []
    for panel in doc["panels"]:
        for t in panel["targets"]:
            expr = t["expr"].replace("$__rate_interval", "1m")
            for name, value in values.items():
                expr = expr.replace("$" + name, value)
            assert "$" not in expr, expr  # a variable this test does not know
            out.append((panel["title"], expr))
    return out


def test_every_dashboard_query_returns_data_from_a_real_prometheus(deployed, tmp_path):
    """Issue 33: Debian's Prometheus scrapes the app's /metrics through Serve's proxy every
    second; after a burst of traffic, every PromQL expression of the dashboard the chart ships
    returns at least one finite value."""
    import math
    import shutil
    import time

    if shutil.which("prometheus") is None:
        pytest.skip("prometheus is not installed (apt-get install prometheus)")
    _, _, url, _ = deployed
    prom = PrometheusServer(tmp_path, url.removeprefix("http://"))
    prom.start()
    try:
        deadline = time.monotonic() + 30
        while not prom.target_up():
            assert time.monotonic() < deadline, "prometheus never scraped the app"
            time.sleep(0.5)

        async def traffic():
            c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x")
            until = time.monotonic() + 12
            while time.monotonic() < until:
                await asyncio.gather(*(c.completions.create(model="tiny", prompt=f"{PROMPT} {i}", max_tokens=6,
                                                            extra_body={"ignore_eos": True}) for i in range(2)))
        asyncio.run(traffic())
        time.sleep(3)  # two more scrapes
        empty = []
        for title, expr in dashboard_queries():
            values = [float(r["value"][1]) for r in prom.query(expr)]
            if not any(math.isfinite(v) for v in values):
                empty.append((title, expr, values))
        assert not empty, empty
    finally:
        prom.stop()
