"""The PD decider: does a request go through a prefill worker, or does its decode worker compute
the prompt itself (the aggregated path)? Policies by name (`make_decider`), pure Python over the
router's views, so the real router and the simulator run exactly this code.

  threshold  through a prefill worker whenever the uncached part of the prompt is at least
             `min_tokens` (and a prefill pool exists)
  slo        (default) the same floor, then only when it pays against the SLOs, from what the
             router already knows of the two workers it picked (their reported prompt backlog,
             batch, step budget and online step-time fit):
               * a decode step carrying a full chunk of the prompt would take more than
                 `CHUNK_SHARE` of the TPOT target (`chunk_interferes`: its sequences would miss
                 it): through the prefill worker, unless that one's backlog plus the prompt
                 takes more than `ttft_share` of the TTFT target (then as below);
               * the decode worker keeps the prompt when it can prefill its backlog plus this
                 prompt within `ttft_share` of the TTFT target while its running sequences
                 keep the TPOT target — prefill may take the share 1 - (decode step / TPOT
                 target) of its time, so its backlog drains in (fitted prefill seconds) / that
                 share —, and otherwise only when the prefill worker's own backlog would take
                 longer still (the prefill pool is the bottleneck).
             Without both SLOs, or before the decode worker has a step-time fit, it is
             `threshold`.

Prefill seconds of n prompt tokens on a worker: c1·n + c4·n²/2 of its fit (the causal attention
pairs of the prompt as one piece; chunking adds a little, the base cost of the steps is paid by
the decodes anyway).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from splitserve.router.policy import WorkerView


CHUNK_SHARE = 0.6  # of the TPOT target a decode step with a full prefill chunk may take


def chunk_interferes(coeffs: tuple[float, ...], budget: int, tpot_slo_s: float, share: float = CHUNK_SHARE) -> bool:
    """Whether a step carrying a full prefill chunk of `budget` tokens takes more than `share` of
    the TPOT target, by a worker's step-time fit: prompts on that worker would make the sequences
    sharing its steps miss it (the rest of the target is the batch's own reads). The autoscaler
    asks the same of the decode pool."""
    return _coeff(coeffs, 0) + prefill_s(coeffs, budget) > share * tpot_slo_s


class PDDecider(Protocol):
    name: str
    min_tokens: int

    def disaggregate(self, decode: "WorkerView", decode_uncached: int, prefill: "WorkerView",
                     prefill_uncached: int) -> bool:
        """Asked only for a prompt whose uncached part on the decode worker is at least
        `min_tokens`, with a prefill worker picked: True sends it through that prefill worker."""
        ...


class ThresholdDecider:
    name = "threshold"

    def __init__(self, min_tokens: int = 32) -> None:
        if not isinstance(min_tokens, int) or isinstance(min_tokens, bool) or min_tokens < 0:
            raise ValueError(f"disagg_min_tokens must be an integer >= 0, got {min_tokens!r}")
        self.min_tokens = min_tokens

    def disaggregate(self, decode, decode_uncached, prefill, prefill_uncached) -> bool:
        return True


class SLODecider(ThresholdDecider):
    name = "slo"

    def __init__(self, min_tokens: int = 32, ttft_slo_s: float | None = None, tpot_slo_s: float | None = None,
                 ttft_share: float = 0.5) -> None:
        super().__init__(min_tokens)
        for n, v in (("ttft_slo_s", ttft_slo_s), ("tpot_slo_s", tpot_slo_s)):
            if v is not None and not v > 0:
                raise ValueError(f"the PD decider's {n} must be > 0, got {v!r}")
        if not 0 < ttft_share <= 1:
            raise ValueError(f"the PD decider's ttft_share must be in (0, 1], got {ttft_share!r}")
        self.ttft_slo_s, self.tpot_slo_s, self.ttft_share = ttft_slo_s, tpot_slo_s, ttft_share

    def disaggregate(self, decode, decode_uncached, prefill, prefill_uncached) -> bool:
        if self.ttft_slo_s is None or self.tpot_slo_s is None or not _knows_prefill(decode.step_time_coeffs):
            return True
        if chunk_interferes(decode.step_time_coeffs, min(decode.token_budget, decode_uncached), self.tpot_slo_s):
            if not _knows_prefill(prefill.step_time_coeffs) or self._prefill_wait(prefill, prefill_uncached) \
                    <= self.ttft_share * self.ttft_slo_s:
                return True  # else the prefill worker is swamped: weigh the two waits as below
        spare = 1.0 - decode_step_s(decode) / self.tpot_slo_s  # the share of its time prefill may take
        if spare <= 0:
            return True
        on_decode = prefill_s(decode.step_time_coeffs, decode.pending_prefill_tokens + decode_uncached) / spare
        if on_decode <= self.ttft_share * self.ttft_slo_s:
            return False
        if not _knows_prefill(prefill.step_time_coeffs):
            return True
        return self._prefill_wait(prefill, prefill_uncached) <= on_decode

    @staticmethod
    def _prefill_wait(prefill, uncached: int) -> float:
        return prefill_s(prefill.step_time_coeffs, prefill.pending_prefill_tokens + uncached)


def _coeff(coeffs: tuple[float, ...], i: int) -> float:
    return max(0.0, coeffs[i]) if len(coeffs) > i else 0.0


def _knows_prefill(coeffs: tuple[float, ...]) -> bool:
    return _coeff(coeffs, 1) > 0 or _coeff(coeffs, 4) > 0


def prefill_s(coeffs: tuple[float, ...], tokens: int) -> float:
    """Fitted seconds to prefill `tokens` prompt tokens (see the module docstring)."""
    return _coeff(coeffs, 1) * tokens + _coeff(coeffs, 4) * tokens * (tokens + 1) / 2


def decode_step_s(w: "WorkerView") -> float:
    """A decode-only step of the worker's running batch, by its fit."""
    c = w.step_time_coeffs
    return _coeff(c, 0) + _coeff(c, 2) * w.num_running + _coeff(c, 3) * w.decode_context_tokens


DECIDERS = {cls.name: cls for cls in (ThresholdDecider, SLODecider)}


def make_decider(name: str = "slo", min_tokens: int = 32, ttft_slo_s: float | None = None,
                 tpot_slo_s: float | None = None) -> PDDecider:
    if name == "threshold":
        return ThresholdDecider(min_tokens)
    if name == "slo":
        return SLODecider(min_tokens, ttft_slo_s, tpot_slo_s)
    raise ValueError(f"unknown PD decider {name!r}; known: {', '.join(DECIDERS)}")
