"""Pipeline parallelism: one engine's layers cut into S stages (parallel/stages.py), each a
process (parallel/pipe_group.py) holding its layers' weights and their KV cache — or a
tensor-parallel group of T processes, each holding its shard of them (PP x TP).

A step's life: stage 0 — the engine: scheduler, block pool, sampler, as without pipelining —
schedules, flattens the step and cuts it into m micro-batches (parallel/micro_batches.py);
the micro-batches go to every stage in the step broadcast; then every stage runs them in order
(`PipelineRunner.run_stage`): stage 0 embeds micro-batch k and runs its layers, sends the
activations to stage 1 (the hidden states, and on the fused residual path the residual and the
last layer's output unadded) and goes on to micro-batch k+1 while stage 1 runs k; the last
stage applies the final norm and LM head to the rows due a token and sends their logits back to
stage 0, which samples as always. Every activation's receive is posted as the step starts,
every send is asynchronous: no stage waits for a peer to be ready to receive. Stage s runs micro-batch k's
layers before k+1's, so a prefill chunk cut over two micro-batches finds its first part's KV in
each stage's cache (exact, as chunked prefill is).

With m micro-batches in a step, each stage is busy for about m/(m+S-1) of the step's forward
(the pipeline fills and drains once per step); stage 0's scheduling and sampling between steps
idle the others. Interleaving the micro-batches of consecutive steps (a sequence's next step
scheduled only once its token is back) would close that gap: the next thing to build.

Each stage keeps a `StageClock` (time computing, steps, micro-batches; optionally each
micro-batch's interval), read by `on_all_stages(engine, stage_times)` — as is anything else a
stage holds: `on_all_stages` runs a module-level function on every stage's engine (its `stage`:
which layers it holds; its `kv`: their cache under the shared block ids), which is how a KV
handoff will address a stage's layers."""

from __future__ import annotations

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


@dataclass(frozen=True)
class StageTimes:
    stage: int
    layers: range
    busy_s: float  # computing its layers (the embedding on the first; norm + LM head on the last)
    window_s: float  # stage 0: from each step's broadcast to its logits back, summed (0 elsewhere)
    steps: int
    micro_batches: int
    intervals: tuple[tuple[float, float, int], ...]  # (start, end, micro-batch) while recording


@dataclass
class StageClock:
    busy_s: float = 0.0
    window_s: float = 0.0
    steps: int = 0
    micro_batches: int = 0
    record: bool = False  # keep each micro-batch's interval (time.perf_counter: one clock per host)
    intervals: list[tuple[float, float, int]] = field(default_factory=list)


class PipelineRunner(ModelRunner):
    """A stage's model runner: stage 0's `run` (a scheduled step), every stage's `run_stage`."""

    def __init__(self, model, kv, backend, block_size: int, device: torch.device, dtype: torch.dtype,
                 pp: "PipeGroup", stage: Stage, micro_batches: int) -> None:
        super().__init__(model, kv, backend, block_size, device)
        self.pp, self.stage, self.dtype = pp, stage, dtype
        self.micro_batches = micro_batches  # stage 0's choice, per step (the others follow its cut)
        self.clock = StageClock()

    @torch.inference_mode()
    def run(self, sched: SchedulerOutput) -> StepResult:
        t0 = time.perf_counter()
        step, sample_seqs = self._flatten(sched)
        micro = split(step, self.micro_batches, self.block_size)
        self.pp.broadcast(micro)
        logits = self.run_stage(micro)
        self.clock.window_s += time.perf_counter() - t0
        return StepResult(logits, tuple(sample_seqs)) if logits is not None else StepResult(None, ())

    @torch.inference_mode()
    def run_stage(self, micro: tuple[FlatStep, ...]) -> torch.Tensor | None:
        """This stage's part of a step; on stage 0 the sampled rows' logits (fp32), in order."""
        st, pp, model = self.stage, self.pp, self.model
        width = 2 if model.fused else 1  # tensors per hand-over: the stream, or its unadded pair
        inbox = [] if st.first else [self._expect(mb, k, width) for k, mb in enumerate(micro)]
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
                sent += pp.isend([x] if delta is None else [x, delta], pp.next, k * width)
            elif mb.sample_rows:  # every TP rank of the last stage computes them (gathered), one sends
                hidden = x if delta is None else x + delta
                logits = model.compute_logits(hidden[self._tensor(mb.sample_rows)], upcast=False)
                if pp.tp_rank == 0:
                    sent += pp.isend([logits], 0, LOGITS_TAG + k)
            self._clocked(t, k)
        # the logits' receives only now, behind this step's sends: NCCL runs a pair's sends and
        # receives in order on one stream, and at S = 2 stage 1 sends the logits only once the
        # activations have reached it
        logits_box = ([self._expect_logits(mb, k) for k, mb in enumerate(micro) if mb.sample_rows]
                      if pp.rank == 0 else [])  # process 0 samples
        pp.wait(sent)
        self.clock.steps += 1
        if not logits_box:
            return None
        for _, works in logits_box:
            pp.wait(works)
        return torch.cat([buf for buf, _ in logits_box]).float()

    def _expect(self, mb: FlatStep, k: int, width: int):
        bufs = [torch.empty(len(mb.ids), self.model.cfg.hidden_size, dtype=self.dtype, device=self.device)
                for _ in range(width)]
        return bufs, self.pp.irecv(bufs, self.pp.prev, k * width)

    def _expect_logits(self, mb: FlatStep, k: int):
        buf = torch.empty(len(mb.sample_rows), self.model.cfg.vocab_size, dtype=self.dtype, device=self.device)
        return buf, self.pp.irecv([buf], self.pp.last_lead, LOGITS_TAG + k)

    def _clocked(self, t: float, k: int) -> None:
        c = self.clock
        if c.record and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        end = time.perf_counter()
        c.busy_s += end - t
        c.micro_batches += 1
        if c.record:
            c.intervals.append((t, end, k))


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
    """fn(engine, *args) on every stage's engine (stage 0's last), between steps; the answers in
    stage order. `fn`: a module-level function (it is pickled)."""
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
