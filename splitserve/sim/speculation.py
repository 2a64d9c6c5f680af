"""Speculative decoding in the simulator: k proposals a step per decoding sequence, each accepted
with probability `acceptance` (α), i.i.d. The engine then emits, per sequence and verify step,

    E = 1 + α + α² + … + α^k = (1 − α^(k+1)) / (1 − α)    (k + 1 at α = 1)

tokens (the accepted run plus the target's own token), and a verify step computes k + 1 query
rows per sequence: k more rows of matmul FLOPs, of LM head and of attention pairs over the same
context, and k more KV rows written — but the same weights and context read once (`verify_shape`).
In the memory-bound regime the step costs about what a decode step does, so TPOT falls by about
E; compute-bound, the extra rows cost their FLOPs and the gain shrinks (at α = 0 it is a loss).

The simulated engine still emits one token per sequence a step, so a decode-only step is charged
1/E of a verify step's time (a fluid model: the same tokens per second, the same TPOT). A step with
prefill chunks in it is modelled without speculation (its chunks must not run E times faster)."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.engine.step_shape import StepShape
from splitserve.types import ConfigError


@dataclass(frozen=True)
class SpecSim:
    k: int = 0  # proposals per sequence and step (0: no speculation)
    acceptance: float = 0.0  # α: the chance each proposal is accepted, given the ones before were

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 0:
            raise ConfigError(f"speculative k must be an integer >= 0, got {self.k!r}")
        if not 0.0 <= self.acceptance <= 1.0:
            raise ConfigError(f"speculative acceptance rate must be in [0, 1], got {self.acceptance}")

    @property
    def tokens_per_step(self) -> float:
        a, k = self.acceptance, self.k
        return float(k + 1) if a == 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)

    def verify_shape(self, s: StepShape) -> StepShape:
        """A decode step's shape with k more query rows per sequence: those rows count as chunk
        tokens that attend to the sequence's context (no second read of it) and are all sampled."""
        if not self.k or not s.decode_seqs:
            return s
        extra = self.k * s.decode_seqs
        pairs = self.k * s.decode_context + s.decode_seqs * self.k * (self.k + 1) / 2
        return s._replace(prefill_tokens=s.prefill_tokens + extra, prefill_attended=s.prefill_attended + pairs,
                          prefill_context=s.prefill_context + extra, sampled=s.sampled + extra)

    def step_s(self, step_s, s: StepShape) -> float:
        """Seconds the simulated step of shape `s` is charged, `step_s` the cost model's."""
        if not self.k or not s.decode_seqs or s.prefill_tokens:
            return step_s(s)
        return step_s(self.verify_shape(s)) / self.tokens_per_step
