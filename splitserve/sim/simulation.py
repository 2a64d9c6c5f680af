"""Simulation: a workload replayed on simulated pools, each request owned from arrival to end.

A request's life, as on a Ray cluster (docs/architecture.md), on the simulated clock:
  arrival → (+ ingress_s) the router places it (real policy, PD decider) and admission decides
  (real `Admission`, from the workers' last reports) → the prefill worker's engine computes the
  prompt (prefill_only) → its first token reaches the client (+ stream_s) → (+ handoff_s) the
  decode worker allocates the context's blocks (`add_pulled`; out of blocks: it recomputes the
  prompt itself, as the real one does) → the KV moves (Link: bytes / bandwidth + latency, by
  node) → `kv_ready`, the prefill side frees its blocks (the ack) → decode steps stream the
  rest. The aggregated path (no prefill pool, or a prompt the PD decider keeps on the decode
  worker) prefills on the decode worker. `_end` frees what the request holds — its pending
  counts and its admission slot — exactly once, whatever the outcome.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from splitserve.control.autoscale import AutoscaleConfig, Autoscaler, RequestSample
from splitserve.engine.kv_cache import OutOfBlocks
from splitserve.router.admission import Admission, AdmissionConfig, Decision, Plan
from splitserve.router.pd_decider import DECIDERS, make_decider
from splitserve.router.policy import NoCapacity, make_router
from splitserve.sim.cost import ByRole, CostModel
from splitserve.sim.engine import SimEngine
from splitserve.sim.events import EventLoop
from splitserve.sim.pools import SimPools
from splitserve.sim.router import SimRouter
from splitserve.sim.speculation import SpecSim
from splitserve.sim.worker import HostCPU, SimWorker
from splitserve.sim.workload import PrefixHasher, SimRequestSpec, Workload
from splitserve.types import ConfigError, PromptHashes, Request, Role, SamplingParams, TokenChunk, WorkerId, WorkerState


@dataclass(frozen=True)
class SimConfig:
    prefill: int = 1  # workers at the start (0: aggregated — decode workers prefill)
    decode: int = 1
    policy: str = "cache_aware"
    disagg_min_tokens: int = 32
    pd_decider: str = "slo"  # router/pd_decider.py: which requests go through a prefill worker
    # the KV streams while the prompt is computed (DeployConfig.kv_streaming): for a context of
    # kv_streaming_min_tokens or more, only the last step's share is moved after the prefill
    kv_streaming: bool = True
    kv_streaming_min_tokens: int = 2048
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    prefill_max_num_batched_tokens: int | None = None  # the prefill pool's step budget (None: the same)
    max_model_len: int = 131072
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    admission: bool = True
    max_inflight: int = 1_000_000  # one router's cap; a fleet of routers has many
    autoscale: AutoscaleConfig | None = None
    gpus_per_node: int = 8
    layout: str = "by-role"
    worker_start_s: float = 30.0  # an autoscaled worker: asked for → READY (model load)
    report_interval_s: float = 0.05  # how often a router reads a worker's load
    ingress_s: float = 0.0  # arrival → on a worker's queue (HTTP, tokenize, route, RPC)
    handoff_s: float = 0.0  # prefill's first token → the decode worker starts its pull
    stream_s: float = 0.0  # a token from the engine to the client
    host_cores: int | None = None  # CPU serving: the cores a node's workers share (None: a device each)
    # a structured-output grammar's compile on a worker that has not cached it (llguidance, the
    # demo model: p50 1.1 ms, results/structured_output)
    grammar_compile_s: float = 0.0011
    speculation: SpecSim = SpecSim()  # k proposals at acceptance α (sim/speculation.py); k = 0: none

    def __post_init__(self) -> None:
        if self.decode < 1 and self.autoscale is None:
            raise ConfigError("the simulated cluster needs at least one decode worker")
        if self.prefill < 0:
            raise ConfigError("prefill workers must be >= 0")
        for n in ("ingress_s", "handoff_s", "stream_s", "worker_start_s", "grammar_compile_s"):
            if getattr(self, n) < 0:
                raise ConfigError(f"{n} must be >= 0")
        if self.report_interval_s <= 0:
            raise ConfigError("report_interval_s must be > 0")
        if self.prefill_max_num_batched_tokens is not None and self.prefill_max_num_batched_tokens < 1:
            raise ConfigError("prefill_max_num_batched_tokens must be >= 1")
        if self.pd_decider not in DECIDERS:
            raise ConfigError(f"unknown PD decider {self.pd_decider!r}; known: {', '.join(DECIDERS)}")


@dataclass(slots=True)
class SimRequest:
    """One request's state and timings (simulated seconds)."""

    spec: SimRequestSpec
    req: Request
    phase: str = "placing"  # placing → prefill → handoff → decode → done
    tickets: dict = field(default_factory=dict)
    decision: Decision | None = None
    prefill: WorkerId | None = None
    decode: WorkerId | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    tokens: int = 0
    cached_tokens: int = 0
    migrations: int = 0  # decode placed again (its worker left before the handoff)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one request measured: the row the summary is built from."""

    index: int
    status: str  # ok | rejected (admission: 429) | failed (no capacity: 503)
    arrival_s: float
    end_s: float
    ttft_s: float | None
    tpot_s: float | None
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    disaggregated: bool
    migrations: int = 0


class Simulation:
    def __init__(self, config: SimConfig, cost: CostModel | ByRole, workload: Workload) -> None:
        self.config, self.workload = config, workload
        self.costs = ByRole.of(cost)
        self.cost = self.costs.decode  # KV bytes and links
        self.loop = EventLoop()
        slo_s = lambda ms: None if ms is None else ms / 1e3  # noqa: E731
        decider = make_decider(config.pd_decider, config.disagg_min_tokens, slo_s(config.ttft_slo_ms),
                               slo_s(config.tpot_slo_ms))
        policy = make_router(config.policy, decider=decider)
        self.router = SimRouter(policy, lambda: self.loop.now, config.block_size)
        self.admission = Admission(AdmissionConfig(max_inflight=config.max_inflight, ttft_slo_ms=config.ttft_slo_ms,
                                                   tpot_slo_ms=config.tpot_slo_ms, enabled=config.admission))
        self.autoscaler = Autoscaler(config.autoscale) if config.autoscale is not None else None
        # a node holds gpus_per_node GPUs: as many workers as their tensor parallelism leaves room for
        workers_per_node = max(1, config.gpus_per_node // self.cost.gpus_per_worker)
        self.pools = SimPools(self.loop, self.router, self._make_worker, workers_per_node, config.layout,
                              config.worker_start_s)
        self.hasher = PrefixHasher(config.block_size, workload.tokens_per_hash)
        self.targets: dict[Role, int] = {Role.PREFILL: config.prefill, Role.DECODE: config.decode}
        self.requests: dict[str, SimRequest] = {}
        self.outcomes: list[Outcome] = []
        self.pool_sizes: list[dict] = []
        self._next = 0
        self._hosts: dict[str, HostCPU] = {}
        self.wall_s = 0.0

    # -- running ----------------------------------------------------------------------------------
    def run(self) -> "Simulation":
        t0 = time.perf_counter()
        if self.autoscaler is not None:
            for role in Role:
                self.targets[role] = self.autoscaler.initial(role, self.targets[role])
        for role in Role:
            for _ in range(self.targets[role]):
                self.pools.start(role, 0.0)
        self._schedule_next_arrival()
        if self.autoscaler is not None:
            self.loop.after(self.autoscaler.config.interval_s, self._tick)
        self.loop.run()
        self.wall_s = time.perf_counter() - t0
        self._check_drained()
        return self

    def _schedule_next_arrival(self) -> None:
        reqs = self.workload.requests
        if self._next < len(reqs):
            spec = reqs[self._next]
            self._next += 1
            self.loop.at(max(self.loop.now, spec.arrival_s), self._arrive, spec)

    def _busy(self) -> bool:
        return self._next < len(self.workload.requests) or bool(self.requests)

    def _make_worker(self, wid: WorkerId, role: Role, node: str, slot: int) -> SimWorker:
        c = self.config
        engine = SimEngine(self.costs.of_role(role), block_size=c.block_size, max_num_seqs=c.max_num_seqs,
                           max_num_batched_tokens=self._budget(role), max_model_len=c.max_model_len,
                           compile_s=c.grammar_compile_s, speculation=c.speculation)
        host = None
        if c.host_cores is not None:
            host = self._hosts.setdefault(node, HostCPU(c.host_cores))
        return SimWorker(wid, role, node, slot, engine, self.loop, self._on_chunk, self._on_report,
                         c.report_interval_s, host, self.costs.of_role(role).gpus_per_worker)

    def _on_report(self, w: SimWorker, stats, events, at: float) -> None:
        self.router.report(w.id, stats, events, at)

    # -- a request's life ---------------------------------------------------------------------------
    def _arrive(self, spec: SimRequestSpec) -> None:
        self._schedule_next_arrival()
        bs = self.config.block_size
        params = SamplingParams(temperature=0.0, max_tokens=spec.output_len, ignore_eos=True)
        prompt = spec.tokens if spec.tokens is not None else (1,) * spec.input_len
        req = Request(f"r{spec.index}", prompt, params, arrival_time=spec.arrival_s,
                      prompt_hashes=PromptHashes(bs, self.hasher.hashes(spec)))
        sr = self.requests[req.request_id] = SimRequest(spec, req)
        self.loop.after(self.config.ingress_s, self._place, sr)

    def _place(self, sr: SimRequest) -> None:
        rr = self.router.route_request(sr.req)
        try:
            pl, sr.tickets = self.router.place(rr)
        except NoCapacity:
            return self._end(sr, "failed")
        first = pl.prefill if pl.prefill is not None else pl.decode
        stats = self.router.stats
        plan = Plan(first, stats.get(first), pl.decode, stats.get(pl.decode), pl.cached_tokens)
        decision = self.admission.decide(plan, sr.req.priority, rr.num_tokens, grammar=sr.spec.grammar)
        if not decision.admit:
            return self._end(sr, "rejected")
        sr.decision, sr.prefill, sr.decode = decision, pl.prefill, pl.decode
        worker = self.pools.workers[first]
        sr.phase = "prefill" if pl.prefill is not None else "decode"
        worker.submit(sr.req, prefill_only=pl.prefill is not None, grammar=sr.spec.grammar)
        self.router.pending.confirm(first, sr.tickets[first])

    def _on_chunk(self, w: SimWorker, chunk: TokenChunk) -> None:
        sr = self.requests[chunk.request_id]
        now = self.loop.now + self.config.stream_s
        if sr.tokens == 0:
            sr.first_token_at = now
            sr.cached_tokens = chunk.num_cached_tokens
            self.admission.prefilled(sr.decision)
        sr.tokens += 1
        sr.last_token_at = now
        if chunk.finish_reason is not None:
            return self._end(sr, "ok")
        if sr.phase == "prefill":
            sr.phase = "handoff"
            self.loop.after(self.config.handoff_s, self._pull, sr, w, chunk.token_ids[-1])

    def _pull(self, sr: SimRequest, pw: SimWorker, first_token: int) -> None:
        dw = self.pools.workers.get(sr.decode)
        if dw is None:  # drained and stopped while the prompt was computed: placed again, as a RequestRun migrates
            dw = self._replace_decode(sr)
            if dw is None:
                self._release_source(sr, pw)
                return self._end(sr, "failed")
        self.router.pending.confirm(dw.id, sr.tickets[dw.id])
        try:
            dw.engine.add_pulled(sr.req, first_token)
        except OutOfBlocks:  # as the real decode worker: free the source now, compute it here
            self._release_source(sr, pw)
            sr.phase = "decode"
            dw.submit(sr.req, outputs=(first_token,), grammar=sr.spec.grammar)
            return
        nbytes = self._exposed_tokens(sr.spec.input_len) * self.cost.kv_bytes_per_token
        # the decode worker rebuilds the grammar's matcher once the KV has landed (a compile if it has none)
        after = self.cost.link.transfer_s(nbytes, pw.node == dw.node) + dw.engine.grammars.delay(sr.spec.grammar)
        self.loop.after(after, self._landed, sr, pw, dw)

    def _exposed_tokens(self, prompt: int) -> int:
        """The prompt's tokens whose KV moves after its prefill: all of it, or — streamed — the
        last step's, as when the prompt has the step budget to itself (the earlier chunks' KV
        moved while the later ones were computed, behind them)."""
        c = self.config
        if not c.kv_streaming or prompt < c.kv_streaming_min_tokens:
            return prompt
        return (prompt - 1) % self._budget(Role.PREFILL) + 1

    def _budget(self, role: Role) -> int:
        c = self.config
        if role is Role.PREFILL and c.prefill_max_num_batched_tokens is not None:
            return c.prefill_max_num_batched_tokens
        return c.max_num_batched_tokens

    def _replace_decode(self, sr: SimRequest) -> SimWorker | None:
        self.router.pending.done(sr.decode, sr.tickets.pop(sr.decode))
        try:
            pl, tickets = self.router.place(self.router.route_request(sr.req))
        except NoCapacity:
            return None
        for wid, t in tickets.items():  # only the decode side is placed again
            if wid != pl.decode:
                self.router.pending.done(wid, t)
        sr.decode, sr.tickets[pl.decode] = pl.decode, tickets[pl.decode]
        sr.migrations += 1
        return self.pools.workers[pl.decode]

    def _landed(self, sr: SimRequest, pw: SimWorker, dw: SimWorker) -> None:
        dw.engine.kv_ready(sr.req.request_id)
        sr.phase = "decode"
        dw.kick()
        self._release_source(sr, pw)

    def _release_source(self, sr: SimRequest, pw: SimWorker) -> None:
        if not pw.engine.release_detached(sr.req.request_id):
            raise AssertionError(f"{sr.req.request_id}: its prefill blocks were freed twice")
        pw.kick()  # freed blocks may let a waiting prompt in

    def _end(self, sr: SimRequest, status: str) -> None:
        if sr.phase == "done":
            raise AssertionError(f"{sr.req.request_id} ended twice")
        sr.phase = "done"
        del self.requests[sr.req.request_id]
        for wid, ticket in sr.tickets.items():
            self.router.pending.done(wid, ticket)
        ttft = tpot = None
        if sr.first_token_at is not None:
            ttft = sr.first_token_at - sr.spec.arrival_s
            if sr.tokens >= 2:
                tpot = (sr.last_token_at - sr.first_token_at) / (sr.tokens - 1)
        if sr.decision is not None:
            self.admission.finished(sr.decision, ttft)
        if self.autoscaler is not None and status == "ok":
            self.autoscaler.record([RequestSample(self.loop.now, ttft, tpot)])
        self.outcomes.append(Outcome(sr.spec.index, status, sr.spec.arrival_s, self.loop.now, ttft, tpot, sr.tokens,
                                     sr.spec.input_len, sr.cached_tokens, sr.prefill is not None, sr.migrations))

    # -- the pools over time -------------------------------------------------------------------------
    def _tick(self) -> None:
        pools, scaler = self.pools, self.autoscaler
        ready = {r: {str(w.id): w.engine.stats() for w in pools.ready(r)} for r in Role}
        starting = {r: sum(w.state is WorkerState.STARTING for w in pools.live(r)) for r in Role}
        d = scaler.tick(self.loop.now, dict(self.targets), ready[Role.PREFILL], ready[Role.DECODE], starting)
        for role in Role:
            if d.target(role) != self.targets[role]:
                self.targets[role] = d.target(role)
                pools.scale(role, d.target(role))
        self.pool_sizes.append({"t": round(self.loop.now, 3), "prefill": len(pools.ready(Role.PREFILL)),
                                "decode": len(pools.ready(Role.DECODE)), "prefill_target": self.targets[Role.PREFILL],
                                "decode_target": self.targets[Role.DECODE],
                                "reason": f"{d.prefill_reason}/{d.decode_reason}"})
        if self._busy():
            self.loop.after(scaler.config.interval_s, self._tick)

    def _check_drained(self) -> None:
        """The invariants a finished run must hold: every request ended once, every worker
        empty with its block pool consistent, no pending count or admission slot left."""
        if self.requests:
            raise AssertionError(f"{len(self.requests)} requests never ended")
        if len(self.outcomes) != len(self.workload.requests):
            raise AssertionError(f"{len(self.outcomes)} outcomes for {len(self.workload.requests)} requests")
        for w in self.pools.workers.values():
            if not w.idle:
                raise AssertionError(f"{w.id} still holds work at the end")
            w.engine.check_invariants()
            if w.engine.pool.num_in_use:
                raise AssertionError(f"{w.id}: {w.engine.pool.num_in_use} blocks in use at the end")
        if self.admission.inflight:
            raise AssertionError(f"admission counts {self.admission.inflight} requests in flight at the end")
        for wid in self.router.roles:
            if self.router.pending.count(wid, float("inf")):
                raise AssertionError(f"{wid}: pending placements left at the end")
