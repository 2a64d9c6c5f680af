"""What the autoscaler reads every interval: one frozen snapshot per pool (DESIGN.md §4). The
Controller fills it from its workers' load reports and the routers' request records; the
simulator from its simulated pools. Rates are over the last interval(s); latencies are
percentiles of requests finished in that window (None: none finished)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepFit:
    """A worker's online step-time fit (engine/step_model.py): seconds per step =
    base + per_prefill_token · tokens + per_decode_seq · seqs + per_context_token · context
    + per_attention_pair · (causal attention pairs of the prefill chunks)."""

    base: float
    per_prefill_token: float
    per_decode_seq: float
    per_context_token: float
    per_attention_pair: float = 0.0

    @classmethod
    def of(cls, coeffs: tuple[float, ...]) -> "StepFit":
        return cls(*(tuple(coeffs[:5]) + (0.0,) * (5 - len(coeffs[:5]))))

    @property
    def knows_prefill(self) -> bool:
        return self.per_prefill_token > 0 or self.per_attention_pair > 0

    def prefill_tokens_per_s(self, chunk_tokens: int) -> float:
        """Prefill throughput of one worker running chunks of `chunk_tokens` (each attending to
        itself: the attention of a chunk over a longer context is more, so this is an upper bound)."""
        step = (self.base + chunk_tokens * self.per_prefill_token
                + chunk_tokens * (chunk_tokens + 1) / 2 * self.per_attention_pair)
        return chunk_tokens / step if step > 0 else float("inf")


@dataclass(frozen=True)
class PrefillSignals:
    workers: int  # the pool's size now (its target: what the policy moves from)
    queued_tokens: float  # prompt tokens waiting to be prefilled, over the pool
    arriving_tokens_per_s: float  # prompt tokens (not prefix-cached) arriving per second
    served_tokens_per_s: float  # prompt tokens the pool prefilled per second
    ttft_p90_s: float | None
    fit: StepFit  # the pool's typical worker
    starting: int = 0  # workers asked for, not READY yet


@dataclass(frozen=True)
class DecodeSignals:
    workers: int
    running: float  # sequences in decode batches, over the pool
    waiting: float  # handed over, not yet decoding (no room)
    kv_usage: float  # mean fraction of KV blocks in use, 0..1
    mean_context: float  # tokens per running sequence
    tpot_p90_s: float | None
    fit: StepFit
    starting: int = 0
    queued_prompt_tokens: float = 0.0  # prompt tokens the decode workers compute themselves (aggregated path)
    arriving_prompt_tokens_per_s: float = 0.0  # of those, arriving
    # tokens a decode step yields per sequence (speculative decoding: 1 + accepted proposals per
    # verified step, measured over the pool; 1 without it or before enough steps: router/spec_yield.py)
    tokens_per_step: float = 1.0


@dataclass(frozen=True)
class Signals:
    at: float  # seconds, any monotonic clock
    prefill: PrefillSignals
    decode: DecodeSignals
