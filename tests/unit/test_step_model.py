import random

import pytest

from splitserve import LLM, SamplingParams
from splitserve.engine.step_model import StepTimeModel


def test_recovers_known_coefficients():
    m = StepTimeModel(refit_every=4)
    rng = random.Random(0)
    true = (0.002, 1e-5, 3e-4, 2e-7)
    for _ in range(200):
        p, d, c = rng.randint(0, 2048), rng.randint(0, 64), rng.randint(0, 40000)
        m.observe(p, d, c, true[0] + true[1] * p + true[2] * d + true[3] * c)
    for got, want in zip(m.coeffs, true):
        assert got == pytest.approx(want, rel=1e-3)
    assert m.predict(100, 10, 1000) == pytest.approx(true[0] + 100 * true[1] + 10 * true[2] + 1000 * true[3], rel=1e-3)


def test_engine_reports_a_fit(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama")), num_kv_blocks=64)
    llm.generate([[5] * n for n in (10, 50, 90)], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    s = llm.engine.stats()
    assert s.steps_total > 0 and llm.engine.step_model.num_samples == s.steps_total
    assert any(c > 0 for c in s.step_time_coeffs) and all(c >= 0 for c in s.step_time_coeffs)
