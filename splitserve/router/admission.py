"""Admission (DESIGN.md §1 step 3): refuse, before any compute is spent, a request that cannot
meet its latency targets, instead of letting every request miss them.

From the serving worker's fitted step-time model (`WorkerStats.step_time_coeffs`: seconds ≈
c0 + c1·prefill tokens + c2·decode seqs + c3·decode context tokens) and its load, predict:
  TTFT ≈ c1·(prompt tokens pending ahead + this prompt's uncached tokens)
         + steps to get through them (token budget per step) × a step's decode cost
  TPOT ≈ c0 + c2·(running + 1) + c3·(context of the running batch + this prompt)
A request is admitted if both predictions meet its SLOs (per request, else the server's), and
the in-flight count is under its class's limit: sheddable requests go first (half the limit),
standard at the limit, critical only past twice the limit (the hard capacity bound).
Rejections carry a Retry-After estimate: how long until the queue ahead drains.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.types import Priority, WorkerStats


@dataclass(frozen=True)
class AdmissionConfig:
    max_inflight: int = 256
    ttft_slo_ms: float | None = None  # server defaults; a request may set its own
    tpot_slo_ms: float | None = None
    enabled: bool = True

    def __post_init__(self) -> None:
        if self.max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {self.max_inflight}")


@dataclass(frozen=True)
class Decision:
    admit: bool
    reason: str = ""  # capacity | ttft_slo | tpot_slo
    retry_after_s: float = 0.0
    predicted_ttft_s: float = 0.0
    predicted_tpot_s: float = 0.0


_LIMIT = {Priority.SHEDDABLE: 0.5, Priority.STANDARD: 1.0, Priority.CRITICAL: 2.0}


class Admission:
    def __init__(self, config: AdmissionConfig | None = None) -> None:
        self.config = config or AdmissionConfig()
        self.inflight = 0

    def predict(self, stats: WorkerStats, prompt_tokens: int, cached_tokens: int) -> tuple[float, float]:
        c0, c1, c2, c3 = (tuple(stats.step_time_coeffs) + (0.0,) * 4)[:4]
        tokens = stats.pending_prefill_tokens + max(1, prompt_tokens - cached_tokens)
        steps = -(-tokens // max(1, stats.token_budget))
        step_cost = c0 + c2 * stats.num_running + c3 * stats.decode_context_tokens
        ttft = c1 * tokens + steps * step_cost
        tpot = c0 + c2 * (stats.num_running + 1) + c3 * (stats.decode_context_tokens + prompt_tokens)
        return ttft, tpot

    def decide(self, stats: WorkerStats | None, priority: Priority, prompt_tokens: int, cached_tokens: int = 0,
               ttft_slo_ms: float | None = None, tpot_slo_ms: float | None = None) -> Decision:
        cfg = self.config
        if not cfg.enabled:
            return Decision(True)
        limit = cfg.max_inflight * _LIMIT[priority]
        if self.inflight >= limit:
            return Decision(False, "capacity", retry_after_s=1.0)
        if stats is None or priority is Priority.CRITICAL:
            return Decision(True)  # critical requests are refused only at the hard limit
        ttft, tpot = self.predict(stats, prompt_tokens, cached_tokens)
        ttft_slo = ttft_slo_ms if ttft_slo_ms is not None else cfg.ttft_slo_ms
        tpot_slo = tpot_slo_ms if tpot_slo_ms is not None else cfg.tpot_slo_ms
        drain = max(0.0, ttft - (ttft_slo or 0) / 1e3)
        if ttft_slo is not None and ttft * 1e3 > ttft_slo:
            return Decision(False, "ttft_slo", max(1.0, drain), ttft, tpot)
        if tpot_slo is not None and tpot * 1e3 > tpot_slo:
            return Decision(False, "tpot_slo", 1.0, ttft, tpot)
        return Decision(True, "", 0.0, ttft, tpot)
