"""The stages of one pipeline-parallel engine as processes: stage 0 is the calling process (its
Engine schedules and samples), stages 1..S-1 are started by a launcher as tensor-parallel ranks
are (parallel/launch.py: a callable `(config) -> (group, Ranks)`; here local processes) and
each runs `stage_main`: the same Engine on its stage, following stage 0's steps.

Stages talk over torch.distributed as the ranks do (gloo on CPU, NCCL on GPU): stage 0's step
goes to every stage as a posted message (`broadcast`: pickled, sent point to point over a gloo
group of its own without a time limit, as the TP step broadcast is untimed — a stage waits there
between steps); activations go stage to stage and the logits back to stage 0 by point-to-point
sends, asynchronous (`isend` / `irecv`) and under the group's timeout: a stage that dies fails
the others' next transfer at once where its connection closes, else within `timeout_s`, never a
hang. The step is posted, not broadcast as a collective: a collective returns on stage 0 only
once every stage has joined it, i.e. finished the step before, which would keep stage 0 from
starting a step while another is in the later stages (pipeline.py: steps in flight); a post
returns at once, the stages take the posts in order.

Why torch.distributed and not Ray's compiled graphs, measured on this 2-core CPU host
(benchmarks/pipeline_bubble.py → results/pipeline_bubble.json "transport", one hop of an fp32
tensor): gloo isend/irecv 1.7 / 1.6 / 2.1 / 9.2 ms for 1x768 / 32x768 / 768x768 / 768x7168
against a compiled graph's 1.5 / 1.7 / 5.6 / 44 ms (an earlier run: 1.8 / 2.0 / 2.6 / 14 against
1.5 / 0.6 / 3.3 / 43) — about even (within a millisecond) for decode-sized hand-overs, gloo
1.3-5x faster for prefill-sized ones, which cost the most; the
compiled graph's teardown hung past its own 30 s warning there. And the engine runs without Ray
(an import rule), the tensor-parallel collectives already rendezvous here (one transport, NCCL
on GPUs, where compiled graphs would use NCCL too), and isend/irecv needs nothing but the shapes,
which every stage knows from the step."""

from __future__ import annotations

import dataclasses
import datetime
import multiprocessing as mp
import os
import pickle
from typing import Any

import torch

from splitserve.engine.parallel.group import IDLE_FOREVER, DistGroup, GroupSpec, meeting_point
from splitserve.engine.parallel.launch import LocalRanks, on_cuda


class PipeGroup(DistGroup):
    """Process `rank` of the `size` = stages x tp_size processes of a pipeline-parallel engine:
    stage rank // tp_size, its tensor-parallel rank rank % tp_size (PP alone: a stage is one
    process). Every step, each process of stage s receives its micro-batches' activations from
    the same TP rank of stage s-1 and sends its own to that of s+1 (after the all-reduce every
    rank of a stage holds the whole stream); the last stage's TP rank 0 sends the logits of the
    rows to sample back to process 0. With tp_size > 1, `tp` is this stage's TP group."""

    kind = "pipeline-parallel"

    def __init__(self, spec: GroupSpec, tp_size: int = 1, store=None) -> None:
        super().__init__(spec, store)
        self.timeout_s = spec.timeout_s
        self.tp_size = tp_size
        self.stage, self.tp_rank, self.stages = spec.rank // tp_size, spec.rank % tp_size, spec.size // tp_size
        self.tp: StageTPGroup | None = None
        if tp_size > 1:  # every process makes every stage's groups, in one order (torch.distributed's rule)
            groups = [self._stage_groups(s, spec.backend) for s in range(self.stages)]
            self.tp = StageTPGroup(self, *groups[self.stage])
        # the posts: pickled objects over gloo whatever the backend, untimed (a stage waits idle there)
        self._posts = self._dist.new_group(backend="gloo", timeout=IDLE_FOREVER)
        self._posting: list = []  # process 0: its posts' sends not yet known complete, with their tensors

    def _stage_groups(self, stage: int, backend: str):
        ranks = list(range(stage * self.tp_size, (stage + 1) * self.tp_size))
        timed = self._dist.new_group(ranks, backend=backend, timeout=datetime.timedelta(seconds=self.timeout_s))
        return ranks, timed, self._dist.new_group(ranks, backend=backend, timeout=IDLE_FOREVER)

    @property
    def prev(self) -> int:
        return self.rank - self.tp_size

    @property
    def next(self) -> int:
        return self.rank + self.tp_size

    @property
    def last_lead(self) -> int:
        """The process that sends the logits: the last stage's TP rank 0."""
        return (self.stages - 1) * self.tp_size

    def broadcast(self, obj: Any = None) -> Any:
        """Process 0: post `obj` to every other process and return at once (it goes out as each
        takes it; two posts reach a process in the order posted). The others: the next post."""
        if self.rank == 0:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            head = torch.tensor([payload.numel()], dtype=torch.int64)
            self._posting = [p for p in self._posting if not p[0].is_completed()]
            for r in range(1, self.size):
                for tag, t in ((0, head), (1, payload)):
                    self._posting.append((self._collective(self._dist.isend, t, r, group=self._posts, tag=tag), t))
            return obj
        head = torch.empty(1, dtype=torch.int64)
        self._collective(self._dist.recv, head, 0, group=self._posts, tag=0)
        payload = torch.empty(int(head.item()), dtype=torch.uint8)
        self._collective(self._dist.recv, payload, 0, group=self._posts, tag=1)
        return pickle.loads(payload.numpy().tobytes())

    def close(self) -> None:
        for work, _ in self._posting:  # the last posts (the followers' end) out before the group goes
            try:
                work.wait(datetime.timedelta(seconds=2))
            except Exception:  # a process already gone: nothing will take it
                pass
        self._posting = []
        super().close()

    def isend(self, tensors: list[torch.Tensor], dst: int, tag: int) -> list:
        """Start sending `tensors` to `dst` (tags tag, tag+1, ...); the handles to `wait` for
        before the tensors may be reused."""
        return [self._collective(self._dist.isend, t.contiguous(), dst, tag=tag + i) for i, t in enumerate(tensors)]

    def irecv(self, tensors: list[torch.Tensor], src: int, tag: int) -> list:
        return [self._collective(self._dist.irecv, t, src, tag=tag + i) for i, t in enumerate(tensors)]

    def wait(self, works: list) -> None:
        for w in works:
            self._collective(w.wait)


class StageTPGroup(DistGroup):
    """One stage's tensor-parallel group inside the pipeline's processes: the collectives a TP
    engine's model and start need (`TPGroup`), on that stage's ranks only."""

    def __init__(self, pp: PipeGroup, ranks: list[int], timed, untimed) -> None:  # no group of its own to init
        self._dist, self._pg, self._steps, self._ranks = pp._dist, timed, untimed, ranks
        self.rank, self.size = ranks.index(pp.rank), len(ranks)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self._collective(self._dist.all_reduce, x, group=self._pg)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._collective(self._dist.all_gather, parts, x.contiguous(), group=self._pg)
        return torch.cat(parts, dim=dim)

    def broadcast(self, obj: Any = None) -> Any:
        box = [obj]
        self._collective(self._dist.broadcast_object_list, box, src=self._ranks[0], group=self._steps)
        return box[0]

    def broadcast_tensor(self, x: torch.Tensor) -> torch.Tensor:
        self._collective(self._dist.broadcast, x, src=self._ranks[0], group=self._pg)
        return x

    def wait_all(self) -> None:
        self._collective(self._dist.barrier, group=self._steps)

    def gather(self, obj: Any) -> list | None:
        out = [None] * self.size if self.rank == 0 else None
        self._collective(self._dist.gather_object, obj, out, dst=self._ranks[0], group=self._steps)
        return out

    def close(self) -> None:
        pass  # the pipeline's group is destroyed with its own


class LocalStages(LocalRanks):
    def __init__(self, procs: list, tp_size: int = 1) -> None:
        super().__init__(procs)
        self.tp_size = tp_size

    def lost(self) -> str | None:
        gone = [r for r, p in enumerate(self.procs, 1) if not p.is_alive()]
        if not gone:
            return None
        stage, rank = divmod(gone[0], self.tp_size)
        return f"pipeline stage {stage} exited" + (f" (its tensor-parallel rank {rank})" if self.tp_size > 1 else "")


def start_local_stages(config, timeout_s: float = 60.0) -> tuple[PipeGroup, LocalStages]:
    """Start processes 1..S*T-1 of `config`'s engine (S stages of T TP ranks; process r on GPU
    r) and join them as process 0: stage 0, TP rank 0."""
    t = config.tensor_parallel_size
    size = config.pipeline_parallel_size * t
    store, address = meeting_point("127.0.0.1", size, timeout_s)
    backend = "nccl" if on_cuda(config) else "gloo"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=stage_main, args=(config, GroupSpec(r, size, address, backend, timeout_s), r, t),
                         name=f"splitserve-pp-stage{r // t}" + (f"-tp{r % t}" if t > 1 else ""), daemon=True)
             for r in range(1, size)]
    for p in procs:
        p.start()
    try:
        return PipeGroup(GroupSpec(0, size, address, backend, timeout_s), t, store), LocalStages(procs, t)
    except Exception:
        for p in procs:
            p.kill()
        raise


def stage_main(config, spec: GroupSpec, gpu: int | None = 0, tp_size: int = 1) -> int:
    """One process > 0 of the pipeline, to the end of its group; how many steps it ran."""
    from splitserve.engine.engine import Engine
    from splitserve.engine.parallel.pipeline import follow_stage

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.size))
    if on_cuda(config):
        torch.cuda.set_device(gpu)
        config = dataclasses.replace(config, device=f"cuda:{gpu}")
    pp = PipeGroup(spec, tp_size)
    engine = Engine(config, pp=pp)
    try:
        return follow_stage(engine)
    finally:
        engine.close()
        pp.close()
