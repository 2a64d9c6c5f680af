"""Placement policy: filters → scorers in [0, 1] → a weighted picker, and the prefill/decode
pair chosen jointly. Pure Python over small typed values: no Ray, no engine, so the simulator
and the unit tests run exactly this code.

Policies by name: `round_robin`, `least_loaded`, `power_of_two`, `cache_aware` (default: prefix
overlap from the cluster KV index, weighed against queue length and KV usage, so a hot prefix
does not pile every request on one worker). The PD decider (router/pd_decider.py, by name:
`slo` by default, `threshold`) says whether a request goes through a prefill worker or its
decode worker computes the prompt (aggregated path); one whose uncached part is shorter than
`disagg_min_tokens` always stays on the decode worker.

A worker's score is a request-independent part (its load: `Router.load_score`, computed when its
view changes and kept ranked in a `Pool`) plus a request's bonus, which only a few workers get
(the holders of its prefix: `Router.bonus`), summed in that order. Bonuses come in groups of
workers sharing one value (kv_index.Group: the holders whose prefix ends at the same block), and
a pool finds a group's best-ranked member at C speed; so a decision compares a few groups' best
with the best of the rest, and its cost grows with the distinct prefix lengths held, not with
the pool or the holders.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import random
import zlib
from dataclasses import dataclass
from itertools import repeat
from typing import Callable, Collection, Hashable, Mapping, Protocol, Sequence

from splitserve.hashing import BlockHash
from splitserve.router.kv_index import Group, KVIndex
from splitserve.router.pd_decider import PDDecider, ThresholdDecider
from splitserve.types import ExpertBalance, Role, WorkerId, WorkerStats


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker as the router sees it: the registry's facts (role, node) and its last
    reported load, plus what this router placed there since (see router/directory.py)."""

    worker_id: WorkerId
    role: Role
    host: str  # the worker's node (its IP): same host means the KV moves over shared memory
    num_waiting: int = 0
    num_running: int = 0
    kv_usage: float = 0.0  # in [0, 1]
    free_blocks: int = 1 << 30
    healthy: bool = True
    draining: bool = False
    step_time_coeffs: tuple[float, ...] = ()  # its engine's online step-time fit (WorkerStats)
    expert_tokens: tuple[int, ...] = ()  # a mixture of experts: tokens each expert took
    pending_prefill_tokens: int = 0  # prompt tokens it has queued, not yet computed (the PD decider)
    decode_context_tokens: int = 0  # context its running decodes read each step
    token_budget: int = 2048  # its engine's max_num_batched_tokens: the largest prefill chunk a step takes
    expert_balance: ExpertBalance | None = None  # its experts' placement and rank load (WorkerStats)
    # speculative decoding (WorkerStats.spec_*): tokens proposed, of which accepted, and steps
    # that verified any, ever; the seconds of those steps, and the fit's seconds for them without
    # their proposals (for /metrics)
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verify_steps: int = 0
    spec_verify_step_seconds: float = 0.0
    spec_verify_step_plain_seconds: float = 0.0
    slow: bool = False  # unanswered past the probe timeout: alive, placed on only when no other answers

    @property
    def up(self) -> bool:
        return self.healthy and not self.draining

    @staticmethod
    def of(wid: WorkerId, role: Role, host: str, stats: "WorkerStats | None", pending: int, healthy: bool,
           draining: bool, slow: bool = False) -> "WorkerView":
        """The view of a worker whose last report is `stats` (None: not heard from yet, an
        empty worker) and on which `pending` placements are not in that report yet."""
        if stats is None:
            return WorkerView(wid, role, host, pending, healthy=healthy, draining=draining, slow=slow)
        return WorkerView(wid, role, host, stats.num_waiting + pending, stats.num_running, stats.kv_usage,
                          stats.kv_blocks_free + stats.kv_blocks_cached, healthy, draining, stats.step_time_coeffs,
                          stats.expert_tokens_total, stats.pending_prefill_tokens, stats.decode_context_tokens,
                          stats.token_budget, stats.expert_balance, stats.spec_proposed_tokens_total,
                          stats.spec_accepted_tokens_total, stats.spec_verify_steps_total,
                          stats.spec_verify_step_seconds_total, stats.spec_verify_step_plain_seconds_total, slow)


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


class LoadScorer(Protocol):
    def score(self, worker: WorkerView) -> float:
        """A score in [0, 1] from the worker's reported load alone (no request)."""
        ...


class RequestScorer(Protocol):
    def score(self, req: RouteRequest, hits: Sequence[Group]) -> Sequence[Group]:
        """Scores in [0, 1] of the workers this request singles out, in groups sharing a score
        (each worker in one group at most); every other worker scores 0. `hits`: the leading
        blocks of the request the workers hold (KVIndex.holders), grouped by that count."""
        ...


class PrefixScorer:
    def score(self, req: RouteRequest, hits: Sequence[Group]) -> Sequence[Group]:
        n = max(1, req.num_tokens // req.block_size)  # of the prompt's full blocks (its hashes may stop short)
        return tuple(Group(h / n, members) for h, members in hits)


class QueueScorer:
    """1 / (1 + load / half): an idle worker scores 1, one with `half` requests 0.5. Absolute
    rather than relative to the busiest worker, so one request more is not a cliff."""

    def __init__(self, half: float = 8.0) -> None:
        self.half = half

    def score(self, worker: WorkerView) -> float:
        return self.half / (self.half + worker.num_waiting + worker.num_running)


class KVUsageScorer:
    def score(self, worker: WorkerView) -> float:
        u = worker.kv_usage
        return 1.0 - (u if 0.0 <= u <= 1.0 else float(u > 1.0))


class WeightedPicker:
    """Sum of weight × score: over the load scorers for a worker's load score, over the request
    scorers for a request's bonuses."""

    def __init__(self, load: Sequence[tuple[LoadScorer, float]] = (),
                 request: Sequence[tuple[RequestScorer, float]] = ()) -> None:
        self.load, self.request = list(load), list(request)
        if any(weight < 0 for _, weight in self.load + self.request):
            raise ValueError("scorer weights must be >= 0")

    def load_score(self, worker: WorkerView) -> float:
        total = 0.0
        for scorer, weight in self.load:
            total += weight * _checked(scorer, scorer.score(worker))
        return total

    def bonus(self, req: RouteRequest, hits: Sequence[Group]) -> Sequence[Group]:
        scored = []
        for scorer, weight in self.request:
            groups = tuple(scorer.score(req, hits))
            for g in groups:
                _checked(scorer, g.value)
            scored.append((groups, weight))
        if len(scored) == 1:  # the usual case: the groups as they come
            groups, weight = scored[0]
            return groups if weight == 1.0 else tuple(Group(weight * v, ms) for v, ms in groups)
        total: dict = {}
        for groups, weight in scored:
            for v, members in groups:
                for w in members:
                    total[w] = total.get(w, 0.0) + weight * v
        return regroup(total)


def regroup(values: Mapping[Hashable, float]) -> tuple[Group, ...]:
    """Per-worker values as groups of the workers sharing one."""
    by: dict[float, list] = {}
    for w, v in values.items():
        by.setdefault(v, []).append(w)
    return tuple(Group(v, frozenset(ws)) for v, ws in by.items())


def value_of(groups: Sequence[Group], worker: Hashable, default: float = 0) -> float:
    return next((v for v, members in groups if worker in members), default)


def _checked(scorer, s: float) -> float:
    if not 0.0 <= s <= 1.0:
        raise ValueError(f"{type(scorer).__name__} scored {s}, outside [0, 1]")
    return s


class Pool:
    """One pool's workers as a router keeps them between decisions: the up ones (healthy, not
    draining) ranked by load score, re-scored one changed view at a time (`sync`)."""

    def __init__(self, load_score: Callable[[WorkerView], float]) -> None:
        self._load_score = load_score
        self._synced: tuple | None = None  # the views last synced, when given as a tuple
        self._given: tuple[WorkerView, ...] = ()  # the views last synced, in the caller's order
        self._all: dict[Hashable, WorkerView] = {}  # every view, up or not
        self._keys: dict[Hashable, tuple] = {}  # up workers' sort keys: (-load score, _order, id)
        self._ranked: list[tuple] = []  # the keys, best first
        self._hosts: dict[str, list[tuple]] = {}  # the same, per host
        self._host_keys: dict[str, dict[Hashable, tuple]] = {}  # `_keys`, per host
        self._free: list[int] = []  # up workers' free blocks, ascending

    def __len__(self) -> int:
        return len(self._keys)

    def sync(self, views: Sequence[WorkerView]) -> "Pool":
        """Make the pool these views; only views that are new objects are scored again (the
        Directory hands the same view object until the worker's facts change)."""
        if isinstance(views, tuple) and views is self._synced:
            return self
        for v in views:
            if self._all.get(v.worker_id) is not v:
                self._put(v)
        if len(self._all) != len(views):
            keep = {v.worker_id for v in views}
            for wid in [w for w in self._all if w not in keep]:
                self._drop(wid)
                del self._all[wid]
        self._synced = views if isinstance(views, tuple) else None
        self._given = tuple(views)
        return self

    def _put(self, v: WorkerView) -> None:
        wid = v.worker_id
        key = (-self._load_score(v), _order(wid), wid) if v.up else None  # may raise: before any change
        self._drop(wid)
        self._all[wid] = v
        if key is not None:
            self._keys[wid] = key
            bisect.insort(self._ranked, key)
            bisect.insort(self._hosts.setdefault(v.host, []), key)
            self._host_keys.setdefault(v.host, {})[wid] = key
            bisect.insort(self._free, v.free_blocks)

    def _drop(self, wid: Hashable) -> None:
        key = self._keys.pop(wid, None)
        if key is None:
            return
        v = self._all[wid]
        for ranked in (self._ranked, self._hosts[v.host]):
            del ranked[bisect.bisect_left(ranked, key)]
        del self._host_keys[v.host][wid]
        del self._free[bisect.bisect_left(self._free, v.free_blocks)]

    def eligible(self, need: int) -> list[WorkerView]:
        """The up workers with room for `need` blocks, or all of them when none has room (its
        scheduler queues the request until blocks free up); in the order `sync` was given them."""
        ups = [v for v in self._given if v.up]
        return [v for v in ups if v.free_blocks >= need] if self._room(need) else ups

    def best(self, bonus: Sequence[Group], need: int, host: str | None = None
             ) -> tuple[tuple[float, WorkerView], tuple[float, WorkerView] | None]:
        """The eligible worker (see `eligible`) with the highest load score + bonus, and that
        score; ties to the lowest `_order`. Second, the same among the workers on `host` (None
        when none is, or no host is given). The pool must not be empty."""
        room = self._room(need)
        best = self._top(self._ranked, room, need)  # the best by load; bonuses (>= 0) can only add
        near = self._top(self._hosts.get(host, ()), room, need) if host is not None else None
        on_host, host_ranked = self._host_keys.get(host, {}), self._hosts.get(host, ())
        for b, members in bonus:  # members share the bonus: a group's best-ranked eligible one is its best
            best = self._better(best, self._first(members, self._ranked, self._keys, room, need), b)
            if host is not None:
                near = self._better(near, self._first(members, host_ranked, on_host, room, need), b)
        return (-best[0][0], best[1]), None if near is None else (-near[0][0], near[1])

    def _better(self, current: tuple | None, key: tuple | None, b: float) -> tuple | None:
        """`current` ((rank, view) or None), or the worker of `key` with bonus `b` if it ranks above."""
        if key is None:
            return current
        rank = (key[0] - b, key[1], key[2])  # as the keys: smaller is better
        return (rank, self._all[key[2]]) if current is None or rank < current[0] else current

    def _first(self, members: Collection[Hashable], ranked: Sequence[tuple], keys: Mapping[Hashable, tuple],
               room: bool, need: int) -> tuple | None:
        """The smallest key of `members` whose worker is eligible, or None. `ranked`: the keys
        of the pool (or of one host in it), best first; `keys`: the same by worker."""
        if len(members) >= 16 and isinstance(members, (set, frozenset)):
            # a big group: the first members in rank order come soon (at most len(members) steps)
            for key in itertools.islice(ranked, len(members)):
                if key[2] in members and (not room or self._all[key[2]].free_blocks >= need):
                    return key
            if len(ranked) <= len(members):
                return None  # walked them all
        key = min(map(keys.get, members, repeat(_ABSENT)), default=_ABSENT)
        if key is _ABSENT:
            return None
        if room and self._all[key[2]].free_blocks < need:  # rare: look at each member
            fits = [k for k in map(keys.get, members, repeat(_ABSENT))
                    if k is not _ABSENT and self._all[k[2]].free_blocks >= need]
            return min(fits, default=None)
        return key

    def _top(self, keys: Sequence[tuple], room: bool, need: int) -> tuple[tuple, WorkerView] | None:
        """The first of `keys` (ranked) whose worker is eligible, with its view."""
        for key in keys:
            v = self._all[key[2]]
            if not room or v.free_blocks >= need:
                return key, v
        return None

    def _room(self, need: int) -> bool:
        return bool(self._free) and self._free[-1] >= need


_ABSENT = (math.inf,)  # sorts after every key: (-load score, _order, id)


class Router:
    """Chooses a (prefill, decode) pair for each request. Subclasses differ only in how they
    score workers (`load_score`, `bonus`); pairing and the PD decision are shared. Ties go to a
    stable, id-derived order."""

    name = "base"

    def __init__(self, index: KVIndex | None = None, disagg_min_tokens: int = 32,
                 same_host_margin: float = 0.1, host_hit_weight: float = 0.5, decider: PDDecider | None = None
                 ) -> None:
        self.index = index or KVIndex()
        # which requests go through a prefill worker (None: the threshold alone)
        self.decider = decider if decider is not None else ThresholdDecider(disagg_min_tokens)
        self.disagg_min_tokens = self.decider.min_tokens
        self.same_host_margin = same_host_margin
        # a block in a worker's host tier is loaded back, not recomputed, but the load costs:
        # the prefix scorer counts it this fraction of a device block
        self.host_hit_weight = host_hit_weight
        self._pools = {"prefill": Pool(self.load_score), "decode": Pool(self.load_score)}

    def load_score(self, worker: WorkerView) -> float:
        return 0.0

    def bonus(self, req: RouteRequest, pool: Pool, hits: Sequence[Group]) -> Sequence[Group]:
        return ()

    def place(self, req: RouteRequest, prefills: Sequence[WorkerView], decodes: Sequence[WorkerView]) -> Placement:
        dpool, ppool = self._pools["decode"].sync(decodes), self._pools["prefill"].sync(prefills)
        if not dpool:
            raise NoCapacity("no decode worker is ready")
        blocks, hits = self._hits(req)
        need = req.blocks_needed
        (_, d), _ = dpool.best(self.bonus(req, dpool, hits), need)
        d_cached = self._cached_tokens(req, value_of(blocks, d.worker_id))
        if not ppool or req.num_tokens - d_cached < self.decider.min_tokens:
            return Placement(None, d.worker_id, d_cached)
        p = self._pick_prefill(ppool, self.bonus(req, ppool, hits), need, d)
        p_cached = self._cached_tokens(req, value_of(blocks, p.worker_id))
        if not self.decider.disaggregate(d, req.num_tokens - d_cached, p, req.num_tokens - p_cached):
            return Placement(None, d.worker_id, d_cached)
        return Placement(p.worker_id, d.worker_id, p_cached)

    def _hits(self, req: RouteRequest) -> tuple[Sequence[Group], Sequence[Group]]:
        """Blocks the workers would reuse (device + host tier), and what the prefix scorer
        weighs (host blocks at `host_hit_weight`), grouped; workers with none are absent."""
        device = self.index.holders(req.block_hashes)
        host = self.index.host_holders(req.block_hashes, device)
        if not host:
            return device, device
        blocks = {w: v for v, members in device for w in members}
        weighed = dict(blocks)
        for v, members in host:
            for w in members:
                blocks[w] = blocks.get(w, 0) + v
                weighed[w] = weighed.get(w, 0) + self.host_hit_weight * v
        return regroup(blocks), regroup(weighed)

    @staticmethod
    def _cached_tokens(req: RouteRequest, blocks: int) -> int:
        # As the engine reuses them: whole blocks, and never the block holding the last token
        # (its logits must be computed).
        return min(blocks, (req.num_tokens - 1) // req.block_size) * req.block_size

    def _pick_prefill(self, pool: Pool, bonus: Sequence[Group], need: int, decode: WorkerView) -> WorkerView:
        """The best prefill worker, or the best one on the decode worker's host if its score is
        within the margin (KV over shared memory beats KV over the network)."""
        (score, best), near = pool.best(bonus, need, decode.host)
        return near[1] if near is not None and near[0] >= score - self.same_host_margin else best


class NoCapacity(RuntimeError):
    """No worker can take the request now (all unhealthy, draining or full)."""


@functools.lru_cache(maxsize=1 << 14)
def _order(worker_id) -> int:
    # A stable, id-derived order for ties: the same on every router replica and every run
    # (str hash() is salted per process).
    return zlib.crc32(str(worker_id).encode())


class RoundRobin(Router):
    name = "round_robin"

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self._turns = {id(p): itertools.count() for p in self._pools.values()}  # one turn per pool

    def bonus(self, req, pool, hits):
        eligible = pool.eligible(req.blocks_needed)
        return (Group(1.0, (eligible[next(self._turns[id(pool)]) % len(eligible)].worker_id,)),)


class LeastLoaded(Router):
    name = "least_loaded"

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.picker = WeightedPicker(load=[(QueueScorer(), 1.0), (KVUsageScorer(), 0.5)])

    def load_score(self, worker):
        return self.picker.load_score(worker)


class PowerOfTwo(Router):
    """Two workers at random, the less loaded of them: near least-loaded balance, no herding."""

    name = "power_of_two"

    def __init__(self, *a, seed: int = 0, **kw) -> None:
        super().__init__(*a, **kw)
        self._rng = random.Random(seed)

    def bonus(self, req, pool, hits):
        eligible = pool.eligible(req.blocks_needed)
        two = self._rng.sample(eligible, min(2, len(eligible)))
        return (Group(1.0, (min(two, key=lambda w: w.num_waiting + w.num_running + w.kv_usage).worker_id,)),)


class CacheAware(Router):
    name = "cache_aware"

    def __init__(self, *a, prefix_weight: float = 1.0, queue_weight: float = 1.0, kv_weight: float = 0.5,
                 **kw) -> None:
        self.picker = WeightedPicker(load=[(QueueScorer(), queue_weight), (KVUsageScorer(), kv_weight)],
                                     request=[(PrefixScorer(), prefix_weight)])
        self._last_bonus: tuple = (None, ())
        super().__init__(*a, **kw)

    def load_score(self, worker):
        return self.picker.load_score(worker)

    def bonus(self, req, pool, hits):
        # the same for both pools of one decision: computed once
        if hits is not self._last_bonus[0]:
            self._last_bonus = (hits, self.picker.bonus(req, hits))
        return self._last_bonus[1]


POLICIES = {cls.name: cls for cls in (RoundRobin, LeastLoaded, PowerOfTwo, CacheAware)}


def make_router(name: str = "cache_aware", **kwargs) -> Router:
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(POLICIES)}")
    return POLICIES[name](**kwargs)
