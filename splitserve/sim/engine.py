"""SimEngine: the real EngineCore — scheduler, block pool, prefix cache, preemption, chunked
prefill, the KV hand-over, stop rules — with the model replaced by a cost model. A step is
split in two around simulated time: `begin` schedules it and says how long it takes, `finish`
applies it when that time has passed. Sampling draws nothing: every sampled token is the same
id, and outputs end by length (the trace's output length), as a benchmark's ignore_eos does.
Speculative decoding, if configured, changes only the step's time (sim/speculation.py)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from splitserve.engine.core import EngineCore, Sampled
from splitserve.engine.scheduler import SchedulerOutput
from splitserve.engine.sequence import Sequence
from splitserve.engine.step_shape import shape_of
from splitserve.sim.cost import CostModel
from splitserve.sim.speculation import SpecSim
from splitserve.types import GRAMMAR_CACHE_SIZE, Request, SamplingParams, TokenChunk

TOKEN = 1  # the id every simulated sample draws


@dataclass
class SimSampling:
    """What a Sequence reads of its sampling state, without a generator."""

    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)


class GrammarCache:
    """A worker's compiled structured-output grammars (as engine/grammar.py's LRU): a key seen
    lately costs nothing, a new one `compile_s`, before the request reaches the engine."""

    def __init__(self, compile_s: float, size: int = GRAMMAR_CACHE_SIZE) -> None:
        self.compile_s, self.size, self.compiles = compile_s, size, 0
        self._keys: OrderedDict[str, None] = OrderedDict()

    def delay(self, key: str | None) -> float:
        if key is None:
            return 0.0
        if key in self._keys:
            self._keys.move_to_end(key)
            return 0.0
        self._keys[key] = None
        if len(self._keys) > self.size:
            self._keys.popitem(last=False)
        self.compiles += 1
        return self.compile_s


class SimEngine(EngineCore):
    def __init__(self, cost: CostModel, *, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, enable_prefix_caching: bool = True, num_blocks: int | None = None,
                 compile_s: float = 0.0, speculation: SpecSim = SpecSim()) -> None:
        super().__init__(block_size=block_size, num_blocks=num_blocks or cost.kv_blocks(block_size),
                         max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                         max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching)
        self.cost = cost
        self._coeffs = tuple(cost.coeffs())
        self.grammars = GrammarCache(compile_s)
        self.speculation = speculation  # priced by the step's time only (sim/speculation.py)

    def grammar_compile_s(self) -> float:
        return self.grammars.compile_s if self.grammars.compiles else 0.0

    @property
    def step_time_coeffs(self) -> tuple[float, ...]:
        return self._coeffs

    def _new_seq(self, req: Request, outputs: tuple[int, ...] = ()) -> Sequence:
        # a simulated prompt's ids are placeholders (its prefix identity is its prompt_hashes):
        # lengths are checked, ids are not
        return Sequence(request=req, order=next(self._order), sampling=SimSampling(req.params, list(outputs)),
                        max_tokens=self.check_lengths(req), token_ids=list(req.prompt_token_ids) + list(outputs))

    def begin(self) -> tuple[SchedulerOutput, float] | None:
        """Schedule one step: what it runs and the seconds it takes (None: nothing to run)."""
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return None
        return sched, self.speculation.step_s(self.cost.step_s, shape_of(sched))

    def finish(self, sched: SchedulerOutput) -> list[TokenChunk]:
        """The step `begin` scheduled has run: apply it."""
        return self._complete(sched, self._forward(sched))

    def _forward(self, sched: SchedulerOutput) -> list[Sampled]:
        # the rows whose scheduled tokens reach the end of the sequence sample (as ModelRunner's)
        return [(seq, TOKEN, None) for seq, n in sched.scheduled if seq.num_computed_tokens + n == seq.num_tokens]
