"""The autoscaling policy: every interval, `Signals` in, target sizes for the prefill and the
decode pool out, each sized from its own SLO with no offline profile (the workers' online
step-time fits are the model).

  * Prefill: the queued prompt tokens must drain within the TTFT target while the arriving
    ones keep coming: need = arriving tokens/s + queued / TTFT target, in workers of the fitted
    prefill throughput. The pool may be 0 (every prompt on the decode workers, the aggregated
    path; the PD decider sends a prefill worker only the prompts that pay); it opens again with
    one worker when the decode pool misses its TTFT or TPOT target with prompts of its own
    queued (its prefills are what slows it).
  * Decode: every sequence in flight must fit a batch whose fitted step time stays under the
    TPOT target (per token: under speculative decoding a step yields the measured tokens per
    step, `DecodeSignals.tokens_per_step`, so a step may take that many times the target), and
    its KV must fit: need = sequences / (the batch one worker can carry); plus,
    for the prompts the decode workers compute themselves (aggregated path), the prefill
    pool's formula over their own queue and arrivals, in workers of their fitted prefill
    throughput.

Going up sizes the pool to `target_utilization` of its capacity; going down only happens when
the smaller pool would stay under `down_utilization` (a band between the two: noise does not
flap the pool), and while the observed percentile meets the SLO. A pool whose observed
percentile misses its SLO grows by at least one. Each change waits out the pool's cooldown
since its last change (`up_cooldown_s`, the longer `down_cooldown_s`); for shrinking the start
counts as a change (a pool just deployed is not cut before it has seen a cooldown's worth of
load). Targets stay within `Bounds`. With `max_workers` (a fleet of that many workers) decode
is sized first and prefill gets at most what is left: a prompt with no prefill worker is
computed by its decode worker, a sequence with no decode worker is not served. Pure: the caller
passes the time in the signals, so tests and the simulator replay it.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
from dataclasses import dataclass, field

from splitserve.control.autoscale.signals import DecodeSignals, PrefillSignals, Signals, StepFit
from splitserve.types import ConfigError, Role

log = logging.getLogger(__name__)


class Reason(str, enum.Enum):
    HOLD = "hold"  # within the band
    PREFILL_BACKLOG = "prefill_backlog"  # queued + arriving prompt work needs more prefill capacity
    TTFT_MISS = "ttft_miss"  # the observed TTFT percentile is over the SLO
    DECODE_BATCH = "decode_batch"  # the sequences in flight need more batches under the TPOT SLO
    KV_FULL = "kv_full"  # their KV does not fit
    TPOT_MISS = "tpot_miss"  # the observed TPOT percentile is over the SLO
    IDLE = "idle"  # a smaller pool still meets the SLO with room
    COOLDOWN = "cooldown"  # a change is due, the last one too recent
    STARTING = "starting"  # a smaller pool is due, but the last growth has not landed (workers starting)
    BOUND = "bound"  # what the load asks for is outside min / max

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Bounds:
    min: int
    max: int

    def __post_init__(self) -> None:
        for v in (self.min, self.max):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"pool bounds must be integers >= 0, got min={self.min!r} max={self.max!r}")
        if self.min > self.max:
            raise ConfigError(f"pool bounds: min {self.min} > max {self.max}")

    def clamp(self, n: int) -> int:
        return max(self.min, min(self.max, n))


@dataclass(frozen=True)
class AutoscaleConfig:
    prefill: Bounds = Bounds(0, 4)
    decode: Bounds = Bounds(1, 4)
    interval_s: float = 10.0
    ttft_slo_s: float = 1.0
    tpot_slo_s: float = 0.1
    up_cooldown_s: float = 30.0
    down_cooldown_s: float = 120.0
    target_utilization: float = 0.8
    down_utilization: float = 0.5
    chunk_tokens: int = 512  # the prefill chunk the throughput fit is read at
    kv_headroom: float = 0.9  # the KV share a decode worker is sized to
    window_s: float = 30.0  # latency percentiles are over this much of the recent past
    rate_window_s: float = 20.0  # token rates (served, arriving) are over this much
    max_workers: int | None = None  # the two pools together (None: each within its own bounds)

    def __post_init__(self) -> None:
        for name in ("prefill", "decode"):
            if not isinstance(getattr(self, name), Bounds):
                raise ConfigError(f"autoscale {name} must be bounds {{min, max}}, got {getattr(self, name)!r}")
        if self.decode.min < 1:
            raise ConfigError("the decode pool needs at least one worker (decode.min >= 1)")
        for name in ("interval_s", "ttft_slo_s", "tpot_slo_s", "up_cooldown_s", "down_cooldown_s", "window_s",
                     "rate_window_s", "chunk_tokens", "kv_headroom"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"autoscale {name} must be a positive number, got {v!r}")
        if self.max_workers is not None and (not isinstance(self.max_workers, int) or isinstance(self.max_workers, bool)
                                             or self.max_workers < self.prefill.min + self.decode.min):
            raise ConfigError(f"autoscale max_workers must be an integer >= prefill.min + decode.min "
                              f"({self.prefill.min + self.decode.min}), got {self.max_workers!r}")
        if not 0 < self.down_utilization < self.target_utilization <= 1:
            raise ConfigError("autoscale needs 0 < down_utilization < target_utilization <= 1, got "
                              f"{self.down_utilization} and {self.target_utilization}")

    @classmethod
    def from_dict(cls, d: dict, ttft_slo_s: float | None = None, tpot_slo_s: float | None = None) -> "AutoscaleConfig":
        """From the `autoscale:` mapping of a config file or the Serve args: `prefill` and
        `decode` as {min, max}, the other fields by name; the SLOs from the app's own targets
        when it has them."""
        if not isinstance(d, dict):
            raise ConfigError(f"autoscale must be a mapping (prefill: {{min, max}}, decode: ..., interval_s, ...), "
                              f"got {d!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown autoscale keys {sorted(unknown)}; known: {sorted(known)}")
        fields = dict(d)
        for role in ("prefill", "decode"):
            if role in fields:
                fields[role] = _bounds(role, fields[role], getattr(cls, role))
        for name, slo in (("ttft_slo_s", ttft_slo_s), ("tpot_slo_s", tpot_slo_s)):
            if slo is not None:
                fields.setdefault(name, slo)
        return cls(**fields)


def _bounds(role: str, b, default: Bounds) -> Bounds:
    if isinstance(b, Bounds):
        return b
    if not isinstance(b, dict) or set(b) - {"min", "max"}:
        raise ConfigError(f"autoscale {role} must be {{min: N, max: M}}, got {b!r}")
    try:
        return Bounds(b.get("min", default.min), b.get("max", default.max))
    except ConfigError as e:
        raise ConfigError(f"autoscale {role}: {e}") from None


@dataclass(frozen=True)
class AutoscaleDecision:
    at: float
    prefill: int
    decode: int
    prefill_reason: Reason
    decode_reason: Reason
    detail: str = ""  # the numbers behind it, for the log

    def target(self, role: Role) -> int:
        return self.prefill if role is Role.PREFILL else self.decode

    def reason(self, role: Role) -> Reason:
        return self.prefill_reason if role is Role.PREFILL else self.decode_reason


@dataclass
class _Pool:
    last_change_at: float = -math.inf
    fit: StepFit | None = None  # the last useful fit (a pool scaled to zero reports none)


@dataclass
class AutoscalePolicy:
    config: AutoscaleConfig
    _pools: dict = field(default_factory=lambda: {Role.PREFILL: _Pool(), Role.DECODE: _Pool()})
    _started_at: float | None = None  # the first decision's time

    def decide(self, s: Signals) -> AutoscaleDecision:
        if self._started_at is None:
            self._started_at = s.at
        (d, d_reason, d_why) = self._decode(s)
        (p, p_reason, p_why) = self._prefill(s)
        cap = self.config.max_workers
        if cap is not None and p + d > cap:  # decode first: prefill gets what is left
            p, p_reason = max(self.config.prefill.min, cap - d), Reason.BOUND
        decision = AutoscaleDecision(s.at, p, d, p_reason, d_reason, f"prefill: {p_why}; decode: {d_why}")
        changed = p != s.prefill.workers or d != s.decode.workers
        (log.info if changed else log.debug)("autoscale: prefill %d→%d (%s), decode %d→%d (%s) — %s",
                                             s.prefill.workers, p, p_reason, s.decode.workers, d, d_reason,
                                             decision.detail)
        return decision

    # -- prefill --------------------------------------------------------------------------------
    def _prefill(self, s: Signals) -> tuple[int, Reason, str]:
        sig, c = s.prefill, self.config
        capacity = self._prefill_capacity(sig)
        need = sig.arriving_tokens_per_s + sig.queued_tokens / c.ttft_slo_s
        if capacity is None:  # nothing measured yet: one worker when work arrives, else hold
            up = down = max(sig.workers, 1 if need > 0 else 0)
        else:
            up, down = _sizes(need / capacity, c)
        # a miss with work queued grows the pool; a miss at all (a burst just ended) keeps it
        over = sig.ttft_p90_s is not None and sig.ttft_p90_s > c.ttft_slo_s
        missed = over and sig.queued_tokens > 0
        if over:
            down = max(down, sig.workers)
        if sig.workers + sig.starting == 0 and s.decode.queued_prompt_tokens > 0 and (over or self._tpot_over(s)):
            up, missed = max(up, 1), False  # the decode pool's own prompts slow it: open the prefill pool
        why = f"need {need:.0f} tok/s of {capacity or 0:.0f} per worker, TTFT p90 {sig.ttft_p90_s}"
        return self._settle(Role.PREFILL, s.at, sig.workers, sig.starting, up, down, missed,
                            Reason.PREFILL_BACKLOG, Reason.TTFT_MISS, c.prefill) + (why,)

    def _prefill_capacity(self, sig: PrefillSignals) -> float | None:
        pool = self._pools[Role.PREFILL]
        if sig.fit.knows_prefill:
            pool.fit = sig.fit
        if pool.fit is not None:
            return pool.fit.prefill_tokens_per_s(self.config.chunk_tokens)
        if sig.workers and sig.served_tokens_per_s > 0:
            return sig.served_tokens_per_s / sig.workers
        return None

    def _tpot_over(self, s: Signals) -> bool:
        return s.decode.tpot_p90_s is not None and s.decode.tpot_p90_s > self.config.tpot_slo_s

    # -- decode ---------------------------------------------------------------------------------
    def _decode(self, s: Signals) -> tuple[int, Reason, str]:
        sig, c = s.decode, self.config
        pool = self._pools[Role.DECODE]
        if sig.fit.per_decode_seq > 0 or sig.fit.per_context_token > 0:
            pool.fit = sig.fit
        seqs = sig.running + sig.waiting
        per_worker_kv = self._kv_batch(sig)
        batch_up, batch_down = (self._tpot_batch(pool.fit, sig.mean_context, u, sig.tokens_per_step)
                                for u in (c.target_utilization, c.down_utilization))
        prompts = self._decode_prompt_workers(sig, pool.fit)  # workers' worth of prompt work, at full use
        up = _ceil(seqs / min(batch_up, per_worker_kv) + prompts / c.target_utilization)
        down = _ceil(seqs / min(batch_down, per_worker_kv * c.down_utilization / c.target_utilization)
                     + prompts / c.down_utilization)
        reason = Reason.KV_FULL if per_worker_kv < batch_up else Reason.DECODE_BATCH
        if prompts / c.target_utilization > seqs / min(batch_up, per_worker_kv):
            reason = Reason.PREFILL_BACKLOG
        missed = self._tpot_over(s)
        why = (f"{seqs:.0f} seqs, batch ≤ {batch_up:.0f} by TPOT and ≤ {per_worker_kv:.0f} by KV, "
               f"TPOT p90 {sig.tpot_p90_s}")
        return self._settle(Role.DECODE, s.at, sig.workers, sig.starting, up, down, missed, reason,
                            Reason.TPOT_MISS, c.decode) + (why,)

    def _decode_prompt_workers(self, sig: DecodeSignals, fit: StepFit | None) -> float:
        """Decode workers' worth of the prompts they compute themselves: their arrivals plus their
        queue drained within the TTFT target, over one worker's fitted prefill throughput."""
        need = sig.arriving_prompt_tokens_per_s + sig.queued_prompt_tokens / self.config.ttft_slo_s
        if need <= 0 or fit is None or not fit.knows_prefill:
            return 0.0
        return need / fit.prefill_tokens_per_s(self.config.chunk_tokens)

    def _tpot_batch(self, fit: StepFit | None, context: float, utilization: float,
                    tokens_per_step: float = 1.0) -> float:
        """The largest batch whose fitted step time per token stays within `utilization` of the
        TPOT SLO: a step yields `tokens_per_step` tokens per sequence (speculative decoding),
        so it may take that many times the SLO."""
        if fit is None:
            return math.inf
        per_seq = fit.per_decode_seq + context * fit.per_context_token
        room = self.config.tpot_slo_s * utilization * max(1.0, tokens_per_step) - fit.base
        return max(1.0, room / per_seq) if per_seq > 0 else math.inf

    def _kv_batch(self, sig: DecodeSignals) -> float:
        """Sequences one worker's KV holds at `kv_headroom`, at the current sequences' size."""
        if sig.workers == 0 or sig.running == 0 or sig.kv_usage <= 0:
            return math.inf
        return max(1.0, (sig.running / sig.workers) * self.config.kv_headroom / sig.kv_usage)

    # -- shared ---------------------------------------------------------------------------------
    def _settle(self, role: Role, now: float, current: int, starting: int, up: int, down: int, missed: bool,
                grow: Reason, miss: Reason, bounds: Bounds) -> tuple[int, Reason]:
        """The pool's next size: up to `up` (at least one more while its SLO is missed), down to
        `down` only with the SLO met and no worker still starting (the signals do not show the
        last growth yet: a worker slower to start than the cooldown would be stopped unborn,
        again and again), each after its cooldown, within bounds."""
        c, pool = self.config, self._pools[role]
        if missed and up <= current:
            want, reason = current + 1, miss
        elif up > current:
            want, reason = up, grow
        elif down < current and not missed:
            want, reason = down, Reason.IDLE
        else:
            want, reason = current, Reason.HOLD
        clamped = bounds.clamp(want)
        if clamped == current:
            return current, Reason.HOLD if want == current else Reason.BOUND
        if clamped < current and starting:
            return current, Reason.STARTING
        cooldown = c.up_cooldown_s if clamped > current else c.down_cooldown_s
        since = now - pool.last_change_at if clamped > current else now - max(pool.last_change_at, self._started_at)
        if since < cooldown:
            return current, Reason.COOLDOWN
        pool.last_change_at = now
        return clamped, reason


def _sizes(workers_needed: float, c: AutoscaleConfig) -> tuple[int, int]:
    """(the size going up, the size going down): the pool at target / at down utilization."""
    return _ceil(workers_needed / c.target_utilization), _ceil(workers_needed / c.down_utilization)


def _ceil(x: float) -> int:
    return 0 if x <= 0 else (10**6 if math.isinf(x) else math.ceil(x - 1e-9))
