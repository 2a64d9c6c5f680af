"""Adaptive k: how many tokens to propose for one request, from its recent acceptance.

An exponentially weighted average of accepted / proposed per verified step sets k: all of
k_max while proposals are accepted, fewer as they fail, and 0 — no proposals, no verification
cost — once they keep failing; at 0 a single-token probe goes out every `probe_every` steps, so
a request whose text turns repetitive later is sped up again."""

from __future__ import annotations

ALPHA = 0.3  # weight of the latest step: a few failed steps take k down, a few good ones back up
PROBE_EVERY = 8  # steps at k = 0 between single-token probes


class AdaptiveK:
    def __init__(self, k_max: int, adaptive: bool = True) -> None:
        self.k_max = k_max
        self.adaptive = adaptive
        self.rate = 1.0  # start optimistic: the first proposals go out at full length
        self._idle = 0

    def next_k(self) -> int:
        """The k for this step (call once per step the request decodes in)."""
        if not self.adaptive:
            return self.k_max
        k = min(self.k_max, int(self.rate * (self.k_max + 1)))
        if k == 0:
            self._idle += 1
            if self._idle >= PROBE_EVERY:
                self._idle = 0
                return 1
        return k

    def observe(self, proposed: int, accepted: int) -> None:
        if proposed:
            self.rate += ALPHA * (accepted / proposed - self.rate)
