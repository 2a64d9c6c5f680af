"""Where one mixture-of-experts layer's experts sit: physical expert slots, `slots_per_rank` on
each of `ranks` expert-parallel ranks (one rank without expert parallelism: every tensor-parallel
rank then holds a column slice of every slot), more slots than logical experts when the worker
holds redundant replicas of hot ones. `ExpertPlacement` says which logical expert each slot
holds; `plan` (pure: counts, ranks, slots -> placement) chooses one from measured per-expert
token counts.

A token routed to expert e goes to one of e's replicas: e's rows of a step (ordered as the
dispatch orders them) are cut into `m` even contiguous runs, run j to replica j, the replicas in
slot order (rank-major) — so a rank holding several replicas of e takes one contiguous run and
computes it in one GEMM. Every rank routes every token and derives the same cut, so no rank
tells another what it computes. The predicted load of a rank is sum over its slots of
count[e] / m(e); its imbalance max / mean over ranks."""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class ExpertPlacement:
    """`slots[r][i]`: the logical expert in rank r's slot i (global slot r·S + i)."""

    slots: tuple[tuple[int, ...], ...]
    num_experts: int

    def __post_init__(self) -> None:
        if not self.slots or any(len(s) != len(self.slots[0]) for s in self.slots):
            raise ValueError(f"every rank holds the same number of expert slots, got {[len(s) for s in self.slots]}")
        held = {e for s in self.slots for e in s}
        if not held <= set(range(self.num_experts)):
            raise ValueError(f"expert slots name experts outside 0..{self.num_experts - 1}: {sorted(held)}")
        missing = set(range(self.num_experts)) - held
        if missing:
            raise ValueError(f"a placement must hold every expert; missing {sorted(missing)}")

    @property
    def ranks(self) -> int:
        return len(self.slots)

    @property
    def slots_per_rank(self) -> int:
        return len(self.slots[0])

    def flat(self) -> tuple[int, ...]:
        """The expert of every global slot, rank-major."""
        return tuple(e for s in self.slots for e in s)

    def replicas(self) -> list[list[int]]:
        """Per expert, its global slots in ascending order (the order its rows are cut in)."""
        out: list[list[int]] = [[] for _ in range(self.num_experts)]
        for g, e in enumerate(self.flat()):
            out[e].append(g)
        return out

    def rank_loads(self, counts: Sequence[float]) -> list[float]:
        """Each rank's predicted tokens for per-expert `counts`, each expert's spread evenly
        over its replicas."""
        m = [len(r) for r in self.replicas()]
        return [sum(counts[e] / m[e] for e in s) for s in self.slots]

    @staticmethod
    def contiguous(num_experts: int, ranks: int, slots_per_rank: int) -> "ExpertPlacement":
        """The placement a worker starts from: rank r's slots hold its num_experts / ranks
        experts (those the checkpoint loader gives it, shard.py), its spare slots copies of
        them — placed where measured counts say by the first rebalance."""
        per = num_experts // ranks
        if per * ranks != num_experts or slots_per_rank < per:
            raise ValueError(f"{num_experts} experts do not fit {ranks} ranks x {slots_per_rank} slots evenly")
        return ExpertPlacement(tuple(tuple(r * per + i % per for i in range(slots_per_rank)) for r in range(ranks)),
                               num_experts)


def imbalance(loads: Sequence[float]) -> float:
    """max / mean (1.0: even; 0.0 where nothing was counted)."""
    mean = sum(loads) / len(loads) if loads else 0.0
    return max(loads) / mean if mean > 0 else 0.0


def plan(counts: Sequence[float], ranks: int, slots_per_rank: int,
         current: ExpertPlacement | None = None) -> ExpertPlacement:
    """A placement for per-expert token `counts` on `ranks` x `slots_per_rank` slots, greedy:
    every expert gets one slot; each spare slot goes to the expert with the most tokens per
    replica (no more replicas than ranks while another expert could use one: two on one rank
    split nothing); then replicas, heaviest first, each to the least-loaded rank with a free slot
    that does not hold that expert yet (ties: a rank that holds it now, then the lowest rank) —
    the longest-processing-time rule for the max rank load. Within a rank, experts that stay keep
    their slots (fewer weights to copy). Never drops an expert."""
    n = len(counts)
    total = ranks * slots_per_rank
    if ranks < 1 or total < n:
        raise ValueError(f"{n} experts do not fit {ranks} ranks x {slots_per_rank} slots")
    reps = [1] * n
    heap = [(-float(counts[e]), e) for e in range(n)]  # (-tokens per replica, expert)
    heapq.heapify(heap)
    spare, capped = total - n, []
    while spare:
        if not heap:  # every expert on every rank already: the rest are copies that change nothing
            heap, capped = [(-float(counts[e]) / reps[e], e) for e in capped], []
            heapq.heapify(heap)
            continue
        _, e = heapq.heappop(heap)
        reps[e] += 1
        spare -= 1
        (capped.append(e) if reps[e] >= ranks and ranks > 1 else
         heapq.heappush(heap, (-float(counts[e]) / reps[e], e)))
    now = [set(s) for s in current.slots] if current is not None and current.ranks == ranks else [set()] * ranks
    units = sorted(((counts[e] / reps[e], e) for e in range(n) for _ in range(reps[e])), key=lambda u: (-u[0], u[1]))
    load, free = [0.0] * ranks, [slots_per_rank] * ranks
    held: list[list[int]] = [[] for _ in range(ranks)]
    for w, e in units:
        open_ = [r for r in range(ranks) if free[r]]
        fresh = [r for r in open_ if e not in held[r]] or open_
        r = min(fresh, key=lambda r: (load[r], e not in now[r], r))
        held[r].append(e)
        load[r] += w
        free[r] -= 1
    return ExpertPlacement(tuple(_keep_slots(h, current.slots[r] if current is not None and current.ranks == ranks
                                             else None) for r, h in enumerate(held)), n)


def _keep_slots(experts: list[int], old: tuple[int, ...] | None) -> tuple[int, ...]:
    """Rank slots for `experts` (a multiset): a slot whose expert stays keeps it, the rest fill
    the freed slots in ascending order."""
    if old is None:
        return tuple(sorted(experts))
    left = sorted(experts)
    out: list[int | None] = [None] * len(old)
    for i, e in enumerate(old):
        if e in left:
            left.remove(e)
            out[i] = e
    fill = iter(left)
    return tuple(e if e is not None else next(fill) for e in out)
