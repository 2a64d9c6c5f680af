"""Placement policy: filters → scorers in [0, 1] → a weighted picker, and the prefill/decode
pair chosen jointly. Pure Python over small typed values: no Ray, no engine, so the simulator
and the unit tests run exactly this code.

Policies by name: `round_robin`, `least_loaded`, `power_of_two`, `cache_aware` (default: prefix
overlap from the cluster KV index, weighed against queue length and KV usage, so a hot prefix
does not pile every request on one worker). The PD decider sends a request whose uncached part
is shorter than `disagg_min_tokens` to the decode worker alone (aggregated path).
"""

from __future__ import annotations

import functools
import itertools
import random
import zlib
from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

from splitserve.hashing import BlockHash
from splitserve.router.kv_index import KVIndex
from splitserve.types import Role, WorkerId


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker as the router sees it: the registry's facts (role, node) and its last
    reported load, plus what this router placed there since (see cluster/directory.py)."""

    worker_id: WorkerId
    role: Role
    host: str  # the worker's node (its IP): same host means the KV moves over shared memory
    num_waiting: int = 0
    num_running: int = 0
    kv_usage: float = 0.0  # in [0, 1]
    free_blocks: int = 1 << 30
    healthy: bool = True
    draining: bool = False


@dataclass(frozen=True)
class RouteRequest:
    request_id: str
    num_tokens: int
    block_hashes: tuple[BlockHash, ...]  # the prompt's leading blocks' (KVIndex.routable_hashes: maybe not all)
    block_size: int = 16

    @property
    def blocks_needed(self) -> int:
        return -(-self.num_tokens // self.block_size)


@dataclass(frozen=True)
class Placement:
    prefill: WorkerId | None  # None: aggregated (the decode worker prefills)
    decode: WorkerId
    cached_tokens: int  # expected prefix-cache hit on the worker that prefills


class Filter(Protocol):
    def __call__(self, req: RouteRequest, workers: Sequence[WorkerView]) -> list[WorkerView]: ...


class Scorer(Protocol):
    def score(self, req: RouteRequest, workers: Sequence[WorkerView], hits: Mapping) -> list[float]:
        """One score in [0, 1] per worker, in `workers`' order. `hits`: the leading blocks of the
        request each worker holds (KVIndex.overlap, walked once per decision)."""
        ...


def available(req: RouteRequest, workers: Sequence[WorkerView]) -> list[WorkerView]:
    """Healthy and not draining; of those, the ones with room for the request's blocks, or all
    of them when none has room (its scheduler queues the request until blocks free up)."""
    up = [w for w in workers if w.healthy and not w.draining]
    need = req.blocks_needed
    return [w for w in up if w.free_blocks >= need] or up


class PrefixScorer:
    def score(self, req: RouteRequest, workers: Sequence[WorkerView], hits: Mapping) -> list[float]:
        n = max(1, req.num_tokens // req.block_size)  # of the prompt's full blocks (its hashes may stop short)
        return [hits.get(w.worker_id, 0) / n for w in workers]


class QueueScorer:
    """1 / (1 + load / half): an idle worker scores 1, one with `half` requests 0.5. Absolute
    rather than relative to the busiest worker, so one request more is not a cliff."""

    def __init__(self, half: float = 8.0) -> None:
        self.half = half

    def score(self, req: RouteRequest, workers: Sequence[WorkerView], hits: Mapping) -> list[float]:
        half = self.half
        return [half / (half + w.num_waiting + w.num_running) for w in workers]


class KVUsageScorer:
    def score(self, req: RouteRequest, workers: Sequence[WorkerView], hits: Mapping) -> list[float]:
        return [1.0 - (u if 0.0 <= u <= 1.0 else float(u > 1.0)) for u in (w.kv_usage for w in workers)]


class WeightedPicker:
    """Sum of weight × score per worker."""

    def __init__(self, scorers: Sequence[tuple[Scorer, float]]) -> None:
        self.scorers = list(scorers)

    def totals(self, req: RouteRequest, workers: Sequence[WorkerView], hits: Mapping) -> list[float]:
        cols = []
        for scorer, weight in self.scorers:
            s = scorer.score(req, workers, hits)
            if len(s) != len(workers) or (s and not 0.0 <= min(s) <= max(s) <= 1.0):
                raise ValueError(f"{type(scorer).__name__} scored outside [0, 1] or not one score per worker")
            cols.append(s if weight == 1.0 else [weight * x for x in s])
        return list(map(sum, zip(*cols))) if cols else [0.0] * len(workers)


class Router:
    """Chooses a (prefill, decode) pair for each request. Subclasses differ only in how they
    rank workers of one pool (`rank`: a score per worker, in order); pairing and the PD
    decision are shared. Ties go to a stable, id-derived order."""

    name = "base"

    def __init__(self, index: KVIndex | None = None, disagg_min_tokens: int = 32,
                 same_host_margin: float = 0.1, host_hit_weight: float = 0.5) -> None:
        self.index = index or KVIndex()
        self.disagg_min_tokens = disagg_min_tokens
        self.same_host_margin = same_host_margin
        # a block in a worker's host tier is loaded back, not recomputed, but the load costs:
        # the prefix scorer counts it this fraction of a device block
        self.host_hit_weight = host_hit_weight

    def rank(self, req: RouteRequest, workers: Sequence[WorkerView], hits: Mapping) -> list[float]:
        raise NotImplementedError

    def place(self, req: RouteRequest, prefills: Sequence[WorkerView], decodes: Sequence[WorkerView]) -> Placement:
        decodes = available(req, decodes)
        if not decodes:
            raise NoCapacity("no decode worker is ready")
        prefills = available(req, prefills)
        device = self.index.overlap(req.block_hashes)
        host = self.index.host_overlap(req.block_hashes, device)
        blocks, hits = device, device  # blocks reused (cached tokens), and what the prefix scorer weighs
        if host:
            blocks = {w: device.get(w, 0) + host.get(w, 0) for w in device.keys() | host.keys()}
            hits = {w: device.get(w, 0) + self.host_hit_weight * host.get(w, 0) for w in blocks}
        d_scores = self.rank(req, decodes, hits)
        best_d = decodes[_best(decodes, d_scores)]
        d_cached = self._cached_tokens(req, blocks.get(best_d.worker_id, 0))
        if not prefills or req.num_tokens - d_cached < self.disagg_min_tokens:
            return Placement(None, best_d.worker_id, d_cached)
        best_p = self._pick_prefill(prefills, self.rank(req, prefills, hits), best_d)
        return Placement(best_p.worker_id, best_d.worker_id, self._cached_tokens(req, blocks.get(best_p.worker_id, 0)))

    @staticmethod
    def _cached_tokens(req: RouteRequest, blocks: int) -> int:
        # As the engine reuses them: whole blocks, and never the block holding the last token
        # (its logits must be computed).
        return min(blocks, (req.num_tokens - 1) // req.block_size) * req.block_size

    def _pick_prefill(self, prefills: Sequence[WorkerView], scores: list[float], decode: WorkerView) -> WorkerView:
        """The best prefill worker, or a same-host one whose score is within the margin (KV over
        shared memory beats KV over the network)."""
        best = _best(prefills, scores)
        floor = scores[best] - self.same_host_margin
        near = [i for i, w in enumerate(prefills) if w.host == decode.host and scores[i] >= floor]
        if near:
            return prefills[near[_best([prefills[i] for i in near], [scores[i] for i in near])]]
        return prefills[best]


class NoCapacity(RuntimeError):
    """No worker can take the request now (all unhealthy, draining or full)."""


def _best(workers: Sequence[WorkerView], scores: list[float]) -> int:
    """The index of the highest score; ties to the lowest `_order`."""
    top = max(scores)
    tied = [i for i, s in enumerate(scores) if s == top]
    return tied[0] if len(tied) == 1 else min(tied, key=lambda i: _order(workers[i].worker_id))


@functools.lru_cache(maxsize=1 << 14)
def _order(worker_id) -> int:
    # A stable, id-derived order for ties: the same on every router replica and every run
    # (str hash() is salted per process).
    return zlib.crc32(str(worker_id).encode())


class RoundRobin(Router):
    name = "round_robin"

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self._turns: dict[str, itertools.count] = {}  # one turn per pool

    def rank(self, req, workers, hits):
        turn = self._turns.setdefault(workers[0].role, itertools.count())
        pick = next(turn) % len(workers)
        return [1.0 if i == pick else 0.0 for i in range(len(workers))]


class LeastLoaded(Router):
    name = "least_loaded"

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.picker = WeightedPicker([(QueueScorer(), 1.0), (KVUsageScorer(), 0.5)])

    def rank(self, req, workers, hits):
        return self.picker.totals(req, workers, hits)


class PowerOfTwo(Router):
    """Two workers at random, the less loaded of them: near least-loaded balance, no herding."""

    name = "power_of_two"

    def __init__(self, *a, seed: int = 0, **kw) -> None:
        super().__init__(*a, **kw)
        self._rng = random.Random(seed)

    def rank(self, req, workers, hits):
        two = self._rng.sample(range(len(workers)), min(2, len(workers)))
        pick = min(two, key=lambda i: workers[i].num_waiting + workers[i].num_running + workers[i].kv_usage)
        return [1.0 if i == pick else 0.0 for i in range(len(workers))]


class CacheAware(Router):
    name = "cache_aware"

    def __init__(self, *a, prefix_weight: float = 1.0, queue_weight: float = 1.0, kv_weight: float = 0.5,
                 **kw) -> None:
        super().__init__(*a, **kw)
        self.picker = WeightedPicker([(PrefixScorer(), prefix_weight), (QueueScorer(), queue_weight),
                                      (KVUsageScorer(), kv_weight)])

    def rank(self, req, workers, hits):
        return self.picker.totals(req, workers, hits)


POLICIES = {cls.name: cls for cls in (RoundRobin, LeastLoaded, PowerOfTwo, CacheAware)}


def make_router(name: str = "cache_aware", **kwargs) -> Router:
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(POLICIES)}")
    return POLICIES[name](**kwargs)
