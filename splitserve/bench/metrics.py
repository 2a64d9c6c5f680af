"""Summary statistics of a bench run: latency distributions, throughput, goodput.

Latencies (TTFT, TPOT, ITL, end-to-end) are taken over successful requests only and reported in
milliseconds as mean / p50 / p90 / p99. Throughput counts successful requests and their output
tokens per second of run time. Goodput counts only successful requests that met every SLO given
(TTFT <= `ttft_slo_ms`, TPOT <= `tpot_slo_ms`; a one-token output has no TPOT and meets it).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:  # the simulator reads Distribution without the HTTP client
    from splitserve.bench.client import RequestResult


@dataclass(frozen=True)
class Distribution:
    """mean / p50 / p90 / p99 in ms over `count` samples (all None when there are none)."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None

    @staticmethod
    def of(values_s: Sequence[float]) -> "Distribution":
        if not values_s:
            return Distribution(0, None, None, None, None)
        ms = sorted(v * 1000.0 for v in values_s)
        return Distribution(len(ms), sum(ms) / len(ms), percentile(ms, 50), percentile(ms, 90), percentile(ms, 99))


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default) of an ascending, non-empty sequence."""
    pos = (len(sorted_values) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


@dataclass(frozen=True)
class Slo:
    """Latency targets in ms; None: no target."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def met_by(self, r: RequestResult) -> bool:
        if not r.ok:
            return False
        if self.ttft_ms is not None and (r.ttft_s is None or r.ttft_s * 1000.0 > self.ttft_ms):
            return False
        tpot = r.tpot_s
        return self.tpot_ms is None or tpot is None or tpot * 1000.0 <= self.tpot_ms


@dataclass(frozen=True)
class BenchSummary:
    """Everything the JSON's `summary` holds."""

    num_requests: int
    completed: int
    rejected: int  # HTTP 429
    errors: int  # every other failure
    duration_s: float
    request_throughput: float  # completed requests / s
    output_token_throughput: float  # output tokens of completed requests / s
    goodput: float  # completed requests meeting the SLOs / s
    slo_attainment: float | None  # fraction of completed requests meeting the SLOs
    slo: Slo
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2e_ms: Distribution
    total_output_tokens: int
    status_counts: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(results: Sequence[RequestResult], duration_s: float, slo: Slo) -> BenchSummary:
    """Reduce per-request results to a `BenchSummary`."""
    ok = [r for r in results if r.ok]
    rejected = sum(r.rejected for r in results)
    tokens = sum(r.output_tokens for r in ok)
    good = sum(slo.met_by(r) for r in ok)
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    return BenchSummary(
        num_requests=len(results), completed=len(ok), rejected=rejected,
        errors=len(results) - len(ok) - rejected, duration_s=duration_s,
        request_throughput=per_s(len(ok)), output_token_throughput=per_s(tokens), goodput=per_s(good),
        slo_attainment=good / len(ok) if ok else None, slo=slo,
        ttft_ms=Distribution.of([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot_ms=Distribution.of([r.tpot_s for r in ok if r.tpot_s is not None]),
        itl_ms=Distribution.of([x for r in ok for x in r.itl_s]),
        e2e_ms=Distribution.of([r.e2e_s for r in ok]),
        total_output_tokens=tokens,
        status_counts=dict(sorted(Counter(r.status for r in results).items())),
    )


def format_summary(s: BenchSummary) -> str:
    """A short human-readable table of the summary."""
    lines = [
        f"requests: {s.num_requests}  ok: {s.completed}  rejected (429): {s.rejected}  errors: {s.errors}"
        f"  in {s.duration_s:.2f} s",
        f"throughput: {s.request_throughput:.2f} req/s, {s.output_token_throughput:.1f} output tok/s;"
        f"  goodput: {s.goodput:.2f} req/s",
        f"{'ms':<6}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for name, d in (("TTFT", s.ttft_ms), ("TPOT", s.tpot_ms), ("ITL", s.itl_ms), ("E2E", s.e2e_ms)):
        cells = "".join(f"{v:>10.1f}" if v is not None else f"{'-':>10}" for v in (d.mean, d.p50, d.p90, d.p99))
        lines.append(f"{name:<6}{cells}")
    return "\n".join(lines)
