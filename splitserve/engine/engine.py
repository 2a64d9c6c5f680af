"""Engine: the only entry point workers use. add_request / abort / step / stats.

One `step()` = schedule (scheduler) → one forward pass over decodes and prefill chunks (model
runner) → sample the sequences whose next token is due (sampler) → apply token-level stop rules
(EOS, stop token ids, max_tokens, context length) → hand finished blocks back to the pool (full
blocks stay in the prefix cache). Text and stop strings are the caller's (`detokenizer`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import time
import uuid
from pathlib import Path

import torch

from splitserve.config import EngineConfig
from splitserve.engine.attention import get_backend
from splitserve.engine.attention.paged_backends import triton_unavailable
from splitserve.engine.decode_graphs import cuda_graph_capture
from splitserve.engine.kv_cache import BlockPool, BlockStored, HostTier, KVCacheTensors, KVEvent
from splitserve.engine.kernels.norm_rope_cpu import available as cpu_kernels
from splitserve.engine.kv_cache.tensors import SHM_PREFIX, sweep_stale_shm
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.loader import cpu_has_amx, load_model, resolve_dtype
from splitserve.engine.model.widened_linear import widen_linears
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.sampler import Sampler, SamplingState, make_generator
from splitserve.engine.scheduler import Scheduler
from splitserve.engine.sequence import Sequence, SeqStatus
from splitserve.engine.step_model import StepTimeModel
from splitserve.types import (
    ConfigError,
    FinishReason,
    PhaseTimes,
    Request,
    SamplingParams,
    Tier,
    TokenChunk,
    WorkerStats,
    as_token_ids,
)


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model)
        mc = self.model_config
        self.device = _device(config.device)
        self.dtype = resolve_dtype(config.dtype, mc)
        self.max_model_len = _max_model_len(config, mc)
        torch.manual_seed(config.seed)
        model = load_model(Path(config.model), mc, self.dtype, self.max_model_len, self.device)
        num_blocks = config.num_kv_blocks or _blocks_for_memory(config, mc, self.dtype, self.device)
        shm = None
        if config.kv_shared_memory:
            sweep_stale_shm(SHM_PREFIX)  # files of workers that died without cleaning up
            shm = f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
        self.kv = KVCacheTensors.allocate(mc.num_layers, num_blocks, config.block_size, mc.num_kv_heads,
                                          mc.head_dim, self.dtype, self.device, shm_path=shm)
        self.pool = BlockPool(num_blocks, config.block_size, config.enable_prefix_caching)
        self.host: HostTier | None = None
        if config.host_kv_blocks:
            self.host = HostTier(config.host_kv_blocks, self.kv.storage)
            self.pool.on_evict = self.host.save
        self.scheduler = Scheduler(self.pool, config.max_num_seqs, config.max_num_batched_tokens, self.host)
        cpu_bf16 = self.device.type == "cpu" and self.dtype == torch.bfloat16
        if config.fused_kernels and self.device.type == "cuda" and triton_unavailable(self.device) is None:
            model.use_triton_kernels()  # fused residual + RMSNorm and rotary: fewer passes, same rounding
        elif config.fused_kernels and cpu_bf16 and cpu_kernels():
            # bf16 only: the kernels round as torch does but sum a row in another order, and fp32
            # keeps the torch ops so that greedy output stays bit-exact with Hugging Face
            model.use_cpu_kernels()
        if cpu_bf16 and not cpu_has_amx():
            widen_linears(model)  # prefill matmuls at fp32 speed, same bf16 result (model/widened_linear.py)
        backend = get_backend(config.attention_backend, self.dtype, self.device, block_size=config.block_size,
                              head_dim=mc.head_dim)
        self.runner = ModelRunner(model, self.kv, backend, config.block_size, self.device)
        if config.cuda_graphs and self.device.type == "cuda" and backend.name == "triton":
            self.runner.capture_decode_graphs(config.max_num_seqs, self.max_model_len,
                                              functools.partial(cuda_graph_capture, pool=torch.cuda.graph_pool_handle()))
        self.sampler = Sampler()
        self._seqs: dict[str, Sequence] = {}
        self._pulling: dict[str, Sequence] = {}  # blocks allocated, KV arriving from a peer
        self._detached: dict[str, list[int]] = {}  # blocks pinned for a KV handoff
        self._order = itertools.count()
        self._steps = 0
        self._prefill_tokens = 0  # prompt tokens computed, ever (the autoscaler's served rate)
        self.step_model = StepTimeModel()

    def warmup(self, prompt_lens: tuple[int, ...] = (16, 64, 256), max_tokens: int = 4) -> None:
        """Run synthetic requests through the real path before serving, one at a time and then
        together: lazy initialisation (kernels, allocator) happens here rather than in the first
        user's TTFT, and the step-time model has a first fit (prefill sizes, decode batches) for
        admission. Leaves no trace: prefix cache emptied, its events and counters dropped."""
        limit = max(1, min(self.max_model_len - max_tokens - 1, self.config.max_num_batched_tokens))
        lens = sorted({min(n, limit) for n in prompt_lens})
        vocab = self.model_config.vocab_size
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for group in [[n] for n in lens] + [lens]:
            for n in group:
                rid = f"warmup-{next(self._order)}"
                self.add_request(Request(rid, [(31 * k + n) % vocab for k in range(n)], sp))
            while self.scheduler.has_work():
                self.step()
        self.pool.reset_prefix_cache()
        self.pool.drain_events()
        if self.host is not None:
            self.host.reset()
            self.host.drain_events()
        self.scheduler.prefix_query_tokens = self.scheduler.prefix_hit_tokens = 0

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, req: Request, *, prefill_only: bool = False, outputs: tuple[int, ...] = ()) -> None:
        """Queue a request; bad input raises ConfigError here, before anything is allocated.
        `prefill_only`: stop after the first token and hand the prompt's KV blocks over (the
        chunk carries `kv_blocks`; `release_detached` frees them later). `outputs`: tokens
        already generated elsewhere (a handoff that fell back to local compute, a migration):
        they are recomputed as context and generation continues after them."""
        seq = self._new_seq(req, outputs=tuple(outputs))
        seq.prefill_only = prefill_only
        self._seqs[req.request_id] = seq
        self.scheduler.add(seq)

    def check_request(self, req: Request, outputs: tuple[int, ...] = ()) -> int:
        """Everything about a request that can be wrong regardless of engine state; reads only
        configuration, so any thread may call it. Returns the effective max_tokens."""
        as_token_ids(req.prompt_token_ids, self.model_config.vocab_size)
        as_token_ids(outputs, self.model_config.vocab_size)
        prompt_len = len(req.prompt_token_ids)
        if prompt_len >= self.max_model_len:
            raise ConfigError(f"prompt has {prompt_len} tokens; the context length is {self.max_model_len} "
                              "and at least one token must be generated")
        room = self.max_model_len - prompt_len
        max_tokens = room if req.params.max_tokens is None else min(req.params.max_tokens, room)
        self._check_fits(prompt_len + max_tokens)
        return max_tokens

    def _new_seq(self, req: Request, outputs: tuple[int, ...] = ()) -> Sequence:
        if req.request_id in self._seqs or req.request_id in self._pulling or req.request_id in self._detached:
            raise ConfigError(f"request id {req.request_id!r} is already running")
        max_tokens = self.check_request(req, outputs)
        sampling = SamplingState(params=req.params, prompt_token_ids=req.prompt_token_ids,
                                 output_token_ids=list(outputs), eos_token_ids=self.model_config.eos_token_ids,
                                 generator=make_generator(req.params, num_output_tokens=len(outputs)))
        seq = Sequence(request=req, order=next(self._order), sampling=sampling, max_tokens=max_tokens,
                       token_ids=list(req.prompt_token_ids) + list(outputs))
        seq.update_hashes(self.config.block_size)
        return seq

    # -- disaggregation: the prefill side hands blocks over, the decode side takes KV in -------
    def release_detached(self, request_id: str) -> bool:
        """Free the blocks pinned for a handoff (acknowledged or lease expired)."""
        blocks = self._detached.pop(request_id, None)
        if blocks is None:
            return False
        self.pool.free(blocks)
        return True

    def detached_requests(self) -> list[str]:
        return list(self._detached)

    def add_pulled(self, req: Request, first_token: int, outputs: tuple[int, ...] = ()) -> list[int]:
        """Allocate blocks for a context whose KV a peer computed — the prompt, and `outputs`
        when the request migrated — and which the peer continued with `first_token`; the caller
        fills them and then calls kv_ready (or kv_failed to recompute locally). Raises
        OutOfBlocks if none free."""
        seq = self._new_seq(req, outputs=(*outputs, first_token))
        seq.block_ids = self.pool.allocate(-(-(seq.num_tokens - 1) // self.config.block_size))
        self._pulling[req.request_id] = seq
        if self.device.type == "cuda":
            # The blocks' last owner may still have KV writes queued on the GPU; a transport
            # writing them from outside the stream (NIXL, RDMA) must not land before those.
            torch.cuda.current_stream(self.device).synchronize()
        return list(seq.block_ids)

    def is_pulling(self, request_id: str) -> bool:
        return request_id in self._pulling

    def kv_ready(self, request_id: str) -> None:
        """The pulled KV is in place and verified: the request joins the decode batch."""
        seq = self._pulling.pop(request_id)
        seq.num_computed_tokens = seq.num_tokens - 1  # all but the peer's token, computed next
        seq.num_cached_tokens = 0
        self._advance(seq, 0)  # full prompt blocks become reusable prefix-cache entries
        self._seqs[request_id] = seq
        self.scheduler.add_running(seq)

    def kv_failed(self, request_id: str) -> None:
        """The pull failed: drop the blocks and compute the prompt here instead (the first token
        is kept, so the output continues exactly where the peer left it)."""
        seq = self._pulling.pop(request_id)
        self.pool.free(seq.block_ids)
        seq.block_ids = []
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def _check_fits(self, max_len: int) -> None:
        blocks = -(-max_len // self.config.block_size)
        if blocks > self.pool.num_blocks:
            raise ConfigError(f"a request of up to {max_len} tokens needs {blocks} KV blocks; the pool has "
                              f"{self.pool.num_blocks}: lower max_tokens or give the engine more KV memory")

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is; its blocks return at once and no chunk of it follows.
        Unknown ids are ignored (the request may have finished in the meantime)."""
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.scheduler.remove(seq)
        pulling = self._pulling.pop(request_id, None)
        if pulling is not None:  # the caller has stopped its transfer into these blocks
            self.pool.free(pulling.block_ids)
        self.release_detached(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    # -- one iteration -------------------------------------------------------------------------
    def step(self) -> list[TokenChunk]:
        chunks: list[TokenChunk] = []
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return chunks
        t0 = time.perf_counter()
        result = self.runner.run(sched)
        for item in sched.scheduled:
            self._advance(item.seq, item.num_new_tokens)
        if result.sample_seqs:
            out = self.sampler(result.logits, [s.sampling for s in result.sample_seqs])
            for seq, tok, lp in zip(result.sample_seqs, out.token_ids, out.logprobs):
                chunks.append(self._append(seq, tok, lp))
        self._steps += 1
        self._observe(sched, time.perf_counter() - t0)
        return chunks

    def _observe(self, sched, seconds: float) -> None:
        decodes = [s for s in sched.scheduled if s.num_new_tokens == 1]
        self._prefill_tokens += sched.num_tokens - len(decodes)
        self.step_model.observe(sched.num_tokens - len(decodes), len(decodes),
                                sum(s.seq.num_computed_tokens for s in decodes), seconds)

    def _advance(self, seq: Sequence, n: int) -> None:
        seq.num_computed_tokens += n
        full = seq.num_computed_tokens // self.config.block_size
        if full > seq.num_cached_blocks:
            self.pool.cache_blocks(seq.block_ids[seq.num_cached_blocks:full], seq.block_hashes[seq.num_cached_blocks:full])
            seq.num_cached_blocks = full

    def _append(self, seq: Sequence, tok: int, lp) -> TokenChunk:
        first = not seq.output_token_ids
        seq.append_token(tok, self.config.block_size)
        reason, stop_id = self._finish_reason(seq, tok)
        chunk = TokenChunk(seq.request_id, (tok,), (lp,) if lp is not None else None, reason, stop_id,
                           num_prompt_tokens=seq.num_prompt_tokens,
                           num_cached_tokens=max(seq.num_cached_tokens, 0) if first or reason else 0,
                           phases=_phases(seq) if first else None)
        if reason is not None:
            self._seqs.pop(seq.request_id, None)
            self.scheduler.remove(seq)
        elif seq.prefill_only:
            self._seqs.pop(seq.request_id, None)
            self.scheduler.detach(seq)
            self._detached[seq.request_id] = list(seq.block_ids)
            chunk = dataclasses.replace(chunk, kv_blocks=tuple(seq.block_ids))
        return chunk

    def _finish_reason(self, seq: Sequence, tok: int) -> tuple[FinishReason | None, int | None]:
        p = seq.request.params
        n_out = len(seq.output_token_ids)
        if n_out >= p.min_tokens:
            if not p.ignore_eos and tok in self.model_config.eos_token_ids:
                return FinishReason.STOP, tok
            if tok in p.stop_token_ids:
                return FinishReason.STOP, tok
        if n_out >= seq.max_tokens:
            return FinishReason.LENGTH, None
        return None, None

    def close(self) -> None:
        """Release what outlives the process otherwise (a shared-memory KV file)."""
        self.kv.close()

    # -- introspection -------------------------------------------------------------------------
    def stats(self) -> WorkerStats:
        return WorkerStats(
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            num_preempted_total=self.scheduler.num_preemptions,
            kv_blocks_total=self.pool.num_blocks,
            kv_blocks_free=self.pool.num_free,
            kv_blocks_cached=self.pool.num_cached,
            prefix_query_tokens_total=self.scheduler.prefix_query_tokens,
            prefix_hit_tokens_total=self.scheduler.prefix_hit_tokens,
            host_hit_tokens_total=0 if self.host is None else self.host.promoted_total * self.config.block_size,
            kv_host_blocks_cached=0 if self.host is None else len(self.host),
            steps_total=self._steps,
            prefill_tokens_total=self._prefill_tokens,
            step_time_coeffs=self.step_model.coeffs,
            pending_prefill_tokens=sum(max(0, s.num_tokens - s.num_computed_tokens - 1) for s in self._seqs.values()),
            decode_context_tokens=sum(s.num_computed_tokens for s in self.scheduler.running),
            token_budget=self.config.max_num_batched_tokens,
        )

    def block_counts(self) -> dict[str, int]:
        """Check the invariants, then report the pool's counts (for workers' health checks)."""
        self.check_invariants()
        p = self.pool
        return {"in_use": p.num_in_use, "free": p.num_free, "cached": p.num_cached, "total": p.num_blocks}

    def drain_kv_events(self) -> list[KVEvent]:
        return self.pool.drain_events() + (self.host.drain_events() if self.host is not None else [])

    def kv_listing(self) -> list[KVEvent]:
        """The whole prefix cache as events: what a router rebuilds this worker's index from."""
        listing = [BlockStored(self.pool.cached_hashes())]
        return listing + ([BlockStored(self.host.held_hashes(), Tier.HOST)] if self.host is not None else [])

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        if self.host is not None:
            self.host.check_invariants()
        held = sum(len(s.block_ids) for s in (*self._seqs.values(), *self._pulling.values()))
        held += sum(len(b) for b in self._detached.values())
        if not (self._seqs or self._pulling or self._detached) and self.pool.num_in_use:
            raise AssertionError(f"no requests, yet {self.pool.num_in_use} blocks are in use")
        if held < self.pool.num_in_use:
            raise AssertionError(f"{self.pool.num_in_use} blocks in use but requests hold only {held}")
        for s in self._seqs.values():
            if s.status is SeqStatus.WAITING and s.block_ids:
                raise AssertionError(f"waiting request {s.request_id} holds blocks")


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _max_model_len(config: EngineConfig, mc: ModelConfig) -> int:
    if config.max_model_len is None:
        return mc.max_context
    if config.max_model_len > mc.max_context:
        raise ConfigError(f"max_model_len {config.max_model_len} exceeds the model's context length {mc.max_context}")
    return config.max_model_len


def _blocks_for_memory(config: EngineConfig, mc: ModelConfig, dtype: torch.dtype, device: torch.device) -> int:
    per_block = KVCacheTensors.bytes_per_block(mc.num_layers, config.block_size, mc.num_kv_heads, mc.head_dim, dtype)
    if config.gpu_memory_utilization is not None and device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = kv_budget_bytes(total, free, config.gpu_memory_utilization)
    else:
        budget = int(config.kv_cache_memory_gib * (1 << 30))
    return max(1, budget // per_block)


def kv_budget_bytes(total: int, free: int, utilization: float, headroom: int = 1 << 30) -> int:
    """The KV cache's bytes when this engine may use `utilization` of a GPU of `total` bytes of
    which `free` are free now (after its weights): what is left of that share, less `headroom`
    for activations. Refuses when nothing is left (raise the share, or lower max_model_len)."""
    budget = int(total * utilization) - (total - free) - headroom
    if budget <= 0:
        raise ConfigError(f"gpu_memory_utilization {utilization} leaves no room for a KV cache: "
                          f"{(total - free) / 2**30:.1f} GiB of {total / 2**30:.1f} GiB are in use already")
    return budget


def _phases(seq: Sequence) -> PhaseTimes:
    now = time.monotonic()
    sched = seq.scheduled_at if seq.scheduled_at is not None else now
    return PhaseTimes(queue_s=sched - seq.added_at, prefill_s=now - sched)
