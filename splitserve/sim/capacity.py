"""Steady-state capacity from a cost model alone — the roofline's own answer to "how many output
tokens a second can this worker give at this TPOT", before any simulation:

  aggregated  B sequences decode together, each at context input + output / 2 on average (a
              steady state's sequences are spread evenly over their outputs); every step also
              prefills the prompts of the B / output requests that finish in it (B × input /
              output tokens, each prompt's causal pairs input² / 2), so arrivals match
              completions. The largest B whose step stays within the TPOT target, whose KV fits
              (B × (input + output / 2) tokens) and within the schedulers' `max_seqs`:
              output tokens/s = B / step(B).
  pd          a decode worker the same without the prompts; a prefill worker computes
              `chunk`-token steps back to back, each request's prompt input / chunk of them:
              output tokens/s = min(decode workers × B / step, prefill workers × chunk / step /
              input × output).

What it leaves to the simulation (simulation.py): arrivals' burstiness, queueing and TTFT,
admission, preemption, the KV hand-over's time, the spread of lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.engine.step_shape import StepShape
from splitserve.sim.cost import CostModel
from splitserve.types import ConfigError


@dataclass(frozen=True)
class Capacity:
    batch: int  # sequences decoding together (0: not even one meets the target)
    step_s: float  # at that batch
    output_tokens_per_s: float
    gpus: int
    bound: str  # what stops a larger batch: "tpot", "kv", "max_seqs" (pd: or "prefill")

    @property
    def per_gpu(self) -> float:
        return self.output_tokens_per_s / self.gpus


def steady_shape(batch: int, input_len: float, output_len: float, with_prompts: bool = True) -> StepShape:
    """A steady state's step with `batch` sequences decoding (and, `with_prompts`, the prompts
    of those that finish in it prefilled)."""
    ctx = batch * (input_len + output_len / 2)
    if not with_prompts:
        return StepShape(0, 0.0, 0, batch, int(ctx), batch)
    done = batch / output_len  # requests finishing, and prompts to prefill, per step
    p = done * input_len
    return StepShape(int(round(p)), done * input_len * (input_len + 1) / 2, int(round(p)), batch, int(ctx),
                     batch + int(round(done)))


def _largest_batch(cost: CostModel, tpot_s: float, limit: int, shape) -> int:
    """The largest batch in [1, limit] whose step is within `tpot_s` (steps grow with the batch)."""
    if limit < 1 or cost.step_s(shape(1)) > tpot_s:
        return 0
    lo, hi = 1, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if cost.step_s(shape(mid)) <= tpot_s else (lo, mid - 1)
    return lo


def decode_capacity(cost: CostModel, input_len: float, output_len: float, tpot_s: float, max_seqs: int,
                    block_size: int = 64, with_prompts: bool = True) -> Capacity:
    """One worker's steady state (aggregated: `with_prompts`; a PD decode worker: without)."""
    if min(input_len, output_len, tpot_s) <= 0:
        raise ConfigError("input and output lengths and the TPOT target must be > 0")
    kv_seqs = int(cost.kv_blocks(block_size) * block_size // (input_len + output_len / 2))
    limit = min(kv_seqs, max_seqs)
    shape = lambda b: steady_shape(b, input_len, output_len, with_prompts)  # noqa: E731
    b = _largest_batch(cost, tpot_s, limit, shape)
    bound = "tpot" if b < limit else ("kv" if kv_seqs <= max_seqs else "max_seqs")
    step = cost.step_s(shape(b)) if b else float("inf")
    return Capacity(b, step, b / step if b else 0.0, cost.gpus_per_worker, bound)


def prefill_tokens_per_s(cost: CostModel, input_len: float, chunk: int) -> float:
    """A prefill worker's prompt tokens a second, full `chunk`-token steps of prompts of
    `input_len` (a chunk's pairs: each prompt's input² / 2 spread over its chunks)."""
    n = chunk
    pairs = n * (input_len + 1) / 2
    return n / cost.step_s(StepShape(n, pairs, n, 0, 0, max(1, round(n / input_len))))


def pd_capacity(prefill: CostModel, decode: CostModel, prefill_workers: int, decode_workers: int,
                input_len: float, output_len: float, tpot_s: float, max_seqs: int, chunk: int,
                block_size: int = 64) -> Capacity:
    d = decode_capacity(decode, input_len, output_len, tpot_s, max_seqs, block_size, with_prompts=False)
    dec = decode_workers * d.output_tokens_per_s
    pre = prefill_workers * prefill_tokens_per_s(prefill, input_len, chunk) / input_len * output_len
    gpus = prefill_workers * prefill.gpus_per_worker + decode_workers * decode.gpus_per_worker
    return Capacity(d.batch, d.step_s, min(dec, pre), gpus, d.bound if dec <= pre else "prefill")
