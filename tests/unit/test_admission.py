import pytest

from splitserve.router.admission import Admission, AdmissionConfig, Calibration, Outstanding, Plan, predict
from splitserve.types import Priority, WorkerStats


def stats(waiting=0, running=0, coeffs=(0.01, 0.001, 0.0005, 1e-6), steps=10):
    return WorkerStats(num_waiting=waiting, num_running=running, num_preempted_total=0, kv_blocks_total=100,
                       kv_blocks_free=50, kv_blocks_cached=0, prefix_query_tokens_total=0, prefix_hit_tokens_total=0,
                       steps_total=steps, step_time_coeffs=coeffs, pending_prefill_tokens=256 * waiting,
                       decode_context_tokens=512 * running, token_budget=2048)


def plan(first=None, decode=None, cached=0):
    first = first or stats()
    return Plan("p0", first, "d0", decode or first, cached)


def test_prediction_grows_with_queue_and_shrinks_with_cache():
    t_idle, _ = predict(stats(), 500, 0)
    t_busy, _ = predict(stats(waiting=10), 500, 0)
    t_cached, _ = predict(stats(), 500, 480)
    assert t_cached < t_idle < t_busy
    assert t_idle == pytest.approx(0.001 * 500 + 0.01)  # one step: its fixed cost, nothing decoding


def test_slo_rejects_with_retry_after_and_admits_when_feasible():
    a = Admission(AdmissionConfig(ttft_slo_ms=200))
    assert a.decide(plan(), Priority.STANDARD, 100).admit  # 0.11 s predicted
    d = a.decide(plan(stats(waiting=20)), Priority.STANDARD, 100)  # 0.001 * (5120 + 100) + 3 steps ≈ 5.25 s
    assert not d.admit and d.reason == "ttft_slo" and d.retry_after_s >= 1.0
    # a request's own SLO only tightens the server's: a laxer one does not get it past admission
    laxer = a.decide(plan(stats(waiting=20)), Priority.STANDARD, 100, ttft_slo_ms=10_000)
    assert not laxer.admit and laxer.ttft_slo_ms == 200
    tighter = a.decide(plan(), Priority.STANDARD, 100, ttft_slo_ms=50)  # 0.11 s predicted > 50 ms
    assert not tighter.admit and tighter.reason == "ttft_slo"
    assert a.decide(plan(stats(waiting=20)), Priority.CRITICAL, 100).admit  # critical: only the hard limit
    assert a.inflight == 2  # the admitted ones, until finished
    own = Admission(AdmissionConfig()).decide(plan(stats(waiting=20)), Priority.STANDARD, 100, ttft_slo_ms=200)
    assert not own.admit and own.reason == "ttft_slo"  # no server SLO: the request's own applies


def test_ttft_is_judged_on_the_worker_that_prefills_and_tpot_on_the_decoder():
    a = Admission(AdmissionConfig(ttft_slo_ms=200, tpot_slo_ms=50))
    busy_prefill, busy_decode = stats(waiting=20), stats(running=200)
    assert a.decide(Plan("p", busy_prefill, "d", stats()), Priority.STANDARD, 100).reason == "ttft_slo"
    assert a.decide(Plan("p", stats(), "d", busy_decode), Priority.STANDARD, 100).reason == "tpot_slo"
    # A prefix hit on the prefill worker makes a long prompt cheap.
    assert a.decide(Plan("p", stats(), "d", stats()), Priority.STANDARD, 1900).reason == "ttft_slo"
    assert a.decide(Plan("p", stats(), "d", stats(), cached_tokens=1888), Priority.STANDARD, 1900).admit


def test_a_grammar_not_compiled_on_the_first_worker_adds_its_compile_time():
    import dataclasses

    from splitserve.router.admission import COMPILE_PRIOR_S

    a = Admission(AdmissionConfig())

    def ttft(p, grammar=None):  # each ends at once, so none queues ahead of the next
        d = a.decide(p, Priority.STANDARD, 100, grammar=grammar)
        a.finished(d, None)
        return d.model_ttft_s

    free = ttft(plan())
    assert ttft(plan(), "g1") == pytest.approx(free + COMPILE_PRIOR_S)
    assert ttft(plan(), "g1") == pytest.approx(free)  # sent there: compiled
    slow = dataclasses.replace(stats(), grammar_compile_s=0.3)  # the worker's own measure, once it has one
    assert ttft(plan(slow), "g2") == pytest.approx(free + 0.3)
    d = Admission(AdmissionConfig(ttft_slo_ms=200)).decide(plan(slow), Priority.STANDARD, 100, grammar="g3")
    assert not d.admit and d.reason == "ttft_slo"  # 0.11 s alone, 0.41 s with its compile
    assert ("p0", "g3") not in a.compiled  # refused: nothing was sent there


def test_capacity_limits_by_class():
    a = Admission(AdmissionConfig(max_inflight=10))
    a.inflight = 5
    assert a.decide(plan(), Priority.SHEDDABLE, 10).reason == "capacity"  # sheddable first
    assert a.decide(plan(), Priority.STANDARD, 10).admit
    a.inflight = 10
    assert not a.decide(plan(), Priority.STANDARD, 10).admit and a.decide(plan(), Priority.CRITICAL, 10).admit
    a.inflight = 20
    assert not a.decide(plan(), Priority.CRITICAL, 10).admit
    off = Admission(AdmissionConfig(max_inflight=1, enabled=False))  # --no-admission: no SLO checks...
    assert off.decide(plan(stats(waiting=999)), Priority.SHEDDABLE, 10).admit
    assert off.decide(plan(), Priority.STANDARD, 10).reason == "capacity"  # ...but max_inflight still holds


def test_a_burst_between_snapshots_sees_its_own_load():
    a = Admission(AdmissionConfig(ttft_slo_ms=1000, calibration_prior=1.0))
    snap = stats()  # idle, and the same snapshot for the whole burst
    decisions = [a.decide(plan(snap), Priority.STANDARD, 400) for _ in range(10)]
    ttfts = [d.predicted_ttft_s for d in decisions if d.admit]
    assert ttfts == sorted(ttfts) and ttfts[-1] > ttfts[0]  # each one queued behind the ones before
    assert not decisions[-1].admit  # 10 × 400 tokens at 1 ms/token: past the SLO
    admitted = [d for d in decisions if d.admit]
    assert a.outstanding["p0"] == (len(admitted), 400 * len(admitted))
    # First tokens back (or requests gone without one): the queue this router knows of empties.
    a.prefilled(admitted[0])
    for d in admitted[1:]:
        a.finished(d, observed_ttft_s=None)
    assert a.outstanding["p0"] == (0, 0) and a.decide(plan(snap), Priority.STANDARD, 400).admit
    # A worker's own report (other routers' requests too) wins when it shows more.
    o = Outstanding()
    o.add("w", 500)
    assert o.adjusted("w", stats()).pending_prefill_tokens == 500
    assert o.adjusted("w", stats(waiting=4)).pending_prefill_tokens == 1024


def test_calibration_scales_predictions_by_the_observed_ratio():
    cal = Calibration(quantile=0.9, window=100, min_samples=5, prior=1.25)
    assert cal.factor == 1.25  # a margin until it has seen enough
    for r in (1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 1.1, 1.3, 1.5, 1.7):
        cal.observe(1.0, r)
    assert cal.factor == pytest.approx(2.0)
    # no server SLO: each request is judged against its own
    a = Admission(AdmissionConfig(calibration_min_samples=3, calibration_prior=1.0))
    d = a.decide(plan(stats(waiting=1)), Priority.STANDARD, 100, ttft_slo_ms=400)  # 0.001 * 356 + 0.01 ≈ 0.37 s
    assert d.admit
    for _ in range(3):  # the requests took twice as long as predicted
        a.finished(d, observed_ttft_s=2 * d.predicted_ttft_s)
    assert a.calibration.factor == pytest.approx(2.0)
    assert not a.decide(plan(stats(waiting=1)), Priority.STANDARD, 100, ttft_slo_ms=400).admit  # now ≈ 0.73 s
    # Predictions far below the SLO do not calibrate (fixed overheads dominate their ratio).
    tiny = a.decide(plan(), Priority.STANDARD, 1, ttft_slo_ms=10_000)
    a.finished(tiny, observed_ttft_s=10.0)  # judged against its own SLO, carried by the decision
    assert len(a.calibration) == 3


def test_config_is_validated():
    for bad in ({"max_inflight": 0}, {"ttft_slo_ms": -1}, {"calibration_quantile": 0.1}, {"calibration_prior": 0.5}):
        with pytest.raises(ValueError):
            AdmissionConfig(**bad)
