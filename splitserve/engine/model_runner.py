"""Turns a scheduled step into one forward pass: flat token ids, positions, KV slots, the
attention batch, and logits for exactly the sequences whose next token is due.

Under tensor parallelism rank 0 flattens the step (`FlatStep`: plain ids, no sequences) and
sends it to the other ranks, and every rank runs the same forward pass on its shard
(`run_flat`; engine/parallel/follower.py is the other ranks' loop).

A row that verifies proposals (speculative decoding, `seq.spec_tokens`) runs like a prefill
chunk: its last token and the proposals after it, at the positions they would take, their KV
written into the sequence's blocks (past what it has computed, so never into a shared or cached
block), with logits for every one of those positions. The backends attend a step's verify rows
batched, not one sequence at a time: torch/cpu gather them together as short multi-query rows
(torch_backend.py), triton runs all of a step's chunks in one launch of its prefill kernel, and
flash_attn's varlen call takes every row anyway; such a step skips the decode CUDA graphs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.engine.attention import AttentionBackend, AttentionBatch, SeqSlice
from splitserve.engine.decode_graphs import Capture, DecodeGraphs, default_buckets
from splitserve.engine.kv_cache import KVCacheTensors
from splitserve.engine.model.llama import LlamaModel
from splitserve.engine.scheduler import SchedulerOutput
from splitserve.engine.sequence import Sequence
from splitserve.engine.parallel.group import TPGroup


@dataclass(frozen=True)
class FlatStep:
    """One forward pass, as every rank of a tensor-parallel engine runs it."""

    ids: list[int]
    pos: list[int]
    slots: list[int]
    slices: list[SeqSlice]
    sample_rows: list[int]  # rows whose next token is due


@dataclass(frozen=True)
class StepResult:
    logits: torch.Tensor | None  # [len(sample_seqs), vocab] fp32
    sample_seqs: tuple[Sequence, ...]  # sequences that get a new token from this step
    # speculative steps: logits rows of each of sample_seqs, in order (1 + its proposals);
    # None when no row verifies proposals (then one row each)
    rows_per_seq: tuple[int, ...] | None = None


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVCacheTensors, backend: AttentionBackend, block_size: int,
                 device: torch.device, tp: TPGroup | None = None) -> None:
        self.model = model
        self.tp = tp or TPGroup()
        self.kv = kv
        self.kv_layers = kv.layers
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.graphs: DecodeGraphs | None = None
        # a draft head reads every row's hidden state of the last step (speculative/draft.py)
        self.keep_hidden = False
        self.last_hidden: torch.Tensor | None = None  # [rows, hidden], before the final norm

    def capture_decode_graphs(self, max_batch: int, max_model_len: int, capture: Capture) -> None:
        """Capture decode steps of up to `max_batch` sequences (triton backend only: its step
        metadata is plain tensors the graph can read in place, and it never reads the device
        from the host)."""
        if self.backend.name != "triton":
            raise ValueError(f"decode graphs need the triton attention backend, not {self.backend.name!r}")

        def forward(ids: torch.Tensor, pos: torch.Tensor, meta) -> torch.Tensor:
            return self.model(ids, pos, self.kv_layers, self.backend, meta)

        cfg = self.model.cfg
        graphs = DecodeGraphs(forward, num_kv_heads=cfg.num_kv_heads, block_size=self.block_size,
                              max_blocks_per_seq=-(-max_model_len // self.block_size), device=self.device,
                              buckets=default_buckets(max_batch))
        with torch.inference_mode():
            graphs.capture(capture)
        self.graphs = graphs

    @torch.inference_mode()
    def run(self, sched: SchedulerOutput) -> StepResult:
        step, sample_seqs = self._flatten(sched)
        if self.tp.size > 1:
            self.tp.broadcast(step)
        logits = self.run_flat(step)
        if logits is None:
            return StepResult(None, ())
        if sched.speculative:
            return StepResult(logits, tuple(sample_seqs), tuple(1 + len(s.spec_tokens) for s in sample_seqs))
        return StepResult(logits, tuple(sample_seqs))

    @torch.inference_mode()
    def run_flat(self, step: FlatStep) -> torch.Tensor | None:
        """The forward pass; the sampled rows' logits (on every rank), None if none is due."""
        meta, batch = self.prepare(step)
        ids_t, pos_t = self._tensor(step.ids), self._tensor(step.pos)
        hidden = None
        if self.graphs is not None and not batch.prefills:
            hidden = self.graphs.run(ids_t, pos_t, meta)
        if hidden is None:
            hidden = self.model(ids_t, pos_t, self.kv_layers, self.backend, meta)
        if self.keep_hidden:
            self.last_hidden = hidden
        if not step.sample_rows:
            return None
        return self.model.compute_logits(hidden[self._tensor(step.sample_rows)])

    def prepare(self, step: FlatStep):
        """The attention backend's metadata for `step`, and its batch."""
        batch = AttentionBatch(
            num_tokens=len(step.ids),
            slot_mapping=self._tensor(step.slots),
            decodes=tuple(s for s in step.slices if s.q_len == 1),
            prefills=tuple(s for s in step.slices if s.q_len != 1),
            block_size=self.block_size,
        )
        return self.backend.prepare(batch), batch

    def _tensor(self, xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.int64, device=self.device)

    def _flatten(self, sched: SchedulerOutput):
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        slices: list[SeqSlice] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        for item in sched.scheduled:
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            end = start + n
            q_start = len(ids)
            ids += seq.token_ids[start:end]
            pos += range(start, end)
            blocks = seq.block_ids
            slots += [blocks[p // bs] * bs + p % bs for p in range(start, end)]
            slices.append(SeqSlice(q_start, n, end, tuple(blocks[: -(-end // bs)])))
            if end == seq.num_tokens:
                sample_rows.append(len(ids) - 1)
                sample_seqs.append(seq)
            elif end > seq.num_tokens:  # its last token and its proposals: every row is scored
                ids += seq.spec_tokens
                sample_rows += range(q_start, len(ids))
                sample_seqs.append(seq)
        return FlatStep(ids, pos, slots, slices, sample_rows), sample_seqs
