"""What runs the policy (no Ray): the latency window routers feed, the signals observed from
workers' load reports, the Autoscaler's decisions and report, the `autoscale:` config key, and
the metrics routers export from the report."""

import pytest

from splitserve.control.autoscale import (AutoscaleConfig, Autoscaler, Bounds, LatencyWindow, Reason, RequestSample,
                                  SignalObserver)
from splitserve.control.deploy_config import DeployConfig
from splitserve.metrics import Metrics
from splitserve.types import ConfigError, Role, WorkerStats
from tests.tiny_models import build_checkpoint

P, D = Role.PREFILL, Role.DECODE


def stats(**kw) -> WorkerStats:
    base = dict(num_waiting=0, num_running=0, num_preempted_total=0, kv_blocks_total=100, kv_blocks_free=100,
                kv_blocks_cached=0, prefix_query_tokens_total=0, prefix_hit_tokens_total=0, steps_total=0)
    return WorkerStats(**{**base, **kw})


def test_window_p90_covers_only_the_recent_past():
    w = LatencyWindow(window_s=10)
    w.add([RequestSample(float(t), ttft_s=t / 10, tpot_s=None) for t in range(1, 21)])
    assert w.p90("ttft_s", 20.0) == pytest.approx(1.9)  # t = 10..20 remain: p90 of 1.0..2.0
    assert w.p90("tpot_s", 20.0) is None
    assert w.p90("ttft_s", 100.0) is None and len(w) == 0


def test_observer_rates_from_counters_between_two_looks():
    obs, w = SignalObserver(), LatencyWindow(30)
    targets = {P: 2, D: 1}
    first = obs.observe(0.0, targets, {"p1": stats(prefill_tokens_total=1000, pending_prefill_tokens=500)}, {}, w)
    assert first.prefill.served_tokens_per_s == 0 and first.prefill.queued_tokens == 500
    # p1 computed 4000 in 2 s while its queue grew by 1000; p2 appeared with a big counter: no jump
    s = obs.observe(2.0, targets, {"p1": stats(prefill_tokens_total=5000, pending_prefill_tokens=1500),
                                   "p2": stats(prefill_tokens_total=10**6)}, {}, w)
    assert s.prefill.served_tokens_per_s == pytest.approx(2000)
    assert s.prefill.arriving_tokens_per_s == pytest.approx(2500)
    assert s.prefill.workers == 2  # the target, not the READY count


def test_observer_decode_load_and_pool_fit():
    obs, w = SignalObserver(), LatencyWindow(30)
    w.add([RequestSample(1.0, 0.2, 0.05), RequestSample(1.5, 0.4, 0.07)])
    decode = {"d1": stats(num_running=4, num_waiting=1, kv_blocks_free=50, decode_context_tokens=400, steps_total=9,
                          step_time_coeffs=(0.01, 0.0, 0.002, 0.0)),
              "d2": stats(num_running=2, kv_blocks_free=90, decode_context_tokens=200, steps_total=9,
                          step_time_coeffs=(0.03, 0.0, 0.004, 0.0)),
              "d3": stats()}  # no steps yet: not in the fit
    s = obs.observe(2.0, {P: 0, D: 3}, {}, decode, w)
    assert (s.decode.running, s.decode.waiting, s.decode.mean_context) == (6, 1, 100)
    assert s.decode.kv_usage == pytest.approx((0.5 + 0.1 + 0.0) / 3)
    assert (s.decode.fit.base, s.decode.fit.per_decode_seq) == (pytest.approx(0.02), pytest.approx(0.003))
    assert s.decode.tpot_p90_s == 0.07 and s.prefill.ttft_p90_s == 0.4


def test_autoscaler_grows_prefill_on_a_backlog_and_counts_reasons():
    cfg = AutoscaleConfig(prefill=Bounds(1, 3), decode=Bounds(1, 2), interval_s=1, ttft_slo_s=0.5,
                          up_cooldown_s=1, down_cooldown_s=100)
    a = Autoscaler(cfg)
    assert (a.initial(P, 0), a.initial(D, 5)) == (1, 2)
    fit = (0.01, 0.001, 0.001, 0.0)  # 512-token chunks at ~0.52 s: ~980 tokens/s per worker
    targets = {P: 1, D: 1}
    for t, computed in ((0.0, 0), (2.0, 2000)):
        prefill = {"p1": stats(prefill_tokens_total=computed, pending_prefill_tokens=3000, steps_total=5,
                               step_time_coeffs=fit)}
        d = a.tick(t, targets, prefill, {"d1": stats()})
    assert d.prefill == 3 and d.prefill_reason is Reason.PREFILL_BACKLOG
    assert d.decode == 1
    r = a.report({P: 3, D: 1})
    assert r.last is d and dict(((role, why), n) for role, why, n in r.decisions)[P, Reason.PREFILL_BACKLOG] >= 1
    assert sum(n for role, _, n in r.decisions if role is D) == 2  # one decision per pool per tick


def test_metrics_export_the_report_as_a_target_gauge_and_a_reason_counter():
    a = Autoscaler(AutoscaleConfig(prefill=Bounds(0, 2), decode=Bounds(1, 2)))
    m = Metrics()
    for t in range(3):
        a.tick(float(t), {P: 0, D: 1}, {}, {"d1": stats()})
        m.export_autoscale(a.report({P: 0, D: 1}))
    text = m.exposition().decode()
    assert 'splitserve_autoscaler_target{role="decode"} 1.0' in text
    # idle: prefill holds at 0, decode would go to 0 but its min is 1
    assert 'splitserve_autoscaler_decisions_total{reason="hold",role="prefill"} 3.0' in text
    assert 'splitserve_autoscaler_decisions_total{reason="bound",role="decode"} 3.0' in text


def test_autoscale_config_key(tmp_path):
    model = str(build_checkpoint("llama", tmp_path / "m"))
    cfg = DeployConfig.from_options({"model": model, "ttft_slo_ms": 400, "autoscale":
                                     "{prefill: {min: 1, max: 3}, decode: {max: 2}, interval_s: 5}"})
    a = cfg.autoscale
    assert (a.prefill, a.decode, a.interval_s, a.ttft_slo_s) == (Bounds(1, 3), Bounds(1, 2), 5, 0.4)
    assert DeployConfig.from_options({"model": model}).autoscale is None
    for bad, words in (({"prefill": {"min": 1, "max": "abc"}}, "autoscale prefill"),
                       ({"decode": {"min": 0, "max": 2}}, "decode.min >= 1"),
                       ({"prefill": {"min": 3, "max": 1}}, "min 3 > max 1"),
                       ({"interval": 5}, "unknown autoscale keys"),
                       ([1, 2], "must be a mapping")):
        with pytest.raises(ConfigError, match=words):
            DeployConfig.from_options({"model": model, "autoscale": bad})


def test_observer_rates_span_the_rate_window():
    """A queue moving to a new worker within one interval is not 'nothing arriving': rates are
    over `rate_window_s`, from the newest observation at least that old."""
    obs, w = SignalObserver(rate_window_s=4), LatencyWindow(30)
    for t in range(11):
        queued = 0 if t == 10 else 500  # at t=10 the queue went to a worker that just joined
        s = obs.observe(float(t), {P: 1, D: 1}, {"p1": stats(prefill_tokens_total=1000 * t,
                                                              pending_prefill_tokens=queued)}, {}, w)
    assert s.prefill.served_tokens_per_s == pytest.approx(1000)  # over t = 6..10
    assert s.prefill.arriving_tokens_per_s == pytest.approx(1000 - 500 / 4)


def _decode_with_prompts(computed: int, queued: int, running: int = 0) -> dict:
    # a decode worker computing prompts itself (aggregated path): 512-token chunks at ~0.52 s
    return {"d1": stats(prefill_tokens_total=computed, pending_prefill_tokens=queued, num_running=running,
                        steps_total=5, step_time_coeffs=(0.01, 0.001, 0.001, 0.0))}


def test_decode_pool_is_sized_for_the_prompts_it_computes_itself():
    cfg = AutoscaleConfig(prefill=Bounds(0, 4), decode=Bounds(1, 8), interval_s=1, ttft_slo_s=1.0,
                          up_cooldown_s=1, down_cooldown_s=100)
    a = Autoscaler(cfg)
    for t, computed in ((0.0, 0), (2.0, 2000)):  # ~1000 tok/s served, 2000 queued: ~3 workers' worth
        d = a.tick(t, {P: 0, D: 1}, {}, _decode_with_prompts(computed, 2000))
    s = a.observer.observe(3.0, {P: 0, D: 1}, {}, _decode_with_prompts(3000, 2000), a.window)
    assert s.decode.queued_prompt_tokens == 2000 and s.decode.arriving_prompt_tokens_per_s > 0
    assert d.decode >= 3 and d.decode_reason is Reason.PREFILL_BACKLOG
    assert d.prefill == 0  # no prefill worker: nothing says the decode pool misses
    quiet = Autoscaler(cfg)
    for t in (0.0, 2.0):
        d = quiet.tick(t, {P: 0, D: 1}, {}, _decode_with_prompts(0, 0, running=2))
    assert d.decode == 1  # the same pool without prompt work stays


def test_prefill_pool_opens_when_the_decode_pool_misses_with_prompts_queued():
    cfg = AutoscaleConfig(prefill=Bounds(0, 4), decode=Bounds(1, 1), interval_s=1, ttft_slo_s=1.0, tpot_slo_s=0.05,
                          up_cooldown_s=1, down_cooldown_s=100)
    a = Autoscaler(cfg)
    d = a.tick(0.0, {P: 0, D: 1}, {}, _decode_with_prompts(0, 5000, running=4))
    assert d.prefill == 0  # meeting its targets: the decode pool keeps its prompts
    a.record([RequestSample(0.5, 0.2, 0.09)])  # TPOT 90 ms over the 50 ms target
    d = a.tick(1.0, {P: 0, D: 1}, {}, _decode_with_prompts(0, 5000, running=4))
    assert d.prefill == 1 and d.prefill_reason is Reason.PREFILL_BACKLOG
    b = Autoscaler(cfg)
    b.record([RequestSample(0.5, 0.2, 0.09)])
    assert b.tick(1.0, {P: 0, D: 1}, {}, _decode_with_prompts(0, 0, running=4)).prefill == 0  # no prompts queued


def test_max_workers_sizes_decode_first_and_prefill_gets_what_is_left():
    cfg = AutoscaleConfig(prefill=Bounds(0, 8), decode=Bounds(1, 8), interval_s=1, ttft_slo_s=0.5,
                          up_cooldown_s=1, down_cooldown_s=100, max_workers=4)
    a = Autoscaler(cfg)
    fit = (0.01, 0.001, 0.001, 0.0)
    for t, computed in ((0.0, 0), (2.0, 2000)):
        prefill = {"p1": stats(prefill_tokens_total=computed, pending_prefill_tokens=20000, steps_total=5,
                               step_time_coeffs=fit)}
        d = a.tick(t, {P: 1, D: 3}, prefill, _decode_with_prompts(0, 0, running=2))
    assert d.prefill + d.decode <= 4 and d.decode >= 1
    assert d.prefill == 4 - d.decode and d.prefill_reason is Reason.BOUND
    with pytest.raises(ConfigError, match="max_workers"):
        AutoscaleConfig(prefill=Bounds(1, 4), decode=Bounds(1, 4), max_workers=1)


def test_a_pool_just_started_is_not_shrunk_before_its_down_cooldown():
    cfg = AutoscaleConfig(prefill=Bounds(0, 4), decode=Bounds(1, 8), interval_s=1, up_cooldown_s=1,
                          down_cooldown_s=10)
    a = Autoscaler(cfg)
    sizes = [a.tick(t, {P: 0, D: 8}, {}, {"d1": stats()}) for t in range(0, 12)]
    assert [d.decode for d in sizes[:10]] == [8] * 10  # idle, but just deployed
    assert sizes[0].decode_reason is Reason.COOLDOWN
    assert sizes[10].decode == 1  # a cooldown after the start: shrunk
