import pytest

from splitserve.router.admission import Admission, AdmissionConfig
from splitserve.types import Priority, WorkerStats


def stats(waiting=0, running=0, coeffs=(0.01, 0.001, 0.0005, 1e-6)):
    return WorkerStats(num_waiting=waiting, num_running=running, num_preempted_total=0, kv_blocks_total=100,
                       kv_blocks_free=50, kv_blocks_cached=0, prefix_query_tokens_total=0, prefix_hit_tokens_total=0,
                       steps_total=10, step_time_coeffs=coeffs, pending_prefill_tokens=256 * waiting,
                       decode_context_tokens=512 * running, token_budget=2048)


def test_prediction_grows_with_queue_and_shrinks_with_cache():
    a = Admission()
    t_idle, _ = a.predict(stats(), 500, 0)
    t_busy, _ = a.predict(stats(waiting=10), 500, 0)
    t_cached, _ = a.predict(stats(), 500, 480)
    assert t_cached < t_idle < t_busy
    assert t_idle == pytest.approx(0.001 * 500 + 0.01)  # one step: its fixed cost, nothing decoding


def test_slo_rejects_with_retry_after_and_admits_when_feasible():
    a = Admission(AdmissionConfig(ttft_slo_ms=200))
    assert a.decide(stats(), Priority.STANDARD, 100).admit  # 0.11 s predicted
    d = a.decide(stats(waiting=20), Priority.STANDARD, 100)  # 0.001 * (5120 + 100) + 3 steps ≈ 5.25 s
    assert not d.admit and d.reason == "ttft_slo" and d.retry_after_s >= 1.0
    assert a.decide(stats(waiting=20), Priority.STANDARD, 100, ttft_slo_ms=10_000).admit  # its own, laxer SLO
    assert a.decide(stats(waiting=20), Priority.CRITICAL, 100).admit  # critical: only the hard limit


def test_tpot_slo():
    a = Admission(AdmissionConfig(tpot_slo_ms=50))
    assert a.decide(stats(running=10), Priority.STANDARD, 100).admit
    assert a.decide(stats(running=200), Priority.STANDARD, 100).reason == "tpot_slo"


def test_capacity_limits_by_class():
    a = Admission(AdmissionConfig(max_inflight=10))
    a.inflight = 5
    assert a.decide(stats(), Priority.SHEDDABLE, 10).reason == "capacity"  # sheddable first
    assert a.decide(stats(), Priority.STANDARD, 10).admit
    a.inflight = 10
    assert not a.decide(stats(), Priority.STANDARD, 10).admit and a.decide(stats(), Priority.CRITICAL, 10).admit
    a.inflight = 20
    assert not a.decide(stats(), Priority.CRITICAL, 10).admit
    assert Admission(AdmissionConfig(max_inflight=1, enabled=False)).decide(stats(waiting=999), Priority.SHEDDABLE, 10).admit
