"""The planner (splitserve/sim/planner.py): it picks, of the candidates it simulates, the one with
the most goodput per GPU — a prefill:decode split where long prompts would stall an aggregated
worker's decode steps past a tight TPOT target, aggregated where the prompts are the work and a
tight TTFT wants every worker prefilling."""

from __future__ import annotations

import pytest

from splitserve.sim.cost.hardware import gpu
from splitserve.sim.cost.roofline import RooflineCost
from splitserve.sim.cost.shapes import model_shape
from splitserve.sim.planner import Candidate, candidates, plan, window
from splitserve.sim.simulation import SimConfig
from splitserve.sim.workload import SimRequestSpec, Workload
from splitserve.types import ConfigError

COST = RooflineCost(gpu("h200"), model_shape("llama-3-8b"))
AGG, SPLIT = Candidate(0, 2, "slo", 2048), Candidate(1, 1, "threshold", 2048)


def uniform(n: int, every_s: float, prompt: int, output: int) -> Workload:
    return Workload(tuple(SimRequestSpec(i, i * every_s, prompt, output) for i in range(n)), 16, "uniform")


def test_candidates_are_every_budget_aggregated_then_every_split():
    names = [c.name for c in candidates(4, budgets=(512, 2048), deciders=("threshold", "slo"))]
    assert names == ["aggregated/512", "aggregated/2048", "pd/1:3", "pd/2:2", "pd/3:1",
                     "pd-slo/1:3", "pd-slo/2:2", "pd-slo/3:1"]
    with pytest.raises(ConfigError):
        candidates(0)


def test_window_cuts_a_slice_and_moves_it_to_time_zero():
    w = window(uniform(10, 0.5, 100, 10), 4, 3)
    assert [(r.index, r.arrival_s) for r in w.requests] == [(0, 0.0), (1, 0.5), (2, 1.0)]
    with pytest.raises(ConfigError):
        window(w, 5, 3)


def test_long_prompts_and_a_tight_tpot_plan_a_split():
    # 8K-token prompts: an aggregated worker's steps carrying a 2048-token chunk take ~60 ms,
    # past the 15 ms TPOT of every request decoding beside it; a prefill worker keeps them apart
    base = SimConfig(block_size=16, ttft_slo_ms=3000, tpot_slo_ms=15)
    p = plan(COST, uniform(24, 0.5, 8192, 128), base, 2, 0.9, (AGG, SPLIT), iters=2, max_scale=16)
    by = {s.candidate.name: s.goodput for s in p.scored}
    assert (p.prefill, p.decode, p.decider) == (1, 1, "threshold"), by
    assert by["pd/1:1"] > 1.2 * by["aggregated/2048"], by
    assert p.goodput == by["pd/1:1"] and not p.autoscale
    assert p.deploy_values() == {"prefill": 1, "decode": 1, "pd_decider": "threshold",
                                 "engine": {"max_num_batched_tokens": 2048}, "autoscale": False}


def test_short_outputs_and_a_tight_ttft_plan_aggregated():
    # 2K-token prompts, 8 tokens out, TTFT 300 ms: the prompts are the work and the TPOT is loose;
    # two workers prefill them where a split has one
    base = SimConfig(block_size=16, ttft_slo_ms=300, tpot_slo_ms=200)
    p = plan(COST, uniform(60, 0.1, 2048, 8), base, 2, 0.9, (AGG, SPLIT), iters=2, max_scale=16)
    by = {s.candidate.name: s.goodput for s in p.scored}
    assert (p.prefill, p.decode, p.budget) == (0, 2, 2048), by
    assert by["aggregated/2048"] > 1.2 * by["pd/1:1"], by


def test_the_planner_needs_an_slo():
    with pytest.raises(ConfigError):
        plan(COST, uniform(2, 1.0, 100, 4), SimConfig(), 2, cands=(AGG,))


def test_simulate_plan_prints_and_writes_the_deploy_values(tmp_path, capsys):
    import json

    from splitserve.cli.main import main

    out = tmp_path / "plan.json"
    assert main(["simulate", "--dataset", "random", "--num-requests", "24", "--rate", "2", "--input-len", "8192", "8192",
                 "--output-len", "128", "128", "--gpu", "h200", "--model", "llama-3-8b", "--aggregated", "2",
                 "--ttft-slo-ms", "3000", "--tpot-slo-ms", "15", "--plan", "--out", str(out)]) == 0
    said = json.loads(out.read_text())
    assert said["plan"] == "pd/1:1" and said["deploy"]["prefill"] == 1, said
    assert {s["name"] for s in said["scored"]} >= {"aggregated/2048", "pd/1:1"}
    assert 'DeployConfig: {"prefill": 1, "decode": 1' in capsys.readouterr().out
    # without an SLO there is nothing to plan for: a clear error, not a traceback
    assert main(["simulate", "--dataset", "random", "--num-requests", "4", "--aggregated", "2", "--gpu", "h200",
                 "--model", "llama-3-8b", "--plan", "--out", str(out)]) != 0
