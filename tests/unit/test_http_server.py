"""The OpenAI-compatible HTTP surface, driven by the official `openai` SDK unchanged (over an
in-process ASGI transport) and by raw bad requests: completions and chat, streaming and not,
usage, stop, n=2, logprobs; greedy text equals Hugging Face's; bad input is a 4xx."""

import asyncio

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")

from splitserve.engine.step_model import FEATURES  # noqa: E402
from splitserve.config import EngineConfig  # noqa: E402
from splitserve.orchestrator.local_backend import LocalBackend  # noqa: E402
from splitserve.ingress.http import OpenAIServer  # noqa: E402
from tests.loopback import free_port  # noqa: E402


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    backend = LocalBackend(EngineConfig(model=str(tiny_checkpoint("llama")), num_kv_blocks=256), model_name="tiny")
    return OpenAIServer(backend)


def run(coro):
    return asyncio.run(coro)


def client(server):
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app), base_url="http://test")
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http)


def hf_greedy_text(server, path, ids, n):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    t = torch.tensor([ids])
    out = hf.generate(t, attention_mask=torch.ones_like(t), do_sample=False, max_new_tokens=n, pad_token_id=0)
    new = out[0, len(ids):].tolist()
    eos = server.backend.engine.model_config.eos_token_ids
    return server.backend.tokenizer.decode(new), (new[-1] in eos)


def test_completion_greedy_equals_hf(server, tiny_checkpoint):
    async def go():
        c = client(server)
        r = await c.completions.create(model="tiny", prompt="Paris is the capital", max_tokens=12, temperature=0)
        s = await c.completions.create(model="tiny", prompt="Paris is the capital", max_tokens=12, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
        parts, usage = [], None
        async for ev in s:
            if ev.choices:
                parts.append(ev.choices[0].text)
            if ev.usage:
                usage = ev.usage
        return r, "".join(parts), usage

    r, streamed, usage = run(go())
    ids = server.backend.tokenizer.encode("Paris is the capital")
    ref, _ = hf_greedy_text(server, tiny_checkpoint("llama"), ids, 12)
    assert r.choices[0].text == ref == streamed
    assert r.usage.prompt_tokens == len(ids) == usage.prompt_tokens
    assert r.usage.completion_tokens == usage.completion_tokens <= 12
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_stop_n_logprobs(server):
    async def go():
        c = client(server)
        msgs = [{"role": "user", "content": "Say something."}]
        base = await c.chat.completions.create(model="tiny", messages=msgs, max_tokens=16, temperature=0,
                                               extra_body={"ignore_eos": True})
        text = base.choices[0].message.content
        stop = text[4:7]
        cut = await c.chat.completions.create(model="tiny", messages=msgs, max_tokens=16, temperature=0, stop=[stop],
                                              extra_body={"ignore_eos": True})
        two = await c.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, n=2, seed=1,
                                              temperature=1.0, logprobs=True, top_logprobs=2)
        stream = await c.chat.completions.create(model="tiny", messages=msgs, max_tokens=16, temperature=0,
                                                 stream=True, stop=[stop], extra_body={"ignore_eos": True})
        parts = [ev.choices[0].delta.content or "" async for ev in stream if ev.choices]
        return text, stop, cut, two, "".join(parts)

    text, stop, cut, two, streamed = run(go())
    assert len(text) > 7
    assert cut.choices[0].message.content == text[: text.find(stop)] == streamed
    assert cut.choices[0].finish_reason == "stop"
    assert [ch.index for ch in two.choices] == [0, 1]
    lp = two.choices[0].logprobs.content
    assert len(lp) == two.usage.completion_tokens // 2 and all(len(e.top_logprobs) == 2 for e in lp)


def test_models_health_ready(server):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app), base_url="http://t") as h:
            return [await h.get(p) for p in ("/v1/models", "/health", "/ready")]

    models, health, ready = run(go())
    assert models.json()["data"][0]["id"] == "tiny"
    assert health.status_code == ready.status_code == 200


def _short(value):
    """A body's test id: its start and size (a whole 8 MB body in every report line is noise)."""
    if isinstance(value, bytes) and len(value) > 80:
        return f"{value[:60].decode(errors='replace')}...({len(value)} bytes)"
    return None


@pytest.mark.parametrize("path,body,status", [
    ("/v1/completions", b"{not json", 400),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "max_tokens": -1}', 400),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "temperature": NaN}', 400),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "temperature": 1e9}', 400),
    ("/v1/completions", b'{"model": "nope", "prompt": "x"}', 404),
    ("/v1/completions", b'{"model": "tiny", "prompt": [1, 2, 999999]}', 400),
    ("/v1/completions", b'{"model": "tiny", "prompt": [1, 2, -3]}', 400),
    ("/v1/completions", b'{"model": "tiny", "prompt": ' + str([5] * 1100).encode() + b"}", 400),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": "hi"}', 400),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": 3}]}', 400),
    ("/v1/completions", b'{"model": "tiny", "prompt": "' + b"x" * (9 << 20) + b'"}', 413),
    ("/v1/completions", b'[1, 2]', 400),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "max_tokens": "ten"}', 400),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "n": true}', 400),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "stream": "yes"}', 400),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "stop": 5}', 400),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "top_p": 0}', 400),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "logprobs": 9}', 400),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "priority": "vip"}', 400),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "ttft_slo_ms": -1}', 400),
    ("/v1/completions", b'{"model": "tiny", "prompt": ""}', 400),
    ("/v1/completions", b'{"model": "tiny", "prompt": [[]]}', 400),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}', 400),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}',
     400),
    # bounded before any work (issue 31): nesting past 400 levels (and past Python's recursion
    # limit, which json.loads would otherwise raise as a 500), a million stop_token_ids
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "user": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "user": ' + b"[" * 401 + b"]" * 401 + b"}", 400),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "stop_token_ids": ' + str(list(range(10**6))).encode() + b"}",
     400),
], ids=_short)
def test_bad_requests_are_4xx_in_openai_shape(server, path, body, status):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app), base_url="http://t") as h:
            return await h.post(path, content=body, headers={"content-type": "application/json"})

    r = run(go())
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and "type" in err and "param" in err
    server.backend.engine.check_invariants()
    assert server.backend.engine.pool.num_in_use == 0


def _aborted(server) -> float:
    return server.metrics.requests.labels(status="abort", tenant="default")._value.get()


def _until(cond, what: str, within_s: float = 10.0) -> None:
    import time

    deadline = time.time() + within_s
    while not cond():
        assert time.time() < deadline, what
        time.sleep(0.01)


def slowed(step, seconds: float):
    import time

    def step_then_wait():
        out = step()
        time.sleep(seconds)
        return out

    return step_then_wait


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts(server, stream, monkeypatch):
    """A real socket: uvicorn in a thread; a streaming request read for three lines then closed,
    or a non-streaming one whose client closes its socket while the engine generates (uvicorn
    does not cancel the handler: the server must notice the disconnect itself). Each step made
    to take 20 ms, so the 1000 tokens take 20 s, longer than the 10 s the abort is given: a
    server that misses the disconnect fails here, however starved its event loop (at 5 ms a
    loaded machine let the request end as `length` first)."""
    import json
    import socket
    import threading

    import uvicorn

    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(server.app, host="127.0.0.1", port=port, log_level="error"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    try:
        _until(lambda: srv.started, "uvicorn did not start")
        body = {"model": "tiny", "prompt": "x", "max_tokens": 1000, "temperature": 0, "stream": stream,
                "ignore_eos": True}
        eng, before = server.backend.engine, _aborted(server)
        monkeypatch.setattr(eng, "step", slowed(eng.step, 0.02))
        if stream:
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=10) as r:
                lines = r.iter_lines()
                got = [next(lines) for _ in range(3)]
            assert any(g.startswith("data: ") for g in got)
        else:
            payload = json.dumps(body).encode()
            head = (f"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(payload)}\r\n\r\n").encode()
            with socket.create_connection(("127.0.0.1", port)) as c:
                c.sendall(head + payload)
                _until(eng.has_unfinished, "the request never reached the engine")
        _until(lambda: not eng.has_unfinished() and eng.pool.num_in_use == 0,
               "a disconnected client's request must be aborted and its blocks freed")
        assert _aborted(server) == before + 1, "it ended as an abort, not by generating all its tokens"
        eng.check_invariants()
    finally:
        srv.should_exit = True
        t.join(timeout=10)


def test_metrics_endpoint_counts_requests(server):
    async def go():
        c = client(server)
        await c.completions.create(model="tiny", prompt="metrics please", max_tokens=3, temperature=0)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app), base_url="http://t") as h:
            return (await h.get("/metrics")).text

    text = run(go())
    names = ["splitserve_time_to_first_token_seconds_count", "splitserve_e2e_request_latency_seconds_count",
             "splitserve_prefix_cache_query_tokens_total", "splitserve_requests_total"]
    for n in names:
        assert n in text, n
    count = [ln for ln in text.splitlines() if ln.startswith("splitserve_time_to_first_token_seconds_count")][0]
    assert float(count.split()[-1]) >= 1
    # the engine's online step-time fit, one gauge per term, equal to what its stats report
    fit = {ln.split('term="')[1].split('"')[0]: float(ln.split()[-1]) for ln in text.splitlines()
           if ln.startswith("splitserve_worker_step_time_coefficient{")}
    coeffs = server.backend.loop.latest_stats.step_time_coeffs
    assert list(fit) == list(FEATURES) and list(fit.values()) == pytest.approx(list(coeffs), rel=1e-6)
    assert fit["const"] > 0


def test_overload_gets_429_with_retry_after(tiny_checkpoint):
    from splitserve.router.admission import Admission, AdmissionConfig

    backend = LocalBackend(EngineConfig(model=str(tiny_checkpoint("llama")), num_kv_blocks=256), model_name="tiny")
    srv = OpenAIServer(backend, admission=Admission(AdmissionConfig(max_inflight=2)))

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=srv.app), base_url="http://t") as h:
            body = {"model": "tiny", "prompt": "load", "max_tokens": 30, "ignore_eos": True}
            rs = await asyncio.gather(*[h.post("/v1/completions", json=body) for _ in range(6)])
            sheddable = await h.post("/v1/completions", json={**body, "priority": "sheddable", "max_tokens": 2})
            return rs, sheddable, (await h.get("/metrics")).text

    rs, sheddable, metrics = run(go())
    codes = sorted(r.status_code for r in rs)
    assert codes.count(200) >= 2 and codes.count(429) >= 1, codes
    rejected = [r for r in rs if r.status_code == 429][0]
    assert int(rejected.headers["retry-after"]) >= 1 and rejected.json()["error"]["type"] == "rate_limit_error"
    assert sheddable.status_code == 200  # the server is idle again
    refused = next(float(ln.split()[-1]) for ln in metrics.splitlines()
                   if ln.startswith('splitserve_admission_rejections_total{reason="capacity"}'))
    assert refused == codes.count(429)
    assert srv.admission.inflight == 0


def test_usage_counts_each_prompt_once_even_when_identical(server):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app), base_url="http://t") as h:
            r = await h.post("/v1/completions", json={"model": "tiny", "prompt": [[5, 6, 7], [5, 6, 7]], "n": 2,
                                                      "max_tokens": 2, "ignore_eos": True})
            return r.json()

    body = run(go())
    assert len(body["choices"]) == 4
    assert body["usage"]["prompt_tokens"] == 6  # two prompts of 3 tokens; n does not multiply them
    assert body["usage"]["completion_tokens"] == 8


def test_one_failed_choice_stops_the_others_and_is_a_400(tiny_checkpoint):
    """n=2, non-streamed: choice 1 fails with a ConfigError while choice 0 is still generating.
    The answer is the 400, choice 0 is aborted at once (not run to its end), every admission
    slot comes back."""
    from splitserve.types import ConfigError

    class Failing(LocalBackend):
        async def generate(self, req, plan=None):
            if req.request_id.endswith("-1"):
                await asyncio.sleep(0.3)  # choice 0 is well under way by then
                raise ConfigError("choice 1 cannot be served")
            async for chunk in super().generate(req, plan):
                yield chunk

    backend = Failing(EngineConfig(model=str(tiny_checkpoint("llama")), num_kv_blocks=256), model_name="tiny")
    srv = OpenAIServer(backend)

    async def go():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=srv.app), base_url="http://test")
        body = {"model": "tiny", "prompt": "x", "max_tokens": 1000, "n": 2, "temperature": 0, "ignore_eos": True}
        r = await http.post("/v1/completions", json=body, timeout=30)
        await asyncio.sleep(0.2)  # the abort travels to the engine thread
        return r

    r = run(go())
    assert r.status_code == 400 and "choice 1 cannot be served" in r.json()["error"]["message"]
    eng = backend.engine
    assert not eng.has_unfinished() and eng.pool.num_in_use == 0, "choice 0 must be aborted, not run to the end"
    assert srv.front.admission.inflight == 0
    eng.check_invariants()


def test_a_body_in_small_parts_is_read_whole(server):
    """2 MB in 100-byte parts (a slow or hostile client): read in linear time, parsed once."""
    body = b'{"model": "tiny", "prompt": "x", "max_tokens": 1, "user": "' + b"u" * (2 << 20) + b'"}'

    async def parts():
        for i in range(0, len(body), 100):
            yield body[i:i + 100]

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app), base_url="http://t") as h:
            return await h.post("/v1/completions", content=parts(), headers={"content-type": "application/json"})

    r = run(go())
    assert r.status_code == 400 and r.json()["error"]["param"] == "user", r.text  # parsed: too long a user


def test_json_depth_is_counted_without_recursion():
    from splitserve.ingress.http import json_depth

    deep: list = []
    for _ in range(5000):
        deep = [deep]
    assert (json_depth(1), json_depth([]), json_depth({"a": [1, {"b": []}]}), json_depth(deep)) == (0, 1, 4, 5001)


def test_text_is_tokenized_off_the_event_loop(server, monkeypatch):
    """A prompt's tokenization (and a chat's template) runs on a worker thread: a large prompt
    must not stall the loop that streams every other request's tokens."""
    import threading

    tok = server.backend.tokenizer
    seen = []
    for name in ("encode", "encode_chat"):
        real = getattr(tok, name)
        monkeypatch.setattr(tok, name, lambda *a, _real=real, **kw: (seen.append(threading.current_thread()),
                                                                      _real(*a, **kw))[1])

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app), base_url="http://t") as h:
            a = await h.post("/v1/completions", json={"model": "tiny", "prompt": "Paris is", "max_tokens": 1})
            b = await h.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 1,
                                                          "messages": [{"role": "user", "content": "hi"}]})
            return threading.current_thread(), a, b

    loop_thread, a, b = run(go())
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    assert len(seen) >= 2 and loop_thread not in seen, seen
