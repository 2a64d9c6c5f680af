"""Admission (DESIGN.md §1 step 3): refuse, before any compute is spent, a request that cannot
meet its latency targets, instead of letting every request miss them.

The ingress asks the backend for a `Plan` (which worker computes the prompt, which decodes,
how much of the prompt the first one has cached, and both workers' load), then asks here.
From each worker's fitted step-time model (`WorkerStats.step_time_coeffs`: seconds ≈
c0 + c1·prefill tokens + c2·decode seqs + c3·decode context tokens + c4·prefill attention
pairs) and its load, predict:
  TTFT ≈ c1·(prompt tokens pending ahead + this prompt's uncached tokens)
         + c4·(this prompt's attention pairs: new tokens × (cached + half the new ones))
         + steps to get through them (token budget per step) × a step's decode cost
         (on the worker that computes the prompt: the first token comes from it, before any
         KV moves)
  TPOT ≈ (c0 + c2·(running + 1) + c3·(context of the running batch + this prompt))
         / tokens per step (on the decode worker; above 1 under speculative decoding, from its
         measured acceptance once it has verified enough steps: router/spec_yield.py)
A request with a structured-output grammar that its first worker has not compiled (as far as
this router knows: it has not sent that spec there lately) adds that worker's measured compile
time (`WorkerStats.grammar_compile_s`; a prior until it has compiled one) to its TTFT; a first
worker that is slow (its load poll unanswered: router/directory.py) adds its silence so far
(`Plan.wait_s`), a wait the request shares.
The TTFT prediction is then calibrated online: the model sees the queue as it is now, not the
steps that grow as the requests ahead start decoding, nor the ingress and RPC hops, nor other
processes competing for the host, so it runs low under load. Each finished request reports
observed vs predicted TTFT; the prediction is multiplied by a high quantile of that ratio over
recent requests whose prediction mattered (near the SLO), and by a prior margin until a few
such requests have been seen.

A request is admitted if both predictions meet its SLOs (per request, else the server's), and
the in-flight count is under its class's limit: sheddable requests go first (half the limit),
standard at the limit, critical only past twice the limit (the hard capacity bound).
Rejections carry a Retry-After estimate: how long until the queue ahead drains.

Worker stats arrive as snapshots, late and at intervals; a burst arriving between two snapshots
must not all see the same idle worker, so the queue ahead also counts what this router admitted
to that worker and has not seen prefilled yet (`Outstanding`).
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass
from typing import Any, Hashable

from splitserve.router.spec_yield import worker_tokens_per_step
from splitserve.types import Priority, WorkerStats


@dataclass(frozen=True)
class AdmissionConfig:
    max_inflight: int = 256
    ttft_slo_ms: float | None = None  # server defaults; a request may only tighten them
    tpot_slo_ms: float | None = None
    enabled: bool = True
    calibration_quantile: float = 0.95  # of observed/predicted TTFT: the margin the SLO check keeps
    calibration_window: int = 200  # recent finished requests it is taken over
    calibration_min_samples: int = 4
    calibration_prior: float = 1.5  # the factor until then: the model runs low before it is checked

    def __post_init__(self) -> None:
        if self.max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {self.max_inflight}")
        if not 1.0 <= self.calibration_prior <= 8.0:
            raise ValueError(f"calibration_prior must be in [1, 8], got {self.calibration_prior}")
        if not 0.5 <= self.calibration_quantile <= 1.0:
            raise ValueError(f"calibration_quantile must be in [0.5, 1], got {self.calibration_quantile}")
        for name in ("ttft_slo_ms", "tpot_slo_ms"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be > 0, got {v}")


@dataclass(frozen=True)
class Plan:
    """Where a request would run: the worker that computes its prompt (a prefill worker, or the
    decode worker itself on the aggregated path) and the one that decodes it, with their load
    snapshots (None: unknown) and the prompt tokens the first already has cached."""

    first_worker: Hashable  # a WorkerId (or "local": the in-process engine)
    first_stats: WorkerStats | None
    decode_worker: Hashable
    decode_stats: WorkerStats | None
    cached_tokens: int = 0
    route: Any = None  # the backend's own placement, handed back to its generate()
    wait_s: float = 0.0  # the first worker is slow: silent this long so far, which the request waits too


@dataclass(frozen=True)
class Decision:
    admit: bool
    reason: str = ""  # capacity | ttft_slo | tpot_slo
    retry_after_s: float = 0.0
    predicted_ttft_s: float = 0.0  # calibrated
    predicted_tpot_s: float = 0.0
    model_ttft_s: float = 0.0  # the cost model's TTFT before calibration
    ttft_slo_ms: float | None = None  # the target it was judged against
    worker: str | None = None  # admitted: where its prompt is computed, and how many tokens
    tokens: int = 0


COMPILE_PRIOR_S = 0.005  # a grammar's compile time before a worker has measured one (llguidance: ~1 ms here)
COMPILED_SEEN = 4096  # (worker, grammar) pairs remembered as compiled there (workers keep 128 each)
_LIMIT = {Priority.SHEDDABLE: 0.5, Priority.STANDARD: 1.0, Priority.CRITICAL: 2.0}
_RATIO_BOUNDS = (0.5, 8.0)  # a calibration factor beyond these says the model is broken, not biased


def predict(stats: WorkerStats, prompt_tokens: int, cached_tokens: int) -> tuple[float, float]:
    """(TTFT, TPOT) in seconds on a worker with this load, before calibration."""
    c0, c1, c2, c3, c4 = (tuple(stats.step_time_coeffs) + (0.0,) * 5)[:5]
    new = max(1, prompt_tokens - cached_tokens)
    tokens = stats.pending_prefill_tokens + new
    steps = -(-tokens // max(1, stats.token_budget))
    step_cost = c0 + c2 * stats.num_running + c3 * stats.decode_context_tokens
    # its own prompt's attention (each new token attends to what precedes it); the queue's
    # prompts are not known token by token, so theirs is left out
    ttft = c1 * tokens + c4 * new * (cached_tokens + (new + 1) / 2) + steps * step_cost
    step = c0 + c2 * (stats.num_running + 1) + c3 * (stats.decode_context_tokens + prompt_tokens)
    # speculative decoding: a step emits 1 + (accepted proposals) tokens per sequence, as measured
    tpot = step / worker_tokens_per_step(stats)
    return ttft, tpot


class Outstanding:
    """Requests this router admitted to each worker whose first token has not come back yet:
    the queue it knows of at once, before any worker snapshot can show it. A worker's own
    report also counts what other routers sent it, so the larger of the two is used."""

    def __init__(self) -> None:
        self._by_worker: dict[str, tuple[int, int]] = {}  # worker -> (requests, prompt tokens to compute)

    def add(self, worker: str, tokens: int, sign: int = 1) -> None:
        n, t = self._by_worker.get(worker, (0, 0))
        self._by_worker[worker] = (n + sign, t + sign * tokens)

    def remove(self, worker: str, tokens: int) -> None:
        self.add(worker, tokens, -1)

    def adjusted(self, worker: str, stats: WorkerStats | None) -> WorkerStats | None:
        if stats is None:
            return None
        n, t = self._by_worker.get(worker, (0, 0))
        return dataclasses.replace(stats, num_waiting=max(stats.num_waiting, n),
                                   pending_prefill_tokens=max(stats.pending_prefill_tokens, t))

    def __getitem__(self, worker: str) -> tuple[int, int]:
        return self._by_worker.get(worker, (0, 0))


class Calibration:
    """A high quantile of observed / predicted TTFT over recent requests (`prior` until enough)."""

    def __init__(self, quantile: float, window: int, min_samples: int, prior: float = 1.0) -> None:
        self.quantile, self.min_samples, self.prior = quantile, min_samples, prior
        self._recent: collections.deque[float] = collections.deque(maxlen=window)

    def observe(self, predicted_s: float, observed_s: float) -> None:
        if predicted_s > 0 and observed_s > 0:
            lo, hi = _RATIO_BOUNDS
            self._recent.append(min(hi, max(lo, observed_s / predicted_s)))

    @property
    def factor(self) -> float:
        if len(self._recent) < self.min_samples:
            return self.prior
        ordered = sorted(self._recent)
        return ordered[min(len(ordered) - 1, int(self.quantile * len(ordered)))]

    def __len__(self) -> int:
        return len(self._recent)


class Admission:
    def __init__(self, config: AdmissionConfig | None = None) -> None:
        self.config = config or AdmissionConfig()
        self.inflight = 0
        self.outstanding = Outstanding()
        self.compiled: collections.OrderedDict[tuple, None] = collections.OrderedDict()  # (worker, grammar key)
        c = self.config
        self.calibration = Calibration(c.calibration_quantile, c.calibration_window, c.calibration_min_samples,
                                       c.calibration_prior)

    def decide(self, plan: Plan | None, priority: Priority, prompt_tokens: int,
               ttft_slo_ms: float | None = None, tpot_slo_ms: float | None = None, grammar: str | None = None
               ) -> Decision:
        """Admit or refuse one request placed by `plan` (`grammar`: its structured-output spec's
        key); an admitted one counts as in flight (and as load on its workers) until `finished`."""
        compile_s = self._compile_s(plan, grammar)
        decision = self._decide(plan, priority, prompt_tokens, ttft_slo_ms, tpot_slo_ms, compile_s)
        if decision.admit:
            self.inflight += 1
            if plan is not None and grammar is not None:
                self._seen(plan.first_worker, grammar)
            if plan is not None:
                decision = dataclasses.replace(decision, worker=plan.first_worker,
                                               tokens=max(1, prompt_tokens - plan.cached_tokens))
                self.outstanding.add(decision.worker, decision.tokens)
        return decision

    def prefilled(self, decision: Decision) -> None:
        """An admitted request's first token arrived: it no longer waits for its prefill."""
        if decision.worker is not None:
            self.outstanding.remove(decision.worker, decision.tokens)

    def finished(self, decision: Decision, observed_ttft_s: float | None) -> None:
        """An admitted request ended; its TTFT (None: no token came, so it was never
        `prefilled`) calibrates the predictor. Only predictions that could have decided
        something count: those past a quarter of the SLO (far below it, fixed per-request
        overheads dominate the ratio)."""
        self.inflight -= 1
        if observed_ttft_s is None:
            self.prefilled(decision)
        slo = decision.ttft_slo_ms
        if observed_ttft_s is not None and (slo is None or decision.predicted_ttft_s * 1e3 >= slo / 4):
            self.calibration.observe(decision.model_ttft_s, observed_ttft_s)

    def _compile_s(self, plan: Plan | None, grammar: str | None) -> float:
        """The compile time a grammar adds on the plan's first worker (0: none, or compiled there)."""
        if plan is None or grammar is None or (plan.first_worker, grammar) in self.compiled:
            return 0.0
        measured = plan.first_stats.grammar_compile_s if plan.first_stats is not None else 0.0
        return measured or COMPILE_PRIOR_S

    def _seen(self, worker: Hashable, grammar: str) -> None:
        self.compiled[(worker, grammar)] = None
        self.compiled.move_to_end((worker, grammar))
        while len(self.compiled) > COMPILED_SEEN:
            self.compiled.popitem(last=False)

    def _decide(self, plan, priority, prompt_tokens, ttft_slo_ms, tpot_slo_ms, compile_s: float = 0.0) -> Decision:
        cfg = self.config
        limit = cfg.max_inflight * _LIMIT[priority]
        if self.inflight >= limit:  # the hard limit holds with the SLO checks off too
            return Decision(False, "capacity", retry_after_s=1.0)
        if not cfg.enabled:
            return Decision(True)
        ttft_slo, tpot_slo = _tighter(ttft_slo_ms, cfg.ttft_slo_ms), _tighter(tpot_slo_ms, cfg.tpot_slo_ms)
        first = None if plan is None else self.outstanding.adjusted(plan.first_worker, plan.first_stats)
        decode = None if plan is None else plan.decode_stats
        model = ttft = tpot = 0.0
        if first is not None:  # a slow worker's silence so far counts as time the request waits
            model = predict(first, prompt_tokens, plan.cached_tokens)[0] + compile_s + plan.wait_s
            ttft = model * self.calibration.factor
        if decode is not None:
            tpot = predict(decode, prompt_tokens, 0)[1]
        if priority is not Priority.CRITICAL:  # critical requests are refused only at the hard limit
            if first is not None and ttft_slo is not None and ttft * 1e3 > ttft_slo:
                return Decision(False, "ttft_slo", max(1.0, ttft - ttft_slo / 1e3), ttft, tpot, model, ttft_slo)
            if decode is not None and tpot_slo is not None and tpot * 1e3 > tpot_slo:
                return Decision(False, "tpot_slo", 1.0, ttft, tpot, model, ttft_slo)
        return Decision(True, "", 0.0, ttft, tpot, model, ttft_slo)


def _tighter(asked: float | None, server: float | None) -> float | None:
    """A request's own SLO may only tighten the server's: a client cannot buy its way past
    admission by asking for a looser target than the operator set."""
    if asked is None or server is None:
        return server if asked is None else asked
    return min(asked, server)
