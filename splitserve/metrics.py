"""Every Prometheus metric splitserve exports, defined once (DESIGN.md §4 "Metrics"), in a
registry per server so tests and several servers in one process do not collide."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from splitserve.types import MoveKind, MoveReason

PREFIX = "splitserve_"
# why the edge refuses a request before any compute: admission's (capacity, ttft_slo, tpot_slo)
# and the tenant's limits
REJECTION_REASONS = ("capacity", "ttft_slo", "tpot_slo", "rate_limit", "tenant_concurrency")
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_RATE = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 400.0)
_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Phase(str, Enum):
    """The phases of `request_phase_seconds`. queue → prefill → (transfer) → first token is the
    request's own timeline as its workers saw it; first_token and e2e as the ingress saw them."""

    QUEUE = "queue"  # added to an engine → first scheduled
    PREFILL = "prefill"  # first scheduled → first token sampled
    TRANSFER = "transfer"  # the decode worker's KV landing: pull (or a streamed tail) + verify + ack
    EXPOSED_TRANSFER = "exposed_transfer"  # the prefill's last pass ended → KV verified: the critical-path part
    FIRST_TOKEN = "first_token"  # arrived at the ingress → first token (TTFT)
    INTER_TOKEN = "inter_token"  # the mean gap between its later tokens (its TPOT)
    E2E = "e2e"  # arrived → last token


@dataclass
class Metrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token", buckets=_LATENCY,
                              registry=r)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds", "Time per output token after the first",
                              buckets=_TOKEN, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "End-to-end request latency", buckets=_LATENCY,
                             registry=r)
        self.requests = Counter(PREFIX + "requests", "Finished requests by status and tenant", ["status", "tenant"],
                                registry=r)
        self.rejections = Counter(PREFIX + "admission_rejections", "Requests rejected before any compute",
                                  ["reason"], registry=r)
        # by the worker whose prefix cache the prompt was looked up in (the one placed to compute it)
        self.prefix_query = Counter(PREFIX + "prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache",
                                    ["worker"], registry=r)
        self.prefix_hit = Counter(PREFIX + "prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache",
                                  ["worker"], registry=r)
        self.kv_transfer_bytes = Counter(PREFIX + "kv_transfer_bytes", "KV bytes moved between workers",
                                         ["transport"], registry=r)
        self.kv_transfer_seconds = Histogram(PREFIX + "kv_transfer_seconds", "KV transfer time", ["transport"],
                                             buckets=_LATENCY, registry=r)
        self.kv_transfer_rate = Histogram(PREFIX + "kv_transfer_gigabytes_per_second",
                                          "One request's KV bytes over its transfer time (a streamed one's time is "
                                          "only its landing after the prefill: hidden time is not counted)",
                                          ["transport"], buckets=_RATE, registry=r)
        self.phase = Histogram(PREFIX + "request_phase_seconds",
                               "Seconds a request spent in each phase (Phase), by route (aggregated: one worker; "
                               "disaggregated: a prefill worker, then the KV moved to a decode worker) and tenant",
                               ["phase", "route", "tenant"], buckets=_LATENCY, registry=r)
        self.moves = Counter(PREFIX + "request_moves", "Requests moved off a worker before they were done: "
                             "kind migration (its decode worker lost it mid-stream) or retry (its prefill worker "
                             "failed it), by reason", ["kind", "reason"], registry=r)
        self.kv_exposed_transfer_seconds = Histogram(
            PREFIX + "kv_exposed_transfer_seconds",
            "From the end of a prompt's last prefill forward pass to its KV verified on the decode worker: "
            "the hand-over on the request's critical path", buckets=_LATENCY, registry=r)
        self.kv_usage = Gauge(PREFIX + "worker_kv_usage_ratio", "KV blocks in use / total", ["role", "worker"],
                              registry=r)
        self.queue = Gauge(PREFIX + "worker_queue_length", "Requests waiting", ["role", "worker"], registry=r)
        self.step_time = Gauge(PREFIX + "worker_step_time_coefficient",
                               "A worker's online step-time fit: seconds per unit of each term (engine/step_model.py)",
                               ["role", "worker", "term"], registry=r)
        self.expert_tokens = Gauge(PREFIX + "worker_expert_tokens",
                                   "A mixture-of-experts worker: tokens routed to each expert, over all layers",
                                   ["role", "worker", "expert"], registry=r)
        self.expert_imbalance = Gauge(
            PREFIX + "worker_expert_imbalance",
            "A mixture-of-experts worker's load imbalance, max / mean: scope expert, its busiest expert's tokens "
            "(ever); scope rank, its busiest expert-parallel rank's (summed over layers of each layer's busiest), "
            "since the last expert rebalance; scope rank_before_rebalance, the same over the window that rebalance "
            "was planned from (engine/expert_balance.py)", ["role", "worker", "scope"], registry=r)
        # speculative decoding (engine/speculative/), per worker: its engine's totals, raised to
        # each report (export_speculation)
        self.spec_proposed = Counter(PREFIX + "worker_spec_proposed_tokens",
                                     "Speculative decoding: tokens proposed and verified", ["role", "worker"],
                                     registry=r)
        self.spec_accepted = Counter(PREFIX + "worker_spec_accepted_tokens",
                                     "Speculative decoding: proposed tokens the model accepted (each verifying step "
                                     "also emits one token of its own per sequence)", ["role", "worker"], registry=r)
        self.spec_verify_steps = Counter(PREFIX + "worker_spec_verify_steps",
                                         "Speculative decoding: verifications, one per sequence per step that verified its proposals",
                                         ["role", "worker"], registry=r)
        self.spec_step_seconds = Counter(
            PREFIX + "worker_spec_verify_step_seconds",
            "Speculative decoding: wall seconds of the engine steps that verified proposals (from its step-time "
            "fit's 32nd step on)", ["role", "worker"], registry=r)
        self.spec_plain_seconds = Counter(
            PREFIX + "worker_spec_verify_step_plain_seconds",
            "Speculative decoding: the engine's step-time fit's seconds for those same steps without their "
            "proposals (each verifying row a one-token decode); verify_step_seconds minus this is the estimated "
            "cost of verification, their ratio its factor on a step's time", ["role", "worker"], registry=r)
        self.spec_acceptance = Gauge(PREFIX + "worker_spec_acceptance_ratio",
                                     "Speculative decoding: accepted / proposed tokens, ever", ["role", "worker"],
                                     registry=r)
        self.pool_size = Gauge(PREFIX + "pool_size", "Workers per role", ["role"], registry=r)
        self.slow = Gauge(PREFIX + "worker_slow",
                          "1 while a worker leaves its load poll or health probe unanswered past the probe timeout "
                          "(slow, alive: it is DEAD only past dead_after_s and then leaves these series)",
                          ["role", "worker"], registry=r)
        self.autoscaler_target = Gauge(PREFIX + "autoscaler_target", "The autoscaler's target pool size", ["role"],
                                       registry=r)
        self.autoscaler_decisions = Counter(PREFIX + "autoscaler_decisions", "Autoscaler decisions by pool and reason",
                                            ["role", "reason"], registry=r)
        # every known label value present from the start, at 0: a rate over them is 0, not "no data"
        for reason in REJECTION_REASONS:
            self.rejections.labels(reason=reason)
        for kind in MoveKind:
            for why in MoveReason:
                self.moves.labels(kind=kind.value, reason=why.value)
        self._decisions_seen: dict[tuple[str, str], int] = {}
        self._moves_seen: dict[tuple[str, str], int] = {}
        # per counter: (role, worker) -> the total last seen
        self._spec_seen: dict[str, dict[tuple[str, str], int]] = {
            name: {} for name in ("spec_proposed", "spec_accepted", "spec_verify_steps", "spec_step_seconds",
                                  "spec_plain_seconds")}

    def forget_workers(self, live: set[str]) -> None:
        """Drop every per-worker series of a worker not in `live` (one that stopped or died): a
        gone worker's last values must not be scraped, nor its series pile up forever."""
        for g in (self.kv_usage, self.queue, self.slow, self.step_time, self.expert_tokens, self.expert_imbalance,
                  self.prefix_query, self.prefix_hit, self.spec_proposed, self.spec_accepted,
                  self.spec_verify_steps, self.spec_step_seconds, self.spec_plain_seconds, self.spec_acceptance):
            worker = g._labelnames.index("worker")
            for labels in list(g._metrics):  # prometheus_client lists a metric's series only here
                if labels[worker] not in live:
                    g.remove(*labels)
        for seen in self._spec_seen.values():
            for key in [k for k in seen if k[1] not in live]:  # (role, worker)
                del seen[key]

    def export_speculation(self, role: str, worker: str, proposed: int, accepted: int, verify_steps: int,
                           step_seconds: float = 0.0, plain_seconds: float = 0.0) -> None:
        """One worker's speculation totals (WorkerStats.spec_*) into its counters and ratio; a
        worker that never proposed gets no series."""
        if not proposed:
            return
        for name, total in (("spec_proposed", proposed), ("spec_accepted", accepted),
                            ("spec_verify_steps", verify_steps), ("spec_step_seconds", step_seconds),
                            ("spec_plain_seconds", plain_seconds)):
            getattr(self, name).labels(role=role, worker=worker)  # present at 0 until it first grows
            _add_up_to(getattr(self, name), self._spec_seen[name], total, role=role, worker=worker)
        self.spec_acceptance.labels(role=role, worker=worker).set(accepted / proposed)

    def export_autoscale(self, report) -> None:
        """An AutoscaleReport (the Controller's totals) into the target gauge and the counter."""
        for role, n in report.targets:
            self.autoscaler_target.labels(role=role.value).set(n)
        for role, reason, total in report.decisions:
            _add_up_to(self.autoscaler_decisions, self._decisions_seen, total, role=role.value, reason=reason.value)

    def export_moves(self, counts) -> None:
        """The orchestrator's move totals (MoveCount) into the counter, as increments."""
        for c in counts:
            _add_up_to(self.moves, self._moves_seen, c.total, kind=c.kind.value, reason=c.reason.value)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def _add_up_to(counter: Counter, seen: dict, total: float, **labels: str) -> None:
    """A counter's series raised to `total`, a count kept elsewhere (the Controller's, the
    orchestrator's) that only grows; one that starts again (a restart) is skipped to."""
    key = tuple(labels.values())
    new = total - seen.get(key, 0)
    if new > 0:
        counter.labels(**labels).inc(new)
    seen[key] = total
