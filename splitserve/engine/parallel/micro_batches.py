"""A step cut into micro-batches that enter the pipeline one after another: while stage s runs
micro-batch k, stage s-1 runs micro-batch k+1 (engine/parallel/pipeline.py).

The step's flat token run is cut into `m` runs of nearly equal token counts. A cut may fall
inside a prefill chunk: its first part is then a chunk of its own (the KV it writes is context
for the second part; never a single token, which would be taken for a decode), and only the
part holding the chunk's last token samples. That is exact because every stage runs the
micro-batches in order: the first part's KV is in each stage's cache before the second part's
attention reads it there — a prefill chunk pipelined. A decode
is one token and never cut. The micro-batches' sampled rows, in order, are the step's."""

from __future__ import annotations

from splitserve.engine.attention import SeqSlice
from splitserve.engine.model_runner import FlatStep


def split(step: FlatStep, m: int, block_size: int) -> tuple[FlatStep, ...]:
    """`step` as at most `m` micro-batches (fewer when it has fewer tokens), none empty."""
    n = len(step.ids)
    m = max(1, min(m, n))
    if m == 1:
        return (step,)
    cuts = sorted({_movable(step, k * n // m) for k in range(m + 1)})
    return tuple(_part(step, lo, hi, block_size) for lo, hi in zip(cuts, cuts[1:]))


def _movable(step: FlatStep, cut: int) -> int:
    """`cut`, or one further where it would leave a prefill's first token alone at the end of a
    micro-batch: a one-token row there would be taken for a decode, and a backend reads the
    decodes as the batch's first rows."""
    for s in step.slices:
        if s.q_len > 1 and cut == s.q_start + 1:
            return cut + 1
    return cut


def _part(step: FlatStep, lo: int, hi: int, block_size: int) -> FlatStep:
    """The rows [lo, hi) of `step`, as a forward pass of its own."""
    slices = []
    for s in step.slices:
        a, b = max(lo, s.q_start), min(hi, s.q_start + s.q_len)
        if a >= b:
            continue
        ctx = s.ctx_len - (s.q_start + s.q_len - b)  # the context as far as row b-1
        slices.append(SeqSlice(a - lo, b - a, ctx, s.block_ids[: -(-ctx // block_size)]))
    return FlatStep(step.ids[lo:hi], step.pos[lo:hi], step.slots[lo:hi], slices,
                    [r - lo for r in step.sample_rows if lo <= r < hi])
