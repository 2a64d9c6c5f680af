"""Tenants at the edge: API keys on every route but /health and /ready (HTTP 401 in the OpenAI
shape, gRPC UNAUTHENTICATED), a tenant's own prefix cache (another tenant's cached prompt is
not a hit, nor visible), priorities capped by the key, per-tenant token-bucket limits (429 +
Retry-After, other tenants unaffected), caps on fan-out and max_tokens, and the key file."""

import asyncio
import hashlib

import grpc
import httpx
import pytest

from splitserve.config import EngineConfig

from splitserve.control.deploy_config import DeployConfig
from splitserve.orchestrator.local_backend import LocalBackend
from splitserve.ingress.grpc_service import GenerationService, serve
from splitserve.ingress.http import OpenAIServer
from splitserve.tenancy import KeyRing, RateLimiter, Tenant, load_keys
from splitserve.types import ConfigError, Priority
from splitserve.v1 import generation_pb2 as pb
from splitserve.v1 import generation_pb2_grpc as pb_grpc

ALPHA, BETA, GAMMA = "sk-alpha-0123456789", "sk-beta-0123456789", "sk-gamma-0123456789"
OPERATOR = "sk-operator-0123456789"
KEYS = {"keys": [
    {"key": ALPHA, "tenant": "alpha", "priority": "standard"},
    {"key_sha256": hashlib.sha256(BETA.encode()).hexdigest(), "tenant": "beta", "priority": "critical"},
    {"key": GAMMA, "tenant": "gamma", "requests_per_s": 1},
    {"key": OPERATOR, "tenant": "ops", "operator": True},
]}


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def backend(tiny_checkpoint):
    return LocalBackend(EngineConfig(model=str(tiny_checkpoint("llama")), num_kv_blocks=256), model_name="tiny")


def server(backend, keys=KEYS, limiter=None):
    return OpenAIServer(backend, keys=KeyRing.from_options(keys), limiter=limiter)


def call(srv, method, path, key=None, body=None):
    async def go():
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=srv.app), base_url="http://t") as h:
            return await h.request(method, path, json=body, headers=headers)

    return asyncio.run(go())


def completion(prompt="Paris is the capital", **kw):
    return {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0, **kw}


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
ROUTES = [("POST", "/v1/completions", completion()), ("POST", "/v1/chat/completions", CHAT),
          ("GET", "/v1/models", None), ("GET", "/openapi.json", None)]


@pytest.mark.parametrize("method, path, body", ROUTES)
def test_every_route_needs_a_known_key(backend, method, path, body):
    srv = server(backend)
    for key in (None, "sk-wrong-0123456789", ""):
        r = call(srv, method, path, key, body)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (path, key)
        err = r.json()["error"]
        assert err["code"] == "invalid_api_key" and "key" in err["message"] and err["type"]
    assert call(srv, method, path, ALPHA, body).status_code == 200
    assert call(srv, method, path, BETA, body).status_code == 200  # a file may hold only the digest


def test_health_and_ready_stay_open_and_metrics_can_be(backend):
    srv = server(backend)
    assert call(srv, "GET", "/health").status_code == 200 and call(srv, "GET", "/ready").status_code == 200
    assert call(server(backend, {**KEYS, "metrics_open": True}), "GET", "/metrics").status_code == 200


def test_metrics_need_an_operator_key(backend):
    """/metrics holds every tenant's counters: a tenant's key is refused (403), an operator's
    reads them, no key at all is a 401."""
    srv = server(backend)
    assert call(srv, "GET", "/metrics").status_code == 401
    refused = call(srv, "GET", "/metrics", ALPHA)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "permission_denied", refused.text
    ok = call(srv, "GET", "/metrics", OPERATOR)
    assert ok.status_code == 200 and "splitserve_" in ok.text
    assert KeyRing.from_options(KEYS).to_options()["keys"][-1]["operator"] is True  # travels with the app
    assert call(server(backend, None), "GET", "/v1/models").status_code == 200  # no keys: open


def test_a_tenant_never_hits_or_sees_another_tenants_cached_prompt(backend):
    srv = server(backend)
    prompt = "The quick brown fox jumps over the lazy dog, " * 8 + "tenant isolation"

    def cached(key):
        r = call(srv, "POST", "/v1/completions", key, completion(prompt))
        assert r.status_code == 200
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(ALPHA) == 0
    assert cached(ALPHA) > 0  # the same tenant hits its own prefix
    assert cached(BETA) == 0  # the other tenant computes it afresh and learns nothing
    assert cached(BETA) > 0
    text = call(srv, "GET", "/metrics", OPERATOR).text
    assert 'splitserve_requests_total{status="length",tenant="alpha"} 2.0' in text
    assert 'tenant="beta"' in text


def test_a_client_cannot_raise_its_priority_above_its_key(backend):
    srv = server(backend)
    seen = []
    plan = srv.backend.plan

    async def spy(req):  # a recording wrapper around the real backend
        seen.append(req.priority)
        return await plan(req)

    srv.backend.plan = spy
    try:
        for key, asked in ((ALPHA, "critical"), (BETA, "critical"), (ALPHA, "sheddable")):
            assert call(srv, "POST", "/v1/completions", key, completion(priority=asked)).status_code == 200
    finally:
        del srv.backend.plan
    assert seen == [Priority.STANDARD, Priority.CRITICAL, Priority.SHEDDABLE]


def test_rate_limit_admits_its_rate_and_spares_other_tenants():
    """R requests/s offered at 3R for 30 s: R ± 10% admitted; the other tenant, offered the same,
    is limited by its own bucket only; an unlimited tenant is never refused."""
    clock = Clock()
    lim = RateLimiter(clock)
    a, b, free = (Tenant("a", requests_per_s=4.0), Tenant("b", requests_per_s=2.0), Tenant("free"))
    got = {"a": 0, "b": 0, "free": 0}
    waits = []
    for step in range(int(30 * 12)):  # 12 offers a second each: 3R for a
        clock.t += 1 / 12
        for t in (a, b, free):
            wait = lim.charge_now(t, 1, 10)
            if wait == 0:
                got[t.name] += 1
            else:
                waits.append(wait)
    assert abs(got["a"] / 30 - 4) <= 0.4 and abs(got["b"] / 30 - 2) <= 0.2, got
    assert got["free"] == 360 and all(0 < w <= 1 for w in waits)
    tok = Tenant("t", tokens_per_min=600)
    assert lim.charge_now(tok, 1, 600) == 0 and lim.charge_now(tok, 1, 60) == pytest.approx(6.0)
    lim.refund(tok, 1, 600)
    assert lim.charge_now(tok, 1, 60) == 0


def test_over_the_limit_is_a_429_with_retry_after(backend):
    clock = Clock()
    srv = server(backend, limiter=RateLimiter(clock))
    assert call(srv, "POST", "/v1/completions", GAMMA, completion()).status_code == 200
    r = call(srv, "POST", "/v1/completions", GAMMA, completion())
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "rate_limit_exceeded" and "gamma" in r.json()["error"]["message"]
    assert call(srv, "POST", "/v1/completions", ALPHA, completion()).status_code == 200  # another tenant
    clock.t += 1.0
    assert call(srv, "POST", "/v1/completions", GAMMA, completion()).status_code == 200


@pytest.mark.parametrize("limit", [{"requests_per_s": 1}, {"tokens_per_min": 60}])
def test_a_tenant_over_its_limit_is_refused_before_its_prompt_is_tokenized(backend, monkeypatch, limit):
    """Authentication, then the rate limit, then tokenization: once a tenant's bucket is empty,
    its next requests on every route are 429s that never reach the tokenizer or the template."""
    keys = {"keys": [{"key": GAMMA, "tenant": "gamma", **limit}]}
    srv = server(backend, keys=keys, limiter=RateLimiter(Clock()))
    tok, seen = backend.tokenizer, []
    for name in ("encode", "encode_chat"):
        real = getattr(tok, name)
        monkeypatch.setattr(tok, name, lambda *a, _real=real, _name=name, **kw: (seen.append(_name), _real(*a, **kw))[1])
    assert call(srv, "POST", "/v1/completions", GAMMA, completion(max_tokens=58)).status_code == 200  # empties it
    assert seen == ["encode"]
    for path, body in (("/v1/completions", completion()), ("/v1/chat/completions", CHAT),
                       ("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 2})):
        r = call(srv, "POST", path, GAMMA, body)
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded", (path, r.text)
    assert seen == ["encode"]  # none of the refused ones was tokenized


def test_a_tenants_requests_in_flight_are_capped(backend):
    """A key's `max_inflight`: while the tenant's streams hold its places, one more is a 429
    (code tenant_concurrency) and the rate limit is not charged for it; other tenants are not
    counted; a stream that ends gives its place back."""
    keys = {"keys": [{"key": ALPHA, "tenant": "alpha", "max_inflight": 2}, {"key": GAMMA, "tenant": "gamma"}]}
    srv = server(backend, keys=keys)
    assert KeyRing.from_options(keys).to_options()["keys"][0]["max_inflight"] == 2  # travels with the app

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=srv.app), base_url="http://t") as h:
            post = lambda key, **kw: h.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},  # noqa: E731
                                            json=completion(**kw))
            held = asyncio.ensure_future(post(ALPHA, n=2, max_tokens=400, ignore_eos=True))
            while srv.front.tenant_inflight["alpha"] < 2:  # both of its choices admitted and running
                assert not held.done(), held.result().text
                await asyncio.sleep(0.001)
            refused, other = await post(ALPHA), await post(GAMMA)
            first = await held
            after = await post(ALPHA)
            return refused, other, first, after

    refused, other, first, after = asyncio.run(go())
    assert first.status_code == 200
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "tenant_concurrency", refused.text
    assert other.status_code == 200 and after.status_code == 200
    assert not srv.front.tenant_inflight  # every place given back
    with pytest.raises(ConfigError, match="max_inflight"):
        KeyRing.from_options({"keys": [{"key": ALPHA, "tenant": "alpha", "max_inflight": 0}]})


def test_fan_out_and_max_tokens_are_bounded(backend):
    srv = server(backend, None)
    limit = backend.max_model_len
    for body, param in ((completion(n=129), "n"), (completion(prompt=["a"] * 257), "prompt"),
                        (completion(prompt=["a"] * 100, n=3), "n"), (completion(max_tokens=10**12), "max_tokens"),
                        (completion(max_tokens=limit), "max_tokens")):
        r = call(srv, "POST", "/v1/completions", None, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (param, r.text)
    r = call(srv, "POST", "/v1/chat/completions", None, {**CHAT, "max_tokens": 10**12})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert call(srv, "POST", "/v1/chat/completions", None, {**CHAT, "max_tokens": None}).status_code == 200


def test_grpc_needs_the_key_in_its_metadata(backend):
    srv = server(backend)

    async def go():
        grpc_server, port = await serve(GenerationService(srv.front), "127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = pb_grpc.GenerationStub(ch)
                req = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(temperature=0, max_tokens=2))
                codes = []
                for md in ((), (("authorization", "Bearer sk-wrong-0123456789"),), (("authorization", ALPHA),)):
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        _ = [m async for m in stub.Generate(req, metadata=md)]
                    codes.append(e.value.code())
                msgs = [m async for m in stub.Generate(req, metadata=(("authorization", f"Bearer {ALPHA}"),))]
                health = await stub.Health(pb.HealthRequest())
                return codes, msgs, health
        finally:
            await grpc_server.stop(None)

    codes, msgs, health = asyncio.run(go())
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 3
    assert msgs and msgs[-1].finish_reason and health.ready


def test_key_files_and_the_environment_key(tmp_path, tiny_checkpoint):
    f = tmp_path / "keys.yaml"
    f.write_text(f"keys:\n  - key: {ALPHA}\n    tenant: alpha\n    tokens_per_min: 1000\n")
    ring = load_keys(f)
    t = ring.tenant(f"Bearer {ALPHA}")
    assert (t.name, t.max_priority, t.tokens_per_min, t.cache_salt) == ("alpha", Priority.STANDARD, 1000.0, "tenant:alpha")
    env = ring.with_env({"SPLITSERVE_API_KEY": "sk-env-0123456789"})
    assert env.tenant("Bearer sk-env-0123456789").name == "default"
    assert KeyRing.from_options(env.to_options()).keys == env.keys  # digests only, as the app config carries them
    assert ALPHA not in str(env.to_options())
    cfg = DeployConfig.from_options({"model": str(tiny_checkpoint("llama")), "api_keys": str(f)})  # serve --config
    assert cfg.api_keys.tenant(f"Bearer {ALPHA}") == t and not DeployConfig(model=cfg.model).api_keys.keys
    bad = [{"tenant": "x"}, {"key": "short", "tenant": "x"}, {"key": ALPHA}, {"key": ALPHA, "tenant": "x", "priority": "top"},
           {"key": ALPHA, "tenant": "x", "requests_per_s": 0}, {"key": ALPHA, "key_sha256": "0" * 64, "tenant": "x"},
           {"key_sha256": "xyz", "tenant": "x"}, {"key": ALPHA, "tenant": "x", "colour": "red"}]
    for entry in bad:
        with pytest.raises(ConfigError):
            KeyRing.from_options({"keys": [entry]})
    with pytest.raises(ConfigError):
        KeyRing.from_options({"keys": [{"key": ALPHA, "tenant": "x"}, {"key": ALPHA, "tenant": "y"}]})
    with pytest.raises(ConfigError):
        load_keys(tmp_path / "missing.yaml")


def test_the_models_recommended_sampling_fills_what_a_request_omits(tmp_path):
    """generation_config.json's temperature / top_p / top_k / min_p / repetition_penalty are the
    defaults of a request that omits them (a greedy checkpoint's, do_sample false, are not);
    what the request sets wins. The demo model recommends its model card's."""
    import json

    from splitserve.engine.model.demo import RECOMMENDED_GENERATION, _recommend_sampling
    from splitserve.engine.model.config import _sampling_defaults
    from splitserve.ingress.protocol import RequestDefaults, parse_chat, parse_completion

    gen = {"temperature": 0.2, "top_p": 0.9, "top_k": 40, "repetition_penalty": 1.1, "eos_token_id": 2, "do_sample": True}
    defaults = RequestDefaults(dict(_sampling_defaults(gen)))
    assert defaults.sampling == {"temperature": 0.2, "top_p": 0.9, "top_k": 40, "repetition_penalty": 1.1}
    assert _sampling_defaults({**gen, "do_sample": False}) == ()
    p = parse_chat(CHAT, ["tiny"], defaults).options.params
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.2, 0.9, 40, 1.1)
    p = parse_completion(completion(top_p=0.5), ["tiny"], defaults).options.params  # completion() sets temperature 0
    assert (p.temperature, p.top_p, p.top_k) == (0.0, 0.5, 40)
    assert parse_chat(CHAT, ["tiny"]).options.params.temperature == 1.0  # no recommendation: OpenAI's default
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    _recommend_sampling(tmp_path)
    written = json.loads((tmp_path / "generation_config.json").read_text())
    assert written == {"eos_token_id": 2, **RECOMMENDED_GENERATION}

