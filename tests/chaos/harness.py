"""What every chaos scenario shares: a load of concurrent streams driven exactly as the ingress
drives them (Frontend + RequestLease, admission included) on the cluster's router loop; the
single engine's reference outputs; faults from outside (signals to a worker's process); and the
check that afterwards nothing is held anywhere."""

from __future__ import annotations

import asyncio
import os
import re
import statistics
import time
from dataclasses import dataclass, field

import torch

from splitserve import LLM
from splitserve.ingress.frontend import Frontend
from splitserve.orchestrator import Cluster
from splitserve.ingress.lease import RequestLease
from splitserve.ingress.protocol import RequestOptions
from splitserve.types import Priority, Request, SamplingParams, ServiceUnavailable

INTERNALS = re.compile(r"actor|pid|\b\d{1,3}(\.\d{1,3}){3}\b", re.I)


def prompts(n: int, seed: int = 11) -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(3, 384, (int(k),), generator=g).tolist())
            for k in torch.randint(20, 90, (n,), generator=g)]


def params(n: int, seeded: bool, max_tokens: int) -> list[SamplingParams]:
    if not seeded:
        return [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)] * n
    return [SamplingParams(temperature=0.8, seed=1000 + i, max_tokens=max_tokens, ignore_eos=True) for i in range(n)]


def reference(model: str, ps, sps) -> list[tuple[int, ...]]:
    """One uninterrupted run of every request on one engine in this process."""
    outs = LLM(model, num_kv_blocks=1024).generate([list(p) for p in ps], sps)
    return [tuple(o.outputs[0].token_ids) for o in outs]


@dataclass
class Outcome:
    request_id: str
    tokens: tuple[int, ...] = ()
    error: str | None = None
    cut: bool = False  # the client left on purpose


@dataclass
class Load:
    """Streams run on the cluster's loop; `progress[i]`: tokens stream i has delivered so far.
    `cut_after[i]`: the client leaves after that many tokens (0: before the body starts).
    `fronts`: the ingress replicas' Frontends, stream i through fronts[i % len] (default: one
    over the cluster's backend)."""

    c: object
    ps: list
    sps: list
    cut_after: dict = field(default_factory=dict)
    progress: list = field(default_factory=list)
    fronts: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.fronts = self.fronts or [Frontend(self.c.backend)]
        self.front = self.fronts[0]
        self.progress = [0] * len(self.ps)
        self.future = asyncio.run_coroutine_threadsafe(self._all(), self.c._loop.loop)

    async def _all(self) -> list[Outcome]:
        return await asyncio.gather(*[self._one(i) for i in range(len(self.ps))])

    async def _one(self, i: int) -> Outcome:
        front = self.fronts[i % len(self.fronts)]
        opts = RequestOptions("m", self.sps[i], True, False, None, Priority.STANDARD, None, None)
        _, choices, reqs = front.requests(opts, [self.ps[i]])
        cut = self.cut_after.get(i)
        try:
            async with RequestLease(front, opts, reqs, choices, await front.prepay(opts.tenant, len(reqs))) as lease:
                if cut == 0:
                    return Outcome(reqs[0].request_id, cut=True)
                async for _ in lease.streams[0]:
                    self.progress[i] = len(choices[0].text.token_ids)
                    if cut is not None and self.progress[i] >= cut:
                        return Outcome(reqs[0].request_id, cut=True)
        except ServiceUnavailable as e:
            return Outcome(reqs[0].request_id, tuple(choices[0].text.token_ids), str(e))
        return Outcome(reqs[0].request_id, tuple(choices[0].text.token_ids))

    def wait_progress(self, at_least: int, timeout: float = 60.0, of=min) -> None:
        """Until every stream (`of=max`: one) has delivered `at_least` tokens."""
        deadline = time.time() + timeout
        while of(self.progress) < at_least and not self.future.done():
            assert time.time() < deadline, f"no progress: {self.progress}"
            time.sleep(0.001)

    def wait_progress_past(self, marks: list[int], timeout: float = 60.0) -> None:
        """Until every stream has delivered more than `marks[i]` tokens (or the load is done)."""
        deadline = time.time() + timeout
        while any(p <= m for p, m in zip(self.progress, marks)) and not self.future.done():
            assert time.time() < deadline, f"no progress past {marks}: {self.progress}"
            time.sleep(0.01)

    def result(self, timeout: float = 180.0) -> list[Outcome]:
        return self.future.result(timeout)


def pid_of(worker) -> int:
    import ray

    return ray.get(worker.describe.remote()).pid


def busiest_record(c, role=None):
    """The record of the worker (of `role`; default decode) that says it runs the most streams,
    asked itself: the directory's view may be a poll old (it once named an idle one)."""
    import ray

    from splitserve.types import Role

    recs = [r for r in c.directory.records.values() if r.role is (role or Role.DECODE)]
    return max(recs, key=lambda r: ray.get(r.handle.load.remote()).stats.num_running)


def signal_worker(worker, sig) -> None:
    os.kill(pid_of(worker), sig)


def running(worker) -> int:
    """The streams (or prompts) its engine runs now, asked of the worker itself."""
    import ray

    return ray.get(worker.load.remote()).stats.num_running


def in_engine(worker) -> int:
    """The requests submitted to its engine and not finished there (its last stats may not show
    them yet: a prefill worker's come and go within one step)."""
    import ray

    return ray.get(worker.__ray_call__.remote(lambda w: w.loop.num_active))


def busiest(workers):
    """The one running the most streams, as each says itself (the directory's view may be a poll
    old, and placement may have favoured one)."""
    return max(workers, key=running)


def replaced(c, before: set, role: str | None = None, timeout: float = 120.0) -> tuple[list, list]:
    """Until the Controller's status shows a worker of `before` (of `role`, if given) dead and a
    new one READY: (the dead, the fresh), as WorkerStatus entries."""
    import ray

    deadline = time.time() + timeout
    while True:
        st = ray.get(c.controller.status.remote())
        mine = [w for w in st.workers if role is None or w.role == role]
        dead = [w for w in mine if w.id in before and w.state == "dead"]
        fresh = [w for w in mine if w.id not in before and w.state == "ready"]
        if dead and fresh:
            return dead, fresh
        assert time.time() < deadline, st.workers
        time.sleep(0.1)


def migration_report(c) -> dict:
    traces = [t for t in list(c.timings) if t.migrations]
    gaps = sorted(g for t in traces for g in t.migration_gaps_s)
    q = (lambda p: gaps[min(len(gaps) - 1, int(p * len(gaps)))]) if gaps else (lambda p: None)
    return {"migrated": len(traces), "migrations": sum(t.migrations for t in traces),
            "gap_p50_s": q(0.5), "gap_p99_s": q(0.99), "gap_mean_s": statistics.mean(gaps) if gaps else None}


def assert_outcomes(outcomes, ref, min_exact: int, recomputed=None) -> int:
    """Every stream completed with the reference tokens, or ended with our explicit error;
    at least `min_exact` completed exactly. `recomputed(i, outcome)`: for a seeded stream that
    migrated and differs, whether it equals one engine's recompute from the same migration points
    (a draw on a CDF boundary may flip when the context's KV is recomputed: fp32 rounding of the
    prefill and decode kernels differs)."""
    exact = 0
    for i, (o, r) in enumerate(zip(outcomes, ref)):
        if o.cut:
            continue
        if o.error is not None:
            assert not INTERNALS.search(o.error), o.error
            assert o.tokens == r[:len(o.tokens)], f"stream {i} delivered wrong tokens before its error"
        elif o.tokens == r:
            exact += 1
        else:
            assert recomputed is not None and recomputed(i, o), f"stream {i}: {o.tokens} != {r}"
    assert exact >= min_exact, f"{exact} exact, wanted >= {min_exact}: {[o.error for o in outcomes if o.error]}"
    return exact


class Recompute:
    """One engine in this process replays a migrated stream: at each migration point the
    context (prompt + tokens delivered so far) is computed afresh, as the cluster did."""

    def __init__(self, model: str, c, ps, sps) -> None:
        from splitserve.config import EngineConfig
        from splitserve.engine.engine import Engine

        self.engine = Engine(EngineConfig(model=model, num_kv_blocks=1024))
        self.traces = {t.request_id: t for t in list(c.timings)}
        self.ps, self.sps, self.replayed = ps, sps, 0

    def __call__(self, i: int, o: Outcome) -> bool:
        points = self.traces[o.request_id].migrated_after
        if not points:
            return False  # it never moved: nothing excuses a difference
        self.replayed += 1
        for k, end in zip(points, points[1:] + [len(o.tokens)]):
            rid = f"replay-{o.request_id}-{k}"
            self.engine.add_request(Request(rid, self.ps[i], self.sps[i]), outputs=o.tokens[:k])
            out = []
            while self.engine.has_unfinished():
                out += [t for ch in self.engine.step() for t in ch.token_ids]
            if tuple(out[:end - k]) != o.tokens[k:end]:
                return False
        return True


def assert_nothing_held(c, load: Load, timeout: float = 10.0) -> None:
    """Every live worker: no block in use, no lease, no handoff or staging; admission back to zero."""
    deadline = time.time() + timeout
    while True:
        counts = c.check_invariants()
        held = [s for s in counts if s["in_use"] or s.get("leases", 0) or s.get("grants", 0) or s.get("handoffs", 0)
                or s.get("staged", 0)]
        inflight = [f.admission.inflight for f in load.fronts]
        if not held and not any(inflight):
            break
        assert time.time() < deadline, (held, inflight)
        time.sleep(0.1)
    assert counts, "no live worker to check"
    for front in load.fronts:
        outstanding = front.admission.outstanding
        assert all(outstanding[w] == (0, 0) for w in list(outstanding._by_worker)), outstanding._by_worker


def streamed_cluster(model, name, **kw):
    """Every prompt takes the streamed path (issue 32: staged on its decode worker, the KV
    handed over as pieces and a tail). The step budget stays the default: these prompts are
    compared token for token with an unchunked run, and a prompt computed in small chunks
    differs in the last bits — enough to flip a near-tie (pieces landing mid-prefill under
    faults: tests/unit/test_decode_lifecycle.py). The decode inactivity timeout is the product's
    (30 s) unless a scenario's fault is silence: a bound of 1.5 s took busy, healthy decode workers
    on a loaded machine for silent, and moved their streams until the migration limit ended them."""
    opts = {"prefill": 1, "decode": 2, "transport": "auto", "disagg_min_tokens": 0, "num_kv_blocks": 512,
            "kv_streaming_min_tokens": 0, **kw}
    return Cluster.start(model=model, name=name, **opts)
