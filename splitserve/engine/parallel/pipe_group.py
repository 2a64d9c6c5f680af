"""The stages of one pipeline-parallel engine as processes: stage 0 is the calling process (its
Engine schedules and samples), stages 1..S-1 are started by a launcher as tensor-parallel ranks
are (parallel/launch.py: a callable `(config) -> (group, Ranks)`; here local processes) and
each runs `stage_main`: the same Engine on its stage, following stage 0's steps.

Stages talk over torch.distributed as the ranks do (gloo on CPU, NCCL on GPU): stage 0's step
goes to every stage by the untimed step broadcast (`DistGroup`); activations go stage to stage
and the logits back to stage 0 by point-to-point sends, asynchronous (`isend` / `irecv`) and
under the group's timeout: a stage that dies fails the others' next transfer at once where its
connection closes, else within `timeout_s`, never a hang.

Why torch.distributed and not Ray's compiled graphs, measured on this 2-core CPU host
(benchmarks/pipeline_bubble.py → results/pipeline_bubble.json "transport", one hop of an fp32
tensor): gloo isend/irecv 1.8 / 2.0 / 2.6 / 14 ms for 1x768 / 32x768 / 768x768 / 768x7168
against a compiled graph's 1.5 / 0.6 / 3.3 / 43 ms — about even (within a millisecond) for
decode-sized hand-overs, gloo 1.3-3x faster for prefill-sized ones, which cost the most; the
compiled graph's teardown hung past its own 30 s warning there. And the engine runs without Ray
(an import rule), the tensor-parallel collectives already rendezvous here (one transport, NCCL
on GPUs, where compiled graphs would use NCCL too), and isend/irecv needs nothing but the shapes,
which every stage knows from the step."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os

import torch

from splitserve.engine.parallel.group import DistGroup, GroupSpec
from splitserve.engine.parallel.launch import LocalRanks, free_address, on_cuda


class PipeGroup(DistGroup):
    """Stage `rank` of `size` (PP alone: a stage is one process). Every step, stage s receives
    its micro-batches' activations from s-1 and sends its own to s+1; the last sends the logits
    of the rows to sample back to stage 0."""

    kind = "pipeline-parallel"

    def __init__(self, spec: GroupSpec) -> None:
        super().__init__(spec)
        self.timeout_s = spec.timeout_s

    @property
    def prev(self) -> int:
        return self.rank - 1

    @property
    def next(self) -> int:
        return self.rank + 1

    def isend(self, tensors: list[torch.Tensor], dst: int, tag: int) -> list:
        """Start sending `tensors` to `dst` (tags tag, tag+1, ...); the handles to `wait` for
        before the tensors may be reused."""
        return [self._collective(self._dist.isend, t.contiguous(), dst, tag=tag + i) for i, t in enumerate(tensors)]

    def irecv(self, tensors: list[torch.Tensor], src: int, tag: int) -> list:
        return [self._collective(self._dist.irecv, t, src, tag=tag + i) for i, t in enumerate(tensors)]

    def wait(self, works: list) -> None:
        for w in works:
            self._collective(w.wait)


class LocalStages(LocalRanks):
    def lost(self) -> str | None:
        gone = [r for r, p in enumerate(self.procs, 1) if not p.is_alive()]
        return f"pipeline stage {gone[0]} exited" if gone else None


def start_local_stages(config, timeout_s: float = 60.0) -> tuple[PipeGroup, LocalStages]:
    """Start stages 1..S-1 of `config`'s engine as local processes (stage s on GPU s) and join
    them as stage 0."""
    size = config.pipeline_parallel_size
    address = free_address()
    backend = "nccl" if on_cuda(config) else "gloo"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=stage_main, args=(config, GroupSpec(s, size, address, backend, timeout_s), s),
                         name=f"splitserve-pp-stage{s}", daemon=True) for s in range(1, size)]
    for p in procs:
        p.start()
    try:
        return PipeGroup(GroupSpec(0, size, address, backend, timeout_s)), LocalStages(procs)
    except Exception:
        for p in procs:
            p.kill()
        raise


def stage_main(config, spec: GroupSpec, gpu: int | None = 0) -> int:
    """One stage > 0, to the end of its group; how many steps it ran."""
    from splitserve.engine.engine import Engine
    from splitserve.engine.parallel.pipeline import follow_stage

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.size))
    if on_cuda(config):
        torch.cuda.set_device(gpu)
        config = dataclasses.replace(config, device=f"cuda:{gpu}")
    pp = PipeGroup(spec)
    engine = Engine(config, pp=pp)
    try:
        return follow_stage(engine)
    finally:
        engine.close()
        pp.close()
