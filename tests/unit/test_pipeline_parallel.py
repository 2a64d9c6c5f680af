"""Pipeline parallelism on CPU: an engine over 2 stage processes (gloo), each holding one of the
tiny models' two layers and that layer's KV cache (the embedding on stage 0, the final norm and
LM head on stage 1), activations sent stage to stage and the logits back to stage 0, a step cut
into micro-batches in flight — gives Hugging Face's greedy tokens (tie rule as in
test_engine_parity) with chunked prefill, prefix hits and preemption, also with each stage a
tensor-parallel group of 2 (four processes) — with two steps in flight (the running sequences
in two groups, one group's step launched while the other's is in stage 1),
a request aborted while its step is in flight included; losing a stage fails the engine with an
error instead of hanging, and frees the blocks of every step in flight once."""

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.config import EngineConfig
from splitserve.engine.attention import SeqSlice
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model_runner import FlatStep
from splitserve.engine.parallel.micro_batches import split
from splitserve.engine.parallel.pipeline import holding, on_all_stages, stage_times
from splitserve.engine.parallel.stages import Stage, split_layers
from splitserve.types import ConfigError
from tests.unit.test_engine_parity import drained, reference, run_and_compare  # noqa: F401  (a fixture)


def test_layers_are_cut_into_contiguous_ranges_as_evenly_as_possible(tiny_checkpoint):
    assert split_layers(61, 2) == (range(0, 30), range(30, 61))
    assert split_layers(7, 3) == (range(0, 2), range(2, 4), range(4, 7))
    assert Stage.of(2, 1, 2) == Stage(1, 2, range(1, 2)) and Stage.of(2, 1, 2).local(1) == 0
    with pytest.raises(ConfigError, match="pipeline_parallel_size 3 exceeds the model's 2 layers"):
        LLM(str(tiny_checkpoint("llama")), num_kv_blocks=16, pipeline_parallel_size=3)
    path = str(tiny_checkpoint("llama"))
    with pytest.raises(ConfigError, match="pipeline_micro_batches > 1 needs pipeline_parallel_size > 1"):
        EngineConfig(model=path, pipeline_micro_batches=2)
    with pytest.raises(ConfigError, match="pipeline_parallel_size must be a positive integer"):
        EngineConfig(model=path, pipeline_parallel_size=0)
    with pytest.raises(ConfigError, match="pipeline_steps_in_flight > 1 needs pipeline_parallel_size > 1"):
        EngineConfig(model=path, pipeline_steps_in_flight=2)
    with pytest.raises(ConfigError, match="pipeline_steps_in_flight must be a positive integer"):
        EngineConfig(model=path, pipeline_parallel_size=2, pipeline_steps_in_flight=0)


@pytest.mark.parametrize("shape, fused", [
    ("llama", False),
    ("qwen2", False),  # the LM head tied to the embedding
    ("llama", True),  # bf16 through the fused residual + RMSNorm kernels: the stream handed over as a pair
])
def test_a_stage_loads_only_its_layers_and_chained_they_are_the_model(tiny_checkpoint, shape, fused):
    from splitserve.engine.attention import get_backend
    from splitserve.engine.kv_cache import KVCacheTensors
    from splitserve.engine.model.loader import load_model
    from splitserve.engine.model_runner import ModelRunner

    from splitserve.engine.kernels.norm_rope_cpu import available

    if fused and not available():
        pytest.skip("no native CPU kernels here")
    path = tiny_checkpoint(shape)
    cfg = ModelConfig.from_dir(path)
    dtype = torch.bfloat16 if fused else torch.float32
    whole = load_model(path, cfg, dtype, 128)
    stages = [load_model(path, cfg, dtype, 128, stage=Stage.of(cfg.num_layers, s, 2)) for s in range(2)]
    if fused:
        for m in [whole] + stages:
            m.use_cpu_kernels()
    assert [len(m.layers) for m in stages] == [1, 1]
    assert stages[0].norm is None and stages[0].lm_head is None
    assert (stages[1].embed_tokens is not None) == cfg.tie_word_embeddings  # a tied LM head is the embedding
    w = whole.state_dict()
    for m in stages:
        for name, t in m.state_dict().items():
            if name.startswith("layers."):
                _, i, rest = name.split(".", 2)
                name = f"layers.{m.stage.layers[int(i)]}.{rest}"
            assert torch.equal(t, w[name]), name
    # one forward: stage 0's layers, their stream into stage 1's, its logits == the whole model's
    backend = get_backend("torch", dtype, torch.device("cpu"), block_size=16, head_dim=cfg.head_dim)
    kvs = [KVCacheTensors.allocate(n, 4, 16, cfg.num_kv_heads, cfg.head_dim, dtype, torch.device("cpu"))
           for n in (cfg.num_layers, 1, 1)]
    step = FlatStep(list(range(3, 23)), list(range(20)), list(range(20)), [SeqSlice(0, 20, 20, (0, 1))], [19])
    want = ModelRunner(whole, kvs[0], backend, 16, torch.device("cpu")).run_flat(step)
    meta, _ = ModelRunner(stages[0], kvs[1], backend, 16, torch.device("cpu")).prepare(step)
    ids, pos = torch.tensor(step.ids), torch.tensor(step.pos)
    x, delta = stages[0].run_layers(stages[0].embed(ids), None, pos, kvs[1].layers, backend, meta)
    assert (delta is not None) == fused
    x, delta = stages[1].run_layers(x, delta, pos, kvs[2].layers, backend, meta)
    assert torch.equal(stages[1].compute_logits((x if delta is None else x + delta)[19:]), want)


def test_micro_batches_cover_the_step_decodes_first_and_cut_prefills_into_chunks():
    bs = 4
    # two decodes, then prefill chunks of 5 (context 9) and 7 (no context) tokens
    slices = [SeqSlice(0, 1, 6, (0, 1)), SeqSlice(1, 1, 3, (2,)), SeqSlice(2, 5, 9, (3, 4, 5)),
              SeqSlice(7, 7, 7, (6, 7))]
    step = FlatStep(list(range(100, 114)), [5, 2, 4, 5, 6, 7, 8, 0, 1, 2, 3, 4, 5, 6], list(range(14)), slices,
                    [0, 1, 6, 13])
    for m in (1, 2, 3, 4, 14, 20):
        parts = split(step, m, bs)
        assert 1 <= len(parts) <= m and all(p.ids for p in parts)
        assert sum((p.ids for p in parts), []) == step.ids and sum((p.slots for p in parts), []) == step.slots
        assert sum(len(p.sample_rows) for p in parts) == 4
        for p in parts:
            ones = [s.q_len == 1 for s in p.slices]
            assert ones == sorted(ones, reverse=True), (m, p.slices)  # the one-token rows first
            for s in p.slices:  # each piece's context ends at its last row's position + 1
                assert s.ctx_len == p.pos[s.q_start + s.q_len - 1] + 1 and len(s.block_ids) == -(-s.ctx_len // bs)
    parts = split(step, 4, bs)  # cuts at 3 (moved to 4: no prefill's first token alone), 7 and 10
    assert [len(p.ids) for p in parts] == [4, 3, 3, 4]
    assert parts[0].slices[2] == SeqSlice(2, 2, 6, (3, 4)) and parts[1].slices == [SeqSlice(0, 3, 9, (3, 4, 5))]
    assert parts[2].slices == [SeqSlice(0, 3, 3, (6,))] and parts[3].slices == [SeqSlice(0, 4, 7, (6, 7))]
    assert [p.sample_rows for p in parts] == [[0, 1], [2], [], [3]]


def _held(engine):
    return on_all_stages(engine, holding)


@pytest.mark.parametrize("shape, num_kv_blocks, in_flight", [
    ("llama", 96, 2),  # GQA; chunked prefill (64 tokens a step) and, on a second pass, prefix hits
    ("deepseek_v3", 24, 2),  # MLA + MoE (the dense layer on stage 0, the sparse one on stage 1); preemption
    ("llama", 96, 1),  # one step at a time (the default)
])
def test_pp2_greedy_equals_transformers(tiny_checkpoint, reference, shape, num_kv_blocks, in_flight):
    with LLM(str(tiny_checkpoint(shape)), num_kv_blocks=num_kv_blocks, max_num_batched_tokens=64,
             pipeline_parallel_size=2, pipeline_micro_batches=2, pipeline_steps_in_flight=in_flight) as llm:
        e = llm.engine
        held = _held(e)
        assert [h[0] for h in held] == [range(0, 1), range(1, 2)] and [h[2] for h in held] == [1, 1]
        assert [h[3:] for h in held] == [(True, False), (False, True)]
        on_all_stages(e, stage_times, True)  # zeroed
        run_and_compare(llm, reference, shape)
        times = on_all_stages(e, stage_times)
        assert all(t.steps == times[0].steps > 0 and t.busy_s > 0 for t in times)
        assert times[0].micro_batches > times[0].steps  # steps were cut in two
        assert e.in_flight == in_flight == e.runner.clock.most_in_flight  # steps in the pipeline at once
        if num_kv_blocks < 96:
            assert e.stats().num_preempted_total > 0, "the pool was meant to be too small for the batch"
        else:
            e.runner.micro_batches = 3  # stage 0's choice, step by step: the stages follow its cut
            hits = e.stats().prefix_hit_tokens_total
            run_and_compare(llm, reference, shape)
            assert e.stats().prefix_hit_tokens_total > hits
        drained(llm)


@pytest.mark.parametrize("shape, num_kv_blocks", [("llama", 96), ("deepseek_v3", 24)])
def test_pp2_tp2_greedy_equals_transformers(tiny_checkpoint, reference, shape, num_kv_blocks):
    """Four processes: each stage a TP group of two (heads, MLP and expert columns, vocab rows
    split), the stream handed from TP rank t of stage 0 to TP rank t of stage 1, the logits
    gathered on stage 1 and sent back by its rank 0. DeepSeek-V3 with a pool too small for the
    batch (preemption)."""
    with LLM(str(tiny_checkpoint(shape)), num_kv_blocks=num_kv_blocks, max_num_batched_tokens=64,
             pipeline_parallel_size=2, tensor_parallel_size=2, pipeline_micro_batches=2,
             pipeline_steps_in_flight=2) as llm:
        held = _held(llm.engine)
        assert [h[0] for h in held] == [range(0, 1)] * 2 + [range(1, 2)] * 2
        e = llm.engine
        assert e.tp.size == 2 and e.runner.model.cfg.num_heads == e.model_config.num_heads // 2
        run_and_compare(llm, reference, shape)  # chunked prefill, prefix hits within the batch
        assert (llm.engine.stats().num_preempted_total > 0) == (num_kv_blocks < 96)
        assert e.runner.clock.most_in_flight == 2
        drained(llm)


def test_a_request_aborted_while_its_step_is_in_flight(tiny_checkpoint, reference):
    """Two steps in flight: a request of the second is aborted after the first lands, while its
    own step is still in the pipeline. Its blocks go back at once (another request may take them:
    the stages run steps in order, so its step's stale writes come before any later step's), no
    token of it follows, and every other request's greedy tokens are still Hugging Face's."""
    from splitserve.types import Request
    from tests.greedy_parity import assert_greedy_equal
    from tests.unit.test_engine_parity import MAX_NEW

    hf, prompts, refs = reference("llama")
    with LLM(str(tiny_checkpoint("llama")), num_kv_blocks=96, max_num_batched_tokens=64,
             pipeline_parallel_size=2, pipeline_steps_in_flight=2) as llm:
        e = llm.engine
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
        for i, p in enumerate(prompts):
            e.add_request(Request(f"r{i}", tuple(p), sp))
        got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        aborted = None
        while e.has_unfinished():
            for c in e.step():
                assert c.request_id != aborted, "a token of an aborted request"
                got[c.request_id] += c.token_ids
            if aborted is None and e.steps_in_flight() and e._steps >= 4:
                held = e.pool.num_in_use
                aborted = e._flights[0].sched.scheduled[0].seq.request_id
                e.abort(aborted)
                assert e.pool.num_in_use < held  # at once, not when its step lands
                e.check_invariants()
        assert aborted is not None
        for i, p in enumerate(prompts):
            if f"r{i}" != aborted:
                assert_greedy_equal(hf, p, got[f"r{i}"], refs[i])
        assert e.steps_in_flight() == 0
        drained(llm)


def test_losing_a_stage_fails_the_engine_with_an_error_not_a_hang(tiny_checkpoint):
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with LLM(str(tiny_checkpoint("llama")), num_kv_blocks=32, pipeline_parallel_size=2) as llm:
        assert len(llm.generate([[5, 6, 7]], sp)[0].outputs[0].token_ids) == 4
        assert llm.engine.ranks.lost() is None
        stage1 = llm.engine.ranks.procs[0]
        stage1.kill()
        stage1.join(10)
        assert llm.engine.ranks.lost() == "pipeline stage 1 exited"
        with pytest.raises(RuntimeError, match="pipeline-parallel group is broken: pipeline stage 1 exited"):
            llm.generate([[8, 9, 10]], sp)  # refused before the step: no transfer waits on the dead stage
        assert llm.engine.pool.num_in_use == 0  # the failed request's blocks went back


@pytest.fixture()
def patient_stages(monkeypatch):
    """Stages whose transfers would wait an hour on a lost stage (the group's timeout, 60 s by
    default), far past the test's own timeout: a step that fails failed because the dead stage's
    connection closed, not because a timeout ran out."""
    import functools

    import splitserve.engine.engine as engine_module
    from splitserve.engine.parallel.pipe_group import start_local_stages

    monkeypatch.setattr(engine_module, "start_local_stages", functools.partial(start_local_stages, timeout_s=3600.0))


def test_a_stage_lost_inside_a_step_fails_that_step(tiny_checkpoint, patient_stages):
    """Unseen before the step (its loss not yet noticed): the activations' transfer to or from
    the dead stage raises — its connection closed — rather than wait."""
    from tests.unit.test_tensor_parallel import UnwatchedRanks

    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with LLM(str(tiny_checkpoint("llama")), num_kv_blocks=32, pipeline_parallel_size=2) as llm:
        watched = llm.engine.ranks
        llm.engine.ranks = UnwatchedRanks(watched)
        stage1 = watched.procs[0]
        stage1.kill()
        stage1.join(10)
        with pytest.raises(RuntimeError):
            llm.generate([[8, 9, 10]], sp)
        assert llm.engine.pp.failure.startswith("a collective of its pipeline-parallel group failed")
        llm.engine.ranks = watched


def test_a_stage_lost_with_two_steps_in_flight_fails_both_and_frees_their_blocks_once(tiny_checkpoint,
                                                                                     patient_stages):
    """Stage 1 killed right after a step is launched while another is still in the pipeline
    (unseen before the step, as above): the landing raises, no step stays in flight, and every
    request of both steps fails and gives its blocks back once (the pool's invariants hold)."""
    from tests.unit.test_tensor_parallel import UnwatchedRanks

    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(str(tiny_checkpoint("llama")), num_kv_blocks=32, pipeline_parallel_size=2,
             pipeline_steps_in_flight=2) as llm:
        e = llm.engine
        watched = e.ranks
        e.ranks = UnwatchedRanks(watched)
        launch, seen = e._launch, []

        def launch_then_kill(sched):  # a test wrapper: the kill lands between two launches
            handle = launch(sched)
            if len(seen) == 3:
                watched.procs[0].kill()
                watched.procs[0].join(10)
            seen.append(e.steps_in_flight())
            return handle

        e._launch = launch_then_kill
        with pytest.raises(RuntimeError):
            llm.generate([[5, 6, 7, 8], [9, 10, 11], [12, 13], [14, 15, 16, 17, 18]], sp)
        assert seen[3] == 1  # the kill came with another step in flight
        assert e.steps_in_flight() == 0 and not e.has_unfinished()
        e.check_invariants()
        assert e.pool.num_in_use == 0
        e.ranks = watched


def test_a_serving_loop_stops_at_the_first_failed_step_of_a_pipeline(tiny_checkpoint):
    """A worker's serving loop retries a failed step of one process, but a pipeline's stages
    wait in that step's transfers: the loop stops at once (its worker is replaced), as for TP."""
    import asyncio

    from splitserve.config import EngineConfig
    from splitserve.types import Request
    from splitserve.worker.engine_loop import EngineLoop
    from tests.unit.test_tensor_parallel import UnwatchedRanks

    loop = EngineLoop.start(EngineConfig(model=str(tiny_checkpoint("llama")), num_kv_blocks=32,
                                         pipeline_parallel_size=2))
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    watched = loop.engine.ranks
    loop.engine.ranks = UnwatchedRanks(watched)

    async def go():
        stage1 = watched.procs[0]
        stage1.kill()
        stage1.join(10)
        q = await loop.submit(Request("after-stage-loss", (5, 6, 7), sp))
        return await asyncio.wait_for(q.get(), 60)

    try:
        item = asyncio.run(go())
        assert isinstance(item, Exception) and "this engine has stopped" in str(item)
        assert loop.failure == "a step of its pipeline-parallel group failed with RuntimeError"  # no retries
    finally:
        loop.close()
        loop.engine.ranks = watched
        loop.engine.close()


def test_steps_in_flight_never_share_a_sequence_and_preempt_only_their_own_group():
    """The bookkeeping alone (EngineCore, no model): with 2 and 3 steps in flight and a pool too
    small for the batch, no sequence is in two steps at once, a step's sequences are all still
    running with their blocks when it lands (no preemption reached into a step in flight), the
    groups share the batch, and every request ends with the same tokens as one step at a time."""
    from splitserve.engine.core import EngineCore
    from splitserve.engine.sequence import Sequence, SeqStatus
    from splitserve.sim.engine import SimSampling
    from splitserve.types import Request

    class Paced(EngineCore):  # a model whose next token depends on the position only
        def __init__(self, **kw):
            super().__init__(**kw)
            self.flying: list[set[int]] = []
            self.most = 0
            self.sizes: list[int] = []

        def _new_seq(self, req, outputs=()):
            return Sequence(request=req, order=next(self._order), sampling=SimSampling(req.params, list(outputs)),
                            max_tokens=self.check_lengths(req), token_ids=list(req.prompt_token_ids) + list(outputs))

        def _launch(self, sched):
            ids = {id(s.seq) for s in sched.scheduled}
            assert all(not ids & other for other in self.flying), "a sequence in two steps at once"
            self.flying.append(ids)
            self.most = max(self.most, len(self.flying))
            self.sizes.append(len(sched.scheduled))
            return sched, ids

        def _land(self, handle):
            sched, ids = handle
            self.flying.remove(ids)
            for seq, n in sched.scheduled:
                assert seq.status is SeqStatus.RUNNING and seq.block_ids, "preempted while in flight"
            return [(seq, 3 + seq.num_tokens % 40, None) for seq, n in sched.scheduled
                    if seq.num_computed_tokens + n == seq.num_tokens]

        def _forward(self, sched):
            return self._land(self._launch(sched))

    def run(in_flight):
        e = Paced(block_size=4, num_blocks=24, max_num_seqs=16, max_num_batched_tokens=32, max_model_len=128,
                  in_flight=in_flight)
        sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        for i in range(10):
            e.add_request(Request(f"r{i}", tuple(range(5, 5 + 3 + 4 * i)), sp))
        out: dict[str, list[int]] = {}
        while e.has_unfinished():
            for c in e.step():
                out.setdefault(c.request_id, []).extend(c.token_ids)
            e.check_invariants()
        assert e.steps_in_flight() == 0 and e.pool.num_in_use == 0
        return out, e

    want, one = run(1)
    assert one.scheduler.num_preemptions > 0, "the pool was meant to be too small for the batch"
    for v in (2, 3):
        got, e = run(v)
        assert got == want and all(len(t) == 12 for t in got.values())
        assert e.most == v and e.scheduler.num_preemptions > 0
        assert max(e.sizes) < 10  # no step took the whole batch: each group a share
