"""The Controller applying the autoscaler on the real (three-node, local) Ray cluster, with
workers that emulate a fixed-speed device (tests/fakes/workers.py: capacity per worker, as on
a GPU): a burst of long prompts grows the prefill pool and not the decode pool; when it stops,
the prefill pool shrinks back through drain after its cooldown; no request fails; the routers
export the targets and the decisions by reason on /metrics and `status` shows the last one."""

import asyncio
import time

import httpx
import pytest
import torch

from splitserve.orchestrator import Cluster
from splitserve.ingress.http import OpenAIServer
from splitserve.types import Request, Role, SamplingParams

SP = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
AUTOSCALE = {"prefill": {"min": 1, "max": 2}, "decode": {"min": 1, "max": 2}, "interval_s": 0.5,
             "up_cooldown_s": 1.0, "down_cooldown_s": 4.0, "window_s": 4.0, "rate_window_s": 3.0,
             "ttft_slo_s": 0.5, "tpot_slo_s": 2.0}


def wait_for(cond, timeout, what, c=None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; {c.status().to_json() if c else ''}")


def pool(c, role, state="ready"):
    return [w for w in c.status().workers if w.role == role and w.state == state]


async def burst(c, n_streams, stop, failures):
    """`n_streams` clients sending distinct 600-token prompts back to back until `stop` is set."""
    async def one(i):
        k = 0
        while not stop:
            k += 1
            g = torch.Generator().manual_seed(i * 1000 + k)
            try:
                await c.run_request(Request(f"burst-{i}-{k}", tuple(torch.randint(3, 384, (600,), generator=g).tolist()),
                                            SP))
            except Exception as e:  # noqa: BLE001 (any failure is what we count)
                failures.append(repr(e))
                await asyncio.sleep(0.1)
        return k

    return sum(await asyncio.gather(*[one(i) for i in range(n_streams)]))


def under_load(c):
    """While the burst lasts: the routers export the targets and the decisions by reason."""
    async def metrics():
        app = OpenAIServer(c.backend).app
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as h:
            return (await h.get("/metrics")).text

    text = c.run(metrics())
    assert 'splitserve_autoscaler_target{role="prefill"} 2.0' in text
    # decode stays at one worker: its decisions hold, or sit at the pool's minimum (4-token
    # outputs leave it idle between requests, so it would want none) — never a growth reason
    decode = {ln.split('reason="')[1].split('"')[0] for ln in text.splitlines()
              if ln.startswith("splitserve_autoscaler_decisions_total{") and 'role="decode"' in ln}
    assert decode and decode <= {"hold", "bound"}, decode


@pytest.mark.slow
def test_prefill_pool_follows_a_burst_of_long_prompts(ray_session, tiny_checkpoint):
    with Cluster.start(model=str(tiny_checkpoint("llama")), prefill=1, decode=1, transport="auto",
                       disagg_min_tokens=0, num_kv_blocks=512, name="autoscale-test", autoscale=AUTOSCALE,
                       prefill_resources={"prefill_node": 1}, decode_resources={"decode_node": 1},
                       worker_classes={"prefill": "tests.fakes.workers:PacedPrefill",
                                       "decode": "tests.fakes.workers:PacedDecode"}) as c:
        failures, stop = [], []
        first = {w.id for w in pool(c, "prefill")}
        load = asyncio.run_coroutine_threadsafe(burst(c, 10, stop, failures), c._loop.loop)
        try:
            wait_for(lambda: len(pool(c, "prefill")) == 2, 90, "a second prefill worker", c)
            (new,) = {w.id for w in pool(c, "prefill")} - first
            wait_for(lambda: any(t.prefill_worker == new for t in list(c.timings)), 60,
                     "the new prefill worker to take requests while the load lasts", c)
            under_load(c)
        finally:
            stop.append(True)
        done = load.result(60)

        assert len(pool(c, "decode")) == 1 and c.status().targets["decode"] == 1  # short outputs: decode holds

        st = c.status()
        reasons = {(d["role"], d["reason"]) for d in st.to_json()["autoscale"]["decisions"]}
        assert ("prefill", "prefill_backlog") in reasons or ("prefill", "ttft_miss") in reasons

        # idle: back to one prefill worker once the down cooldown has passed, through drain
        wait_for(lambda: c.status().targets["prefill"] == 1, 30, "the prefill target to drop", c)
        wait_for(lambda: len(pool(c, "prefill")) == 1 and not pool(c, "prefill", "draining"), 30,
                 "the extra prefill worker to drain", c)
        ended = ray_session.get(c.controller.ended.remote())
        drained = [r for r in ended if r.role is Role.PREFILL and r.reason == "drained"]
        assert len(drained) == 1 and drained[0].final_counts is not None, c.status().to_json()["autoscale"]["changes"]
        assert failures == [] and done > 20, (failures[:3], done)
