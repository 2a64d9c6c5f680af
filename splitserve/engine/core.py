"""EngineCore: everything an engine step does except run the model — requests and their
sequences, the scheduler and block pool, the disaggregation hand-over (detach / pull), token
stop rules, stats and invariants. No torch: the `Engine` adds the model runner and sampler,
the simulator (`splitserve.sim`) adds a cost model, and both run this same bookkeeping.

A step is `scheduler.schedule()` → the subclass's forward + sample (`_forward`) → `_complete`
(advance every scheduled sequence, append the sampled tokens, apply EOS / stop ids /
max_tokens / context length, hand finished blocks back: full ones stay in the prefix cache).

Steps in flight (`in_flight` > 1: a pipeline-parallel engine): the running sequences are split
into that many scheduler groups, and a call to `step()` first starts (`_launch`) a step for
every group that has none in flight and something to run, then finishes the oldest step in
flight (`_land`: its tokens sampled) and completes it. So while one group's step is in the later
stages, stage 0 schedules and starts another's; a sequence's next step is scheduled only once
its token is back. A request aborted while its step is in flight has its blocks freed at once
and the step's rows of it are dropped when it lands (the stages run the steps in the order
started, so its stale KV writes land before any later step's use of the freed blocks).

A speculative step (`sched.speculative`: some row verified proposals, engine/speculative/)
completes through `_complete_verified`: each row's run of accepted tokens is appended one by
one under the same stop rules, as consecutive non-speculative steps would (so EOS, stop ids and
max_tokens cut it exactly there); KV counts as computed only for the accepted proposals, so a
block enters the prefix cache only once every token in it is accepted, and the blocks that
held only rejected positions go back to the pool.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from typing import Callable, Iterable, NamedTuple

from splitserve.engine.kv_cache.block_pool import BlockPool, BlockStored, KVEvent
from splitserve.engine.scheduler import Scheduler, SchedulerOutput
from splitserve.engine.sequence import Sequence, SeqStatus
from splitserve.engine.step_shape import StepShape, shape_of
from splitserve.hashing import block_hashes
from splitserve.types import (ConfigError, ExpertBalance, FinishReason, KVProgress, PhaseTimes, Request, Tier,
                              TokenChunk, WorkerStats)

Sampled = tuple[Sequence, int, object]  # (sequence, next token, its logprob or None)
# a speculative step's row: (sequence, the tokens it emits — its accepted proposals, then one of
# the model's own — and their logprobs or None)
Verified = tuple[Sequence, tuple[int, ...], object]


class InFlight(NamedTuple):
    """A started step not yet landed."""

    group: int
    sched: SchedulerOutput
    shape: StepShape
    handle: object  # the subclass's (`_launch`)
    started: float


@dataclasses.dataclass(frozen=True)
class Reservation:
    """Blocks set aside for a context a peer is still computing (a streamed handoff): the
    first `held` are this engine's own prefix-cache blocks for it — shared, never written, so
    their KV is not moved — the rest are fresh, for the peer's KV."""

    blocks: tuple[int, ...]
    held: int = 0


class EngineCore:
    def __init__(self, *, block_size: int, num_blocks: int, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_ids: Iterable[int] = (), enable_prefix_caching: bool = True,
                 host=None, in_flight: int = 1) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.token_budget = max_num_batched_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        self.host = host  # a HostTier below the pool (the Engine's; it needs torch storage), or None
        if host is not None:
            self.pool.on_evict = host.save
        self.scheduler = Scheduler(self.pool, max_num_seqs, max_num_batched_tokens, host, groups=in_flight)
        self.in_flight = in_flight  # steps started and not yet landed, at most (one per scheduler group)
        self._flights: collections.deque[InFlight] = collections.deque()
        self._next_group = 0
        self._seqs: dict[str, Sequence] = {}
        self._pulling: dict[str, Sequence] = {}  # blocks allocated, KV arriving from a peer
        self._detached: dict[str, list[int]] = {}  # blocks pinned for a KV handoff
        self._reserved: dict[str, Reservation] = {}  # blocks for KV a peer is still computing (streamed)
        # where a streamed prefill's progress goes, on the engine thread, as soon as it is known
        self.kv_progress: Callable[[KVProgress], None] | None = None
        self._order = itertools.count()
        self._steps = 0
        self._prefill_tokens = 0  # prompt tokens computed, ever (the autoscaler's served rate)
        self._spec_proposed = self._spec_accepted = self._spec_steps = 0  # speculative decoding
        self._spec_step_s = self._spec_plain_s = 0.0  # verifying steps: measured, and the fit's without proposals

    # -- what a subclass provides ----------------------------------------------------------------
    def _forward(self, sched: SchedulerOutput) -> list[Sampled]:
        """Run the scheduled tokens through the model; the sequences whose next token is due,
        each with that token."""
        raise NotImplementedError

    def _new_seq(self, req: Request, outputs: tuple[int, ...] = ()) -> Sequence:
        """A sequence for `req` (checked, with its sampling state) continuing after `outputs`."""
        raise NotImplementedError

    def _launch(self, sched: SchedulerOutput) -> object:
        """Start the scheduled step without waiting for its tokens (in_flight > 1); what `_land`
        takes. By default the whole forward, at once."""
        return self._forward(sched)

    def _land(self, handle: object) -> list[Sampled]:
        """A launched step's sampled tokens, once its forward is done."""
        return handle

    def _observe(self, shape: StepShape, seconds: float) -> None:
        """A step of this shape ran in `seconds`, scheduling included (the Engine's step-time
        fit learns from it)."""

    @property
    def step_time_coeffs(self) -> tuple[float, ...]:
        return ()

    def expert_tokens(self) -> tuple[int, ...]:
        """A mixture-of-experts model: tokens routed to each expert so far (summed over layers)."""
        return ()

    def expert_balance(self) -> ExpertBalance | None:
        """A mixture-of-experts model's expert placement and rank load (engine/expert_balance.py)."""
        return None

    def grammar_compile_s(self) -> float:
        """A structured-output grammar's compile time here (0: none compiled yet)."""
        return 0.0

    def _before_pull(self) -> None:
        """Blocks were just allocated for a transport to write into."""

    def _verified(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """A speculative step verified `proposed` tokens of `seq`, of which it accepted `accepted`."""

    def _predict(self, shape: StepShape) -> float | None:
        """The step-time fit's time for a step of this shape (None: no fit yet)."""
        return None

    def _verify_cost(self, plain: StepShape, seconds: float) -> None:
        """A step that verified proposals took `seconds`; `plain` is its shape without them. Its
        time and the fit's time for `plain` add up (once there is a fit) to the two totals whose
        difference is what verification cost: the extra query rows in the forward pass, the
        proposals and the acceptance (the fit learns from these steps too, as prefill chunks of
        k + 1 tokens; a plain decode's terms from the steps without proposals)."""
        estimate = self._predict(plain)
        if estimate is not None:
            self._spec_step_s += seconds
            self._spec_plain_s += estimate

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, req: Request, *, prefill_only: bool = False, outputs: tuple[int, ...] = (),
                    stream_kv: bool = False) -> None:
        """Queue a request; bad input raises ConfigError here, before anything is allocated.
        `prefill_only`: stop after the first token and hand the prompt's KV blocks over (the
        chunk carries `kv_blocks`; `release_detached` frees them later). `stream_kv` (with
        it): report the context's full blocks to `kv_progress` as they are computed — cached
        ones once scheduled, before any compute — except those the last step completes, which
        the final chunk hands over. `outputs`: tokens already generated elsewhere (a handoff
        that fell back to local compute, a migration): they are recomputed as context and
        generation continues after them."""
        seq = self._checked_new_seq(req, tuple(outputs))
        seq.prefill_only = prefill_only
        seq.stream_kv = prefill_only and stream_kv
        self._seqs[req.request_id] = seq
        self.scheduler.add(seq)

    def check_lengths(self, req: Request) -> int:
        """A request's length against the context and the pool; the effective max_tokens."""
        prompt_len = len(req.prompt_token_ids)
        if prompt_len >= self.max_model_len:
            raise ConfigError(f"prompt has {prompt_len} tokens; the context length is {self.max_model_len} "
                              "and at least one token must be generated")
        room = self.max_model_len - prompt_len
        max_tokens = room if req.params.max_tokens is None else min(req.params.max_tokens, room)
        self._check_fits(prompt_len + max_tokens)
        return max_tokens

    def _check_new_id(self, rid: str) -> None:
        if rid in self._seqs or rid in self._pulling or rid in self._detached or rid in self._reserved:
            raise ConfigError(f"request id {rid!r} is already running")

    def _checked_new_seq(self, req: Request, outputs: tuple[int, ...]) -> Sequence:
        self._check_new_id(req.request_id)
        seq = self._new_seq(req, outputs)
        seq.update_hashes(self.block_size)
        return seq

    def _check_fits(self, max_len: int) -> None:
        blocks = -(-max_len // self.block_size)
        if blocks > self.pool.num_blocks:
            raise ConfigError(f"a request of up to {max_len} tokens needs {blocks} KV blocks; the pool has "
                              f"{self.pool.num_blocks}: lower max_tokens or give the engine more KV memory")

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is; its blocks return at once and no chunk of it follows.
        Unknown ids are ignored (the request may have finished in the meantime)."""
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.scheduler.remove(seq)
        pulling = self._pulling.pop(request_id, None)
        if pulling is not None:  # the caller has stopped its transfer into these blocks
            self.pool.free(pulling.block_ids)
        reserved = self._reserved.pop(request_id, None)
        if reserved is not None:  # likewise
            self.pool.free(reserved.blocks)
        self.release_detached(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    def holds_nothing(self) -> bool:
        """No request runs, waits, lands KV or keeps blocks pinned for a peer."""
        return not (self._seqs or self._pulling or self._detached or self._reserved)

    # -- disaggregation: the prefill side hands blocks over, the decode side takes KV in -------
    def release_detached(self, request_id: str) -> bool:
        """Free the blocks pinned for a handoff (acknowledged or lease expired)."""
        blocks = self._detached.pop(request_id, None)
        if blocks is None:
            return False
        self.pool.free(blocks)
        return True

    def detached_requests(self) -> list[str]:
        return list(self._detached)

    def reserve_pulled(self, req: Request, outputs: tuple[int, ...] = ()) -> Reservation:
        """Set blocks aside for a context whose KV a peer is still computing (a streamed
        handoff): the prompt, and `outputs` when the request migrated. Its full blocks this
        engine holds already (prefix cache) are shared, not refilled. The caller fills the rest
        as the peer publishes, then `add_pulled` takes them over once the peer's token is known
        (`abort` frees them). Raises OutOfBlocks if none free."""
        self._check_new_id(req.request_id)
        self.check_lengths(req)
        tokens = [*req.prompt_token_ids, *outputs]
        held = self.pool.match_prefix(block_hashes(tokens, self.block_size, req.cache_salt)).block_ids
        self.pool.touch(held)
        try:
            fresh = self.pool.allocate(-(-len(tokens) // self.block_size) - len(held))
        except BaseException:
            self.pool.free(held)
            raise
        r = self._reserved[req.request_id] = Reservation((*held, *fresh), len(held))
        self._before_pull()
        return r

    def unshare_reserved(self, request_id: str) -> Reservation:
        """Fresh blocks in place of a reservation's held ones: the peer sends their KV after all
        (it streamed less than they cover). Raises OutOfBlocks (the reservation is unchanged)."""
        r = self._reserved[request_id]
        fresh = self.pool.allocate(r.held)
        self.pool.free(r.blocks[:r.held])
        r = self._reserved[request_id] = Reservation((*fresh, *r.blocks[r.held:]), 0)
        self._before_pull()
        return r

    def add_pulled(self, req: Request, first_token: int, outputs: tuple[int, ...] = ()) -> list[int]:
        """Allocate blocks for a context whose KV a peer computed — the prompt, and `outputs`
        when the request migrated — and which the peer continued with `first_token` (the
        blocks `reserve_pulled` set aside for it, if it did); the caller fills them and then
        calls kv_ready (or kv_failed to recompute locally). Raises OutOfBlocks if none free."""
        reserved = self._reserved.pop(req.request_id, None)
        try:
            seq = self._checked_new_seq(req, (*outputs, first_token))
        except BaseException:
            if reserved is not None:
                self.pool.free(reserved.blocks)
            raise
        if reserved is not None:
            seq.block_ids = list(reserved.blocks)
            seq.num_cached_blocks = reserved.held  # in the prefix cache already
            self._pulling[req.request_id] = seq
            return list(seq.block_ids)
        seq.block_ids = self.pool.allocate(-(-(seq.num_tokens - 1) // self.block_size))
        self._pulling[req.request_id] = seq
        self._before_pull()
        return list(seq.block_ids)

    def is_pulling(self, request_id: str) -> bool:
        return request_id in self._pulling

    def kv_ready(self, request_id: str) -> None:
        """The pulled KV is in place and verified: the request joins the decode batch."""
        seq = self._pulling.pop(request_id)
        seq.num_computed_tokens = seq.num_tokens - 1  # all but the peer's token, computed next
        seq.num_cached_tokens = 0
        self._advance(seq, 0)  # full prompt blocks become reusable prefix-cache entries
        self._seqs[request_id] = seq
        self.scheduler.add_running(seq)

    def kv_failed(self, request_id: str) -> None:
        """The pull failed: drop the blocks and compute the prompt here instead (the first token
        is kept, so the output continues exactly where the peer left it)."""
        seq = self._pulling.pop(request_id)
        self.pool.free(seq.block_ids)
        seq.block_ids = []
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    # -- one iteration -------------------------------------------------------------------------
    def step(self) -> list[TokenChunk]:
        if self.in_flight > 1:
            return self._step_in_flight()
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        if self.kv_progress is not None:  # before the forward: cached blocks move while it runs
            self._report_progress(sched)
        if not sched.scheduled:
            return []
        shape = shape_of(sched)  # before the step advances what it counts
        plain = shape_of(sched, proposals=False) if sched.speculative else None
        chunks = self._complete(sched, self._forward(sched))
        seconds = time.perf_counter() - t0
        if plain is not None:
            self._verify_cost(plain, seconds)
        self._observe(shape, seconds)
        return chunks

    def _step_in_flight(self) -> list[TokenChunk]:
        """Start a step for every idle group with work (from the one after the last started),
        then land the oldest step in flight; its tokens."""
        try:
            busy = {f.group for f in self._flights}
            for g in [(self._next_group + i) % self.in_flight for i in range(self.in_flight)]:
                if g in busy:
                    continue
                t0 = time.perf_counter()
                sched = self.scheduler.schedule(g)
                if self.kv_progress is not None:
                    self._report_progress(sched)
                if not sched.scheduled:
                    continue
                self._flights.append(InFlight(g, sched, shape_of(sched), self._launch(sched), t0))
                self._next_group = (g + 1) % self.in_flight
            if not self._flights:
                return []
            f = self._flights[0]
            sampled = self._land(f.handle)
            self._flights.popleft()
        except BaseException:
            self._flights.clear()  # the pipeline is broken: no step in flight will land; the caller aborts
            raise
        live = tuple(s for s in f.sched.scheduled if self._seqs.get(s.seq.request_id) is s.seq)
        if len(live) < len(f.sched.scheduled):  # aborted while in flight: nothing of them is kept
            sampled = [x for x in sampled if self._seqs.get(x[0].request_id) is x[0]]
            f = f._replace(sched=SchedulerOutput(live, f.sched.preempted))
        chunks = self._complete(f.sched, sampled)
        self._observe(f.shape, time.perf_counter() - f.started)
        return chunks

    def steps_in_flight(self) -> int:
        return len(self._flights)

    def _report_progress(self, sched: SchedulerOutput) -> None:
        """Streamed prefills: a preempted one's blocks are void (a new epoch); a scheduled one's
        full blocks computed so far (its cached prefix, at first) are reported."""
        for seq in sched.preempted:
            if seq.stream_kv:
                seq.published = 0
                self.kv_progress(KVProgress(seq.request_id, (), seq.num_preemptions))
        for seq, _ in sched.scheduled:
            if seq.stream_kv:
                self._publish(seq)

    def _publish(self, seq: Sequence) -> None:
        full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        if full > seq.published:
            seq.published = full
            self.kv_progress(KVProgress(seq.request_id, tuple(seq.block_ids[:full]), seq.num_preemptions))

    def _layer_progress(self, sched: SchedulerOutput, num_layers: int, groups: int) -> Callable[[int], None] | None:
        """What reports a streamed prefill's blocks layer group by layer group during this
        step's forward (`after_layer`: called with each layer once it has run), or None when
        no streamed prefill runs in it. The blocks reported are those the step completes (its
        last: up to the context's end, the partial block too — nothing writes it after)."""
        if self.kv_progress is None:
            return None
        runs = []
        for seq, n in sched.scheduled:
            if not seq.stream_kv or n <= 1:
                continue
            upto = seq.num_computed_tokens + n
            before = seq.num_computed_tokens // self.block_size
            end = upto // self.block_size if upto < seq.num_tokens else -(-upto // self.block_size)
            if end > before:
                runs.append(KVProgress(seq.request_id, tuple(seq.block_ids[:before]), seq.num_preemptions,
                                       tuple(seq.block_ids[before:end])))
        if not runs:
            return None
        every = -(-num_layers // groups)

        def after_layer(i: int) -> None:
            if (i + 1) % every == 0 or i + 1 == num_layers:
                for p in runs:
                    self.kv_progress(dataclasses.replace(p, layers=i + 1))

        return after_layer

    def _complete(self, sched: SchedulerOutput, sampled: list[Sampled]) -> list[TokenChunk]:
        """The step's forward pass is done: advance what it computed, append what it sampled."""
        if sched.speculative:
            return self._complete_verified(sched, sampled)
        for seq, n in sched.scheduled:
            self._advance(seq, n)
            # a streamed prefill not done yet reports what this step completed (the last step's
            # blocks go with the final chunk: publishing them first would only delay it)
            if seq.stream_kv and self.kv_progress is not None and seq.num_computed_tokens < seq.num_tokens:
                self._publish(seq)
            if n != 1:
                self._prefill_tokens += n
        chunks = [self._append(seq, tok, lp) for seq, tok, lp in sampled]
        self._steps += 1
        return chunks

    def _complete_verified(self, sched: SchedulerOutput, verified: list[Verified]) -> list[TokenChunk]:
        """`_complete` for a step that verified proposals: a row's own tokens are computed; each
        accepted proposal is computed once the token before it is appended (its hash known)."""
        for seq, n in sched.scheduled:
            own = n - len(seq.spec_tokens)  # 1 for a row that verifies, its chunk otherwise
            self._advance(seq, own)
            if seq.stream_kv and self.kv_progress is not None and seq.num_computed_tokens < seq.num_tokens:
                self._publish(seq)
            if own != 1:
                self._prefill_tokens += own
        chunks = []
        for seq, tokens, lps in verified:
            proposed, accepted = len(seq.spec_tokens), len(tokens) - 1
            if proposed:
                self._spec_proposed += proposed
                self._spec_accepted += accepted
                self._spec_steps += 1  # one sequence's verification (tokens per step are per sequence)
                self._verified(seq, proposed, accepted)
            seq.spec_tokens = []
            chunk = None
            for i, tok in enumerate(tokens):
                if i:
                    self._advance(seq, 1)  # the proposal just appended was computed by this step
                c = self._append(seq, tok, lps[i] if lps is not None else None)
                chunk = c if chunk is None else _joined(chunk, c)
                if c.finish_reason is not None or seq.prefill_only:
                    break
            if seq.status is SeqStatus.RUNNING:
                self._drop_rejected(seq)
            chunks.append(chunk)
        for seq, _ in sched.scheduled:  # rows that sampled nothing (a prefill chunk) carry none
            seq.spec_tokens = []
        self._steps += 1
        return chunks

    def _drop_rejected(self, seq: Sequence) -> None:
        """Free the blocks past the computed KV: they held only rejected positions."""
        keep = -(-seq.num_computed_tokens // self.block_size)
        if len(seq.block_ids) > keep:
            self.pool.free(seq.block_ids[keep:])
            del seq.block_ids[keep:]

    def _advance(self, seq: Sequence, n: int) -> None:
        seq.num_computed_tokens += n
        full = seq.num_computed_tokens // self.block_size
        if full > seq.num_cached_blocks:
            self.pool.cache_blocks(seq.block_ids[seq.num_cached_blocks:full], seq.block_hashes[seq.num_cached_blocks:full])
            seq.num_cached_blocks = full

    def _append(self, seq: Sequence, tok: int, lp) -> TokenChunk:
        first = not seq.output_token_ids
        seq.append_token(tok, self.block_size)
        reason, stop_id = self._finish_reason(seq, tok)
        chunk = TokenChunk(seq.request_id, (tok,), (lp,) if lp is not None else None, reason, stop_id,
                           num_prompt_tokens=seq.num_prompt_tokens,
                           num_cached_tokens=max(seq.num_cached_tokens, 0) if first or reason else 0,
                           phases=_phases(seq) if first else None)
        if reason is not None:
            self._seqs.pop(seq.request_id, None)
            self.scheduler.remove(seq)
        elif seq.prefill_only:
            self._seqs.pop(seq.request_id, None)
            self.scheduler.detach(seq)
            self._detached[seq.request_id] = list(seq.block_ids)
            chunk = dataclasses.replace(chunk, kv_blocks=tuple(seq.block_ids))
        return chunk

    def _finish_reason(self, seq: Sequence, tok: int) -> tuple[FinishReason | None, int | None]:
        p = seq.request.params
        n_out = len(seq.output_token_ids)
        if n_out >= p.min_tokens:
            if not p.ignore_eos and tok in self.eos_token_ids:
                return FinishReason.STOP, tok
            if tok in p.stop_token_ids:
                return FinishReason.STOP, tok
        if n_out >= seq.max_tokens:
            return FinishReason.LENGTH, None
        return None, None

    # -- introspection -------------------------------------------------------------------------
    def stats(self) -> WorkerStats:
        return WorkerStats(
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            num_preempted_total=self.scheduler.num_preemptions,
            kv_blocks_total=self.pool.num_blocks,
            kv_blocks_free=self.pool.num_free,
            kv_blocks_cached=self.pool.num_cached,
            prefix_query_tokens_total=self.scheduler.prefix_query_tokens,
            prefix_hit_tokens_total=self.scheduler.prefix_hit_tokens,
            host_hit_tokens_total=0 if self.host is None else self.host.promoted_total * self.block_size,
            kv_host_blocks_cached=0 if self.host is None else len(self.host),
            steps_total=self._steps,
            prefill_tokens_total=self._prefill_tokens,
            step_time_coeffs=self.step_time_coeffs,
            pending_prefill_tokens=sum(max(0, s.num_tokens - s.num_computed_tokens - 1) for s in self._seqs.values()),
            decode_context_tokens=sum(s.num_computed_tokens for s in self.scheduler.running),
            token_budget=self.token_budget,
            expert_tokens_total=self.expert_tokens(),
            expert_balance=self.expert_balance(),
            grammar_compile_s=self.grammar_compile_s(),
            spec_proposed_tokens_total=self._spec_proposed,
            spec_accepted_tokens_total=self._spec_accepted,
            spec_verify_steps_total=self._spec_steps,
            spec_verify_step_seconds_total=self._spec_step_s,
            spec_verify_step_plain_seconds_total=self._spec_plain_s,
        )

    def block_counts(self) -> dict[str, int]:
        """Check the invariants, then report the pool's counts (for workers' health checks)."""
        self.check_invariants()
        p = self.pool
        return {"in_use": p.num_in_use, "free": p.num_free, "cached": p.num_cached, "total": p.num_blocks}

    def drain_kv_events(self) -> list[KVEvent]:
        return self.pool.drain_events() + (self.host.drain_events() if self.host is not None else [])

    def kv_listing(self) -> list[KVEvent]:
        """The whole prefix cache as events: what a router rebuilds this worker's index from."""
        listing = [BlockStored(self.pool.cached_hashes())]
        return listing + ([BlockStored(self.host.held_hashes(), Tier.HOST)] if self.host is not None else [])

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        if self.host is not None:
            self.host.check_invariants()
        held = sum(len(s.block_ids) for s in (*self._seqs.values(), *self._pulling.values()))
        held += sum(len(b) for b in self._detached.values()) + sum(len(r.blocks) for r in self._reserved.values())
        if self.holds_nothing() and self.pool.num_in_use:
            raise AssertionError(f"no requests, yet {self.pool.num_in_use} blocks are in use")
        if held < self.pool.num_in_use:
            raise AssertionError(f"{self.pool.num_in_use} blocks in use but requests hold only {held}")
        for s in self._seqs.values():
            if s.status is SeqStatus.WAITING and s.block_ids:
                raise AssertionError(f"waiting request {s.request_id} holds blocks")


def _joined(a: TokenChunk, b: TokenChunk) -> TokenChunk:
    """One chunk for a request's tokens of one step: `b`'s tokens after `a`'s; its end is `b`'s."""
    return dataclasses.replace(a, token_ids=a.token_ids + b.token_ids,
                               logprobs=None if a.logprobs is None else a.logprobs + b.logprobs,
                               finish_reason=b.finish_reason, stop_token_id=b.stop_token_id,
                               num_cached_tokens=max(a.num_cached_tokens, b.num_cached_tokens), kv_blocks=b.kv_blocks)


def _phases(seq: Sequence) -> PhaseTimes:
    now = time.monotonic()
    sched = seq.scheduled_at if seq.scheduled_at is not None else now
    return PhaseTimes(queue_s=sched - seq.added_at, prefill_s=now - sched)
