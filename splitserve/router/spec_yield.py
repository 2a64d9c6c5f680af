"""Tokens a decode step yields per sequence under speculative decoding, from a worker's measured
counters (WorkerStats.spec_accepted_tokens_total / spec_verify_steps_total): admission's TPOT
prediction and the autoscaler's decode sizing divide the step time per token by it.

A step that verifies proposals emits the model's own token plus the accepted ones: with a mean
of `a` accepted tokens per verified step, 1 + a tokens. Until a worker has verified enough
steps the mean is noise, so it counts as 1 (no speculation: the step model alone, as before);
and it is capped, so a burst of lucky acceptances cannot promise more than a few tokens per step.
(`spec_verify_steps_total` counts one verification per sequence per step, so the mean is a
sequence's, whatever the batch.)"""

from __future__ import annotations

MIN_VERIFY_STEPS = 32  # fewer verified steps: the acceptance is not known yet, 1 token per step
MAX_TOKENS_PER_STEP = 4.0  # the most a step is credited with, whatever was measured


def tokens_per_step(accepted: int, verify_steps: int) -> float:
    """1 + the mean accepted tokens per verified step, in [1, MAX_TOKENS_PER_STEP]; 1 while
    fewer than MIN_VERIFY_STEPS steps were verified."""
    if verify_steps < MIN_VERIFY_STEPS or accepted <= 0:
        return 1.0
    return min(MAX_TOKENS_PER_STEP, 1.0 + accepted / verify_steps)


def worker_tokens_per_step(stats) -> float:
    """tokens_per_step of one worker's WorkerStats (None: unknown, 1)."""
    if stats is None:
        return 1.0
    return tokens_per_step(stats.spec_accepted_tokens_total, stats.spec_verify_steps_total)
