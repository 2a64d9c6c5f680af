"""One request, one trace across the split (issue 33): a 1P+1D cluster tracing to an OTLP
receiver (a test fixture: tests/otlp_receiver.py). A disaggregated request over HTTP, sent with
a client's W3C `traceparent`, gives one trace whose spans come from three processes — the
ingress (here the driver: the request, tokenize, admission, the prefill and decode calls), the
prefill worker and the decode worker (its decode and its KV landing) — linked parent to child,
with the client's span as the root's parent; the answer returns the root's `traceparent`. A
request whose decode worker is SIGKILLed mid-stream keeps its trace: the migration and the
second decode call are in it."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal

import httpx
import pytest

from splitserve import SamplingParams, tracing
from splitserve.ingress.http import OpenAIServer
from splitserve.orchestrator import Cluster
from splitserve.types import Request
from tests.otlp_receiver import OTLPReceiver

SERVER, CLIENT = 2, 3  # OTLP span kinds


@pytest.fixture
def receiver():
    r = OTLPReceiver().start()
    yield r
    tracing.shutdown()  # this process's provider exports to this receiver only
    r.stop()


def test_a_disaggregated_request_is_one_trace_over_three_processes(ray_session, tiny_checkpoint, receiver):
    client_trace, client_span = secrets.token_hex(16), secrets.token_hex(8)
    with Cluster.start(model=str(tiny_checkpoint("llama")), transport="tcp", disagg_min_tokens=0, num_kv_blocks=256,
                       pd_decider="threshold", otlp_traces_endpoint=receiver.endpoint) as c:
        app = OpenAIServer(c.backend).app

        async def go():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as h:
                return await h.post("/v1/completions", headers={"traceparent": f"00-{client_trace}-{client_span}-01"},
                                    json={"model": c.backend.model_name, "prompt": "One trace across the split",
                                          "max_tokens": 6, "temperature": 0, "ignore_eos": True})

        r = c.run(go())
        assert r.status_code == 200, r.text
        _, trace_id, root_id, _ = r.headers["traceparent"].split("-")
        assert trace_id == client_trace and root_id != client_span
        tracing.flush()
        names = {"POST /v1/completions", "tokenize", "admission", "prefill_call", "prefill", "decode_call", "decode",
                 "kv_transfer"}
        spans = receiver.wait_for(client_trace, names)
    by = {s.name: s for s in spans}
    assert names <= set(by), sorted(by)
    assert {s.service for s in spans} == {"splitserve-ingress", "splitserve-prefill", "splitserve-decode"}
    root = by["POST /v1/completions"]
    assert (root.span_id, root.parent_id, root.kind) == (root_id, client_span, SERVER)
    assert root.attributes["gen_ai.operation.name"] == "text_completion"
    for child in ("tokenize", "admission", "prefill_call", "decode_call"):
        assert by[child].parent_id == root.span_id and by[child].service == "splitserve-ingress", by[child]
    assert by["admission"].attributes["splitserve.route"] == "disaggregated"
    assert (by["prefill"].parent_id, by["prefill"].service, by["prefill"].kind) == (
        by["prefill_call"].span_id, "splitserve-prefill", SERVER)
    assert by["prefill_call"].kind == CLIENT
    n_prompt = by["prefill"].attributes["gen_ai.usage.input_tokens"]
    assert n_prompt > 0 and by["decode"].attributes["gen_ai.usage.input_tokens"] == n_prompt
    assert (by["decode"].parent_id, by["decode"].service) == (by["decode_call"].span_id, "splitserve-decode")
    assert by["decode"].attributes["gen_ai.usage.output_tokens"] == 5  # the first token was the prefill's
    kv = by["kv_transfer"]
    assert kv.parent_id == by["decode"].span_id and kv.attributes["splitserve.kv.bytes"] > 0
    assert kv.attributes["splitserve.kv.transport"] == "tcp"
    assert len({s.instance for s in spans}) == 3


def test_a_migrated_request_stays_in_its_trace(ray_session, tiny_checkpoint, receiver):
    """Its decode worker SIGKILLed after a few tokens: the request migrates (the fault landed:
    its RequestTrace counts the move), and the migration span and both decode calls are spans
    of its one trace."""
    with Cluster.start(model=str(tiny_checkpoint("llama")), decode=2, transport="tcp", disagg_min_tokens=0,
                       num_kv_blocks=256, pd_decider="threshold", otlp_traces_endpoint=receiver.endpoint) as c:
        pids = {str(wid): c.run(_pid(rec.handle)) for wid, rec in c.directory.records.items()}
        root = tracing.tracer().start_span("client")
        req = Request("traced-migration", tuple(range(5, 45)),
                      SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                      traceparent=tracing.traceparent_of(root))

        async def go():
            tokens = 0
            async for chunk in c.backend.generate(req):
                tokens += len(chunk.token_ids)
                if tokens == 5:  # mid-stream: its decode worker dies
                    os.kill(pids[next(t for t in c.timings if t.request_id == req.request_id).decode_worker],
                            signal.SIGKILL)
            return tokens

        tokens = c.run(go())
        moved = next(t for t in c.timings if t.request_id == req.request_id)
        assert moved.migrations == 1  # the fault landed: it moved
        assert tokens == 200
        root.end()
        tracing.flush()
        trace_id = format(root.get_span_context().trace_id, "032x")
        spans = receiver.wait_for(trace_id, {"migration", "decode_call", "decode"})
    calls = [s for s in spans if s.name == "decode_call"]
    migration = next(s for s in spans if s.name == "migration")
    root_id = format(root.get_span_context().span_id, "016x")
    assert len(calls) == 2 and {s.parent_id for s in calls + [migration]} == {root_id}
    assert sorted(s.status_code for s in calls) == [0, 2]  # the lost call ended in error, the second did not
    assert migration.attributes["splitserve.tokens_delivered"] >= 5 and migration.attributes["splitserve.migration.reason"]
    decodes = [s for s in spans if s.name == "decode" and s.service == "splitserve-decode"]
    assert decodes and all(s.parent_id in {c_.span_id for c_ in calls} for s in decodes)


async def _pid(handle) -> int:
    return (await handle.describe.remote()).pid
