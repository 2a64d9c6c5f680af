"""Continuous batching with chunked prefill under a per-step token budget.

Each step, in priority-then-arrival order:
  1. every running sequence gets its next tokens (one for a decode, a chunk for an unfinished
     prefill) while the budget lasts; when blocks run out, the lowest-priority, newest running
     sequence is preempted (blocks dropped, to be recomputed later — its tokens are kept);
  2. then waiting sequences are admitted, reusing prefix-cached blocks, with at most the budget
     left as their first chunk. A waiting sequence that does not fit may preempt running ones of
     strictly lower priority; otherwise admission stops (FCFS, no overtaking).
Decodes and prefill chunks share one forward pass. The scheduler decides; the BlockPool only
counts.

Groups (a pipeline-parallel engine with steps in flight, engine/core.py): the running sequences
are split into `groups`, and a step schedules one group — its running sequences, its victims
for preemption, and admissions into it — so that another group's step may be in the pipeline
meanwhile: a sequence's next step is scheduled only once its last one is done. A waiting
sequence joins the group being scheduled unless that group already runs its share of all the
sequences, running and waiting (the groups stay even, so every step carries a share of the batch).

Speculative decoding (`speculative` on): a decoding sequence may carry proposed tokens
(`seq.spec_tokens`, set by the engine before the step); it is scheduled for its last token plus
those proposals, cut to what the budget and the free blocks allow — proposals never preempt
anyone, and a preempted sequence drops its proposals.
"""

from __future__ import annotations

import bisect
import time
from typing import TYPE_CHECKING, NamedTuple

from splitserve.engine.kv_cache import BlockPool
from splitserve.engine.sequence import Sequence, SeqStatus

if TYPE_CHECKING:
    from splitserve.engine.kv_cache import HostTier


class Scheduled(NamedTuple):  # a tuple: built for every row of every step (the simulator's hot path)
    seq: Sequence
    num_new_tokens: int


class SchedulerOutput(NamedTuple):  # one per step
    scheduled: tuple[Scheduled, ...]  # decodes (one new token) first, then prefill chunks
    preempted: tuple[Sequence, ...]
    # some row verifies proposals: its num_new_tokens is 1 + len(seq.spec_tokens)
    speculative: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int,
                 host: HostTier | None = None, groups: int = 1) -> None:
        self.pool = pool
        self.groups = groups
        self.host = host
        self.block_size = pool.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Sequence] = []  # sorted by sort_key
        self.running: list[Sequence] = []  # sorted by sort_key
        self.num_preemptions = 0
        self._group = 0  # the group being scheduled
        self.prefix_query_tokens = 0  # prompt tokens looked up in the prefix cache (first admission)
        self.prefix_hit_tokens = 0  # of which found cached
        self.speculative = False  # running sequences may carry proposals (seq.spec_tokens)

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished or aborted) and drop its blocks."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SeqStatus.FINISHED

    def detach(self, seq: Sequence) -> None:
        """Take a running sequence out but leave its blocks allocated: their ownership passes
        to the caller (a prefill worker pinning them for a KV handoff)."""
        self.running.remove(seq)
        seq.status = SeqStatus.FINISHED

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose blocks are allocated and filled already (KV pulled from a peer)."""
        if seq.scheduled_at is None:
            seq.scheduled_at = time.monotonic()
        if self.groups > 1:
            sizes = self._group_sizes()
            seq.group = sizes.index(min(sizes))
        seq.status = SeqStatus.RUNNING
        bisect.insort(self.running, seq, key=lambda s: s.sort_key)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -----------------------------------------------------------------------------
    def _group_sizes(self) -> list[int]:
        sizes = [0] * self.groups
        for s in self.running:
            sizes[s.group] += 1
        return sizes

    def schedule(self, group: int = 0) -> SchedulerOutput:
        """The next step of `group` (of `groups`; the only one by default)."""
        self._group = group
        budget = self.max_num_batched_tokens
        out: list[Scheduled] = []
        preempted: list[Sequence] = []
        admitting = True
        spec = self.speculative
        verifying = False
        # Class by class: a class's running sequences (older) before its waiting ones, and a
        # waiting critical request before a running sheddable one.
        classes = {s.request.priority for s in self.running}
        classes.update(s.request.priority for s in self.waiting)
        for prio in sorted(classes):
            for seq in list(self.running) if len(classes) == 1 else [s for s in self.running if s.request.priority == prio]:
                if seq.status is not SeqStatus.RUNNING or budget == 0 or seq.group != group:
                    continue
                n = seq.num_tokens - seq.num_computed_tokens
                if spec and n == 1 and seq.spec_tokens:
                    n = self._fit_proposals(seq, budget)
                    verifying = verifying or n > 1
                if n > budget:
                    n = budget
                if self._grow_or_preempt(seq, n, out, preempted):
                    out.append(Scheduled(seq, n))
                    budget -= n
                else:
                    admitting = False  # memory is short: admitting more would only thrash
            if admitting:
                budget, admitting = self._admit(prio, budget, out, preempted)
        if len(out) > 1:
            out.sort(key=lambda s: s.num_new_tokens != 1)  # stable: one-token rows form the decode batch
        return SchedulerOutput(tuple(out), tuple(preempted), verifying)

    def _fit_proposals(self, seq: Sequence, budget: int) -> int:
        """Cut a decoding sequence's proposals to the budget and to the blocks free now (a
        proposal never preempts); the tokens it is scheduled for: its last one and those left."""
        bs = self.block_size
        have = len(seq.block_ids)
        room = (have + self.pool.num_available) * bs - seq.num_computed_tokens - 1  # after its own token
        if -(-(seq.num_computed_tokens + 1) // bs) - have > self.pool.num_available:
            room = 0  # its own token preempts someone already: propose nothing on top
        k = max(0, min(len(seq.spec_tokens), budget - 1, room))
        del seq.spec_tokens[k:]
        return 1 + k

    def _grow_or_preempt(self, seq: Sequence, n: int, out: list[Scheduled], preempted: list[Sequence]) -> bool:
        """Give `seq` blocks for n more tokens, preempting newer/lower-priority running
        sequences not yet scheduled this step. False if `seq` itself had to go."""
        need = -(-(seq.num_computed_tokens + n) // self.block_size) - len(seq.block_ids)
        if need > self.pool.num_available:  # rare: the set costs O(batch), once per sequence short of blocks
            scheduled = {id(s.seq) for s in out}
            while need > self.pool.num_available:  # a victim of this group: another's may be in flight
                victim = next((s for s in reversed(self.running) if id(s) not in scheduled and s.group == seq.group),
                              None)
                if victim is None:
                    return False
                self._preempt(victim, preempted)
                if victim is seq:
                    return False
        if need > 0:
            seq.block_ids += self.pool.allocate(need)
        return True

    def _admit(self, prio: int, budget: int, out: list[Scheduled], preempted: list[Sequence]) -> tuple[int, bool]:
        """Admit waiting sequences of class `prio` in order; (budget left, whether admission may
        go on to lower classes — not once a sequence had to be left waiting)."""
        if not self.waiting:
            return budget, True
        # with groups: this group's share of all the sequences, running and waiting
        share = -(-(len(self.running) + len(self.waiting)) // self.groups) if self.groups > 1 else None
        mine = self._group_sizes()[self._group] if self.groups > 1 else 0
        for seq in [s for s in self.waiting if s.request.priority == prio]:
            if budget == 0 or len(self.running) >= self.max_num_seqs:
                return budget, False
            if share is not None and mine >= share:
                return budget, False  # the other groups' steps admit the rest
            mine += 1
            match = self._prefix_hit(seq)
            computed = len(match) * self.block_size
            n = min(seq.num_tokens - computed, budget)
            need = self._blocks_needed_from(len(match), computed + n)
            while need > self.pool.num_available - self.pool.count_available(match):
                victim = self._lower_priority_victim(seq, out)
                if victim is None:
                    return budget, False
                self._preempt(victim, preempted)
            self._start(seq, match, need)
            out.append(Scheduled(seq, n))
            budget -= n
        return budget, True

    def _start(self, seq: Sequence, match: tuple[int, ...], need: int) -> None:
        self.waiting.remove(seq)
        self.pool.touch(match)
        seq.block_ids = list(match) + self.pool.allocate(need)
        computed = len(match) * self.block_size
        seq.num_computed_tokens = computed
        seq.num_cached_blocks = len(match)
        if seq.num_cached_tokens < 0:
            seq.num_cached_tokens = computed
            self.prefix_query_tokens += seq.num_tokens
            self.prefix_hit_tokens += computed
        if seq.scheduled_at is None:
            seq.scheduled_at = time.monotonic()
        seq.group = self._group
        seq.status = SeqStatus.RUNNING
        bisect.insort(self.running, seq, key=lambda s: s.sort_key)

    def _prefix_hit(self, seq: Sequence) -> tuple[int, ...]:
        # Leave at least the last token to compute (its logits are needed), and never write
        # into a shared block: only blocks entirely before the last token are reused.
        seq.update_hashes(self.block_size)
        usable = (seq.num_tokens - 1) // self.block_size
        match = self.pool.match_prefix(seq.block_hashes[:usable]).block_ids
        if self.host is not None and len(match) < usable:  # the prefix may go on in host memory
            match += self.host.promote(self.pool, match, seq.block_hashes[len(match):usable])
        return match

    def _lower_priority_victim(self, seq: Sequence, out: list[Scheduled]) -> Sequence | None:
        scheduled = {id(s.seq) for s in out}
        for victim in reversed(self.running):
            if (victim.request.priority > seq.request.priority and id(victim) not in scheduled
                    and victim.group == self._group):
                return victim
        return None

    def _preempt(self, seq: Sequence, preempted: list[Sequence]) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)
        preempted.append(seq)

    def _release(self, seq: Sequence) -> None:
        self.pool.free(seq.block_ids)
        seq.spec_tokens.clear()
        seq.block_ids = []
        seq.num_computed_tokens = 0
        seq.num_cached_blocks = 0

    def _blocks_needed_from(self, have: int, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - have)
