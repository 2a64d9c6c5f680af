"""`SignalObserver`: the pools' `Signals` from what the Controller (or the simulator) has — each
live worker's last load report, the pool targets, and the routers' latency window.

Rates come from counters between now and the observation `rate_window_s` ago, per worker present
in both (a worker that appeared or left contributes no bogus jump): served = prompt tokens
computed per second; arriving = served + the growth of the queue per second (what came in is
what was done plus what piled up). Over one short interval the queue's growth is noise — a new
worker taking half the queue looks like nothing arriving — hence the window. The decode pool's own
prompt work (the aggregated path) is counted the same way, from its workers' counters.
A pool's step-time fit is the mean of its workers' fits that have seen steps; the decode pool's
tokens per step, its workers' measured speculative acceptance (router/spec_yield.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from splitserve.control.autoscale.signals import DecodeSignals, PrefillSignals, Signals, StepFit
from splitserve.control.autoscale.window import LatencyWindow
from splitserve.router.spec_yield import tokens_per_step
from splitserve.types import Role, WorkerStats


@dataclass(frozen=True)
class _Seen:
    at: float
    computed: dict  # worker id -> prefill_tokens_total
    queued: float
    decode_computed: dict  # the same for the decode pool (prompts its workers compute themselves)
    decode_queued: float


class SignalObserver:
    def __init__(self, rate_window_s: float = 20.0) -> None:
        self.rate_window_s = rate_window_s
        self._seen: deque[_Seen] = deque()

    def observe(self, at: float, targets: dict[Role, int], prefill: dict[str, WorkerStats],
                decode: dict[str, WorkerStats], window: LatencyWindow, starting: dict[Role, int] | None = None
                ) -> Signals:
        """`prefill` / `decode`: the READY workers' last stats by worker id; `targets`: the
        pools' current sizes (what the policy moves from); `starting`: workers not READY yet."""
        starting = starting or {}
        queued = float(sum(s.pending_prefill_tokens for s in prefill.values()))
        computed = {wid: s.prefill_tokens_total for wid, s in prefill.items()}
        d_queued = float(sum(s.pending_prefill_tokens for s in decode.values()))
        d_computed = {wid: s.prefill_tokens_total for wid, s in decode.items()}
        served = arriving = d_arriving = 0.0
        last = self._base(at)
        self._seen.append(_Seen(at, computed, queued, d_computed, d_queued))
        if last is not None and at > last.at:
            dt = at - last.at
            served = _rate(computed, last.computed, dt)
            arriving = max(0.0, served + (queued - last.queued) / dt)
            d_arriving = max(0.0, _rate(d_computed, last.decode_computed, dt) + (d_queued - last.decode_queued) / dt)
        running = sum(s.num_running for s in decode.values())
        context = sum(s.decode_context_tokens for s in decode.values())
        return Signals(
            at,
            PrefillSignals(targets[Role.PREFILL], queued, arriving, served, window.p90("ttft_s", at),
                           pool_fit(prefill.values()), starting.get(Role.PREFILL, 0)),
            DecodeSignals(targets[Role.DECODE], float(running), float(sum(s.num_waiting for s in decode.values())),
                          _mean([s.kv_usage for s in decode.values()]), context / running if running else 0.0,
                          window.p90("tpot_s", at), pool_fit(decode.values()), starting.get(Role.DECODE, 0),
                          d_queued, d_arriving, _tokens_per_step(decode.values())))

    def _base(self, at: float) -> _Seen | None:
        """The newest observation at least `rate_window_s` old (else the oldest one kept)."""
        while len(self._seen) > 1 and self._seen[1].at <= at - self.rate_window_s:
            self._seen.popleft()
        return self._seen[0] if self._seen else None


def _tokens_per_step(stats) -> float:
    """The decode pool's tokens per step per sequence, from its workers' speculation counters
    summed (a worker without speculation adds nothing to either)."""
    stats = list(stats)
    return tokens_per_step(sum(s.spec_accepted_tokens_total for s in stats),
                           sum(s.spec_verify_steps_total for s in stats))


def _rate(now: dict, then: dict, dt: float) -> float:
    """Tokens per second computed by the workers seen both times."""
    return sum(max(0, n - then[w]) for w, n in now.items() if w in then) / dt


def pool_fit(stats) -> StepFit:
    """The mean fit of the workers that have one (all zeros: none has stepped yet)."""
    fits = [s.step_time_coeffs for s in stats if s.steps_total > 0 and any(s.step_time_coeffs)]
    if not fits:
        return StepFit(0.0, 0.0, 0.0, 0.0)
    fits = [tuple(f) + (0.0,) * (5 - len(f)) for f in fits]
    return StepFit.of(tuple(_mean([max(0.0, f[i]) for f in fits]) for i in range(5)))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
