"""Data-parallel attention + expert parallelism (issue 35): D replicas of one engine, one process
each, every replica a whole `Engine` on its own requests — its own scheduler, block pool and KV
cache (a latent-attention model's latent cache once per replica, not once per TP rank), the
attention and dense layers whole — but holding only num_experts / D of each MoE layer's experts
(plus redundant replicas under expert_balance). In each MoE layer every replica's tokens go to
the replicas holding their experts and come back (parallel/expert_dispatch.py).

`DataParallelEngine` is the front: to the caller (`LLM`, a worker's EngineLoop) one engine.
Replica 0 is an Engine in the front's process; replicas 1..D-1 run `serve`.

  add_request  placed on the replica with the fewest live context tokens (dp_placement.py);
               replica 0's is added at once, another's is queued for the next step's order
  abort        goes to the owning replica (at once, or with the next order)
  step         one broadcast of a `StepOrder` (each replica's queued adds and aborts, and
               whether to step): that is how an idle replica learns there is a step — no step
               is ordered while no replica holds a request. Every replica applies its ops and
               steps; one that schedules nothing still runs every MoE layer's exchange with zero
               rows (`idle_pass`). The chunks come back in one (timed) gather.
  stats        every replica's, summed (counters, KV blocks, expert tokens), kept until a
               request, step or call changes them (an idle worker's polls cost no round on
               the group); `replica_stats` lists them; block_counts / check_invariants check every replica
  expert load  rebalancing (redundant_experts, expert_rebalance_interval_steps) is planned here
               from the replicas' summed counts and applied on all of them between steps
  failure      a replica process that exited is seen before the next step (its launcher's
               `lost`), one that dies in a step breaks the step's all-to-all or gather, which
               raise (never wait beyond the group's timeout)

  grammar      a request's structured-output grammar lives where the request does: its replica
               builds the matcher from its own tokenizer and fills its rows' masks in its own
               step, as one engine does. The front compiles the grammar first (`prepare`, off
               the engine thread; cached on replica 0) and fits the request's tokens to it before
               placing it, so a grammar that does not compile is the same ConfigError as on one
               engine, never a failed op inside a step; a replica > 0 compiles an uncached one
               again when the add arrives (a compiled matcher does not pickle), inside that step.

Not with it yet: a prefill/decode handoff (prefill_only, pulled KV) and tensor or pipeline
parallelism inside a replica. The prefix cache's events are not reported
(`drain_kv_events` is empty): a router's prefix index would credit the worker with a prefix only
one of its replicas holds, while the front places by load."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any, Callable

from splitserve.config import EngineConfig
from splitserve.engine.engine import Engine, warmup_batches
from splitserve.engine.expert_balance import layers_imbalance
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.parallel.dp_group import DPGroup, check, start_local_replicas
from splitserve.engine.parallel.dp_placement import LeastTokens
from splitserve.engine.parallel.expert_dispatch import idle_pass
from splitserve.engine.parallel.rank_calls import RankCall, RankFailure, answer, call_group
from splitserve.types import ConfigError, ExpertBalance, Request, SamplingParams, TokenChunk, WorkerStats


@dataclass(frozen=True)
class Add:
    request: Request
    outputs: tuple[int, ...] = ()

    def apply(self, engine: Engine) -> None:
        engine.add_request(self.request, outputs=self.outputs)


@dataclass(frozen=True)
class Abort:
    request_id: str

    def apply(self, engine: Engine) -> None:
        engine.abort(self.request_id)


@dataclass(frozen=True)
class StepOrder:
    ops: tuple[tuple[Add | Abort, ...], ...]  # per replica, applied before its step
    run: bool  # whether every replica steps (False: only ops to deliver)


@dataclass(frozen=True)
class StepAnswer:
    chunks: tuple[TokenChunk, ...]
    failure: RankFailure | None = None  # an op that failed (the step ran regardless)


class DataParallelEngine:
    def __init__(self, config: EngineConfig, start_replicas: Callable[[EngineConfig], tuple[DPGroup, Any]] | None = None
                 ) -> None:
        if config.data_parallel_size < 2:
            raise ConfigError("a DataParallelEngine needs data_parallel_size >= 2")
        mc = ModelConfig.from_dir(config.model)
        check(mc, config)  # before any replica starts
        self.config, self.model_config = config, mc
        self.failure: str | None = None  # set once a step failed here: the replicas are out of step for good
        self.group, self.ranks = (start_replicas or start_local_replicas)(config)
        try:
            self.engine = Engine(config, dp=self.group)  # replica 0
            self.group.wait_all()  # every replica loaded, however long that takes
        except BaseException:
            self._stop()
            raise
        self.max_model_len = self.engine.max_model_len
        # what a worker reads of an engine: replica 0's (its KV cache is what a transport
        # registers, though no handoff lands here; its memory report is one replica's process)
        self.kv, self.memory, self.tp, self.pp = self.engine.kv, self.engine.memory, self.engine.tp, None
        self.dp = self.group  # its `failure`: the serving loop's health check (worker/engine_loop.py)
        self.placer = LeastTokens(config.data_parallel_size)
        self.kv_progress = None  # no streamed prefill here (prefill_only is refused)
        self._ops: list[list[Add | Abort]] = [[] for _ in range(config.data_parallel_size)]
        self._order = itertools.count()
        self._steps = 0
        # the summed stats, kept until a request, a step or a call on the replicas may change them:
        # a router polls an idle worker's stats often, and each would be a round on the group
        self._stats: WorkerStats | None = None

    # -- requests -------------------------------------------------------------------------
    def check_request(self, req: Request, outputs: tuple[int, ...] = ()) -> int:
        return self.engine.check_request(req, outputs)  # reads config only: every replica's answer

    def prepare(self, params: SamplingParams) -> None:
        self.engine.prepare(params)  # replica 0's compile: the others compile when the add arrives

    def add_request(self, req: Request, *, prefill_only: bool = False, outputs: tuple[int, ...] = (),
                    stream_kv: bool = False) -> None:
        if prefill_only or stream_kv:
            raise _no_handoff()
        outputs = tuple(outputs)
        self._stats = None
        if self.placer.owner(req.request_id) is not None:
            raise ConfigError(f"request id {req.request_id!r} is already running")
        self.check_request(req, outputs)
        self._check_grammar(req, outputs)
        r = self.placer.place(req.request_id, len(req.prompt_token_ids) + len(outputs))
        if r == 0:
            try:
                self.engine.add_request(req, outputs=outputs)
            except BaseException:
                self.placer.done(req.request_id)
                raise
        else:
            self._ops[r].append(Add(req, outputs))

    def abort(self, request_id: str) -> None:
        self._stats = None
        r = self.placer.done(request_id)
        if r == 0:
            self.engine.abort(request_id)
        elif r is not None:
            self._ops[r].append(Abort(request_id))

    def replica_of(self, request_id: str) -> int | None:
        return self.placer.owner(request_id)

    def has_unfinished(self) -> bool:
        return self.placer.live()

    def holds_nothing(self) -> bool:
        return not self.placer.live()  # no handoffs here: a request holds blocks while it lives

    def is_pulling(self, request_id: str) -> bool:
        return False

    def reserve_pulled(self, *args, **kwargs):
        raise _no_handoff()

    def add_pulled(self, *args, **kwargs):
        raise _no_handoff()

    # -- steps --------------------------------------------------------------------------------
    def step(self) -> list[TokenChunk]:
        self._check_replicas()
        bal = self.engine.expert_balancer
        if bal is not None and bal.interval and self._steps - bal.last_step >= bal.interval:
            self.rebalance_experts()
        run = self.placer.live()
        if not run and not any(self._ops):
            return []
        ops, self._ops = self._ops, [[] for _ in self._ops]
        self._stats = None
        try:
            self.group.broadcast(StepOrder(tuple(map(tuple, ops)), run))
            answers = self.group.gather_step(run_order(self.engine, ops[0], run, 0))
        except BaseException as e:  # the others may still be inside this step's exchanges: no later one lines up
            self.failure = f"a step failed with {type(e).__name__}"
            raise
        self._steps += run
        chunks: list[TokenChunk] = []
        for a in answers:
            if a.failure is not None:
                raise a.failure.error
            chunks += a.chunks
        for c in chunks:
            if self.placer.owner(c.request_id) is None:
                continue
            if c.finish_reason is not None:
                self.placer.done(c.request_id)
            else:
                self.placer.grew(c.request_id, len(c.token_ids))
        return chunks

    def warmup(self, prompt_lens: tuple[int, ...] = (16, 64, 256), max_tokens: int = 4) -> None:
        """Engine.warmup's requests through the front (placed as any), then every replica
        forgets them."""
        for batch in warmup_batches(self, prompt_lens, max_tokens):
            for req in batch:
                self.add_request(req)
            while self.has_unfinished():
                self.step()
        self.on_all_replicas(_forget_warmup)
        if self.engine.expert_balancer is not None:
            self.engine.expert_balancer.last_step = self._steps  # counted in the front's steps here

    def on_all_replicas(self, fn: Callable[..., Any], *args: Any) -> list:
        """fn(engine, *args) on every replica between steps; the answers in replica order."""
        self._check_replicas()
        if fn not in _READS:
            self._stats = None
        return call_group(self.engine, self.group, RankCall(fn, args))

    # -- experts --------------------------------------------------------------------------
    def rebalance_experts(self, placements=None) -> bool:
        """Plan the experts' placement from every replica's tokens per expert since the last
        rebalance (or take `placements`, one per MoE layer) and apply it on all of them."""
        bal = self.engine.expert_balancer
        if bal is None:
            raise ConfigError("expert rebalancing needs redundant_experts or expert_rebalance_interval_steps")
        bal.last_step = self._steps
        if placements is None:
            counts = _summed(self.on_all_replicas(_window_counts))
            placements = bal.plan(counts)
            if placements is None:
                return False
        placements = tuple(placements)
        if len(placements) != len(bal.layers):
            raise ValueError(f"{len(placements)} placements for {len(bal.layers)} MoE layers")
        before = layers_imbalance(_summed(self.on_all_replicas(_rank_loads)))
        self.on_all_replicas(_apply_placements, placements, before)
        return True

    # -- introspection --------------------------------------------------------------------
    def replica_stats(self) -> list[WorkerStats]:
        return self.on_all_replicas(_stats)

    def stats(self) -> WorkerStats:
        if self._stats is not None:
            return self._stats
        per = self.replica_stats()
        out = {f.name: _sum_field(f.name, [getattr(s, f.name) for s in per]) for f in dataclasses.fields(WorkerStats)}
        out["steps_total"] = self._steps
        out["step_time_coeffs"] = per[0].step_time_coeffs  # the replicas step together: one step's time
        out["expert_balance"] = self._expert_balance(per[0].expert_balance)
        self._stats = WorkerStats(**out)
        return self._stats

    def expert_tokens(self) -> tuple[int, ...]:
        return self.stats().expert_tokens_total

    def _expert_balance(self, first: ExpertBalance | None) -> ExpertBalance | None:
        if first is None:
            return None
        loads = _summed(self.on_all_replicas(_rank_loads))  # every replica's tokens, per layer and rank
        return dataclasses.replace(first, rank_tokens=tuple(map(sum, zip(*loads))) if loads else (),
                                   imbalance=layers_imbalance(loads))

    def block_counts(self) -> dict[str, int]:
        """Every replica's invariants checked; their pools' counts summed (`replica_block_counts`: each)."""
        per = self.replica_block_counts()
        return {k: sum(c[k] for c in per) for k in per[0]}

    def replica_block_counts(self) -> list[dict[str, int]]:
        return self.on_all_replicas(_block_counts)

    def check_invariants(self) -> None:
        self.on_all_replicas(_check_invariants)
        if sum(self.placer.requests) != len(self.placer._held) or min(self.placer.tokens) < 0:
            raise AssertionError(f"the front's load accounting is off: {self.placer.requests}, {self.placer.tokens}")

    def drain_kv_events(self) -> list:
        return []

    def kv_listing(self) -> list:
        return []

    def grammar_compile_s(self) -> float:
        return self.engine.grammar_compile_s()  # replica 0 compiles every request's grammar first

    @property
    def cache_layers(self) -> int:
        return self.engine.cache_layers

    @property
    def step_time_coeffs(self) -> tuple[float, ...]:
        return self.engine.step_time_coeffs

    def close(self) -> None:
        self.engine.close()
        self._stop()

    # -- replicas -------------------------------------------------------------------------
    def _check_replicas(self) -> None:
        """A replica that exited is known before the step: the order's broadcast waits on an
        untimed group, and a send to a dead peer was seen to hang there (launch.py's note)."""
        lost = self.failure or self.group.failure or (self.ranks.lost() if self.ranks is not None else "closed")
        if lost is not None:
            raise RuntimeError(f"this engine's data-parallel group is broken: {lost}")

    def _stop(self) -> None:
        if self.ranks is None:
            return
        self.ranks, ranks = None, self.ranks
        if (self.failure or self.group.failure or ranks.lost()) and hasattr(ranks, "abandon"):
            ranks.abandon(self.group)  # a broken group takes no last order: it may never arrive
        else:
            ranks.stop(self.group)

    def _check_grammar(self, req: Request, outputs: tuple[int, ...]) -> None:
        """The request's grammar compiled and its tokens fitted to it here, before placing: a
        replica > 0 would raise the same ConfigError, but as a failed op of a step, after the
        front had counted the request as its."""
        if req.params.grammar is not None:
            self.engine.grammar_masks().matcher(req.params.grammar, outputs)


def _no_handoff() -> ConfigError:
    return ConfigError("a prefill handoff (prefill_only, pulled KV) is not supported with data_parallel_size > 1 yet")


# -- every replica --------------------------------------------------------------------------------

def serve(engine: Engine, group: DPGroup) -> int:
    """A replica > 0: apply the front's orders and step, answer its calls, until it sends None or
    the group breaks; how many steps ran."""
    steps = 0
    while (order := group.broadcast(None)) is not None:
        if isinstance(order, RankCall):
            group.gather(answer(engine, order, group))
            continue
        group.gather_step(run_order(engine, order.ops[group.rank], order.run, group.rank))
        steps += order.run
    return steps


def run_order(engine: Engine, ops: tuple[Add | Abort, ...] | list, run: bool, rank: int) -> StepAnswer:
    """This replica's part of a step order: its ops, then its step (with every other replica)."""
    failure = None
    for op in ops:
        try:
            op.apply(engine)
        except Exception as e:  # answered, not raised: the step must still run here
            failure = failure or RankFailure(rank, e)
    return StepAnswer(tuple(step_replica(engine)) if run else (), failure)


def step_replica(engine: Engine) -> list[TokenChunk]:
    """One step of this replica; with no forward pass of its own (nothing scheduled), its part
    of every MoE layer's exchange all the same."""
    before = engine._steps
    chunks = engine.step()
    if engine._steps == before:
        idle_pass(engine._moe_layers, engine.model_config.hidden_size, engine.dtype, engine.device)
    return chunks


def _summed(per_replica: list[list[list[int]]]) -> list[list[int]]:
    """Per layer, elementwise sums over the replicas."""
    return [[sum(xs) for xs in zip(*layer)] for layer in zip(*per_replica)]


def _sum_field(name: str, values: list) -> Any:
    if isinstance(values[0], bool) or values[0] is None:
        return values[0]
    if isinstance(values[0], (int, float)):
        return max(values) if name == "grammar_compile_s" else sum(values)
    if isinstance(values[0], tuple) and all(isinstance(v, int) for v in values[0]):
        return tuple(map(sum, zip(*values)))
    return values[0]


# -- what on_all_replicas runs (module-level: pickled by name) --------------------------------

def _stats(engine: Engine) -> WorkerStats:
    return engine.stats()


def _block_counts(engine: Engine) -> dict[str, int]:
    return engine.block_counts()


def _check_invariants(engine: Engine) -> None:
    engine.check_invariants()


def _forget_warmup(engine: Engine) -> None:
    engine.forget_warmup()


def _window_counts(engine: Engine) -> list[list[int]]:
    return engine.expert_balancer.window_counts()


def _rank_loads(engine: Engine) -> list[list[int]]:
    return engine.expert_balancer.rank_loads()


def _apply_placements(engine: Engine, placements, before: float) -> None:
    engine.expert_balancer.apply(placements, engine.dp)
    engine.expert_balancer.applied(before)


_READS = frozenset({_stats, _block_counts, _check_invariants, _window_counts, _rank_loads})  # change nothing
