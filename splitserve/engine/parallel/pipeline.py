"""Pipeline parallelism: one engine's layers cut into S stages (parallel/stages.py), each a
process (parallel/pipe_group.py) holding its layers' weights and their KV cache — or a
tensor-parallel group of T processes, each holding its shard of them (PP x TP).

A step's life: stage 0 — the engine: scheduler, block pool, sampler, as without pipelining —
schedules, flattens the step and cuts it into m micro-batches (parallel/micro_batches.py); the
step (`PipeStep`: its number and micro-batches) is posted to every stage (pipe_group.py: a
point-to-point post, which returns at once); then every stage runs the micro-batches in order
(`_forward_stage`): stage 0 embeds micro-batch k and runs its layers, sends the activations to
stage 1 (the hidden states, and on the fused residual path the residual and the last layer's
output unadded) and goes on to micro-batch k+1 while stage 1 runs k; the last stage applies
the final norm and LM head to the rows due a token and sends their logits back to stage 0,
which samples as always. Every activation's receive is posted as a stage takes the step, every
send is asynchronous: no stage waits for a peer to be ready to receive. Stage s runs
micro-batch k's layers before k+1's, so a prefill chunk cut over two micro-batches finds its
first part's KV in each stage's cache (exact, as chunked prefill is).

Steps in flight: stage 0's part of a step is `launch` (post, its layers, sends, the logits'
receives posted) and `land` (wait for the logits); the engine (engine/core.py) keeps up to
`pipeline_steps_in_flight` steps launched and not landed (S keeps every stage busy), each of its
own group of the running sequences, so stage 0 computes group g+1's step while group g's is in
the later stages, and schedules group g's next step once its tokens are back. Every stage
takes the posts in order and runs each step whole before the next, so a step's KV writes (even
a step of a request aborted while in flight, whose blocks went back at once) are in every
stage's cache before any later step reads there: exact whatever is in flight. Each step's
transfers carry tags of their own (its number % STEP_TAGS), so two steps' activations or
logits between the same two processes are never taken for each other.

With one step at a time and m micro-batches, each stage is busy for about m/(m+S-1) of the
step's forward (the pipeline fills and drains once per step), and stage 0's scheduling and
sampling between steps idle the others; with S or more steps in flight the pipeline stays
full across steps (benchmarks/pipeline_bubble.py).

Each stage keeps a `StageClock` (time computing, steps, micro-batches; optionally each
micro-batch's interval; on stage 0 the time some step was in flight and the most at once), read by `on_all_stages(engine, stage_times)` — as is anything else a
stage holds: `on_all_stages` runs a module-level function on every stage's engine (its `stage`:
which layers it holds; its `kv`: their cache under the shared block ids), which is how a KV
handoff will address a stage's layers."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from splitserve.engine.model_runner import FlatStep, ModelRunner, StepResult
from splitserve.engine.parallel.micro_batches import split
from splitserve.engine.parallel.rank_calls import RankCall, answer, call_group
from splitserve.engine.parallel.stages import Stage
from splitserve.engine.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from splitserve.engine.engine import Engine
    from splitserve.engine.parallel.pipe_group import PipeGroup

LOGITS_TAG = 1 << 20  # + micro-batch: the logits' tags (activations: micro-batch * tensors + i)
STEP_TAGS = 16  # steps in flight tell their transfers apart by step number % STEP_TAGS (a tag block each)
STEP_TAG = 1 << 21


@dataclass(frozen=True)
class PipeStep:
    """What stage 0 posts to every stage for one step: its number and its micro-batches."""

    number: int
    micro: tuple[FlatStep, ...]

    @property
    def tags(self) -> int:
        return (self.number % STEP_TAGS) * STEP_TAG


@dataclass(frozen=True)
class StageTimes:
    stage: int
    layers: range
    busy_s: float  # computing its layers (the embedding on the first; norm + LM head on the last)
    window_s: float  # stage 0: the time some step was in the pipeline (0 elsewhere)
    steps: int
    micro_batches: int
    intervals: tuple[tuple[float, float, int, int], ...]  # (start, end, step, micro-batch) while recording


@dataclass
class StageClock:
    busy_s: float = 0.0
    window_s: float = 0.0
    steps: int = 0
    micro_batches: int = 0
    record: bool = False  # keep each micro-batch's interval (time.perf_counter: one clock per host)
    intervals: list[tuple[float, float, int, int]] = field(default_factory=list)
    open_since: float | None = None  # stage 0: since when some step is in the pipeline (None: since `made`)
    made: float = field(default_factory=time.perf_counter)  # a clock made anew while steps are in flight
    most_in_flight: int = 0  # stage 0: the most steps started and not landed at once


@dataclass
class Flight:
    """A step stage 0 has started and not yet landed: its sends (kept with their tensors until
    they complete) and the receives of its sampled rows' logits."""

    step: PipeStep
    sample_seqs: tuple
    sent: list
    logits_box: list


class PipelineRunner(ModelRunner):
    """A stage's model runner: stage 0's `launch` / `land` (a scheduled step started, then its
    logits taken; `run` both), every stage's `run_stage`."""

    def __init__(self, model, kv, backend, block_size: int, device: torch.device, dtype: torch.dtype,
                 pp: "PipeGroup", stage: Stage, micro_batches: int) -> None:
        super().__init__(model, kv, backend, block_size, device)
        self.pp, self.stage, self.dtype = pp, stage, dtype
        self.micro_batches = micro_batches  # stage 0's choice, per step (the others follow its cut)
        self.clock = StageClock()
        self._numbers = itertools.count()
        self._in_flight = 0

    @torch.inference_mode()
    def run(self, sched: SchedulerOutput) -> StepResult:
        return self.land(self.launch(sched))

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> Flight:
        """Post the step to every stage, run stage 0's layers on its micro-batches, send them on
        and post the receives of its logits; returns without waiting for the later stages."""
        if self._in_flight == 0:
            self.clock.open_since = time.perf_counter()
        self._in_flight += 1
        self.clock.most_in_flight = max(self.clock.most_in_flight, self._in_flight)
        step, sample_seqs = self._flatten(sched)
        ps = PipeStep(next(self._numbers), split(step, self.micro_batches, self.block_size))
        self.pp.broadcast(ps)
        sent, logits_box = self._forward_stage(ps)
        return Flight(ps, tuple(sample_seqs), sent, logits_box)

    @torch.inference_mode()
    def land(self, f: Flight) -> StepResult:
        """Wait for a launched step's logits (the sampled rows', fp32, in order)."""
        self.pp.wait(f.sent)
        for _, works in f.logits_box:
            self.pp.wait(works)
        self.clock.steps += 1
        self._in_flight -= 1
        if self._in_flight == 0:
            c = self.clock
            c.window_s += time.perf_counter() - (c.made if c.open_since is None else c.open_since)
            c.open_since = None
        if not f.logits_box:
            return StepResult(None, ())
        return StepResult(torch.cat([buf for buf, _ in f.logits_box]).float(), f.sample_seqs)

    @torch.inference_mode()
    def run_stage(self, ps: PipeStep) -> None:
        """A stage > 0: its part of a step, to the end of its sends."""
        sent, _ = self._forward_stage(ps)
        self.pp.wait(sent)
        self.clock.steps += 1

    def _forward_stage(self, ps: PipeStep) -> tuple[list, list]:
        """This stage's layers on every micro-batch of `ps`, in order: the sends started (and on
        process 0 the logits' receives posted), none waited for."""
        st, pp, model, micro, base = self.stage, self.pp, self.model, ps.micro, ps.tags
        width = 2 if model.fused else 1  # tensors per hand-over: the stream, or its unadded pair
        inbox = [] if st.first else [self._expect(mb, base + k * width, width) for k, mb in enumerate(micro)]
        sent: list = []
        for k, mb in enumerate(micro):
            if not st.first:
                bufs, works = inbox[k]
                pp.wait(works)
            t = time.perf_counter()
            meta, _ = self.prepare(mb)
            if st.first:
                x, delta = model.embed(self._tensor(mb.ids)), None
            else:
                x, delta = bufs[0], (bufs[1] if width == 2 else None)
            x, delta = model.run_layers(x, delta, self._tensor(mb.pos), self.kv_layers, self.backend, meta)
            if not st.last:
                sent += pp.isend([x] if delta is None else [x, delta], pp.next, base + k * width)
            elif mb.sample_rows:  # every TP rank of the last stage computes them (gathered), one sends
                hidden = x if delta is None else x + delta
                logits = model.compute_logits(hidden[self._tensor(mb.sample_rows)], upcast=False)
                if pp.tp_rank == 0:
                    sent += pp.isend([logits], 0, base + LOGITS_TAG + k)
            self._clocked(t, ps.number, k)
        # the logits' receives only now, behind this step's sends: NCCL runs a pair's sends and
        # receives in order on one stream, and at S = 2 stage 1 sends the logits only once the
        # activations have reached it
        logits_box = ([self._expect_logits(mb, base + LOGITS_TAG + k) for k, mb in enumerate(micro)
                       if mb.sample_rows] if pp.rank == 0 else [])  # process 0 samples
        return sent, logits_box

    def _expect(self, mb: FlatStep, tag: int, width: int):
        bufs = [torch.empty(len(mb.ids), self.model.cfg.hidden_size, dtype=self.dtype, device=self.device)
                for _ in range(width)]
        return bufs, self.pp.irecv(bufs, self.pp.prev, tag)

    def _expect_logits(self, mb: FlatStep, tag: int):
        buf = torch.empty(len(mb.sample_rows), self.model.cfg.vocab_size, dtype=self.dtype, device=self.device)
        return buf, self.pp.irecv([buf], self.pp.last_lead, tag)

    def _clocked(self, t: float, number: int, k: int) -> None:
        c = self.clock
        if c.record and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        end = time.perf_counter()
        c.busy_s += end - t
        c.micro_batches += 1
        if c.record:
            c.intervals.append((t, end, number, k))


def follow_stage(engine: "Engine") -> int:
    """A stage > 0: run stage 0's steps and calls until it sends None or the group breaks; how
    many steps ran."""
    steps = 0
    while (step := engine.pp.broadcast(None)) is not None:
        if isinstance(step, RankCall):
            engine.pp.gather(answer(engine, step, engine.pp))
            continue
        engine.runner.run_stage(step)
        steps += 1
    return steps


def on_all_stages(engine: "Engine", fn: Callable[..., Any], *args: Any) -> list:
    """fn(engine, *args) on every stage's engine (stage 0's last), between steps: each stage runs
    it after the steps started before it (so it returns once those have passed every stage) and
    before any started after; the answers in stage order. `fn`: a module-level function (it is
    pickled)."""
    return call_group(engine, engine.pp, RankCall(fn, args))


def agree(pp: "PipeGroup", value: Any, combine: Callable[[list], Any]) -> Any:
    """`combine` of every stage's `value`, on every stage (at start: the KV block count)."""
    values = pp.gather(value)
    return pp.broadcast(combine(values) if pp.rank == 0 else None)


# -- what on_all_stages runs ------------------------------------------------------------------

def stage_times(engine: "Engine", reset: bool = False, record: bool | None = None) -> StageTimes:
    """This stage's clock (then zeroed if `reset`; recording intervals from then on if `record`)."""
    c = engine.runner.clock
    out = StageTimes(engine.stage.index, engine.stage.layers, c.busy_s, c.window_s, c.steps, c.micro_batches,
                     tuple(c.intervals))
    if reset:
        engine.runner.clock = StageClock(record=c.record if record is None else record)
    return out


def holding(engine: "Engine") -> tuple[range, int, int, bool, bool]:
    """What a stage holds: its layers, their parameter count, its cache's layer count, whether
    it holds the embedding and the LM head."""
    model = engine.runner.model
    params = sum(p.numel() for p in model.layers.parameters())
    return (engine.stage.layers, params, len(engine.kv.layers), model.embed_tokens is not None,
            model.lm_head is not None)
