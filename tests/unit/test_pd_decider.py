"""The PD decider (router/pd_decider.py): `threshold` sends every prompt of `min_tokens` uncached
tokens through a prefill worker; `slo` keeps it on its decode worker while that worker can
prefill its backlog plus the prompt within its share of the TTFT target at the TPOT target,
and otherwise unless the prefill worker's backlog is the longer wait. Through `Router.place`,
as the real router and the simulator call it."""

import pytest

from splitserve.control.deploy_config import DeployConfig
from splitserve.hashing import block_hashes
from splitserve.router import RouteRequest, WorkerView, make_router
from splitserve.router.pd_decider import (SLODecider, ThresholdDecider, chunk_interferes, decode_step_s,
                                          make_decider, prefill_s)
from splitserve.sim.simulation import SimConfig
from splitserve.types import ConfigError

BS = 16
# 10 ms per step, 0.1 ms per prompt token, 1 ms per decode sequence: 1000 tokens prefill in 0.1 s
FIT = (0.01, 1e-4, 1e-3, 0.0, 0.0)


def req(n):
    tokens = list(range(n))
    return RouteRequest("r", n, tuple(block_hashes(tokens, BS)), BS)


def view(role, name, **kw):
    # a 128-token step budget: a step with a full chunk takes 22.8 ms, within 0.6 of 50 ms
    return WorkerView(name, role, "h0", step_time_coeffs=FIT, **{"token_budget": 128, **kw})


def place(decider, n, decode, prefill):
    return make_router("cache_aware", decider=decider).place(req(n), [prefill], [decode])


def slo(**kw):
    return SLODecider(32, ttft_slo_s=1.0, tpot_slo_s=0.05, **kw)


def test_fitted_prefill_and_decode_step():
    assert prefill_s(FIT, 1000) == pytest.approx(0.1)
    assert prefill_s((0.0, 0.0, 0.0, 0.0, 2e-9), 1000) == pytest.approx(2e-9 * 1000 * 1001 / 2)
    assert decode_step_s(view("decode", "d", num_running=10)) == pytest.approx(0.02)
    assert prefill_s((), 1000) == 0.0  # no fit: nothing known


def test_threshold_sends_every_long_enough_prompt_through_a_prefill_worker():
    pl = place(ThresholdDecider(32), 4000, view("decode", "d0"), view("prefill", "p0"))
    assert pl.prefill == "p0"
    assert place(ThresholdDecider(32), 20, view("decode", "d0"), view("prefill", "p0")).prefill is None


def test_slo_keeps_a_prompt_an_idle_decode_worker_absorbs():
    # idle decode step 10 ms of a 50 ms TPOT: prefill may take 80% of its time; 2000 tokens = 0.2 s
    # of prefill, 0.25 s at that share, within half the 1 s TTFT
    assert place(slo(), 2000, view("decode", "d0"), view("prefill", "p0")).prefill is None


def test_slo_disaggregates_when_the_decode_backlog_would_miss():
    # 4000 tokens already queued there: 0.6 s of prefill / 0.8 = 0.75 s > 0.5 s
    busy = view("decode", "d0", pending_prefill_tokens=4000)
    assert place(slo(), 2000, busy, view("prefill", "p0")).prefill == "p0"
    # a larger share of the TTFT lets the decode worker keep it
    assert place(slo(ttft_share=1.0), 2000, busy, view("prefill", "p0")).prefill is None


def test_slo_disaggregates_when_a_chunk_would_slow_the_decode_steps():
    # a 2048-token budget: a step with a full chunk of this prompt takes 0.21 s, past the 50 ms TPOT
    assert chunk_interferes(FIT, 2048, 0.05) and not chunk_interferes(FIT, 128, 0.05)
    assert place(slo(), 2000, view("decode", "d0", token_budget=2048), view("prefill", "p0")).prefill == "p0"
    assert place(slo(), 150, view("decode", "d0", token_budget=2048), view("prefill", "p0")).prefill is None
    swamped = view("prefill", "p0", pending_prefill_tokens=20000)  # 2 s queued there: the decode worker's 0.25 s wins
    assert place(slo(), 2000, view("decode", "d0", token_budget=2048), swamped).prefill is None


def test_slo_disaggregates_when_the_batch_leaves_no_room_for_prefill():
    full = view("decode", "d0", num_running=40)  # 50 ms step at the 50 ms TPOT target
    assert place(slo(), 200, full, view("prefill", "p0")).prefill == "p0"


def test_slo_keeps_the_prompt_when_the_prefill_worker_is_the_longer_wait():
    busy = view("decode", "d0", pending_prefill_tokens=4000)
    swamped = view("prefill", "p0", pending_prefill_tokens=20000)  # 2 s of prefill queued
    assert place(slo(), 2000, busy, swamped).prefill is None


def test_slo_without_targets_or_a_fit_is_the_threshold():
    busy = view("decode", "d0")
    assert place(SLODecider(32), 2000, busy, view("prefill", "p0")).prefill == "p0"  # no SLOs
    unfit = WorkerView("d0", "decode", "h0")  # not stepped yet: no fit
    assert place(slo(), 2000, unfit, view("prefill", "p0")).prefill == "p0"
    assert place(slo(), 20, busy, view("prefill", "p0")).prefill is None  # under min_tokens


def test_deciders_by_name_and_validated():
    assert isinstance(make_decider("threshold", 8), ThresholdDecider)
    d = make_decider("slo", 8, 1.0, 0.05)
    assert isinstance(d, SLODecider) and (d.min_tokens, d.ttft_slo_s, d.tpot_slo_s) == (8, 1.0, 0.05)
    with pytest.raises(ValueError, match="known: threshold, slo"):
        make_decider("always")
    with pytest.raises(ValueError, match="ttft_share"):
        SLODecider(32, 1.0, 0.05, ttft_share=0.0)
    with pytest.raises(ValueError, match="tpot_slo_s"):
        SLODecider(32, 1.0, -1.0)
    with pytest.raises(ValueError, match="disagg_min_tokens"):
        ThresholdDecider(-1)
    assert make_router("cache_aware", disagg_min_tokens=64).decider.min_tokens == 64  # the old keyword
    with pytest.raises(ConfigError, match="PD decider"):
        SimConfig(pd_decider="always")
    with pytest.raises(ConfigError, match="pd_decider"):
        DeployConfig(model="m", pd_decider="always")
