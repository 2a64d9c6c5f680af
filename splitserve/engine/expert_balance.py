"""Expert load balancing for a mixture-of-experts engine (issue 35): redundant replicas of hot
experts and a placement rebalanced at runtime from the measured per-expert counts.

  slots      each MoE layer holds (num_experts + redundant_experts) / R physical expert slots on
             each of its R expert-parallel ranks (R = tensor_parallel_size under expert_parallel,
             data_parallel_size under data-parallel attention, else 1: every rank then holds a
             column slice of every slot). A worker starts from
             the loaded layout (rank r: its num_experts / R experts; spare slots copies of them).
  planner    every `expert_rebalance_interval_steps` steps (or when told: `rebalance`), rank 0
             reads each layer's tokens per expert since the last rebalance and plans a placement
             (model/expert_placement.plan: replicas for the hottest, longest-processing-time
             assignment to ranks); it is applied only if it lowers the predicted sum over layers
             of the busiest rank's load by MIN_GAIN.
  applying   between two steps (before the next is scheduled), through the step broadcast
             (engine/parallel/rank_calls.on_all_ranks): every rank runs `apply_placements` at the
             same point of its step sequence. A slot whose expert a rank already holds is a local
             copy; experts that move between ranks are sent by all-gathering, as bytes, the
             experts each rank is the first old holder of. Requests in flight keep their KV and
             state: only which slot computes which rows changes, not the arithmetic (moe.py).
  shared     a shared expert (DeepSeek-V3, Qwen2-MoE) is split over the ranks as a dense MLP is
             (shard.py): every rank computes its columns for every token, so its load is already
             even and there is nothing to replicate; it would matter where the shared expert sits
             whole on some ranks (data-parallel attention + EP, issue 35 item 2).
  exported   `ExpertBalance` in the worker's stats: per-rank tokens and the imbalance since the
             last rebalance, and the window's before it; /metrics as
             splitserve_worker_expert_imbalance{scope="rank"|"rank_before_rebalance"} beside the
             per-expert scope="expert".
  pipeline   under pipeline parallelism each stage holds its own MoE layers (and, with expert
             parallelism inside a stage, its TP group is that stage's expert-parallel ranks).
             Stage 0 plans for all of them: it reads every stage's counts and placements
             (`expert_state`, over parallel/pipeline.on_all_stages) and sends each stage its
             layers' placements (`apply_stage_placements`), which the stage's ranks apply among
             themselves; the gain test sums over every stage's layers. A stage runs such a call
             after the steps sent before it and before those sent after (the step broadcast's
             order), so a placement changes at the same point of every stage's step sequence, as
             on the ranks of one stage. Stage 0's stats read the other stages at most every
             `STAGE_READ_STEPS` steps (`StageExperts`): each read waits for every stage to finish
             the steps in flight, which a read per step would serialise.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.expert_placement import ExpertPlacement, plan
from splitserve.engine.model.moe import Experts, SparseMoE
from splitserve.engine.parallel.group import TPGroup
from splitserve.engine.parallel.rank_calls import RankCall, call_group, on_all_ranks
from splitserve.types import ConfigError, ExpertBalance

if TYPE_CHECKING:
    from splitserve.config import EngineConfig
    from splitserve.engine.engine import Engine
    from splitserve.engine.parallel.shard import Shard

log = logging.getLogger(__name__)

MIN_GAIN = 0.02  # a new placement must cut the predicted busiest-rank load by this much to be worth its copies
STAGE_READ_STEPS = 32  # under pipeline parallelism, stage 0's stats read the other stages' counts this often


@dataclass(frozen=True)
class ExpertState:
    """One stage's MoE layers (all of them without pipelining), as its TP rank 0 holds them."""

    tokens: tuple[tuple[int, ...], ...]  # per layer: tokens per logical expert so far
    window: tuple[tuple[int, ...], ...] = ()  # per layer: the same since the last rebalance (balancing on)
    rank_loads: tuple[tuple[int, ...], ...] = ()  # per layer: tokens per expert-parallel rank, likewise
    placements: tuple[ExpertPlacement, ...] = ()


def expert_state(engine: "Engine") -> ExpertState:
    """This engine's MoE layers' counts (a stage call: module-level, pickled by name)."""
    tokens = tuple(tuple(m.expert_tokens.tolist()) for m in engine._moe_layers)
    bal = engine.expert_balancer
    if bal is None:
        return ExpertState(tokens)
    return ExpertState(tokens, tuple(map(tuple, bal.window_counts())), tuple(map(tuple, bal.rank_loads())),
                       bal.placements)


def reset_counts(engine: "Engine") -> None:
    """Forget this engine's counted expert load (after the warmup); a stage call."""
    for m in engine._moe_layers:
        m.expert_tokens.zero_()
    if engine.expert_balancer is not None:
        engine.expert_balancer.reset(engine._steps)


def every_stage(engine: "Engine", fn, *args) -> list:
    """fn(engine, *args) on every process of a pipeline (without one: here), the answers of each
    stage's TP rank 0 in stage order (a stage's ranks hold the same counts and placements)."""
    pp = engine.pp
    if pp is None:
        return [fn(engine, *args)]
    engine._check_ranks()  # the step broadcast has no timeout: a lost stage is named, not waited on
    return call_group(engine, pp, RankCall(fn, args))[::pp.tp_size]


class StageExperts:
    """Stage 0's view of every stage's `ExpertState`: read afresh when asked to, else at most
    every STAGE_READ_STEPS steps (without pipelining: always, it is local)."""

    def __init__(self) -> None:
        self.states: list[ExpertState] | None = None
        self.read_at = 0

    def get(self, engine: "Engine", fresh: bool = False) -> list[ExpertState]:
        if engine.pp is None or fresh or self.states is None or engine._steps - self.read_at >= STAGE_READ_STEPS:
            self.states, self.read_at = every_stage(engine, expert_state), engine._steps
        return self.states

    def forget(self) -> None:
        self.states = None


def check(cfg: ModelConfig, config: "EngineConfig") -> None:
    """Refuse, before any rank starts, settings the model cannot take."""
    if not (config.redundant_experts or config.expert_rebalance_interval_steps):
        return
    if cfg.moe is None:
        raise ConfigError("redundant_experts / expert_rebalance_interval_steps need a mixture-of-experts model")
    ranks = config.tensor_parallel_size if config.expert_parallel else 1
    if config.data_parallel_size > 1:  # the replicas are the expert-parallel ranks
        ranks = config.data_parallel_size
    slots = cfg.moe.num_experts + config.redundant_experts
    if slots % ranks:
        raise ConfigError(f"num_experts {cfg.moe.num_experts} + redundant_experts {config.redundant_experts} must "
                          f"divide evenly over the {ranks} expert-parallel ranks")


class ExpertBalancer:
    """One engine's (one rank's) MoE layers, their placements and the counts windows."""

    def __init__(self, layers: list[SparseMoE], ranks: int, rank: int, slots_per_rank: int, interval: int,
                 num_experts: int) -> None:
        self.layers, self.ranks, self.rank, self.num_experts = layers, ranks, rank, num_experts
        self.slots_per_rank, self.interval = slots_per_rank, interval
        self.last_step = 0
        self.reset()

    @staticmethod
    def attach(model: torch.nn.Module, cfg: ModelConfig, config: "EngineConfig",
               shard: "Shard | None") -> "ExpertBalancer | None":
        """Lay the loaded model's experts out in slots (None: balancing is off, the plain path)."""
        if not (config.redundant_experts or config.expert_rebalance_interval_steps):
            return None
        check(cfg, config)
        ep = shard is not None and shard.expert_parallel
        ranks, rank = (shard.size, shard.rank) if ep else (1, 0)
        layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
        slots = (cfg.moe.num_experts + config.redundant_experts) // ranks
        start = ExpertPlacement.contiguous(cfg.moe.num_experts, ranks, slots)
        for m in layers:
            m.experts.place(start, rank)
        return ExpertBalancer(layers, ranks, rank, slots, config.expert_rebalance_interval_steps, cfg.moe.num_experts)

    def reset(self, step: int = 0) -> None:
        """Forget what was counted (the warmup's load is not the users'); the placement stays."""
        for m in self.layers:
            m.experts.slot_tokens.zero_()
        self.window = [m.expert_tokens.clone() for m in self.layers]
        self.imbalance_before = 0.0
        self.rebalances = 0
        self.last_step = step

    @property
    def placements(self) -> tuple[ExpertPlacement, ...]:
        return tuple(m.experts.placement for m in self.layers)

    def window_counts(self) -> list[list[int]]:
        """Per layer, tokens per logical expert since the last rebalance."""
        return [(m.expert_tokens - w).tolist() for m, w in zip(self.layers, self.window)]

    def rank_loads(self) -> list[list[int]]:
        """Per layer, tokens each rank's slots took since the last rebalance (measured)."""
        return [m.experts.slot_tokens.view(self.ranks, -1).sum(1).tolist() for m in self.layers]

    def measured_imbalance(self) -> float:
        return layers_imbalance(self.rank_loads())

    # -- rank 0 (stage 0's) ------------------------------------------------------------------
    def between_steps(self, engine: "Engine") -> None:
        if self.interval and engine._steps - self.last_step >= self.interval:
            self.rebalance(engine)

    def rebalance(self, engine: "Engine", placements: Sequence[ExpertPlacement] | None = None) -> bool:
        """Plan from the counts since the last rebalance (or take `placements`, one per MoE
        layer of every stage, in layer order) and apply on every rank; whether a new placement
        was applied."""
        self.last_step = engine._steps
        states = engine.stage_experts.get(engine, fresh=True)
        current = tuple(p for st in states for p in st.placements)
        if placements is None:
            placements = self.plan([list(c) for st in states for c in st.window], current)
            if placements is None:
                return False
        placements = tuple(placements)
        if len(placements) != len(current):
            raise ValueError(f"{len(placements)} placements for {len(current)} MoE layers")
        before = layers_imbalance([list(r) for st in states for r in st.rank_loads])
        if engine.pp is None:
            on_all_ranks(engine, apply_placements, placements)
        else:  # each stage its own layers' share, in order
            cuts, k = [], 0
            for st in states:
                cuts.append(placements[k:k + len(st.placements)])
                k += len(st.placements)
            every_stage(engine, apply_stage_placements, tuple(cuts))
        engine.stage_experts.forget()
        self.applied(before)
        return True

    def plan(self, counts: list[list[int]], current: Sequence[ExpertPlacement] | None = None
             ) -> tuple[ExpertPlacement, ...] | None:
        """Per layer, a placement for its tokens per expert `counts` (the layers placed as
        `current`: by default this engine's); None when nothing was counted or the plan would
        not lower the busiest ranks' load by MIN_GAIN."""
        current = self.placements if current is None else current
        if not any(map(any, counts)):
            return None
        placements = tuple(plan(c, self.ranks, self.slots_per_rank, p) for c, p in zip(counts, current))
        now = sum(max(p.rank_loads(c)) for c, p in zip(counts, current))
        new = sum(max(p.rank_loads(c)) for c, p in zip(counts, placements))
        return None if new > now * (1 - MIN_GAIN) else placements

    def applied(self, before: float) -> None:
        """A new placement is in place on every rank (each reset its window in `apply`); the
        measured imbalance was `before`."""
        self.imbalance_before = before
        self.rebalances += 1
        log.info("experts rebalanced (%d): rank imbalance %.3f before", self.rebalances, before)

    def stats(self, engine: "Engine") -> ExpertBalance:
        states = engine.stage_experts.get(engine)
        loads = [list(r) for st in states for r in st.rank_loads]
        replicas = [0] * self.num_experts
        for st in states:
            for p in st.placements:
                for e in p.flat():
                    replicas[e] += 1
        return ExpertBalance(ranks=self.ranks, slots_per_rank=self.slots_per_rank, replicas=tuple(replicas),
                             rank_tokens=tuple(map(sum, zip(*loads))) if loads else (),
                             imbalance=layers_imbalance(loads), imbalance_before=self.imbalance_before,
                             rebalances_total=self.rebalances)

    # -- every rank -------------------------------------------------------------------------
    def apply(self, placements: Sequence[ExpertPlacement], tp: TPGroup) -> None:
        for m, p in zip(self.layers, placements):
            move_experts(m.experts, p, tp)
        self.window = [m.expert_tokens.clone() for m in self.layers]  # each stage keeps its own window


def apply_stage_placements(engine: "Engine", by_stage: tuple[tuple[ExpertPlacement, ...], ...]) -> None:
    """A stage call: this stage's layers' share of the new placements, applied by its ranks
    together (its TP group: its expert-parallel ranks)."""
    engine.expert_balancer.apply(by_stage[engine.stage.index], engine.tp)


def apply_placements(engine: "Engine", placements: tuple[ExpertPlacement, ...]) -> None:
    """A rank call (pickled by name): this rank's share of the new placements."""
    engine.expert_balancer.apply(placements, engine.tp if engine.dp is None else engine.dp)


def move_experts(experts: Experts, new: ExpertPlacement, tp: TPGroup) -> None:
    """Fill this rank's slots with `new`'s experts: from its own old slots where it holds the
    expert already, else from the first rank that held it (every rank derives the same sends from
    the old and new placements, so all of them meet in the same all-gather, or skip it)."""
    old, rank = experts.placement, experts.rank
    if new.ranks != old.ranks or new.slots_per_rank != old.slots_per_rank or new.num_experts != old.num_experts:
        raise ValueError(f"a placement of {new.ranks} x {new.slots_per_rank} slots for {new.num_experts} experts "
                         f"cannot replace one of {old.ranks} x {old.slots_per_rank} for {old.num_experts}")
    first_holder = {}
    for r, slots in enumerate(old.slots):
        for e in slots:
            first_holder.setdefault(e, r)
    sends: list[list[int]] = [[] for _ in range(old.ranks)]  # per source rank, the experts it sends
    for r in range(new.ranks):
        for e in sorted(set(new.slots[r]) - set(old.slots[r])):
            if e not in sends[first_holder[e]]:
                sends[first_holder[e]].append(e)
    w1, w2 = experts.gate_up_proj.data, experts.down_proj.data
    received = None
    width = max(map(len, sends))
    if width:  # an expert as bytes: gate_up then down (exact, whatever the dtype)
        n1, n2 = w1[0].numel() * w1.element_size(), w2[0].numel() * w2.element_size()
        out = torch.zeros(width, n1 + n2, dtype=torch.uint8, device=w1.device)
        for k, e in enumerate(sends[rank]):
            i = old.slots[rank].index(e)
            out[k, :n1] = w1[i].contiguous().view(-1).view(torch.uint8)
            out[k, n1:] = w2[i].contiguous().view(-1).view(torch.uint8)
        received = tp.all_gather(out, dim=0)  # [ranks · width, bytes]
    mine_old, mine_new = old.slots[rank], new.slots[rank]
    changed = [i for i, e in enumerate(mine_new) if mine_old[i] != e]
    local = [(i, mine_old.index(e)) for i in changed if (e := mine_new[i]) in mine_old]
    with torch.no_grad():
        if local:  # read every source before any slot is written
            dst, src = [i for i, _ in local], [j for _, j in local]
            g1, g2 = w1[src].clone(), w2[src].clone()
            w1[dst], w2[dst] = g1, g2
        for i in changed:
            e = mine_new[i]
            if e in mine_old:
                continue
            r = first_holder[e]
            row = received[r * width + sends[r].index(e)]
            w1[i] = row[:n1].view(w1.dtype).view(w1[i].shape)
            w2[i] = row[n1:].view(w2.dtype).view(w2[i].shape)
    experts.set_placement(new, rank)


def layers_imbalance(loads: list[list[int]]) -> float:
    """Sum over layers of the busiest rank's load / sum of the mean rank's (0.0: none counted)."""
    mean = sum(sum(layer) / len(layer) for layer in loads if layer)
    return sum(max(layer) for layer in loads if layer) / mean if mean > 0 else 0.0
