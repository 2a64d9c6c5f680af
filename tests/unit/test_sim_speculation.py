"""Speculative decoding in the simulator (sim/speculation.py): at acceptance 0 it cannot raise
throughput (a verify step costs at least a decode step and still yields one token); at α = 0.8,
k = 4, in the memory-bound regime (batch 1 on an H200 roofline), TPOT falls by the expected
tokens per step (1 − α^(k+1)) / (1 − α), the verify step costing about a decode step; the CLI
takes --spec-k / --spec-acceptance and bad values are refused by name."""

import argparse

import pytest

from splitserve.engine.step_shape import StepShape
from splitserve.sim import command
from splitserve.sim.cost.hardware import gpu
from splitserve.sim.cost.roofline import RooflineCost
from splitserve.sim.cost.shapes import model_shape
from splitserve.sim.simulation import SimConfig, Simulation
from splitserve.sim.speculation import SpecSim
from splitserve.sim.workload import SimRequestSpec, Workload
from splitserve.types import ConfigError


def _tpot(spec: SpecSim, n: int = 1) -> float:
    cost = RooflineCost(gpu("h200"), model_shape("llama-3-8b"))
    reqs = tuple(SimRequestSpec(i, 0.0, 200, 40) for i in range(n))
    sim = Simulation(SimConfig(prefill=1, decode=1, speculation=spec), cost, Workload(reqs, 16)).run()
    assert all(o.status == "ok" and o.output_tokens == 40 for o in sim.outcomes)
    return sum(o.tpot_s for o in sim.outcomes) / n


def test_expected_tokens_per_step_follow_the_geometric_sum():
    for k in (1, 4, 8):
        for a in (0.0, 0.3, 0.8):
            assert SpecSim(k, a).tokens_per_step == pytest.approx(sum(a ** j for j in range(k + 1)))
    assert SpecSim(3, 1.0).tokens_per_step == 4


def test_a_verify_step_reads_the_same_weights_and_context_and_computes_k_more_rows():
    s = StepShape(decode_seqs=4, decode_context=4000, sampled=4)
    v = SpecSim(4, 0.5).verify_shape(s)
    assert (v.decode_seqs, v.decode_context) == (4, 4000)  # the context is read once
    assert (v.prefill_tokens, v.sampled) == (16, 20)  # 4 more rows each, every row sampled
    assert v.prefill_attended == 4 * 4000 + 4 * 10  # each extra row attends the context + the rows before it
    assert SpecSim(0, 0.9).verify_shape(s) == s


@pytest.mark.parametrize("n", [1, 8])
def test_no_acceptance_does_not_raise_throughput(n):
    assert _tpot(SpecSim(4, 0.0), n) >= _tpot(SpecSim(), n)


def test_acceptance_0_8_cuts_tpot_by_the_expected_factor_when_memory_bound():
    spec = SpecSim(4, 0.8)
    ratio = _tpot(SpecSim()) / _tpot(spec)
    assert ratio <= spec.tokens_per_step  # the verify step never costs less than a decode step
    assert ratio == pytest.approx(spec.tokens_per_step, rel=0.02)


def test_the_cli_takes_speculation_and_refuses_bad_values():
    p = argparse.ArgumentParser()
    command.add_arguments(p)
    a = p.parse_args(["--gpu", "h200", "--spec-k", "4", "--spec-acceptance", "0.7"])
    assert command.config_of(a).speculation == SpecSim(4, 0.7)
    with pytest.raises(ConfigError, match="acceptance"):
        command.config_of(p.parse_args(["--spec-acceptance", "1.5"]))
    with pytest.raises(ConfigError, match="k must"):
        SpecSim(-1, 0.5)
