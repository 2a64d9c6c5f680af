"""What a tensor-parallel rank other than 0 does: hold its shard of the model and of the KV
cache, and run every forward pass rank 0 sends — and every `RankCall` (engine/parallel/rank_calls.py),
answered back to rank 0 — until rank 0 sends None (closing) or the group breaks (a rank died:
the collective raises, and this rank exits rather than wait)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from splitserve.engine.parallel.rank_calls import RankCall, answer

if TYPE_CHECKING:
    from splitserve.engine.engine import Engine


def follow(engine: "Engine") -> int:
    """Run rank 0's steps and calls; how many steps ran."""
    steps = 0
    while (step := engine.tp.broadcast(None)) is not None:
        if isinstance(step, RankCall):
            engine.tp.gather(answer(engine, step))
            continue
        engine.runner.run_flat(step)
        steps += 1
    return steps
