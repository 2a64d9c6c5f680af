"""/metrics' end-to-end series (issue 33, item 2): each finished request's phases by route and
tenant, the KV transfer by transport, and moves counted once however often they are exported."""

import pytest
from fake_backend import ViewsBackend
from prometheus_client.parser import text_string_to_metric_families

from splitserve.ingress.frontend import Choice, Frontend
from splitserve.metrics import Metrics
from splitserve.router.admission import Plan
from splitserve.text.detokenizer import RequestText
from splitserve.text.tokenizer import Tokenizer
from splitserve.types import MoveCount, MoveKind, MoveReason, PhaseTimes, SamplingParams, TokenChunk, FinishReason


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_checkpoint):
    return Tokenizer(tiny_checkpoint("llama"))


def samples(m: Metrics, name: str) -> dict[tuple, float]:
    out = {}
    for fam in text_string_to_metric_families(m.exposition().decode()):
        for s in fam.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def finished_choice(tokenizer, plan: Plan | None, phases: PhaseTimes, tenant: str) -> Choice:
    text = RequestText(tokenizer, SamplingParams(max_tokens=3), (1, 2))
    for i, t in enumerate((5, 6, 7)):
        text.add(TokenChunk("r", (t,), finish_reason=FinishReason.LENGTH if i == 2 else None))
    c = Choice(0, 0, (1, 2), text, arrived=100.0, tenant=tenant, plan=plan, phases=phases)
    c.first_at, c.ended_at = 100.5, 101.5
    return c


def test_a_disaggregated_request_records_every_phase_and_its_transfer_by_transport(tiny_tokenizer):
    front = Frontend(ViewsBackend(), Metrics())
    split = Plan("p0", None, "d0", None)
    phases = PhaseTimes(queue_s=0.1, prefill_s=0.3, transfer_s=0.05, transfer_bytes=50_000_000,
                        exposed_transfer_s=0.01, transport="nixl")
    front._record(finished_choice(tiny_tokenizer, split, phases, "acme"))
    front._record(finished_choice(tiny_tokenizer, Plan("d1", None, "d1", None), PhaseTimes(queue_s=0.0, prefill_s=0.2),
                                  "default"))
    got = samples(front.metrics, "splitserve_request_phase_seconds_sum")
    split_phases = {dict(k)["phase"]: v for k, v in got.items() if dict(k)["route"] == "disaggregated"}
    assert split_phases == {"queue": 0.1, "prefill": 0.3, "transfer": 0.05, "exposed_transfer": 0.01,
                            "first_token": 0.5, "e2e": 1.5, "inter_token": 0.5}
    assert all(dict(k)["tenant"] == "acme" for k in got if dict(k)["route"] == "disaggregated")
    agg = {dict(k)["phase"] for k in got if dict(k)["route"] == "aggregated"}
    assert agg == {"queue", "prefill", "first_token", "e2e", "inter_token"}  # no transfer on one worker
    assert samples(front.metrics, "splitserve_kv_transfer_bytes_total") == {(("transport", "nixl"),): 50_000_000}
    rate = samples(front.metrics, "splitserve_kv_transfer_gigabytes_per_second_sum")
    assert rate == {(("transport", "nixl"),): 1.0}  # 50 MB in 50 ms
    # prefix lookups by the worker that computed the prompt (the prefill worker of a split request)
    assert samples(front.metrics, "splitserve_prefix_cache_query_tokens_total") == {(("worker", "p0"),): 2,
                                                                                    (("worker", "d1"),): 2}


def test_prefix_hits_are_counted_per_worker_and_a_gone_workers_series_dropped(tiny_tokenizer):
    front = Frontend(ViewsBackend(), Metrics())
    for worker, cached in (("p0", 0), ("p0", 16), ("p1", 8)):
        c = finished_choice(tiny_tokenizer, Plan(worker, None, "d0", None), PhaseTimes(), "default")
        c.text.num_cached_tokens = cached
        front._record(c)
    assert samples(front.metrics, "splitserve_prefix_cache_hit_tokens_total") == {(("worker", "p0"),): 16,
                                                                                  (("worker", "p1"),): 8}
    front.metrics.forget_workers({"p1", "d0"})  # p0 is gone
    assert samples(front.metrics, "splitserve_prefix_cache_hit_tokens_total") == {(("worker", "p1"),): 8}
    assert samples(front.metrics, "splitserve_prefix_cache_query_tokens_total") == {(("worker", "p1"),): 2}


def test_moves_are_counted_once_by_kind_and_reason():
    views = ViewsBackend()
    front = Frontend(views, Metrics())
    views.counts = (MoveCount(MoveKind.MIGRATION, MoveReason.DIED, 2), MoveCount(MoveKind.RETRY, MoveReason.SILENT, 1))
    front.export_worker_gauges()
    front.export_worker_gauges()  # a second scrape with nothing new adds nothing
    views.counts = (MoveCount(MoveKind.MIGRATION, MoveReason.DIED, 3), MoveCount(MoveKind.RETRY, MoveReason.SILENT, 1))
    front.export_worker_gauges()
    got = samples(front.metrics, "splitserve_request_moves_total")
    assert len(got) == 8  # every kind and reason, from the start: a rate over them is 0, not "no data"
    assert {k: v for k, v in got.items() if v} == {
        (("kind", "migration"), ("reason", "died")): 3.0, (("kind", "retry"), ("reason", "silent")): 1.0}
