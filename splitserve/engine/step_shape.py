"""What one scheduled engine step computes, read off the scheduler's output: the features the
step-time fits use (the engine's online fit, step_model.py; the simulator's cost models)."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from splitserve.engine.scheduler import SchedulerOutput


class StepShape(NamedTuple):  # a tuple: one per step, cheap to make
    prefill_tokens: int = 0  # tokens of prefill chunks
    prefill_attended: float = 0.0  # Σ chunk tokens × (context before it + half the chunk): causal attention pairs
    prefill_context: int = 0  # Σ (context + chunk) over chunks: the KV those chunks read
    decode_seqs: int = 0
    decode_context: int = 0  # Σ context of the decoding sequences (the KV decode reads)
    sampled: int = 0  # rows that go through the LM head


def shape_of(sched: "SchedulerOutput", proposals: bool = True) -> StepShape:
    """The shape of a step, before it runs (each sequence's computed count is the one before).
    `proposals=False`: the same step had its rows carried no speculative proposals — each
    verifying row (last token + k proposals, a chunk of k + 1) a one-token decode, what the
    non-speculative engine would have run (the verification's cost, core.py)."""
    pt = pc = ds = dc = sampled = 0
    attended = 0.0
    for seq, n in sched.scheduled:
        if not proposals:
            n -= len(seq.spec_tokens)
        ctx = seq.num_computed_tokens
        if ctx + n == seq.num_tokens:
            sampled += 1
        if n == 1:
            ds += 1
            dc += ctx
        else:
            pt += n
            pc += ctx + n
            attended += n * (ctx + (n + 1) / 2)
    return StepShape(pt, attended, pc, ds, dc, sampled)
