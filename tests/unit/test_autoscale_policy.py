"""The autoscaling policy on scripted signal traces (no Ray): signals come from a small fluid
model of the two pools under a load (arrival rate, prompt and output lengths), whose workers
have a fixed step-time fit. A step up in long prompts grows prefill and not decode; a shift to
long outputs grows decode and not prefill; a drop shrinks each pool only after its cooldown; a
steady load with noise changes each pool at most once in 100 intervals; bounds hold."""

import dataclasses
import random

import pytest

from splitserve.control.autoscale import (AutoscaleConfig, AutoscalePolicy, Bounds, DecodeSignals, PrefillSignals, Reason,
                                  Signals, StepFit)
from splitserve.types import ConfigError

FIT = StepFit(base=0.01, per_prefill_token=0.0002, per_decode_seq=0.001, per_context_token=0.000002)
CFG = AutoscaleConfig(prefill=Bounds(1, 8), decode=Bounds(1, 8), interval_s=10, ttft_slo_s=1.0, tpot_slo_s=0.05,
                      up_cooldown_s=30, down_cooldown_s=120)


def signals(t, pools, rate, prompt, output, noise=None):
    """The pools' signals under `rate` req/s of `prompt`-token prompts and `output`-token outputs."""
    n = (lambda x: x * (1 + noise.uniform(-0.1, 0.1))) if noise else (lambda x: x)
    p, d = pools
    arriving = n(rate * prompt)
    capacity = p * FIT.prefill_tokens_per_s(CFG.chunk_tokens)
    queued = max(0.0, arriving - capacity) * CFG.interval_s
    seqs = n(rate * output * 0.02)  # Little's law at ~20 ms per token
    ctx = prompt + output / 2
    return Signals(t, PrefillSignals(p, queued, arriving, min(arriving, capacity), None, FIT),
                   DecodeSignals(d, seqs, 0.0, min(0.95, seqs * ctx / (d * 50_000)), ctx, None, FIT))


def run(policy, load, steps, pools, t0=0.0, noise=None):
    """Apply each decision, as the Controller does; returns the pools' sizes over time."""
    history = []
    for i in range(steps):
        rate, prompt, output = load(i)
        dec = policy.decide(signals(t0 + i * CFG.interval_s, pools, rate, prompt, output, noise))
        pools = (dec.prefill, dec.decode)
        history.append((pools, dec))
    return history


def test_long_prompts_arriving_grow_prefill_not_decode():
    pol = AutoscalePolicy(CFG)
    h = run(pol, lambda i: (2, 200, 40) if i < 10 else (2, 3000, 40), 30, (1, 1))
    before, after = h[9][0], h[-1][0]
    assert after[0] > before[0] and after[1] == before[1], (before, after)
    assert any(d.prefill_reason is Reason.PREFILL_BACKLOG for _, d in h)


def test_long_outputs_grow_decode_not_prefill():
    pol = AutoscalePolicy(CFG)
    h = run(pol, lambda i: (4, 200, 40) if i < 10 else (4, 200, 1500), 30, (1, 1))
    before, after = h[9][0], h[-1][0]
    assert after[1] > before[1] and after[0] == before[0], (before, after)
    assert any(d.decode_reason in (Reason.DECODE_BATCH, Reason.KV_FULL) for _, d in h)


def test_a_drop_shrinks_each_pool_only_after_its_cooldown():
    pol = AutoscalePolicy(CFG)
    h = run(pol, lambda i: (4, 3000, 1500) if i < 5 else (0.2, 200, 40), 60, (1, 1))
    peak = h[4][0]
    assert peak[0] > 1 and peak[1] > 1
    for role in (0, 1):
        sizes = [1] + [pools[role] for pools, _ in h]  # sizes[k + 1]: after decision k
        changed = [k for k in range(len(h)) if sizes[k + 1] != sizes[k]]
        last_before = max(k for k in changed if k < 5)
        first_after = min(k for k in changed if k >= 5)
        assert sizes[first_after + 1] < sizes[first_after]  # a shrink
        assert (first_after - last_before) * CFG.interval_s >= CFG.down_cooldown_s  # not before its cooldown
    assert h[-1][0] < peak and h[-1][0] == (1, 1)
    assert any(d.prefill_reason is Reason.COOLDOWN or d.decode_reason is Reason.COOLDOWN for _, d in h[5:])


def test_a_steady_noisy_load_changes_each_pool_at_most_once():
    pol = AutoscalePolicy(CFG)
    rng = random.Random(7)
    h = run(pol, lambda i: (3, 1500, 600), 100, (1, 1), noise=rng)
    for role in (0, 1):
        sizes = [pools[role] for pools, _ in h]
        assert sum(a != b for a, b in zip(sizes, sizes[1:])) <= 1, sizes


def test_bounds_hold_and_are_reported():
    cfg = AutoscaleConfig(prefill=Bounds(1, 2), decode=Bounds(1, 2), ttft_slo_s=1.0, tpot_slo_s=0.05,
                          up_cooldown_s=1, down_cooldown_s=1)
    h = run(AutoscalePolicy(cfg), lambda i: (50, 4000, 2000), 20, (1, 1))
    assert all(1 <= p <= 2 and 1 <= d <= 2 for (p, d), _ in h)
    assert h[-1][1].prefill_reason is Reason.BOUND and h[-1][1].decode_reason is Reason.BOUND
    h = run(AutoscalePolicy(cfg), lambda i: (0, 100, 10), 20, (2, 2))
    assert h[-1][0] == (1, 1)  # never below min


def test_a_missed_slo_grows_the_pool_by_one():
    pol = AutoscalePolicy(CFG)
    s = signals(0, (2, 2), 1, 100, 10)
    s = Signals(0, PrefillSignals(2, 500, 100, 100, 3.0, FIT), s.decode)  # TTFT p90 3 s against 1 s
    d = pol.decide(s)
    assert (d.prefill, d.prefill_reason) == (3, Reason.TTFT_MISS)


@pytest.mark.parametrize("bad", [dict(prefill=Bounds(0, 2), decode=Bounds(0, 2)),
                                 dict(target_utilization=0.4, down_utilization=0.5), dict(tpot_slo_s=0)])
def test_bad_configs_are_refused(bad):
    with pytest.raises(ConfigError):
        AutoscaleConfig(**bad)
    with pytest.raises(ConfigError):
        Bounds(3, 1)



def test_a_pool_still_starting_its_new_workers_is_not_shrunk():
    """The signals do not show a growth until its workers are READY: a worker slower to start
    than the down cooldown must not be stopped unborn when the load dips meanwhile."""
    cfg = AutoscaleConfig(prefill=Bounds(1, 4), decode=Bounds(1, 4), up_cooldown_s=1, down_cooldown_s=1)
    pol = AutoscalePolicy(cfg)
    grown = pol.decide(signals(0, (1, 1), 3, 3000, 40))
    assert grown.prefill > 1
    idle = signals(10, (grown.prefill, 1), 0.01, 100, 10)
    held = pol.decide(Signals(idle.at, dataclasses.replace(idle.prefill, starting=1), idle.decode))
    assert held.prefill == grown.prefill and held.prefill_reason is Reason.STARTING
    assert pol.decide(signals(20, (grown.prefill, 1), 0.01, 100, 10)).prefill < grown.prefill  # landed: it shrinks


def test_a_fit_whose_prefill_cost_is_all_attention_still_sizes_prefill():
    """The online fit may put a long prompt's cost in its attention term (c4) rather than per
    token (c1): the prefill capacity must count it, not read the worker as infinitely fast."""
    from splitserve.control.autoscale.signals import StepFit

    per_token = StepFit.of((0.01, 1e-4, 0.0, 0.0))
    attention = StepFit.of((0.01, 0.0, 0.0, 0.0, 2e-7))  # 1024 tokens: 0.01 + 524800 * 2e-7 s
    assert not StepFit.of((0.01, 0.0, 0.0, 0.0)).knows_prefill and attention.knows_prefill
    assert attention.prefill_tokens_per_s(1024) == pytest.approx(1024 / (0.01 + 1024 * 1025 / 2 * 2e-7))
    assert per_token.prefill_tokens_per_s(1024) == pytest.approx(1024 / (0.01 + 0.1024))
