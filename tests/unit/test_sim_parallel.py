"""The parallel roofline (splitserve/sim/cost/parallel.py, comm.py, mla_moe.py): pipeline stages
and their bubble, data-parallel attention with expert parallelism and its all-to-all, cross-node
tensor parallelism's all-reduces, DeepSeek-V3/R1's shape — each term against its formula worked
by hand — and the seed study (benchmarks/sim_seed_study.py) ranking its strategies as the
formulas do, which the event simulation agrees with."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

from splitserve.engine.step_shape import StepShape
from splitserve.sim.capacity import decode_capacity, pd_capacity
from splitserve.sim.cost.comm import (all_to_all_bytes, all_to_all_s, allreduce_s, bubble_factor, experts_hit,
                                      pipeline_s)
from splitserve.sim.cost.hardware import gpu
from splitserve.sim.cost.mla_moe import MLAMoEShape
from splitserve.sim.cost.parallel import Layout, ParallelCost
from splitserve.sim.cost.roofline import RooflineCost
from splitserve.sim.cost.shapes import model_shape
from splitserve.sim.report import summarize
from splitserve.sim.simulation import SimConfig, Simulation
from splitserve.sim.workload import SimRequestSpec, Workload
from splitserve.types import ConfigError

R1, H20, H800 = model_shape("deepseek-r1"), gpu("h20"), gpu("h800")
DP16 = Layout(dp_attention=16, expert_parallel=True)
DECODE = StepShape(0, 0.0, 0, 256, 256 * 3000, 256)


def _study():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "sim_seed_study.py"
    spec = importlib.util.spec_from_file_location("sim_seed_study", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


# -- DeepSeek-V3/R1's shape ---------------------------------------------------------------------------
def test_deepseek_shape_counts_671b_parameters_37b_active_and_a_576_value_latent():
    assert R1.total_params == pytest.approx(671e9, rel=0.01)
    assert R1.active_params == pytest.approx(37e9, rel=0.03)
    assert R1.kv_bytes_per_token == 61 * (512 + 64) * 2
    layers = R1.layers()
    assert len(layers) == 61 and [x.experts for x in layers[:4]] == [0, 0, 0, 256]
    assert all(not x.kv_by_heads for x in layers)  # one latent: not split by TP's heads
    # FP8 linear weights, bf16 embedding and head
    assert R1.weight_bytes == pytest.approx(R1.total_params - R1.embedding_params + 2 * R1.embedding_params)
    cfg = {"num_hidden_layers": 61, "first_k_dense_replace": 3, "hidden_size": 7168, "intermediate_size": 18432,
           "num_attention_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
           "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256, "n_shared_experts": 1,
           "moe_intermediate_size": 2048, "num_experts_per_tok": 8, "vocab_size": 129280,
           "quantization_config": {"quant_method": "fp8"}}
    assert MLAMoEShape.from_config(cfg, "deepseek-r1") == R1


def test_h20_and_h800_as_sourced_and_fp8_gemms_at_the_fp8_rate():
    assert (H20.bf16_flops, H20.fp8_flops, H20.hbm_bytes, H20.hbm_bandwidth) == (148e12, 296e12, 96e9, 4.0e12)
    assert (H800.bf16_flops, H800.fp8_flops, H800.hbm_bytes, H800.nvlink_bandwidth) == (989e12, 1979e12, 80e9, 200e9)
    assert gpu("a100").weight_flops == gpu("a100").bf16_flops  # no FP8 tensor cores
    with pytest.raises(ConfigError):
        RooflineCost(H20, R1, tensor_parallel=16)  # the dense roofline refuses it, naming the parallel one


# -- one stage of a dense model: the old roofline, exactly ----------------------------------------------
def test_one_stage_of_a_dense_model_is_the_tensor_parallel_roofline():
    shapes = (DECODE, StepShape(2048, 2048 * 1024.5, 2048, 0, 0, 1), StepShape(1000, 5e5, 3000, 32, 32 * 4000, 33))
    for name, t in (("llama-3-8b", 1), ("llama-3-70b", 4), ("llama-3-70b", 8)):
        old = RooflineCost(gpu("h200"), model_shape(name), tensor_parallel=t)
        new = ParallelCost(gpu("h200"), model_shape(name), Layout(tp=t))
        assert [new.step_s(s) for s in shapes] == pytest.approx([old.step_s(s) for s in shapes], rel=1e-12)
        assert new.kv_blocks(16) == old.kv_blocks(16) and new.gpus_per_worker == t


# -- pipeline parallelism --------------------------------------------------------------------------------
def test_the_bubble_formula_and_the_pipelined_step():
    assert bubble_factor(2, 1) == 2 and bubble_factor(4, 4) == 7 / 4 and bubble_factor(1, 8) == 1
    t, S = 0.04, 4
    for m in (1, 2, 4, 8):  # equal stages of t / m a micro-batch: t · (S + m - 1) / m
        assert pipeline_s([t / m] * S, m) == pytest.approx(t * bubble_factor(S, m))
        assert pipeline_s([t / m] * S, m, schedule="async") == pytest.approx(max(S, m) * t / m)
    assert pipeline_s([1.0, 3.0], 3, transfer_s=0.5) == 1 + 3 + 2 * 3 + 0.5
    # a compute-bound prefill on 4 stages of TP 2: each micro-batch's stage time is 1/m of the
    # whole batch's, and the step is Σ stages + (m-1) × the slowest + 3 transfers
    prefill = StepShape(16384, 16384 * 64.5, 16384, 0, 0, 128)
    costs = {m: ParallelCost(gpu("h200"), model_shape("llama-3-70b"), Layout(tp=2, pp=4, micro_batches=m))
             for m in (1, 4)}
    one, _ = costs[1].stage_times(prefill)
    four, step = costs[4].stage_times(prefill)
    assert four == pytest.approx([x / 4 for x in one], rel=0.01)
    _, hop, m = costs[4].terms(prefill)
    assert m == 4 and hop > 0
    assert step - costs[4].step_overhead_s == pytest.approx(sum(four) + 3 * max(four) + 3 * hop)
    assert step < costs[1].step_s(prefill)  # the bubble shrinks with micro-batches


def test_each_stage_holds_its_layers_kv_one_sth_of_the_models():
    for shape, tp in ((model_shape("llama-3-70b"), 2), (R1, 8)):
        c = ParallelCost(H20 if shape is R1 else gpu("h200"), shape, Layout(tp=tp, pp=2))
        per_rank = shape.kv_bytes_per_token / (tp if shape.layers()[0].kv_by_heads else 1)
        kv = [st.kv_bytes_per_token for st in c.stages]
        assert sum(kv) == pytest.approx(per_rank)
        for st, rng in zip(c.stages, c.layout.stage_layers(len(shape.layers()))):
            assert st.kv_bytes_per_token == pytest.approx(per_rank * len(rng) / len(shape.layers()))
    llama = ParallelCost(gpu("h200"), model_shape("llama-3-70b"), Layout(tp=2, pp=4))
    assert all(st.kv_bytes_per_token == model_shape("llama-3-70b").kv_bytes_per_token / 2 / 4 for st in llama.stages)
    # the worker's tokens: what the fullest stage's ranks have left, over its per-token KV
    free = min((H20.hbm_bytes * 0.9 - st.held_bytes - 4e9) / st.kv_bytes_per_token
               for st in ParallelCost(H20, R1, Layout(tp=8, pp=2)).stages)
    assert ParallelCost(H20, R1, Layout(tp=8, pp=2)).kv_tokens == pytest.approx(free)


def test_stages_across_nodes_send_activations_over_the_nics():
    c = ParallelCost(H20, R1, Layout(tp=8, pp=2, micro_batches=2))
    assert c.layout.boundary_crosses_nodes(0) and c.layout.gpus == 16
    _, hop, m = c.terms(DECODE)
    nbytes = DECODE.decode_seqs / m / 8 * R1.hidden * 2  # a micro-batch's tokens × hidden × bf16, 1/8 a rank
    assert hop == pytest.approx(c.cross_node_latency_s + nbytes / (H20.network_bandwidth * c.link_efficiency))


# -- cross-node tensor parallelism ------------------------------------------------------------------------
def test_cross_node_tp_takes_two_all_reduces_a_layer_each_at_the_cross_node_latency():
    tp16 = ParallelCost(H20, R1, Layout(tp=16))
    assert tp16.allreduces_per_pass == 2 * 61 == 122
    later = dataclasses.replace(tp16, cross_node_latency_s=tp16.cross_node_latency_s + 1e-3)
    assert later.step_s(DECODE) - tp16.step_s(DECODE) == pytest.approx(122e-3)
    # hierarchical: NVLink within each node, each rank's 1/8 share over its NIC across the two nodes
    msg = 256 * R1.hidden * 2
    nv, net = H20.nvlink_bandwidth * 0.8, H20.network_bandwidth * 0.8
    one = allreduce_s(msg, 16, 8, nv, net, 30e-6)
    assert one == pytest.approx(30e-6 + 2 * 7 / 8 * msg / nv + 2 * 1 / 2 * msg / 8 / net)
    assert allreduce_s(msg, 8, 8, nv, net, 0.0) == pytest.approx(2 * 7 / 8 * msg / nv)  # a ring within a node
    assert tp16.terms(DECODE)[0][0].allreduce_s == pytest.approx(122 * one)
    assert ParallelCost(H20, R1, Layout(tp=8, pp=2)).allreduces_per_pass == 122  # within a node: cheaper each
    assert ParallelCost(H20, R1, DP16).allreduces_per_pass == 0


# -- data-parallel attention + expert parallelism ------------------------------------------------------------
def test_all_to_all_bytes_and_time_over_nvlink_and_the_network():
    assert all_to_all_bytes(100, 8, 7168, 1) == 100 * 8 * 7168
    b, nv, net = 1e6, 400e9, 40e9
    assert all_to_all_s(b, 8, 8, nv, net, 1e-5, 3e-5) == pytest.approx(1e-5 + b * 7 / 8 / nv)
    assert all_to_all_s(b, 16, 8, nv, net, 1e-5, 3e-5) == pytest.approx(3e-5 + b * 8 / 16 / net)
    assert all_to_all_s(b, 1, 8, nv, net, 1e-5, 3e-5) == 0.0
    # the worker's term: a dispatch (FP8) and a combine (bf16) each MoE layer, for a rank's 1/16 of the tokens
    for imb in (1.0, 1.5):
        c = ParallelCost(H20, R1, DP16, expert_imbalance=imb)
        per_rank = DECODE.decode_seqs / 16 * imb
        one = sum(all_to_all_s(all_to_all_bytes(per_rank, 8, 7168, d), 16, 8, H20.nvlink_bandwidth * 0.8,
                               H20.network_bandwidth * 0.8, 10e-6, 30e-6) for d in (1, 2))
        assert c.all_to_alls_per_pass == 2 * 58
        assert c.terms(DECODE)[0][0].all_to_all_s == pytest.approx(58 * one)


def test_dp_attention_holds_the_latent_once_a_replica_and_experts_spread_over_the_ranks():
    tp16, dp16 = ParallelCost(H20, R1, Layout(tp=16)), ParallelCost(H20, R1, DP16)
    assert dp16.kv_tokens > 8 * tp16.kv_tokens  # TP 16 holds the latent on every rank
    st = dp16.stages[0]
    assert st.expert_bytes == pytest.approx(58 * math.ceil(256 / 16) * R1.expert_params)  # FP8: a byte each
    assert st.kv_bytes_per_token == R1.kv_bytes_per_token
    # the routed FLOPs split over the 16 ranks, the attention's over the replicas
    assert st.routed_flops == pytest.approx(2 * 58 * 8 * R1.expert_params / 16)
    with pytest.raises(ConfigError):
        ParallelCost(H20, R1, Layout(dp_attention=16))  # every replica would hold every expert
    with pytest.raises(ConfigError):
        ParallelCost(H20, R1, Layout(tp=8))  # 671 GB on 8 × 96 GB: no KV left at 90%
    assert experts_hit(1, 256, 8) == pytest.approx(8) and experts_hit(10 ** 4, 256, 8) == pytest.approx(256)
    # a lone decode reads only the experts it picks: far less than a full batch's
    assert dp16.step_s(StepShape(0, 0.0, 0, 1, 3000, 1)) < dp16.step_s(DECODE)


# -- capacity and the study --------------------------------------------------------------------------------
def test_capacity_is_the_largest_batch_within_the_tpot_target_and_the_kv():
    c = ParallelCost(H20, R1, DP16)
    cap = decode_capacity(c, 2048, 1536, 0.05, 10 ** 6)
    assert cap.bound == "tpot" and cap.step_s <= 0.05
    assert decode_capacity(c, 2048, 1536, 0.05, cap.batch + 1).batch == cap.batch  # not bound by max_seqs
    assert cap.output_tokens_per_s == pytest.approx(cap.batch / cap.step_s)
    tp16 = decode_capacity(ParallelCost(H20, R1, Layout(tp=16)), 2048, 1536, 1.0, 10 ** 6)
    assert tp16.bound == "kv" and tp16.batch == int(ParallelCost(H20, R1, Layout(tp=16)).kv_blocks(64) * 64 // 2816)
    pd = pd_capacity(ParallelCost(H20, R1, Layout(tp=16)), c, 1, 1, 2048, 1536, 0.05, 10 ** 6, 2048)
    assert pd.gpus == 32 and pd.output_tokens_per_s <= decode_capacity(c, 2048, 1536, 0.05, 10 ** 6,
                                                                      with_prompts=False).output_tokens_per_s


def test_the_seed_study_ranks_strategies_by_their_formulas_and_the_simulation_agrees(tmp_path):
    study = _study()
    rows = [{"name": s.name, **study.describe(s), "capacity_tpot50": study.capacity(s, 50.0),
             "capacity_tpot100": study.capacity(s, 100.0), "ceiling": study.ceiling(s)} for s in study.STRATEGIES]
    by = {r["name"]: r for r in rows}
    ranked = study.compare(rows)["by_capacity_per_gpu"]
    assert ranked == sorted(by, key=lambda n: -by[n]["capacity_tpot50"]["per_gpu"])
    assert by["tp16"]["capacity_tpot50"]["bound"] == "kv"  # cross-node TP: the replicated latent fills HBM
    assert by["tp16"]["allreduces_per_pass"] == 122 and by["dp16-ep16"]["all_to_alls_per_pass"] == 116
    # the imbalance only costs; async micro-batches beat the flushed ones; the ceiling bounds the capacity
    assert by["dp16-ep16 (imbalance 1.3)"]["capacity_tpot50"]["per_gpu"] < by["dp16-ep16"]["capacity_tpot50"]["per_gpu"]
    assert by["tp8-pp2-m2-async"]["capacity_tpot50"]["per_gpu"] > by["tp8-pp2-m2"]["capacity_tpot50"]["per_gpu"]
    assert all(r["capacity_tpot100"]["per_gpu"] <= r["ceiling"]["per_gpu"] for r in rows if r["gpus"] == 16
               and "pd" not in r["name"])
    # a saturating burst through the event simulation orders three strategies as their capacities do
    n, inp, out = 240, 2048, 96
    w = Workload(tuple(SimRequestSpec(i, i * 1e-3, inp, out) for i in range(n)), 64, "burst")
    sim, formula = {}, {}
    for name in ("tp8-pp2", "tp16", "dp8-ep8-pp2-m2-async"):
        s = next(x for x in study.STRATEGIES if x.name == name)
        cost = s.cost(s.decode)
        formula[name] = decode_capacity(cost, inp, out, 10.0, min(n, s.max_seqs()), 64).output_tokens_per_s
        cfg = SimConfig(prefill=0, decode=1, block_size=64, max_num_seqs=s.max_seqs(), admission=False,
                        max_num_batched_tokens=2048 * s.decode.dp_attention)
        sim[name] = summarize(Simulation(cfg, cost, w).run())["output_tokens_per_s"]
    assert sorted(sim, key=sim.get) == sorted(formula, key=formula.get)
    for name in sim:  # and within the burst's fill and drain of the steady state
        assert 0.8 * formula[name] < sim[name] < 1.02 * formula[name]


def test_the_cli_simulates_a_dp_attention_expert_parallel_worker(tmp_path):
    from splitserve.cli.main import main

    out = tmp_path / "s.json"
    assert main(["simulate", "--dataset", "random", "--num-requests", "12", "--rate", "20", "--gpu", "h20",
                 "--model", "deepseek-r1", "--aggregated", "1", "--dp-attention", "8", "--expert-parallel",
                 "--pipeline-parallel", "2", "--micro-batches", "2", "--pp-schedule", "async", "--max-num-seqs", "1024",
                 "--no-plot", "--out", str(out)]) == 0
    s = json.loads(out.read_text())
    assert s["gpus"] == 16 and s["completed"] == 12
    assert s["cost_model"]["name"] == "parallel" and s["cost_model"]["layout_name"] == "dp8-ep8-pp2-m2-async"
    assert main(["simulate", "--dataset", "random", "--gpu", "h20", "--model", "deepseek-r1", "--aggregated", "1",
                 "--dp-attention", "16", "--out", str(out)]) == 2  # DP attention without EP: a clear error
