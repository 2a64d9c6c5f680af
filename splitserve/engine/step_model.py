"""A fitted model of how long an engine step takes, from the steps it has run.

  step_s ≈ c0 + c1·(prefill tokens) + c2·(decode sequences) + c3·(context tokens read by decodes)
           + c4·(causal attention pairs of the prefill chunks)

Non-negative least squares over a sliding window of recent steps, refitted every few steps.
The router's admission (predicted TTFT / TPOT) and the autoscaler read the coefficients from
WorkerStats, the router exports them on /metrics, and the simulator can run on them (its
`linear` cost model has the same form); mechanism only here.
"""

from __future__ import annotations

from collections import deque

from splitserve.engine.least_squares import nonneg_least_squares
from splitserve.engine.step_shape import StepShape
from splitserve.types import STEP_TERMS

FEATURES = STEP_TERMS
MIN_FIT_SAMPLES = 32  # steps seen before a prediction is read as a counterfactual (the verification's cost)


def features(s: StepShape) -> tuple[float, ...]:
    return (1.0, float(s.prefill_tokens), float(s.decode_seqs), float(s.decode_context), s.prefill_attended)


class StepTimeModel:
    def __init__(self, window: int = 1024, refit_every: int = 32) -> None:
        self._rows: deque[tuple[float, ...]] = deque(maxlen=window)
        self._times: deque[float] = deque(maxlen=window)
        self._refit_every = refit_every
        self._since_fit = 0
        self._stepped_s = 0.0
        self.coeffs: tuple[float, ...] = (0.0,) * len(FEATURES)
        self.num_samples = 0

    def observe(self, shape: StepShape, seconds: float) -> None:
        self._rows.append(features(shape))
        self._times.append(seconds)
        self.num_samples += 1
        self._since_fit += 1
        self._stepped_s += seconds
        # A refit over the window costs up to a millisecond in Python: early on every step
        # refits (admission needs a fit at once), later every few steps, or after a tenth of a
        # second of them (a prefill worker's few long steps must not leave its fit stale).
        if self._since_fit >= self._refit_every or self._stepped_s >= 0.1 or self.num_samples <= 16:
            self._since_fit, self._stepped_s = 0, 0.0
            self.coeffs = tuple(nonneg_least_squares(self._rows, self._times, ridge=1e-6))

    def predict(self, shape: StepShape) -> float:
        return sum(c * x for c, x in zip(self.coeffs, features(shape)))
