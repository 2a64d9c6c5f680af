"""The latencies clients saw, over a sliding window: routers record one `RequestSample` per
finished request and send them to the Controller, which keeps them in a `LatencyWindow` for the
autoscaler's observed TTFT / TPOT percentiles."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestSample:
    ended_at: float  # time.time() when it ended (routers and the Controller share wall time)
    ttft_s: float | None  # None: it ended before its first token
    tpot_s: float | None  # None: fewer than two tokens


class LatencyWindow:
    def __init__(self, window_s: float, max_samples: int = 100_000) -> None:
        self.window_s = window_s
        self._samples: deque[RequestSample] = deque(maxlen=max_samples)

    def add(self, samples) -> None:
        self._samples.extend(samples)

    def p90(self, attr: str, now: float) -> float | None:
        """The 90th percentile of `attr` (ttft_s / tpot_s) over samples that ended within the
        window; None when none did."""
        self._expire(now)
        values = sorted(v for s in self._samples if s.ended_at <= now and (v := getattr(s, attr)) is not None)
        if not values:
            return None
        return values[min(len(values) - 1, math.ceil(0.9 * len(values)) - 1)]

    def __len__(self) -> int:
        return len(self._samples)

    def _expire(self, now: float) -> None:
        # samples arrive roughly in order; an out-of-order straggler only lingers one window
        while self._samples and self._samples[0].ended_at < now - self.window_s:
            self._samples.popleft()
