"""The planner: a deployment's starting configuration chosen before it serves, the way Dynamo's
profiler / SLA planner sizes one — by simulating a sample of the traffic it expects.

Given a cost model (a GPU's roofline × a model's shape, or a calibrated one), the workers it may
use, the SLO pair and attainment target (in `base`, a SimConfig) and a *sample* of the expected
workload, every candidate

  aggregated/B   every worker prefills and decodes, B tokens per step (one per budget)
  pd/P:D         a static split, every prompt of `disagg_min_tokens`+ uncached tokens through a
                 prefill worker (the `threshold` PD decider), the engine's default budget
  pd-slo/P:D     the same split with the `slo` decider (router/pd_decider.py), if asked for

gets DistServe's goodput search (search.goodput: the highest rate multiple at which `target` of
the requests meet both SLOs) and the best is the one with the most goodput per GPU; a tie goes
to the higher attainment at that rate, then to the earlier candidate (aggregated first, then
fewer prefill workers). Given an `AutoscaleConfig`, the best is then run on the sample with the
autoscaler starting from it and without, both on search.goodput_scan's grid of rates (an
autoscaled fleet's attainment is not monotonic in the rate), and the autoscaler is kept only
where it gives more goodput per GPU. A `Plan` is what a deployment starts from: the pool sizes
(the autoscaler's first targets), the PD decider, the step budget, whether to autoscale.

The sample must not be the traffic the plan is judged on: `window` cuts requests [start,
start + count) of a trace and moves them to time 0 (benchmarks/sim_study.py plans on requests
300..600 and evaluates on the first 300).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from splitserve.control.autoscale import AutoscaleConfig
from splitserve.sim import search
from splitserve.sim.cost import ByRole, CostModel
from splitserve.sim.report import summarize
from splitserve.sim.simulation import SimConfig, Simulation
from splitserve.sim.workload import Workload
from splitserve.types import ConfigError

BUDGETS = (512, 1024, 2048)
PD_BUDGET = 2048  # a split's step budget, both pools: the engine's default


@dataclass(frozen=True)
class Candidate:
    prefill: int  # 0: aggregated
    decode: int
    decider: str  # the PD decider ("threshold" / "slo"); aggregated: the one a later prefill pool gets
    budget: int  # tokens per step

    @property
    def name(self) -> str:
        if self.prefill == 0:
            return f"aggregated/{self.budget}"
        return f"{'pd' if self.decider == 'threshold' else 'pd-' + self.decider}/{self.prefill}:{self.decode}"

    def config(self, base: SimConfig) -> SimConfig:
        """`base` (SLOs, engine, router) with this candidate's pools, decider and budget, static."""
        return dataclasses.replace(base, prefill=self.prefill, decode=self.decode, pd_decider=self.decider,
                                   max_num_batched_tokens=self.budget, prefill_max_num_batched_tokens=PD_BUDGET,
                                   autoscale=None)


@dataclass(frozen=True)
class Scored:
    candidate: Candidate
    goodput: float  # requests/s per GPU at the target attainment (0: no rate meets it)
    rate_scale: float  # the rate multiple of the sample that goodput is
    attainment: float  # at that rate (or the best seen where none met the target)


@dataclass(frozen=True)
class Plan:
    prefill: int
    decode: int
    decider: str
    budget: int
    goodput: float  # requests/s per GPU on the sample, at `target`
    target: float
    scored: tuple[Scored, ...]  # every candidate, in the order tried
    autoscale: bool = False  # start the autoscaler from this plan (it did better on the sample)
    scanned: tuple[float, float] | None = None  # the best on the rate grid: (static, autoscaled) goodput

    @property
    def name(self) -> str:
        return Candidate(self.prefill, self.decode, self.decider, self.budget).name

    def deploy_values(self) -> dict:
        """The DeployConfig keys this plan sets (`serve --config`)."""
        return {"prefill": self.prefill, "decode": self.decode, "pd_decider": self.decider,
                "engine": {"max_num_batched_tokens": self.budget}, "autoscale": self.autoscale}


def candidates(workers: int, budgets: tuple[int, ...] = BUDGETS, deciders: tuple[str, ...] = ("threshold",),
               aggregated_decider: str = "slo") -> tuple[Candidate, ...]:
    """Aggregated at each budget, then every split P:D (P = 1..workers-1) with each decider."""
    if workers < 1:
        raise ConfigError(f"the planner needs at least one worker, got {workers}")
    out = [Candidate(0, workers, aggregated_decider, b) for b in budgets]
    out += [Candidate(p, workers - p, d, PD_BUDGET) for d in deciders for p in range(1, workers)]
    return tuple(out)


def window(workload: Workload, start: int, count: int) -> Workload:
    """Requests [start, start + count) of `workload`, the first arriving at time 0."""
    reqs = workload.requests[start:start + count]
    if not reqs:
        raise ConfigError(f"the workload has no requests in [{start}, {start + count})")
    t0 = reqs[0].arrival_s
    moved = tuple(dataclasses.replace(r, index=i, arrival_s=r.arrival_s - t0) for i, r in enumerate(reqs))
    return Workload(moved, workload.tokens_per_hash, workload.name)


def score(candidate: Candidate, cost: CostModel | ByRole, sample: Workload, base: SimConfig, target: float,
          iters: int = 3, max_scale: float = 64.0, min_scale: float = 1 / 8) -> Scored:
    """One candidate's goodput per GPU on `sample` at `target` attainment."""
    cfg = candidate.config(base)
    run: Callable[[float], dict] = lambda s: summarize(Simulation(cfg, cost, sample.scaled(s)).run())  # noqa: E731
    res = search.goodput(run, target=target, iters=iters, max_scale=max_scale, min_scale=min_scale)
    at = next((p["slo_attainment"] for p in res["probes"] if p["rate_scale"] == res["rate_scale"]), None)
    return Scored(candidate, res["goodput_rps_per_gpu"], res["rate_scale"],
                  at if at is not None else res["best_attainment_seen"])


def scan(config: SimConfig, cost: CostModel | ByRole, sample: Workload, target: float, hi: float = 16.0) -> float:
    """Goodput per GPU on search.goodput_scan's grid of rates (x1/8 .. x`hi`)."""
    run: Callable[[float], dict] = lambda s: summarize(Simulation(config, cost, sample.scaled(s)).run())  # noqa: E731
    return search.goodput_scan(run, target=target, hi=hi)["goodput_rps_per_gpu"]


def plan(cost: CostModel | ByRole, sample: Workload, base: SimConfig, workers: int, target: float = 0.9,
         cands: tuple[Candidate, ...] | None = None, autoscale: AutoscaleConfig | None = None,
         scan_hi: float = 16.0, **search_kw) -> Plan:
    """The candidate with the most goodput per GPU on `sample` (ties, and where none meets the
    target: higher attainment, then the earlier candidate); with `autoscale`, autoscaled from it
    where that did better on the sample. `base` carries the SLOs; `search_kw` goes to `score`."""
    if base.ttft_slo_ms is None and base.tpot_slo_ms is None:
        raise ConfigError("the planner needs a TTFT and/or TPOT target")
    scored = tuple(score(c, cost, sample, base, target, **search_kw) for c in (cands or candidates(workers)))
    best = max(scored, key=lambda s: (s.goodput, s.attainment, -scored.index(s)))
    c = best.candidate
    if autoscale is None or best.goodput == 0:
        return Plan(c.prefill, c.decode, c.decider, c.budget, best.goodput, target, scored)
    static = scan(c.config(base), cost, sample, target, scan_hi)
    auto = scan(dataclasses.replace(c.config(base), autoscale=autoscale), cost, sample, target, scan_hi)
    return Plan(c.prefill, c.decode, c.decider, c.budget, auto if auto > static else best.goodput, target, scored,
                autoscale=auto > static, scanned=(static, auto))
