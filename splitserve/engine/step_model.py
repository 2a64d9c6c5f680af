"""A fitted model of how long an engine step takes, from the steps it has run.

  step_s ≈ c0 + c1·(prefill tokens) + c2·(decode sequences) + c3·(context tokens read by decodes)

Least squares over a sliding window of recent steps, refitted every few steps. The router's
admission (predicted TTFT / TPOT) reads the coefficients from WorkerStats; mechanism only here.
"""

from __future__ import annotations

from collections import deque

import torch

FEATURES = ("const", "prefill_tokens", "decode_seqs", "decode_ctx_tokens")


class StepTimeModel:
    def __init__(self, window: int = 512, refit_every: int = 16) -> None:
        self._rows: deque[tuple[float, float, float, float]] = deque(maxlen=window)
        self._times: deque[float] = deque(maxlen=window)
        self._refit_every = refit_every
        self._since_fit = 0
        self.coeffs: tuple[float, ...] = (0.0,) * len(FEATURES)
        self.num_samples = 0

    def observe(self, prefill_tokens: int, decode_seqs: int, decode_ctx_tokens: int, seconds: float) -> None:
        self._rows.append((1.0, float(prefill_tokens), float(decode_seqs), float(decode_ctx_tokens)))
        self._times.append(seconds)
        self.num_samples += 1
        self._since_fit += 1
        if self._since_fit >= self._refit_every or self.num_samples <= 8:
            self._fit()

    def _fit(self) -> None:
        self._since_fit = 0
        x = torch.tensor(list(self._rows), dtype=torch.float64)
        y = torch.tensor(list(self._times), dtype=torch.float64)[:, None]
        # Ridge term: early on, with few distinct step shapes, plain least squares is singular.
        a = x.T @ x + 1e-6 * torch.eye(x.shape[1], dtype=torch.float64)
        sol = torch.linalg.solve(a, x.T @ y)[:, 0].clamp(min=0.0)
        self.coeffs = tuple(float(v) for v in sol)

    def predict(self, prefill_tokens: int, decode_seqs: int, decode_ctx_tokens: int) -> float:
        c = self.coeffs
        return c[0] + c[1] * prefill_tokens + c[2] * decode_seqs + c[3] * decode_ctx_tokens
