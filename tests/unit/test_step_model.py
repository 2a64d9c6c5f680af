import random

import pytest

from splitserve import LLM, SamplingParams
from splitserve.engine.step_model import FEATURES, StepTimeModel
from splitserve.engine.step_shape import StepShape


def test_recovers_known_coefficients():
    m = StepTimeModel(refit_every=4)
    rng = random.Random(0)
    true = (0.002, 1e-5, 3e-4, 2e-7, 1e-9)
    for _ in range(200):
        p, d, c = rng.randint(0, 2048), rng.randint(0, 64), rng.randint(0, 40000)
        s = StepShape(p, p * (rng.randint(0, 1000) + (p + 1) / 2), 0, d, c)
        m.observe(s, true[0] + true[1] * p + true[2] * d + true[3] * c + true[4] * s.prefill_attended)
    assert len(m.coeffs) == len(FEATURES)
    for got, want in zip(m.coeffs, true):
        assert got == pytest.approx(want, rel=1e-3)
    s = StepShape(100, 100 * 50.5, 0, 10, 1000)
    assert m.predict(s) == pytest.approx(true[0] + 100 * true[1] + 10 * true[2] + 1000 * true[3] + 5050 * true[4],
                                         rel=1e-3)


def test_no_coefficient_goes_negative_on_noisy_steps():
    m = StepTimeModel(refit_every=1)
    rng = random.Random(1)
    for _ in range(100):  # decode steps only, noisy: prefill terms are unidentified, never negative
        d = rng.randint(1, 8)
        m.observe(StepShape(decode_seqs=d, decode_context=100 * d), 0.01 + 0.001 * d + rng.gauss(0, 0.002))
    assert all(c >= 0 for c in m.coeffs) and m.coeffs[2] > 0


def test_engine_reports_a_fit(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama")), num_kv_blocks=64)
    llm.generate([[5] * n for n in (10, 50, 90)], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    s = llm.engine.stats()
    assert s.steps_total > 0 and llm.engine.step_model.num_samples == s.steps_total
    assert len(s.step_time_coeffs) == len(FEATURES)
    assert any(c > 0 for c in s.step_time_coeffs) and all(c >= 0 for c in s.step_time_coeffs)
