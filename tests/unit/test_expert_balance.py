"""Expert load balancing (engine/expert_balance.py, model/expert_placement.py): redundant
replicas of experts in extra slots, placements re-planned from the measured tokens per expert
and applied between steps on every rank, with requests in flight.

Greedy tokens stay Hugging Face's (tie rule of test_engine_parity) with replicas and placements
changing mid-generation — plain, prefix hits, chunked prefill, preemption — in one process and
at TP 2 with expert parallelism (where a hot expert's rows are cut over replicas on both ranks).
In one process a placement changes no bit of the output (a rank computes all its replicas' rows
of an expert in one GEMM); at EP 2 neither does moving whole experts between ranks on a top-2
model (each token's two expert outputs meet in the all-reduce as they would on one rank)."""

import os
import random

import pytest
import torch
from fake_backend import exported

from splitserve import LLM, SamplingParams
from splitserve.config import EngineConfig
from splitserve.engine.model.expert_placement import ExpertPlacement, imbalance, plan
from splitserve.types import ConfigError, ExpertBalance
from tests.unit.test_engine_parity import drained, reference, run_and_compare  # noqa: F401  (a fixture)

SHAPES = ["deepseek_v3", "qwen3_moe"]  # 8 experts each: grouped sigmoid routing + shared expert; softmax top 2


def random_placement(rng: random.Random, p: ExpertPlacement) -> ExpertPlacement:
    """Every expert once, the spare slots random replicas, all shuffled over the ranks."""
    e, total = p.num_experts, p.ranks * p.slots_per_rank
    flat = list(range(e)) + [rng.randrange(e) for _ in range(total - e)]
    rng.shuffle(flat)
    s = p.slots_per_rank
    return ExpertPlacement(tuple(tuple(flat[r * s:(r + 1) * s]) for r in range(p.ranks)), e)


def placements(engine) -> tuple[ExpertPlacement, ...]:
    """Every MoE layer's placement, every stage's, as the stages hold them now."""
    return tuple(p for st in engine.stage_experts.get(engine, fresh=True) for p in st.placements)


def move_every(llm: LLM, steps: int, seed: int = 0) -> list[tuple[ExpertPlacement, ...]]:
    """From now on, a random placement applied every `steps` steps (in place of the planner,
    which in one process has no ranks to balance); the placements applied, in order."""
    eng = llm.engine
    bal, rng, applied = eng.expert_balancer, random.Random(seed), []

    def between_steps(engine):
        if engine._steps - bal.last_step >= steps:
            applied.append(tuple(random_placement(rng, p) for p in placements(engine)))
            bal.rebalance(engine, applied[-1])

    bal.between_steps = between_steps
    return applied


def spans_ranks(placements) -> bool:
    """Some expert has replicas on two ranks."""
    return any(len({g // p.slots_per_rank for g in reps}) > 1 for p in placements for reps in p.replicas())


# -- the planner -----------------------------------------------------------------------------
@pytest.mark.parametrize("ranks, slots", [(2, 4), (2, 5), (2, 6), (4, 3), (4, 4), (8, 2)])
def test_the_planner_lowers_the_busiest_rank_and_never_drops_an_expert(ranks, slots):
    rng = random.Random(ranks * 10 + slots)
    skewed = [[1000, 5, 5, 5, 5, 5, 5, 5], [0, 0, 0, 0, 0, 0, 400, 900],  # one or two hot experts
              [int(100 * rng.paretovariate(1.2)) for _ in range(8)],  # heavy-tailed
              [rng.randrange(50) for _ in range(8)], [7] * 8]
    for counts in skewed:
        start = ExpertPlacement.contiguous(8, ranks, slots)
        p = plan(counts, ranks, slots, start)
        assert sorted(set(p.flat())) == list(range(8)) and len(p.flat()) == ranks * slots  # no expert dropped
        assert max(p.rank_loads(counts)) <= max(start.rank_loads(counts)) + 1e-9
        # replicas beyond one per rank only once every expert that could use one has it
        reps = [len(r) for r in p.replicas()]
        assert max(reps) <= ranks or min(reps) >= ranks
        # the longest-processing-time bound: the busiest rank is at most the mean + one replica's load
        per_replica = max(counts[e] / reps[e] for e in range(8))
        assert max(p.rank_loads(counts)) <= sum(counts) / ranks + per_replica + 1e-9
    hot = [1000, 5, 5, 5, 5, 5, 5, 5]
    before = imbalance(ExpertPlacement.contiguous(8, ranks, slots).rank_loads(hot))
    after = imbalance(plan(hot, ranks, slots).rank_loads(hot))
    if ranks * slots > 8:  # spare slots: the hot expert gets replicas on other ranks
        assert after < before and len({g // slots for g in plan(hot, ranks, slots).replicas()[0]}) > 1
    else:  # no spare slot: nothing beats the rank that holds the hot expert
        assert after == before
    two_hot = [0, 0, 0, 0, 0, 0, 400, 900]  # both on the last rank to start with
    assert max(plan(two_hot, ranks, slots).rank_loads(two_hot)) < max(
        ExpertPlacement.contiguous(8, ranks, slots).rank_loads(two_hot))


def test_a_replan_keeps_the_slots_of_experts_that_stay():
    counts = [100, 1, 1, 1, 1, 1, 1, 90]
    first = plan(counts, 2, 5)
    again = plan(counts, 2, 5, first)
    assert again == first  # the same counts: nothing moves
    shifted = plan([1, 1, 1, 100, 1, 1, 1, 90], 2, 5, first)
    kept = sum(a == b for r in range(2) for a, b in zip(first.slots[r], shifted.slots[r]))
    assert kept >= 5  # most slots keep their expert: fewer weights to copy


def test_a_placement_without_every_expert_is_refused():
    with pytest.raises(ValueError, match="missing"):
        ExpertPlacement(((0, 1), (1, 2)), num_experts=4)
    with pytest.raises(ValueError, match="same number"):
        ExpertPlacement(((0, 1, 2), (3,)), num_experts=4)


# -- configuration ---------------------------------------------------------------------------
def test_the_knobs_are_validated(tiny_checkpoint):
    moe = str(tiny_checkpoint("qwen3_moe"))
    for name, bad in [("redundant_experts", -1), ("redundant_experts", 1.5), ("expert_rebalance_interval_steps", True),
                      ("expert_rebalance_interval_steps", -3)]:
        with pytest.raises(ConfigError, match=f"{name} must be a non-negative integer"):
            EngineConfig(model=moe, **{name: bad})
    with pytest.raises(ConfigError, match="need a mixture-of-experts model"):
        LLM(str(tiny_checkpoint("llama")), num_kv_blocks=16, redundant_experts=2)
    # refused before any rank starts: 8 + 1 slots do not split over 2 expert-parallel ranks
    with pytest.raises(ConfigError, match="redundant_experts 1 must divide evenly over the 2 expert-parallel ranks"):
        LLM(moe, num_kv_blocks=16, tensor_parallel_size=2, expert_parallel=True, redundant_experts=1)
    llm = LLM(moe, num_kv_blocks=16)
    assert llm.engine.expert_balancer is None and llm.engine.stats().expert_balance is None  # off: the plain path
    with pytest.raises(ConfigError, match="needs redundant_experts"):
        llm.engine.rebalance_experts()


# -- one process -----------------------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES)
def test_greedy_parity_with_replicas_placed_anew_mid_generation(tiny_checkpoint, reference, shape):
    """Plain and with prefix hits (a second pass), then chunked prefill (24 tokens a step) with
    a pool too small for the batch (preemption): a new random placement every 3 steps."""
    path = str(tiny_checkpoint(shape))
    llm = LLM(path, num_kv_blocks=256, redundant_experts=4, expert_rebalance_interval_steps=1)
    applied = move_every(llm, 3)
    run_and_compare(llm, reference, shape)
    run_and_compare(llm, reference, shape)
    assert llm.engine.stats().prefix_hit_tokens_total > 0
    drained(llm)
    llm = LLM(path, num_kv_blocks=24, max_num_batched_tokens=24, redundant_experts=4, expert_rebalance_interval_steps=1)
    again = move_every(llm, 3, seed=1)
    run_and_compare(llm, reference, shape)
    stats = llm.engine.stats()
    assert stats.num_preempted_total > 0, "the pool was meant to be too small for the batch"
    assert stats.expert_balance.rebalances_total == len(again) > 5
    assert len(applied) > 5 and any(max(map(len, p.replicas())) > 1 for a in applied + again for p in a)
    drained(llm)


def test_a_new_placement_mid_generation_changes_no_output_bit(tiny_checkpoint):
    """In one process: token ids and logprobs equal the plain engine's exactly, with a new
    placement (replicas included) after every step, through chunked prefill and decode."""
    path = str(tiny_checkpoint("deepseek_v3"))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (3, 17, 40, 70)]
    sp = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0, ignore_eos=True)
    kw = dict(num_kv_blocks=64, max_num_batched_tokens=32)
    plain = LLM(path, **kw).generate(prompts, sp)
    llm = LLM(path, redundant_experts=6, expert_rebalance_interval_steps=1, **kw)
    applied = move_every(llm, 1)
    moved = llm.generate(prompts, sp)
    assert len(applied) >= 10
    for a, b in zip(plain, moved):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [lp.logprob for lp in a.outputs[0].logprobs] == [lp.logprob for lp in b.outputs[0].logprobs]


# -- expert parallelism over 2 ranks -------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES)
def test_ep2_greedy_parity_with_replicas_rebalanced_by_the_planner(tiny_checkpoint, reference, shape):
    """Whole experts per rank, 5 slots each for 8 experts; the planner every 2 steps from the
    measured counts; chunked prefill (64 tokens a step), a pool small enough to preempt, then a
    second pass with prefix hits. Rebalances happen, hot experts get replicas on both ranks, and
    the rank imbalance before and after is reported."""
    with LLM(str(tiny_checkpoint(shape)), num_kv_blocks=32, max_num_batched_tokens=64, tensor_parallel_size=2,
             expert_parallel=True, redundant_experts=2, expert_rebalance_interval_steps=2) as llm:
        bal = llm.engine.expert_balancer
        seen = []
        plan_and_apply = bal.rebalance

        def rebalance(engine, placements=None):
            done = plan_and_apply(engine, placements)
            seen.extend(bal.placements if done else ())
            return done

        bal.rebalance = rebalance
        run_and_compare(llm, reference, shape)
        run_and_compare(llm, reference, shape)
        stats = llm.engine.stats()
        assert stats.num_preempted_total > 0 and stats.prefix_hit_tokens_total > 0
        b = stats.expert_balance
        assert (b.ranks, b.slots_per_rank) == (2, 5) and b.rebalances_total == len(seen) // len(bal.layers) > 0
        assert b.imbalance_before >= 1.0 and b.imbalance >= 1.0 and len(b.rank_tokens) == 2
        assert sum(b.replicas) == 10 * len(bal.layers) and min(b.replicas) >= len(bal.layers)
        assert spans_ranks(seen), "a hot expert was meant to get a replica on the other rank"
        drained(llm)


def test_ep2_experts_moved_between_ranks_mid_generation_change_no_output_bit(tiny_checkpoint):
    """qwen3_moe (top 2, no shared expert) at EP 2: the same batch twice on one engine, the
    second time with the experts permuted over the ranks every 2 steps: equal token ids and
    logprobs, bit for bit — the ranks computing alike: rank 0 on as many threads as the follower
    (launch.rank_main; a GEMM's rounding may depend on how many threads split it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // 2))
    try:
        _moved_between_ranks(tiny_checkpoint)
    finally:
        torch.set_num_threads(threads)


def _moved_between_ranks(tiny_checkpoint):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (4, 20, 45, 66)]
    sp = SamplingParams(temperature=0.0, max_tokens=10, logprobs=0, ignore_eos=True)
    with LLM(str(tiny_checkpoint("qwen3_moe")), num_kv_blocks=64, max_num_batched_tokens=32,
             enable_prefix_caching=False, tensor_parallel_size=2, expert_parallel=True,
             expert_rebalance_interval_steps=10**9) as llm:
        first = llm.generate(prompts, sp)
        applied = move_every(llm, 2)
        second = llm.generate(prompts, sp)
        assert len(applied) >= 4 and llm.engine.stats().expert_balance.rebalances_total == len(applied)
        for a, b in zip(first, second):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert [lp.logprob for lp in a.outputs[0].logprobs] == [lp.logprob for lp in b.outputs[0].logprobs]
        drained(llm)


# -- /metrics --------------------------------------------------------------------------------------
def test_the_rank_imbalance_before_and_after_is_exported_beside_the_experts():
    from splitserve.router.policy import WorkerView

    balance = ExpertBalance(ranks=2, slots_per_rank=5, replicas=(2, 1, 1, 1, 1, 1, 2, 1), rank_tokens=(60, 40),
                            imbalance=1.2, imbalance_before=1.8, rebalances_total=3)

    text = exported([WorkerView("w1", "decode", "h", expert_tokens=(3, 1, 0, 4), expert_balance=balance)]
                    ).exposition().decode()
    got = {ln.split("{")[1].split("}")[0]: float(ln.split()[-1]) for ln in text.splitlines()
           if ln.startswith("splitserve_worker_expert_imbalance")}
    assert got == {'role="decode",scope="expert",worker="w1"': 2.0, 'role="decode",scope="rank",worker="w1"': 1.2,
                   'role="decode",scope="rank_before_rebalance",worker="w1"': 1.8}


# -- pipeline parallelism: the MoE layers on another stage than the planner ---------------------
def test_pp2_counts_come_from_every_stage_and_replicas_placed_anew_keep_greedy_parity(tiny_checkpoint, reference):
    """DeepSeek-V3 at PP 2: its dense layer on stage 0, its MoE layer on stage 1 — the counts
    stage 0 reports and plans from are stage 1's; 4 redundant slots, a new random placement
    (replicas included) every 3 steps, sent to stage 1 between steps — with two steps in flight,
    so a placement reaches stage 1 behind a step stage 0 has not landed yet. Plain, then a
    second pass with prefix hits, chunked prefill (64 tokens a step) and a pool small enough to
    preempt."""
    with LLM(str(tiny_checkpoint("deepseek_v3")), num_kv_blocks=24, max_num_batched_tokens=64,
             pipeline_parallel_size=2, redundant_experts=4, expert_rebalance_interval_steps=1,
             pipeline_steps_in_flight=2) as llm:
        e = llm.engine
        assert e._moe_layers == [] and e.expert_tokens() == (0,) * 8  # stage 0 holds no MoE layer
        applied = move_every(llm, 3)
        run_and_compare(llm, reference, "deepseek_v3")
        run_and_compare(llm, reference, "deepseek_v3")
        stats = e.stats()
        assert stats.num_preempted_total > 0 and stats.prefix_hit_tokens_total > 0
        assert stats.expert_balance.rebalances_total == len(applied) > 5
        assert placements(e) == applied[-1]  # stage 1 holds what stage 0 sent last
        assert any(max(map(len, p.replicas())) > 1 for a in applied for p in a)
        routed = sum(e.stage_experts.get(e, fresh=True)[1].tokens[0])
        assert sum(e.expert_tokens()) == routed > 0  # top 2: two rows per token through the MoE layer
        assert sum(stats.expert_balance.rank_tokens) > 0 and sum(stats.expert_balance.replicas) == 12
        drained(llm)


def test_pp2_ep2_planner_rebalances_the_last_stages_experts(tiny_checkpoint, reference):
    """PP 2 x TP 2 with expert parallelism inside each stage: stage 0 plans every 2 steps from
    stage 1's counts and stage 1's two ranks move whole experts between them (5 slots each for
    8 experts); greedy stays Hugging Face's, a rebalance happens and a hot expert gets replicas
    on both of stage 1's ranks."""
    with LLM(str(tiny_checkpoint("deepseek_v3")), num_kv_blocks=32, max_num_batched_tokens=64,
             pipeline_parallel_size=2, tensor_parallel_size=2, expert_parallel=True, redundant_experts=2,
             expert_rebalance_interval_steps=2, pipeline_steps_in_flight=2) as llm:
        e = llm.engine
        run_and_compare(llm, reference, "deepseek_v3")
        b = e.stats().expert_balance
        assert (b.ranks, b.slots_per_rank) == (2, 5) and b.rebalances_total > 0
        assert b.imbalance_before >= 1.0 and len(b.rank_tokens) == 2 and sum(b.replicas) == 10
        assert spans_ranks(placements(e)), "a hot expert was meant to get a replica on the other rank"
        drained(llm)
