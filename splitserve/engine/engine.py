"""Engine: the only entry point workers use. add_request / abort / step / stats.

The bookkeeping of a step — requests, scheduler, block pool, the KV hand-over, stop rules — is
`EngineCore` (engine/core.py, no torch; the simulator runs it too). This adds the model: one
`step()` = schedule (scheduler) → one forward pass over decodes and prefill chunks (model
runner) → sample the sequences whose next token is due (sampler) → the core's stop rules and
block hand-back. Text and stop strings are the caller's (`detokenizer`).

With speculative decoding configured (`config.speculative`, engine/speculative/), the step first
sets each decoding sequence's proposals; a step in which some row carries proposals is verified
(`speculative.verify`) instead of sampled, and may emit several tokens per sequence.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from splitserve.config import EngineConfig
from splitserve.engine.attention import get_backend
from splitserve.engine.attention.paged_backends import triton_unavailable
from splitserve.engine.core import EngineCore, Sampled
from splitserve.engine.decode_graphs import cuda_graph_capture
from splitserve.engine.expert_balance import ExpertBalancer, StageExperts, every_stage, reset_counts
from splitserve.engine.expert_balance import check as check_expert_balance
from splitserve.engine.kv_cache import HostTier, KVCacheTensors
from splitserve.engine.kernels.norm_rope_cpu import available as cpu_kernels
from splitserve.engine import memory_report
from splitserve.engine.kv_cache.tensors import SHM_PREFIX, sweep_stale_shm
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.loader import cpu_has_amx, load_model, resolve_dtype
from splitserve.engine.model.moe import SparseMoE
from splitserve.engine.model.widened_linear import widen_linears
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.quant.linear import keep_quantized
from splitserve.engine.sampler import Sampler, SamplingState, make_generator
from splitserve.engine.scheduler import SchedulerOutput
from splitserve.engine.sequence import Sequence
from splitserve.engine.speculative.draft import DraftProposer, load_draft_head
from splitserve.engine.speculative.speculator import Speculator
from splitserve.engine.speculative.verify import verify
from splitserve.engine.step_model import MIN_FIT_SAMPLES, StepTimeModel
from splitserve.engine.step_shape import StepShape
from splitserve.engine.parallel.dp_group import DPGroup
from splitserve.engine.parallel.dp_group import check as check_dp
from splitserve.engine.parallel.expert_dispatch import ExpertDispatch
from splitserve.engine.parallel.group import TPGroup
from splitserve.engine.parallel.launch import Ranks, start_local_group
from splitserve.engine.parallel.pipe_group import PipeGroup, start_local_stages
from splitserve.engine.parallel.pipeline import PipelineRunner, agree
from splitserve.engine.parallel.rank_calls import on_all_ranks
from splitserve.engine.parallel.shard import Shard
from splitserve.engine.parallel.shard import check as check_tp
from splitserve.engine.parallel.stages import Stage
from splitserve.engine.parallel.stages import check as check_pp
from splitserve.types import (ConfigError, ExpertBalance, FinishReason, Request, SamplingParams, TokenChunk,
                              as_token_ids)

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from splitserve.engine.grammar import GrammarMasks

# A streamed prefill's step publishes its blocks in this many layer groups as the forward runs
# (the last group's is all that waits for the step's end): more groups hide more of the last
# step's transfer, each costing a checksum and a read of its own.
KV_LAYER_GROUPS = 4


class Engine(EngineCore):
    """`tp`: this process's rank of a tensor-parallel group (parallel/); None with
    tensor_parallel_size > 1: this engine is rank 0 and starts the other ranks with
    `start_ranks` (engine/parallel/launch.py; local processes unless told otherwise). Rank 0 runs
    everything; the others only the forward passes (`follow`).

    `pp`: this process's stage of a pipeline-parallel engine (parallel/pipeline.py); None with
    pipeline_parallel_size > 1: this engine is stage 0 and starts the others with `start_ranks`
    (local processes unless told otherwise; parallel/pipe_group.py). `stage` says which layers
    this engine holds (None: all).

    `dp`: this process's replica of a data-parallel engine (parallel/dp_engine.py, which starts
    them all: data_parallel_size > 1 needs one): a whole engine on its own requests, holding its
    share of the experts, its MoE layers exchanging tokens with the other replicas."""

    def __init__(self, config: EngineConfig, tp: TPGroup | None = None, start_ranks=None,
                 pp: PipeGroup | None = None, dp: DPGroup | None = None) -> None:
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model)
        mc = self.model_config
        self.device = _device(config.device)
        self.dtype = resolve_dtype(config.dtype, mc)
        max_model_len = _max_model_len(config, mc)
        torch.manual_seed(config.seed)
        # before any rank starts: an unknown or unbuilt method fails here (a draft head's proposer
        # needs the model and its cache: built with them, _build)
        spec = config.speculative
        self.speculator = Speculator(spec) if spec is not None and spec.method != "draft" else None
        self.draft: DraftProposer | None = None
        size = config.tensor_parallel_size
        check_tp(mc, size, config.expert_parallel)  # before any rank is started
        check_pp(mc.num_layers, config.pipeline_parallel_size)
        check_expert_balance(mc, config)
        check_dp(mc, config)
        if config.data_parallel_size > 1 and dp is None:
            raise ConfigError("data_parallel_size > 1: the engine is a DataParallelEngine of replicas "
                              "(engine/parallel/dp_engine.py), not one Engine")
        self.dp = dp
        self.ranks: Ranks | None = None  # the followers this engine started (rank 0 only)
        if pp is None and config.pipeline_parallel_size > 1:  # and its stages' TP ranks
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # stage 0's GPU
            pp, self.ranks = (start_ranks or start_local_stages)(config)
        if pp is not None:
            tp = pp.tp  # this stage's TP group (None: a stage is one process)
        elif tp is None and size > 1:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # rank 0's GPU
            tp, self.ranks = (start_ranks or start_local_group)(config)
        self.tp = tp or TPGroup()
        self.pp = pp
        try:
            self._build(config, mc, max_model_len)
        except BaseException:  # the ranks it started must not outlive a failed start
            self._stop_ranks()
            raise

    def _build(self, config: EngineConfig, mc: ModelConfig, max_model_len: int) -> None:
        size = config.tensor_parallel_size
        shard = Shard.of(mc, self.tp.rank, size, config.expert_parallel) if size > 1 else None
        if self.dp is not None:
            shard = Shard.data_parallel(mc, self.dp.rank, self.dp.size)
        pp = self.pp
        self.stage = Stage.of(mc.num_layers, pp.stage, pp.stages) if pp is not None else None
        keep = keep_quantized(config.quantized_weights, mc.quant, self.device)
        model = load_model(Path(config.model), mc, self.dtype, max_model_len, self.device, self.tp, shard, keep,
                           self.stage)
        self.tp.wait_all()  # the slowest rank's load is no collective's timeout
        spec = config.speculative
        head = None
        if spec is not None and spec.method == "draft":  # before the KV is sized: its weights take memory
            head = load_draft_head(spec, config.model, mc, model, max_model_len, self.dtype, self.device, self.tp,
                                   shard)
        # experts in slots, with replicas and a placement rebalanced between steps (None: off)
        self.expert_balancer = ExpertBalancer.attach(model, mc, config, shard)
        if self.dp is not None:  # each MoE layer's tokens go to their experts' replicas and back
            ExpertDispatch.attach(model, self.dp)
        kv_heads = mc.num_kv_heads if shard is None else len(shard.kv_heads)
        kv_layers = mc.num_layers if self.stage is None else len(self.stage.layers)
        kv_layers += head is not None  # a draft head's KV: one more layer, index num_layers (speculative/draft.py)
        # every rank's pool has rank 0's block count: its block ids index them all (every stage's:
        # the fewest any stage's memory holds)
        num_blocks = config.num_kv_blocks
        if num_blocks is None and (self.tp.rank == 0 or pp is not None):
            num_blocks = _blocks_for_memory(config, mc, self.dtype, self.device, kv_heads, kv_layers)
        if pp is not None:
            pp.wait_all()
            num_blocks = agree(pp, num_blocks, min)
            if not agree(pp, model.fused, lambda xs: len(set(xs)) == 1):
                raise ConfigError("the pipeline's stages disagree on fused kernels (what they hand over differs)")
        num_blocks = self.tp.broadcast(num_blocks)
        shm = None
        if config.kv_shared_memory:
            sweep_stale_shm(SHM_PREFIX)  # files of workers that died without cleaning up
            shm = f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
        self.kv = KVCacheTensors.allocate(kv_layers, num_blocks, config.block_size, kv_heads,
                                          mc.head_dim, self.dtype, self.device, shm_path=shm, fp8=config.fp8_kv)
        host = HostTier(config.host_kv_blocks, self.kv.storage) if config.host_kv_blocks else None
        in_flight = 1 if pp is None else config.pipeline_steps_in_flight
        super().__init__(block_size=config.block_size, num_blocks=num_blocks, max_num_seqs=config.max_num_seqs,
                         max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=max_model_len,
                         eos_token_ids=mc.eos_token_ids, enable_prefix_caching=config.enable_prefix_caching,
                         host=host, in_flight=in_flight)
        self.scheduler.speculative = spec is not None
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
                              head_dim=mc.head_dim, fp8_kv=config.fp8_kv)
        if pp is None:
            self.runner = ModelRunner(model, self.kv, backend, config.block_size, self.device, self.tp)
        else:
            self.runner = PipelineRunner(model, self.kv, backend, config.block_size, self.device, self.dtype, pp,
                                         self.stage, config.pipeline_micro_batches)
        if head is not None:
            # under TP rank 0 runs each update and chain on every rank (the head's collectives)
            everywhere = functools.partial(on_all_ranks, self) if self.tp.size > 1 else None
            self.draft = DraftProposer(head, model, self.kv.layers[mc.num_layers], backend, config.block_size,
                                       self.device, self.dtype, config.fp8_kv, self.tp, everywhere)
            self.speculator = Speculator(spec, self.draft)
            self.runner.keep_hidden = True
        # a graph cannot capture the experts' dispatch (which experts a batch needs is read back),
        # nor a gloo collective
        if (config.cuda_graphs and self.device.type == "cuda" and backend.name == "triton" and mc.moe is None
                and size == 1 and pp is None):
            self.runner.capture_decode_graphs(config.max_num_seqs, self.max_model_len,
                                              functools.partial(cuda_graph_capture, pool=torch.cuda.graph_pool_handle()))
        self.memory = memory_report.report(model, mc, config.model, self.kv.storage.numel() * self.kv.storage.element_size(),
                                           num_blocks * config.block_size, self.kv.dtype_name, self.dtype,
                                           config.max_num_batched_tokens, config.max_num_seqs)
        log.info("rank %d memory: %s", self.tp.rank, self.memory.describe())
        self.sampler = Sampler()
        self._grammar_lock = threading.Lock()
        self.step_model = StepTimeModel()
        self._moe_layers = [m for m in model.modules() if isinstance(m, SparseMoE)]  # this stage's
        self.stage_experts = StageExperts()  # every stage's counts, as stage 0 last read them
        # what others attached to this engine and must release before its cache goes (the
        # transports a follower rank serves its cache through): run once, by close()
        self.on_close: list[Callable[[], None]] = []

    def warmup(self, prompt_lens: tuple[int, ...] = (16, 64, 256), max_tokens: int = 4) -> None:
        """Run synthetic requests through the real path before serving, one at a time and then
        together: lazy initialisation (kernels, allocator) happens here rather than in the first
        user's TTFT, and the step-time model has a first fit (prefill sizes, decode batches) for
        admission. Leaves no trace: prefix cache emptied, its events and counters dropped."""
        for batch in warmup_batches(self, prompt_lens, max_tokens):
            for req in batch:
                self.add_request(req)
            while self.scheduler.has_work():
                self.step()
        self.forget_warmup()

    def forget_warmup(self) -> None:
        """Drop what the warmup's requests left: the prefix cache, its events, the counters."""
        self.pool.reset_prefix_cache()
        self.pool.drain_events()
        if self.model_config.moe is not None:  # the expert load is the users' requests', on every stage
            every_stage(self, reset_counts)
            self.stage_experts.forget()
        if self.host is not None:
            self.host.reset()
            self.host.drain_events()
        self.scheduler.prefix_query_tokens = self.scheduler.prefix_hit_tokens = 0
        self._spec_proposed = self._spec_accepted = self._spec_steps = 0

    @property
    def cache_layers(self) -> int:
        """The whole model's KV layers: its decoder layers, and a draft head's one more
        (speculative/draft.py; a pipeline stage's cache holds only its own share of them)."""
        return self.model_config.num_layers + (self.draft is not None)

    def grammar_masks(self) -> GrammarMasks:
        """This model's grammar compiler, made on first use (most engines never need one)."""
        with self._grammar_lock:
            if self.sampler.masks is None:
                from splitserve.engine.grammar import GrammarMasks

                mc = self.model_config
                self.sampler.masks = GrammarMasks(Path(self.config.model) / "tokenizer.json", mc.vocab_size,
                                                  mc.eos_token_ids)
            return self.sampler.masks

    def prepare(self, params: SamplingParams) -> None:
        """Compile a request's grammar (any thread; cached), so that adding it only copies."""
        if params.grammar is not None:
            self.grammar_masks().compile(params.grammar)

    def check_request(self, req: Request, outputs: tuple[int, ...] = ()) -> int:
        """Everything about a request that can be wrong regardless of engine state; reads only
        configuration, so any thread may call it. Returns the effective max_tokens."""
        vocab = self.model_config.vocab_size
        as_token_ids(req.prompt_token_ids, vocab)
        as_token_ids(outputs, vocab)
        outside = [t for t, _ in req.params.logit_bias if t >= vocab]
        if outside:
            raise ConfigError(f"logit_bias: token id {outside[0]} is outside the vocabulary (size {vocab})")
        return self.check_lengths(req)

    def step(self) -> list[TokenChunk]:
        # between steps: every rank applies a new placement here (a data-parallel engine's front
        # rebalances all its replicas at once)
        if self.expert_balancer is not None and self.dp is None:
            self.expert_balancer.between_steps(self)
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        return super().step()

    def rebalance_experts(self, placements=None) -> bool:
        """Re-plan the experts' placement from the tokens per expert since the last rebalance
        (or apply `placements`, one ExpertPlacement per MoE layer) now, between steps."""
        if self.expert_balancer is None:
            raise ConfigError("expert rebalancing needs redundant_experts or expert_rebalance_interval_steps")
        return self.expert_balancer.rebalance(self, placements)

    # -- the model: what EngineCore leaves to its subclass ----------------------------------
    def _new_seq(self, req: Request, outputs: tuple[int, ...] = ()) -> Sequence:
        max_tokens = self.check_request(req, outputs)
        grammar = None if req.params.grammar is None else self.grammar_masks().matcher(req.params.grammar, outputs)
        sampling = SamplingState(params=req.params, prompt_token_ids=req.prompt_token_ids,
                                 output_token_ids=list(outputs), eos_token_ids=self.model_config.eos_token_ids,
                                 generator=make_generator(req.params, num_output_tokens=len(outputs)),
                                 grammar=grammar)
        return Sequence(request=req, order=next(self._order), sampling=sampling, max_tokens=max_tokens,
                        token_ids=list(req.prompt_token_ids) + list(outputs))

    def _forward(self, sched: SchedulerOutput) -> list[Sampled]:
        self._check_ranks()
        ahead = self._masks_ahead(sched)
        model = self.runner.model
        # a CPU forward runs layer after layer as called; on a device, a layer's KV is written
        # only when the stream gets there, so there the blocks move once the step is done
        if self.kv.storage.device.type == "cpu" and self.pp is None:  # a stage's layers are not all
            model.after_layer = self._layer_progress(sched, len(self.runner.kv_layers), KV_LAYER_GROUPS)
        try:
            result = self.runner.run(sched)
            sampled = self._sample(result, ahead)
            if self.draft is not None:  # the draft layer's KV for what the step computed, and the tails
                self.draft.update(sched, self.runner.last_hidden, {s: t if isinstance(t, tuple) else (t,)
                                                                   for s, t, _ in sampled})
                if model.after_layer is not None:
                    model.after_layer(len(self.runner.kv_layers) - 1)  # the draft layer, the cache's last
        finally:
            model.after_layer = None
            self.runner.last_hidden = None
        return sampled

    def _launch(self, sched: SchedulerOutput):
        """A pipeline's step started (parallel/pipeline.py), its logits not waited for."""
        self._check_ranks()
        return self.runner.launch(sched), self._masks_ahead(sched)

    def _land(self, handle) -> list[Sampled]:
        flight, ahead = handle
        return self._sample(self.runner.land(flight), ahead)

    def _sample(self, result, ahead) -> list[Sampled]:
        if not result.sample_seqs:
            return []
        if result.rows_per_seq is not None:
            return verify(self.sampler, result.logits, result.sample_seqs, result.rows_per_seq, ahead)
        out = self.sampler(result.logits, [s.sampling for s in result.sample_seqs], ahead)
        return list(zip(result.sample_seqs, out.token_ids, out.logprobs))

    def _masks_ahead(self, sched: SchedulerOutput):
        """The grammar masks of the step's rows that will sample, filled while the model runs."""
        if self.sampler.masks is None:
            return None
        matchers = [s.seq.sampling.grammar for s in sched.scheduled if s.seq.sampling.grammar is not None
                    and s.seq.num_computed_tokens + s.num_new_tokens == s.seq.num_tokens]
        return self.sampler.masks.fill_ahead(matchers) if matchers else None

    def _append(self, seq: Sequence, tok: int, lp) -> TokenChunk:
        if seq.sampling.grammar is not None:
            seq.sampling.grammar.accept(tok)
        return super()._append(seq, tok, lp)

    def _finish_reason(self, seq: Sequence, tok: int) -> tuple[FinishReason | None, int | None]:
        reason = super()._finish_reason(seq, tok)
        if reason[0] is None and seq.sampling.grammar is not None and seq.sampling.grammar.done:
            return FinishReason.STOP, None  # the grammar is complete: nothing else may follow
        return reason

    def _verified(self, seq: Sequence, proposed: int, accepted: int) -> None:
        self.speculator.observe(seq, proposed, accepted)

    def _observe(self, shape: StepShape, seconds: float) -> None:
        self.step_model.observe(shape, seconds)

    def _predict(self, shape: StepShape) -> float | None:
        return self.step_model.predict(shape) if self.step_model.num_samples >= MIN_FIT_SAMPLES else None

    @property
    def step_time_coeffs(self) -> tuple[float, ...]:
        return self.step_model.coeffs

    def expert_tokens(self) -> tuple[int, ...]:
        """Summed over every MoE layer, every stage's (under pipelining: as last read, at most
        STAGE_READ_STEPS steps ago)."""
        if self.model_config.moe is None:
            return ()
        layers = [t for st in self.stage_experts.get(self) for t in st.tokens]
        return tuple(map(sum, zip(*layers))) if layers else ()

    def expert_balance(self) -> ExpertBalance | None:
        return None if self.expert_balancer is None else self.expert_balancer.stats(self)

    def grammar_compile_s(self) -> float:
        masks = self.sampler.masks
        return 0.0 if masks is None else masks.compile_s

    def _before_pull(self) -> None:
        if self.device.type == "cuda":
            # The blocks' last owner may still have KV writes queued on the GPU; a transport
            # writing them from outside the stream (NIXL, RDMA) must not land before those.
            torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        """Release what outlives the process otherwise (a shared-memory KV file; the ranks it
        started); first what was attached to it (`on_close`)."""
        hooks, self.on_close = self.on_close, []
        for hook in hooks:
            hook()
        if self.sampler.masks is not None:
            self.sampler.masks.close()
        self.kv.close()
        self._stop_ranks()

    def _check_ranks(self) -> None:
        """A follower that exited is known before the step: its broadcast would wait on the
        step group, which has no timeout (an idle engine waits there), and a send to a dead
        peer was seen to hang in it (CI, two test workers on two cores)."""
        lost = self.ranks.lost() if self.ranks is not None else None
        if lost is not None:
            kind = "tensor-parallel" if self.pp is None else "pipeline-parallel"
            raise RuntimeError(f"this engine's {kind} group is broken: {lost}")

    def _stop_ranks(self) -> None:
        if self.ranks is not None:
            self.ranks, ranks = None, self.ranks
            ranks.stop(self.pp or self.tp)


def warmup_batches(engine, prompt_lens: tuple[int, ...], max_tokens: int) -> list[list[Request]]:
    """The warmup's synthetic requests: each prompt length alone, then all together."""
    limit = max(1, min(engine.max_model_len - max_tokens - 1, engine.config.max_num_batched_tokens))
    lens = sorted({min(n, limit) for n in prompt_lens})
    vocab = engine.model_config.vocab_size
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [[Request(f"warmup-{next(engine._order)}", [(31 * k + n) % vocab for k in range(n)], sp) for n in group]
            for group in [[n] for n in lens] + [lens]]


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


def _blocks_for_memory(config: EngineConfig, mc: ModelConfig, dtype: torch.dtype, device: torch.device,
                       kv_heads: int, kv_layers: int) -> int:
    """Blocks of this rank's `kv_heads` of its `kv_layers` layers that fit its memory budget."""
    per_block = KVCacheTensors.bytes_per_block(kv_layers, config.block_size, kv_heads, mc.head_dim, dtype,
                                               fp8=config.fp8_kv)
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
