"""Losing an ingress replica (issue 30), through the app as users run it: the Serve app
(`build_app`) over a 1P+1D cluster with two `Ingress` replicas, 16 streamed completions over
HTTP through Serve's proxy — half of them `MAX_TOKENS` long, half `LONG` (far longer than this
test: their client leaves after `MAX_TOKENS // 2` events). The process of the replica serving the most of
them (as the decode worker counts its callers) is SIGKILLed while they are mid-flight.

Shown, the fault first: that replica held streams at the kill, its process is gone, and its
streams (no others) were cut (each cut one's text a prefix of the uninterrupted run's). Then
recovery: every other stream goes on with the uninterrupted run's text; requests sent right
after the kill are answered (200, the same text); the killed replica's requests are stopped on
the workers — by far fewer decode steps than its `LONG` streams would have taken — and nothing
stays held; Serve brings the replica count back to two."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import pytest
import ray

from splitserve import LLM, SamplingParams
from tests.chaos.harness import prompts
from tests.loopback import free_port

APP, N, MAX_TOKENS = "chaos-ingress", 16, 64
LONG = 900  # odd streams' max_tokens (the tiny model's context is 1024): unstopped, ~900 more decode steps
pytestmark = pytest.mark.timeout(300)


class HttpStreams:
    """Streamed completions through the proxy, each in the background: `progress[i]` (events),
    its text so far, and how it ended (None while it runs; "done" after [DONE]; "left": its client
    left after `leave_after[i]` events, where given; else what broke it)."""

    def __init__(self, url: str, ps, max_tokens: list[int], leave_after: dict[int, int]) -> None:
        self.url, self.ps, self.max_tokens, self.leave_after = url, ps, max_tokens, leave_after
        self.progress, self.texts = [0] * len(ps), [""] * len(ps)
        self.ended: list[str | None] = [None] * len(ps)
        self._thread = threading.Thread(target=lambda: asyncio.run(self._all()), daemon=True)
        self._thread.start()

    async def _all(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(120.0)) as h:
            await asyncio.gather(*[self._one(h, i) for i in range(len(self.ps))])

    async def _one(self, h: httpx.AsyncClient, i: int) -> None:
        body = {"model": "tiny", "prompt": list(self.ps[i]), "max_tokens": self.max_tokens[i], "temperature": 0,
                "ignore_eos": True, "stream": True}
        try:
            async with h.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    self.ended[i] = f"HTTP {r.status_code}"
                    return
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        self.ended[i] = "done"
                        return
                    if line.startswith("data: "):
                        event = json.loads(line[len("data: "):])
                        if "error" in event:
                            self.ended[i] = f"error event: {event['error']}"
                            return
                        self.texts[i] += "".join(c["text"] for c in event["choices"])
                        self.progress[i] += 1
                        if self.progress[i] >= self.leave_after.get(i, self.max_tokens[i] + 1):
                            self.ended[i] = "left"
                            return
            self.ended[i] = "ended without [DONE]"
        except httpx.HTTPError as e:
            self.ended[i] = f"{type(e).__name__}: {e}"

    def wait_progress(self, at_least: int, timeout: float = 90.0) -> None:
        deadline = time.time() + timeout
        while min(self.progress) < at_least:
            assert all(e is None for e in self.ended), self.ended  # none may end before the kill
            assert time.time() < deadline, f"no progress: {self.progress}"
            time.sleep(0.01)

    def join(self, timeout: float = 180.0) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"streams still open: {self.ended}"


def replicas() -> dict[str, int]:
    """The app's live Ingress replicas: Ray actor id (hex) -> the pid of its process."""
    out = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["namespace"] == "serve" and a["name"].startswith(f"SERVE_REPLICA::{APP}#Ingress#"):
            try:
                h = ray.get_actor(a["name"], namespace="serve")
                out[h._actor_id.hex()] = ray.get(h.__ray_call__.remote(lambda _: os.getpid()), timeout=30)
            except (ValueError, ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass  # gone meanwhile
    return out


def streams_by_caller(decode) -> dict[str, int]:
    """The decode worker's running streams, counted by the ingress replica (actor id) they serve."""
    return ray.get(decode.__ray_call__.remote(
        lambda w: {c._actor_id.hex(): len(ids) for c, ids in w.callers._streams.items()}))


def wait_for(what, timeout: float = 60.0, every: float = 0.1):
    deadline = time.time() + timeout
    while not (got := what()):
        assert time.time() < deadline, "timed out"
        time.sleep(every)
    return got


@pytest.fixture
def app(ray_session, tiny_checkpoint):
    """The Serve app, this test's own: Serve replaces the killed replica (and may start a proxy
    on its node), all of which its shutdown takes down."""
    from ray import serve

    from splitserve.control import controller
    from splitserve.control.launch import wait_ready
    from splitserve.deploy import build_app

    model = str(tiny_checkpoint("llama"))
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {"model": model, "prefill": 1, "decode": 1, "transport": "auto", "disagg_min_tokens": 0,
            "served_model_name": "tiny", "engine": {"num_kv_blocks": 1024}, "name": APP, "ingress_replicas": 2}
    try:
        serve.run(build_app(args), name=APP, route_prefix="/")
        ctl = controller.find(APP)
        wait_ready(ctl)
        wait_for(lambda: len(replicas()) == 2)
        yield model, ctl, f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()  # the test session's Ray lives on


def workers(ctl, role: str) -> list:
    snap = ray.get(ctl.snapshot.remote())
    return [w.handle for w in snap.workers if w.role.value == role]


def steps(decode) -> int:
    return ray.get(decode.load.remote()).stats.steps_total


async def answered(url: str, prompt, n: int) -> list[httpx.Response]:
    """`n` requests for `prompt` at once."""
    body = {"model": "tiny", "prompt": list(prompt), "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, timeout=60) as h:
        return await asyncio.gather(*[h.post("/v1/completions", json=body) for _ in range(n)])


def test_sigkill_one_of_two_serve_ingress_replicas(app):
    model, ctl, url = app
    ps = prompts(N + 1, seed=41)
    # the uninterrupted run's text: a short stream's whole, a long one's first 2 * MAX_TOKENS tokens
    # (its client leaves after MAX_TOKENS // 2 events, each one token or more)
    sps = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS if i % 2 == 0 else 2 * MAX_TOKENS, ignore_eos=True)
           for i in range(N + 1)]
    ref = [o.outputs[0].text for o in LLM(model, num_kv_blocks=512).generate([list(p) for p in ps], sps)]
    (decode,) = workers(ctl, "decode")
    # both replicas answer (each its own router: one that has not seen the pools yet would 503)
    wait_for(lambda: all(r.status_code == 200 for r in asyncio.run(answered(url, ps[N], 6))))
    before = replicas()
    load = HttpStreams(url, ps[:N], [MAX_TOKENS if i % 2 == 0 else LONG for i in range(N)],
                       leave_after={i: MAX_TOKENS // 2 for i in range(1, N, 2)})
    load.wait_progress(3)
    # every stream on the decode worker, counted by the replica it serves (a stream's first
    # events may come before its decode stream has registered its caller there)
    wait_for(lambda: sum(streams_by_caller(decode).values()) == N, timeout=30)
    by_caller = streams_by_caller(decode)
    victim = max(before, key=lambda a: by_caller.get(a, 0))
    held, steps_at_kill = by_caller.get(victim, 0), steps(decode)
    os.kill(before[victim], signal.SIGKILL)
    load.join()

    # the fault landed: that replica held streams when its process was killed, and those (no
    # others: the other replica's are untouched) were cut mid-flight
    assert held >= 1 and sum(by_caller.values()) == N, by_caller
    assert victim not in replicas()
    cut = [i for i, e in enumerate(load.ended) if e not in ("done", "left")]
    print(f"\ningress loss: the killed replica held {held} of {N} streams, {len(cut)} cut "
          f"({sorted({load.ended[i] for i in cut})})")
    assert 1 <= len(cut) <= held, load.ended
    for i in range(N):  # what any stream delivered is the uninterrupted run's
        assert ref[i].startswith(load.texts[i]) and load.texts[i], (i, load.texts[i], ref[i])

    # recovery: every other stream went on exactly (the short ones to their end), and requests
    # sent now are answered
    assert all(load.ended[i] == ("done" if i % 2 == 0 else "left") for i in range(N) if i not in cut), load.ended
    assert [load.texts[i] for i in range(0, N, 2) if i not in cut] == [ref[i] for i in range(0, N, 2) if i not in cut]
    for r in asyncio.run(answered(url, ps[N], 4)):
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref[N], r.text
    # the killed replica's requests were stopped on the workers, not decoded to LONG for nobody
    held_now = lambda: [s for h in workers(ctl, "prefill") + workers(ctl, "decode")  # noqa: E731
                        for s in [ray.get(h.check_invariants.remote())]
                        if s["in_use"] or s.get("leases", 0) or s.get("grants", 0) or s.get("handoffs", 0)
                        or s.get("staged", 0)]
    wait_for(lambda: not held_now(), timeout=60)
    assert not streams_by_caller(decode)
    after_kill = steps(decode) - steps_at_kill
    print(f"  {after_kill} decode steps after the kill (an unstopped LONG stream: ~{LONG})")
    assert after_kill < LONG // 2, after_kill
    # and Serve brought a new replica up beside the survivor
    after = wait_for(lambda: r if len(r := replicas()) == 2 else None, timeout=120, every=0.5)
    assert victim not in after and len(set(after) & set(before)) == 1
