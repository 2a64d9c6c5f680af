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

Prefix-cache caveat: a cached block's draft KV at its last slot was made with the next token of
the request that computed it; a request sharing the block but continuing differently reads
that slot as it is. Proposal quality only: the output is the target's, whatever the head says."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from splitserve.config import SpeculativeConfig
from splitserve.engine.attention import AttentionBackend, AttentionBatch, SeqSlice
from splitserve.engine.attention.torch_backend import TorchBackend
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.eagle import eagle_config, load_eagle
from splitserve.engine.model.llama import LlamaModel
from splitserve.engine.model.mtp import check_mtp, load_mtp
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
                    max_positions: int, dtype: torch.dtype, device: torch.device) -> DraftHead:
    """The EAGLE head in `config.draft_path`, else the checkpoint's MTP layer (ConfigError by
    name when neither exists or its geometry does not fit the target's cache)."""
    if config.draft_path is not None:
        return load_eagle(config.draft_path, mc, target, max_positions, dtype, device)
    return load_mtp(model_dir, mc, target, dtype, device)


def check_draft_head(config: SpeculativeConfig, model_dir: str | Path) -> None:
    """What `load_draft_head` refuses from the configs alone (no weights read): a driver's
    check before any worker starts, so a head that cannot fit fails in seconds, not after the
    pools came up (control/launch.py `precheck`)."""
    mc = ModelConfig.from_dir(model_dir)
    if config.draft_path is not None:
        eagle_config(config.draft_path, mc)
    else:
        check_mtp(model_dir, mc)


@dataclass
class DraftTail:
    """The head's output at a sequence's last computed position `pos` (its KV in the cache)."""

    pos: int
    feature: torch.Tensor  # [hidden]: the next chain step reads it
    token: int  # its argmax: the first proposal for the position after next


class DraftProposer:
    """A `BatchProposer` (speculator.py): proposals for many sequences at once, from the head."""

    def __init__(self, head: DraftHead, target: LlamaModel, kv: tuple[torch.Tensor, torch.Tensor],
                 backend: AttentionBackend, block_size: int, device: torch.device, dtype: torch.dtype,
                 fp8_kv: bool = False) -> None:
        self.head, self.target = head, target
        self.rotary = head.rotary if head.rotary is not None else target.rotary
        self.kv, self.backend = kv, backend
        self.block_size, self.device, self.dtype = block_size, device, dtype
        self.reader = TorchBackend(dtype, fp8_kv)  # the chain's gather of the cached draft KV

    def new_state(self) -> None:
        return None  # what a sequence needs is its tail (seq.draft_tail), set by `update`

    # -- after a target step -----------------------------------------------------------------
    @torch.inference_mode()
    def update(self, sched: SchedulerOutput, hidden: torch.Tensor, emitted: dict[Sequence, tuple[int, ...]]) -> None:
        """Draft KV for every position the step computed whose next token is known; the tails
        of the sequences that decode next. `hidden`: the step's rows (the model runner's flat
        layout), before the final norm; `emitted`: each sampled sequence's new tokens (the
        accepted proposals and the model's own), not yet appended."""
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
            return
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
        dev = self.device
        batch = AttentionBatch(len(ids), torch.tensor(slots, dtype=torch.int64, device=dev), tuple(decodes),
                               tuple(prefills), bs)
        meta = self.backend.prepare(batch)
        pos_t = torch.tensor(pos, dtype=torch.int64, device=dev)
        feature = self.target.norm(hidden[torch.tensor(rows, dtype=torch.int64, device=dev)])
        cos, sin = self.rotary(pos_t, feature.dtype)
        out = self.head(torch.tensor(ids, dtype=torch.int64, device=dev), feature, cos, sin, self.kv, self.backend,
                        meta)
        decoding = [(run, at) for run, at in zip(runs, last) if run[0] in emitted and not run[0].prefill_only]
        if not decoding:
            return
        at = torch.tensor([a for _, a in decoding], dtype=torch.int64, device=dev)
        feats = out[at]
        toks = self.head.logits(feats).argmax(-1).tolist()
        for i, ((seq, _, start, m, _), _) in enumerate(decoding):
            seq.draft_tail = DraftTail(start + m - 1, feats[i].clone(), toks[i])

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
        dev, bs = self.device, self.block_size
        attn = ChainAttention(self.reader, self.kv, [seq.block_ids[:-(-(t.pos + 1) // bs)] for _, seq, _, t in chain],
                              [t.pos + 1 for *_, t in chain], dev, self.dtype)
        feat = torch.stack([t.feature for *_, t in chain])
        tok = torch.tensor([t.token for *_, t in chain], dtype=torch.int64, device=dev)
        pos = torch.tensor([t.pos for *_, t in chain], dtype=torch.int64, device=dev)
        for j in range(1, max(k for _, _, k, _ in chain)):
            pos = pos + 1
            cos, sin = self.rotary(pos, feat.dtype)
            feat = self.head(tok, feat, cos, sin, self.kv, attn, None)
            tok = self.head.logits(feat).argmax(-1)
            for (i, _, k, _), t in zip(chain, tok.tolist()):
                if j < k:
                    out[i].append(t)
        return out
