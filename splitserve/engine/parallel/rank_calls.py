"""Work every rank of a tensor-parallel engine does outside the forward pass: serve its KV shard
to readers, checksum it, pull its heads of a handoff. Rank 0 sends a `RankCall` through the same
broadcast its steps take (so calls and steps reach every rank in one order), each rank runs it on
its own engine, and rank 0 gathers the answers. On the engine thread, like a step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from splitserve.engine.engine import Engine


@dataclass(frozen=True)
class RankCall:
    fn: Callable[..., Any]  # a module-level function (it is pickled): fn(engine, *args)
    args: tuple


@dataclass(frozen=True)
class RankFailure:
    """What a rank's call raised, carried back to rank 0 (which raises the first)."""

    rank: int
    error: BaseException


def on_all_ranks(engine: "Engine", fn: Callable[..., Any], *args: Any) -> list:
    """fn(engine, *args) on every rank (rank 0 last sends it); the answers in rank order."""
    if getattr(engine, "pp", None) is not None:  # its processes wait on the pipeline's broadcast, not this one's
        raise RuntimeError("a pipeline-parallel engine runs rank calls on all its processes: on_all_stages")
    if engine.tp.size > 1:
        engine.tp.broadcast(RankCall(fn, args))
    answers = engine.tp.gather(answer(engine, RankCall(fn, args)))
    for a in answers:
        if isinstance(a, RankFailure):
            raise a.error
    return answers


def answer(engine: "Engine", call: RankCall) -> Any:
    try:
        return call.fn(engine, *call.args)
    except Exception as e:  # the gather must complete on every rank
        return RankFailure(engine.tp.rank, e)
