"""Data-parallel attention + expert parallelism (engine/parallel/dp_engine.py): two replicas (two
local processes over gloo), each a whole engine on its own requests and KV cache, holding half
of every MoE layer's experts; each MoE layer sends the tokens to their experts' replica and back.

Greedy tokens equal Hugging Face's (tie rule of test_engine_parity) on DeepSeek-V3's shape
(latent attention, grouped sigmoid routing, a shared expert, a dense first layer) and
Qwen3-MoE's (softmax top 2; and Qwen2-MoE's, plain) — plain, prefix hits, chunked prefill, preemption — and with
redundant experts rebalanced across the replicas mid-generation; the front spreads the requests
over both replicas; a replica with no request still steps with the other; a replica that dies
fails the engine with an error."""

import os
import signal

import pytest

from splitserve import LLM, SamplingParams
from splitserve.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.types import ConfigError, Request
from tests.unit.test_engine_parity import MAX_NEW, reference, run_and_compare  # noqa: F401  (a fixture)

SHAPES = ["deepseek_v3", "qwen3_moe"]


def drained(llm) -> None:
    """Every replica's invariants hold, nothing runs or holds a block; the front agrees."""
    eng = llm.engine
    eng.check_invariants()
    assert not eng.has_unfinished() and eng.holds_nothing()
    for c in eng.replica_block_counts():
        assert c["in_use"] == 0 and c["free"] + c["cached"] == c["total"]


def both_replicas_served(llm) -> None:
    per = llm.engine.replica_stats()
    assert len(per) == 2 and all(s.prefill_tokens_total > 0 for s in per), [s.prefill_tokens_total for s in per]


@pytest.mark.parametrize("shape", SHAPES + ["qwen2_moe"])  # + a gated shared expert, a dense layer after a sparse one
def test_dp2_ep2_greedy_parity_plain_and_prefix_hits(tiny_checkpoint, reference, shape):
    with LLM(str(tiny_checkpoint(shape)), num_kv_blocks=128, data_parallel_size=2) as llm:
        run_and_compare(llm, reference, shape)
        both_replicas_served(llm)
        run_and_compare(llm, reference, shape)  # the shared prefixes hit (on whichever replica holds them)
        stats = llm.engine.stats()
        assert stats.prefix_hit_tokens_total > 0 and stats.kv_blocks_total == 256
        assert stats.expert_balance is None and sum(stats.expert_tokens_total) > 0
        drained(llm)


@pytest.mark.parametrize("shape", SHAPES)
def test_dp2_ep2_greedy_parity_chunked_and_preempted(tiny_checkpoint, reference, shape):
    """24 tokens a step per replica, 16 blocks each: chunks, and preemption."""
    with LLM(str(tiny_checkpoint(shape)), num_kv_blocks=16, max_num_batched_tokens=24, data_parallel_size=2) as llm:
        run_and_compare(llm, reference, shape)
        both_replicas_served(llm)
        assert llm.engine.stats().num_preempted_total > 0, "the pools were meant to be too small for the batch"
        drained(llm)


def test_dp2_ep2_greedy_parity_with_redundant_experts_rebalanced(tiny_checkpoint, reference):
    """5 slots per replica for 8 experts, the planner every 2 steps from both replicas' summed
    counts: rebalances happen, a hot expert gets a replica on the other rank (its rows cut
    over both), with preemption, then a second pass with prefix hits."""
    shape = "deepseek_v3"
    with LLM(str(tiny_checkpoint(shape)), num_kv_blocks=24, max_num_batched_tokens=64, data_parallel_size=2,
             redundant_experts=2, expert_rebalance_interval_steps=2) as llm:
        eng = llm.engine
        seen = []
        rebalance = eng.rebalance_experts

        def recording(placements=None):
            done = rebalance(placements)
            seen.extend(eng.engine.expert_balancer.placements if done else ())
            return done

        eng.rebalance_experts = recording
        run_and_compare(llm, reference, shape)
        run_and_compare(llm, reference, shape)
        stats = eng.stats()
        assert stats.num_preempted_total > 0 and stats.prefix_hit_tokens_total > 0
        b = stats.expert_balance
        layers = len(eng.engine.expert_balancer.layers)
        assert (b.ranks, b.slots_per_rank) == (2, 5) and b.rebalances_total == len(seen) // layers > 0
        assert b.imbalance_before >= 1.0 and b.imbalance >= 1.0 and len(b.rank_tokens) == 2
        assert any(len({g // p.slots_per_rank for g in reps}) > 1 for p in seen for reps in p.replicas()), \
            "a hot expert was meant to get a replica on the other rank"
        # every replica holds the same placement
        assert len({tuple(p) for p in eng.on_all_replicas(_placements)}) == 1
        both_replicas_served(llm)
        drained(llm)


def _placements(engine):
    return engine.expert_balancer.placements


def test_a_replica_without_requests_steps_with_the_other(tiny_checkpoint, reference):
    """One request: its replica runs forward passes, the other none — it joins each step's
    expert exchange with zero rows (else the first would wait in it)."""
    shape = "deepseek_v3"
    hf, prompts, refs = reference(shape)
    with LLM(str(tiny_checkpoint(shape)), num_kv_blocks=64, data_parallel_size=2) as llm:
        out = llm.generate([prompts[3]], SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
        assert list(out[0].outputs[0].token_ids) == refs[3]
        steps = sorted(s.steps_total for s in llm.engine.replica_stats())
        assert steps[0] == 0 and steps[1] >= len(refs[3]) > 0
        drained(llm)


def test_the_front_places_each_request_on_the_replica_with_fewer_context_tokens(tiny_checkpoint):
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with LLM(str(tiny_checkpoint("qwen3_moe")), num_kv_blocks=64, data_parallel_size=2) as llm:
        eng = llm.engine
        eng.add_request(Request("long", list(range(3, 83)), sp))
        eng.add_request(Request("short-1", list(range(3, 13)), sp))
        eng.add_request(Request("short-2", list(range(3, 23)), sp))  # 80 vs 10 tokens: with short-1 again
        assert [eng.replica_of(r) for r in ("long", "short-1", "short-2")] == [0, 1, 1]
        with pytest.raises(ConfigError, match="already running"):
            eng.add_request(Request("short-1", [5, 6], sp))
        eng.abort("long")  # its replica is free again: the next goes there
        eng.add_request(Request("next", [5, 6, 7], sp))
        assert eng.replica_of("next") == 0
        while eng.has_unfinished():
            eng.step()
        drained(llm)


def test_data_parallel_settings_are_validated(tiny_checkpoint):
    moe = str(tiny_checkpoint("qwen3_moe"))
    with pytest.raises(ConfigError, match="data_parallel_size must be a positive integer"):
        EngineConfig(model=moe, data_parallel_size=0)
    with pytest.raises(ConfigError, match="not supported with tensor_parallel_size or pipeline_parallel_size"):
        EngineConfig(model=moe, data_parallel_size=2, tensor_parallel_size=2)
    # refused before any replica starts
    with pytest.raises(ConfigError, match="needs a mixture-of-experts model"):
        LLM(str(tiny_checkpoint("llama")), num_kv_blocks=16, data_parallel_size=2)
    with pytest.raises(ConfigError, match="data_parallel_size 3 does not divide num_experts 8"):
        LLM(moe, num_kv_blocks=16, data_parallel_size=3)
    with pytest.raises(ConfigError, match="redundant_experts 1 must divide evenly over the 2 expert-parallel ranks"):
        LLM(moe, num_kv_blocks=16, data_parallel_size=2, redundant_experts=1)
    with pytest.raises(ConfigError, match="DataParallelEngine"):
        Engine(EngineConfig(model=moe, num_kv_blocks=16, data_parallel_size=2))


def test_a_replica_killed_while_idle_fails_the_next_step(tiny_checkpoint):
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with LLM(str(tiny_checkpoint("qwen3_moe")), num_kv_blocks=64, data_parallel_size=2) as llm:
        proc = llm.engine.ranks.procs[0]
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        with pytest.raises(RuntimeError, match="data-parallel group is broken: data-parallel replica 1 exited"):
            llm.generate([[5, 6, 7], [8, 9, 10]], sp)


def test_a_replica_that_dies_in_a_step_fails_the_step(tiny_checkpoint):
    """Replica 1 exits inside its next step, before its MoE exchanges: replica 0's all-to-all
    raises (the connection closes) rather than wait."""
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with LLM(str(tiny_checkpoint("qwen3_moe")), num_kv_blocks=64, data_parallel_size=2) as llm:
        llm.engine.on_all_replicas(_die_in_the_next_step)
        with pytest.raises(RuntimeError):
            llm.generate([[5, 6, 7], [8, 9, 10]], sp)
        assert llm.engine.ranks.lost() is not None or llm.engine.group.failure is not None


def _die_in_the_next_step(engine):
    """A fault (on replica 1 only): its next step exits the process."""
    if engine.dp.rank == 1:
        engine.step = lambda: os._exit(1)


def test_a_step_that_fails_here_stops_the_engine(tiny_checkpoint):
    """Replica 0's step raises (a fault injected): the other may still be inside that step's
    exchanges, so no later step is ordered — the engine says it is broken instead."""
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with LLM(str(tiny_checkpoint("qwen3_moe")), num_kv_blocks=64, data_parallel_size=2) as llm:
        def fail():
            raise ValueError("injected")

        llm.engine.engine.step = fail
        with pytest.raises(ValueError, match="injected"):
            llm.generate([[5, 6, 7], [8, 9, 10]], sp)
        with pytest.raises(RuntimeError, match="data-parallel group is broken: a step failed with ValueError"):
            llm.generate([[5, 6, 7]], sp)
