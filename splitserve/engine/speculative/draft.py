"""Draft-head speculation (method `draft`): one decoder layer over the target's hidden states —
DeepSeek-V3's multi-token-prediction layer (model/mtp.py) or an EAGLE head (model/eagle.py) —
proposes k tokens as its argmax chain (a point mass each: verify.py's rules stay exact).

Its KV is ONE MORE LAYER of the target's paged cache (layer index num_layers), under the same
block table: the prefix cache, the host tier and a PD handoff (kv_transfer walks every layer)
carry it with no code of their own. Draft KV at position i is computed from (the target's hidden
state at i, token i+1) — shifted by one, as vLLM's and SGLang's EAGLE/MTP do.

In a step (engine/engine.py `_forward`), after the target's forward and sampling:
`update` runs the head over every position the step computed and whose next token is now known
— a prefill chunk's (its last position reads the next prompt token, or on the final chunk the
sampled one), a decode row's, a verify row's accepted run and bonus token — writing their draft
KV into the cache (slots the sequence holds: never a block it does not own), and keeps, per
sequence about to decode, the head's output at its last position (`DraftTail`: its argmax is
the next proposal's first token). A prefill worker runs it too: the prompt's draft KV is
computed where the prompt is, and handed over with the rest. Before the next step the
Speculator asks `propose_batch` for each decoding sequence's k: the tail's token, then k - 1
chain steps, each feeding the head its own output and last guess at the next position. The
chain's positions attend through a scratch (chain_attention.py), never written into the
cache — they need no blocks, so they can never preempt — and the verified ones are written
properly by the next update.

A sequence with no tail for its current position (it just arrived by a PD handoff: the prompt's
draft KV came with it, but not the head's output) gets no proposal for one step; its first
decode step's update makes the tail, attending over the draft KV carried from the prefill side.

Under tensor parallelism (tensor_parallel_size > 1) every rank holds its shard of the head, as
of a target layer (model/eagle.py, model/mtp.py), and the draft layer is one more layer of every
rank's cache shard; the head's all-reduces and its logits' vocab gather are collectives, so every
rank runs it in step with rank 0. Rank 0 plans (`DraftUpdate`, `DraftChain`: plain ids, no
sequences) and runs each plan on every rank through `everywhere` (parallel/rank_calls.py
`on_all_ranks`, the channel its steps take, so a plan follows its step): a rank reads its own
copy of the step's hidden states (each rank holds them whole after the last all-reduce), a chain
its tails' features broadcast from rank 0, which alone keeps the tails; every rank computes the
same argmax and answers its tokens. One process (`everywhere` None) runs the plans itself.

Prefix-cache caveat: a cached block's draft KV at its last slot was made with the next token of
the request that computed it; a request sharing the block but continuing differently reads
that slot as it is. Proposal quality only: the output is the target's, whatever the head says."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from splitserve.config import SpeculativeConfig
from splitserve.engine.attention import AttentionBackend, AttentionBatch, SeqSlice
from splitserve.engine.attention.torch_backend import TorchBackend
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.eagle import eagle_config, load_eagle
from splitserve.engine.model.llama import LlamaModel
from splitserve.engine.model.mtp import check_mtp, load_mtp
from splitserve.engine.parallel.group import TPGroup
from splitserve.engine.parallel.shard import Shard
from splitserve.engine.scheduler import SchedulerOutput
from splitserve.engine.sequence import Sequence
from splitserve.engine.speculative.chain_attention import ChainAttention


class DraftHead(Protocol):
    rotary: object  # its rotary tables, or None: the target's

    def forward(self, ids, feature, cos, sin, kv, backend, meta) -> torch.Tensor:
        """Its output per row (also the next chain step's feature)."""

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] fp32."""


def load_draft_head(config: SpeculativeConfig, model_dir: str | Path, mc: ModelConfig, target: LlamaModel,
                    max_positions: int, dtype: torch.dtype, device: torch.device, tp: TPGroup | None = None,
                    shard: Shard | None = None) -> DraftHead:
    """The EAGLE head in `config.draft_path`, else the checkpoint's MTP layer (ConfigError by
    name when neither exists or its geometry does not fit the target's cache); under tensor
    parallelism the part of it for the target's `shard` (this rank)."""
    if config.draft_path is not None:
        return load_eagle(config.draft_path, mc, target, max_positions, dtype, device, tp, shard)
    return load_mtp(model_dir, mc, target, dtype, device, tp, shard)


def check_draft_head(config: SpeculativeConfig, model_dir: str | Path, tensor_parallel_size: int = 1) -> None:
    """What `load_draft_head` refuses from the configs alone (no weights read): a driver's
    check before any worker starts, so a head that cannot fit fails in seconds, not after the
    pools came up (control/launch.py `precheck`). `tensor_parallel_size`: the largest of the
    pools' (the MTP layer's shapes are the target's: checked with the target's)."""
    mc = ModelConfig.from_dir(model_dir)
    if config.draft_path is not None:
        eagle_config(config.draft_path, mc, tensor_parallel_size)
    else:
        check_mtp(model_dir, mc)


@dataclass
class DraftTail:
    """The head's output at a sequence's last computed position `pos` (its KV in the cache)."""

    pos: int
    feature: torch.Tensor  # [hidden]: the next chain step reads it
    token: int  # its argmax: the first proposal for the position after next


@dataclass(frozen=True)
class DraftUpdate:
    """One step's update as every rank runs it: the head over rows `rows` of the step's hidden
    states, reading tokens `ids` at `pos`, its KV written to `slots`; `tails`: the rows (of
    these) whose output becomes a sequence's tail."""

    ids: tuple[int, ...]
    pos: tuple[int, ...]
    rows: tuple[int, ...]
    slots: tuple[int, ...]
    decodes: tuple[SeqSlice, ...]
    prefills: tuple[SeqSlice, ...]
    tails: tuple[int, ...]


@dataclass(frozen=True)
class DraftChain:
    """A chain as every rank runs it: per sequence its blocks over its context, the context's
    length, its tail's token and position; `steps` chain steps (rank 0 broadcasts the tails'
    features, which it alone keeps)."""

    tables: tuple[tuple[int, ...], ...]
    ctx_lens: tuple[int, ...]
    tokens: tuple[int, ...]
    positions: tuple[int, ...]
    steps: int


# runs fn(engine, *args) on every rank of the engine, in step order; the answers in rank order
Everywhere = Callable[..., list]


def update_on_rank(engine: Any, plan: DraftUpdate) -> list[int]:
    """One rank's part of an update (a RankCall): its tails' tokens."""
    toks = engine.draft.run_update(plan, engine.runner.last_hidden)
    if engine.tp.rank != 0:  # only rank 0 keeps tails
        engine.draft.tail_features = None
    return toks


def chain_on_rank(engine: Any, plan: DraftChain) -> list[list[int]]:
    """One rank's part of a chain (a RankCall): each step's tokens."""
    return engine.draft.run_chain(plan)


class DraftProposer:
    """A `BatchProposer` (speculator.py): proposals for many sequences at once, from the head.
    `tp`: this rank's group; `everywhere`: how rank 0 runs a plan on every rank (None: one
    process, the plans run here)."""

    def __init__(self, head: DraftHead, target: LlamaModel, kv: tuple[torch.Tensor, torch.Tensor],
                 backend: AttentionBackend, block_size: int, device: torch.device, dtype: torch.dtype,
                 fp8_kv: bool = False, tp: TPGroup | None = None, everywhere: Everywhere | None = None) -> None:
        self.head, self.target = head, target
        self.rotary = head.rotary if head.rotary is not None else target.rotary
        self.kv, self.backend = kv, backend
        self.block_size, self.device, self.dtype = block_size, device, dtype
        self.reader = TorchBackend(dtype, fp8_kv)  # the chain's gather of the cached draft KV
        self.tp, self.everywhere = tp or TPGroup(), everywhere
        self.tail_features: torch.Tensor | None = None  # the last update's tails' (rank 0 reads them)
        self.chain_features: torch.Tensor | None = None  # the next chain's first (rank 0 sets them)

    def new_state(self) -> None:
        return None  # what a sequence needs is its tail (seq.draft_tail), set by `update`

    # -- after a target step -----------------------------------------------------------------
    @torch.inference_mode()
    def update(self, sched: SchedulerOutput, hidden: torch.Tensor, emitted: dict[Sequence, tuple[int, ...]]) -> None:
        """Draft KV for every position the step computed whose next token is known; the tails
        of the sequences that decode next. `hidden`: the step's rows (the model runner's flat
        layout), before the final norm; `emitted`: each sampled sequence's new tokens (the
        accepted proposals and the model's own), not yet appended."""
        planned = self._plan_update(sched, emitted)
        if planned is None:
            return
        plan, decoding = planned
        if self.everywhere is None:
            toks = self.run_update(plan, hidden)
        else:
            toks = self.everywhere(update_on_rank, plan)[0]
        for i, (seq, pos) in enumerate(decoding):
            seq.draft_tail = DraftTail(pos, self.tail_features[i].clone(), toks[i])
        self.tail_features = None

    def _plan_update(self, sched: SchedulerOutput, emitted: dict[Sequence, tuple[int, ...]]):
        """The update's plan and its decoding sequences with their tails' positions (None: no
        position to update)."""
        runs = []  # (seq, first flat row, first position, positions, its tokens)
        row = 0
        for item in sched.scheduled:
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            tokens = seq.token_ids + list(emitted.get(seq, ()))
            m = min(n, len(tokens) - 1 - start)  # a verify row: its accepted run and the bonus token
            if m > 0:
                runs.append((seq, row, start, m, tokens))
            row += n
        if not runs:
            return None
        runs.sort(key=lambda r: r[3] != 1)  # the backends take single-token rows first
        bs = self.block_size
        ids, pos, rows, slots, decodes, prefills, last = [], [], [], [], [], [], []
        for seq, r0, start, m, tokens in runs:
            q_start, end = len(ids), start + m
            ids += tokens[start + 1:end + 1]
            pos += range(start, end)
            rows += range(r0, r0 + m)
            blocks = seq.block_ids
            slots += [blocks[p // bs] * bs + p % bs for p in range(start, end)]
            (decodes if m == 1 else prefills).append(SeqSlice(q_start, m, end, tuple(blocks[:-(-end // bs)])))
            last.append(len(ids) - 1)
        decoding = [(run, at) for run, at in zip(runs, last) if run[0] in emitted and not run[0].prefill_only]
        plan = DraftUpdate(tuple(ids), tuple(pos), tuple(rows), tuple(slots), tuple(decodes), tuple(prefills),
                           tuple(at for _, at in decoding))
        return plan, [(seq, start + m - 1) for (seq, _, start, m, _), _ in decoding]

    @torch.inference_mode()
    def run_update(self, plan: DraftUpdate, hidden: torch.Tensor) -> list[int]:
        """The head over `plan` (on every rank, in step): its draft KV written; the tails'
        features kept in `tail_features`, their tokens returned."""
        dev = self.device
        batch = AttentionBatch(len(plan.ids), self._tensor(plan.slots), plan.decodes, plan.prefills, self.block_size)
        meta = self.backend.prepare(batch)
        feature = self.target.norm(hidden[self._tensor(plan.rows)])
        cos, sin = self.rotary(self._tensor(plan.pos), feature.dtype)
        out = self.head(self._tensor(plan.ids), feature, cos, sin, self.kv, self.backend, meta)
        if not plan.tails:
            return []
        feats = out[torch.tensor(plan.tails, dtype=torch.int64, device=dev)]
        self.tail_features = feats
        return self.head.logits(feats).argmax(-1).tolist()

    # -- before the next step ----------------------------------------------------------------
    @torch.inference_mode()
    def propose_batch(self, wants: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Up to k tokens for each (sequence, k): its tail's token, then k - 1 chain steps."""
        out: list[list[int]] = [[] for _ in wants]
        chain = []
        for i, (seq, k) in enumerate(wants):
            tail = seq.draft_tail
            if not isinstance(tail, DraftTail) or tail.pos != seq.num_computed_tokens - 1 or k < 1:
                continue  # no head output for where it stands (just handed over): none this step
            out[i].append(tail.token)
            if k > 1:
                chain.append((i, seq, k, tail))
        if not chain:
            return out
        bs = self.block_size
        plan = DraftChain(tuple(tuple(seq.block_ids[:-(-(t.pos + 1) // bs)]) for _, seq, _, t in chain),
                          tuple(t.pos + 1 for *_, t in chain), tuple(t.token for *_, t in chain),
                          tuple(t.pos for *_, t in chain), max(k for _, _, k, _ in chain) - 1)
        self.chain_features = torch.stack([t.feature for *_, t in chain])
        try:
            steps = self.run_chain(plan) if self.everywhere is None else self.everywhere(chain_on_rank, plan)[0]
        finally:
            self.chain_features = None
        for j, toks in enumerate(steps, 1):
            for (i, _, k, _), t in zip(chain, toks):
                if j < k:
                    out[i].append(t)
        return out

    @torch.inference_mode()
    def run_chain(self, plan: DraftChain) -> list[list[int]]:
        """`plan.steps` chain steps (on every rank, in step): each step's token per sequence."""
        dev = self.device
        attn = ChainAttention(self.reader, self.kv, [list(t) for t in plan.tables], list(plan.ctx_lens), dev,
                              self.dtype)
        feat = self.chain_features
        if self.tp.size > 1:  # rank 0's tails' features, on every rank
            if self.tp.rank != 0:
                feat = torch.empty(len(plan.tokens), self.target.cfg.hidden_size, dtype=self.dtype, device=dev)
            feat = self.tp.broadcast_tensor(feat)
        tok, pos = self._tensor(plan.tokens), self._tensor(plan.positions)
        steps = []
        for _ in range(plan.steps):
            pos = pos + 1
            cos, sin = self.rotary(pos, feat.dtype)
            feat = self.head(tok, feat, cos, sin, self.kv, attn, None)
            tok = self.head.logits(feat).argmax(-1)
            steps.append(tok.tolist())
        return steps

    def _tensor(self, xs) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.int64, device=self.device)
