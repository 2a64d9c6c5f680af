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
    return call_group(engine, engine.tp, RankCall(fn, args), broadcast=engine.tp.size > 1)


def call_group(engine: "Engine", group, call: RankCall, broadcast: bool = True) -> list:
    """`call` on every process of `group` (a TP group, or a pipeline's stages): sent to the
    others, answered here too, the answers gathered in rank order; a failure anywhere raised."""
    if broadcast:
        group.broadcast(call)
    answers = group.gather(answer(engine, call, group))
    for a in answers:
        if isinstance(a, RankFailure):
            raise a.error
    return answers


def answer(engine: "Engine", call: RankCall, group=None) -> Any:
    """`call` run here; a failure is answered, not raised: the gather must complete on every
    process. `group`: whose rank names the failure (the engine's TP group by default)."""
    try:
        return call.fn(engine, *call.args)
    except Exception as e:
        return RankFailure((group or engine.tp).rank, e)
