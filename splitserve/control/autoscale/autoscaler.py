"""`Autoscaler`: the policy with what it needs around it — the latency window routers feed,
the signal observer, and the record of its decisions — so the Controller (and the simulator)
only hands it the pools every interval and applies the targets it returns. Pure Python."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

from splitserve.control.autoscale.observer import SignalObserver
from splitserve.control.autoscale.policy import AutoscaleConfig, AutoscalePolicy, AutoscaleDecision, Reason
from splitserve.control.autoscale.window import LatencyWindow, RequestSample
from splitserve.types import Role, WorkerStats


@dataclass(frozen=True)
class AutoscaleReport:
    """What routers export as metrics and `splitserve status` shows."""

    targets: tuple[tuple[Role, int], ...]
    decisions: tuple[tuple[Role, Reason, int], ...]  # how many decisions had each reason, ever
    last: AutoscaleDecision | None
    changes: tuple[AutoscaleDecision, ...] = ()  # the recent decisions that changed a target, oldest first


class Autoscaler:
    def __init__(self, config: AutoscaleConfig) -> None:
        self.config = config
        self.policy = AutoscalePolicy(config)
        self.window = LatencyWindow(config.window_s)
        self.observer = SignalObserver(config.rate_window_s)
        self.last: AutoscaleDecision | None = None
        self.changes: deque[AutoscaleDecision] = deque(maxlen=32)
        self._counts: Counter = Counter()

    def initial(self, role: Role, n: int) -> int:
        """A pool's first target: the configured size, within bounds."""
        return (self.config.prefill if role is Role.PREFILL else self.config.decode).clamp(n)

    def record(self, samples: list[RequestSample]) -> None:
        self.window.add(samples)

    def tick(self, now: float, targets: dict[Role, int], prefill: dict[str, WorkerStats],
             decode: dict[str, WorkerStats], starting: dict[Role, int] | None = None) -> AutoscaleDecision:
        decision = self.policy.decide(self.observer.observe(now, targets, prefill, decode, self.window, starting))
        for role in Role:
            self._counts[role, decision.reason(role)] += 1
        self.last = decision
        if any(decision.target(r) != targets[r] for r in Role):
            self.changes.append(decision)
        return decision

    def report(self, targets: dict[Role, int]) -> AutoscaleReport:
        return AutoscaleReport(tuple(sorted(targets.items())),
                               tuple((r, why, n) for (r, why), n in sorted(self._counts.items())),
                               self.last, tuple(self.changes))
