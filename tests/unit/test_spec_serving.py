"""Speculative decoding on the serving side (no Ray): `serve --speculative` and the config file
reach the decode pool's engine config only, bad values are refused in our words; /metrics
exports each worker's proposed / accepted tokens, verify steps and acceptance; admission's TPOT
prediction and the autoscaler's decode sizing read the measured tokens per step (a higher
acceptance: a lower TPOT, fewer decode workers), only once enough steps were verified."""

import dataclasses

import pytest
from fake_backend import ViewsBackend, exported
from greedy_parity import drained

from splitserve.control.autoscale import (AutoscaleConfig, AutoscalePolicy, Bounds, DecodeSignals, PrefillSignals,
                                          Signals, SignalObserver, StepFit, LatencyWindow)
from splitserve.control.deploy_config import DeployConfig
from splitserve.metrics import Metrics
from splitserve.router.admission import Admission, AdmissionConfig, Plan, predict
from splitserve.router.spec_yield import MAX_TOKENS_PER_STEP, MIN_VERIFY_STEPS, tokens_per_step
from splitserve.types import ConfigError, Priority, Role, WorkerStats

SPEC = {"method": "ngram", "k": 4}


def parse(argv):
    from splitserve.cli.main import build_parser

    return build_parser().parse_args(argv)


def test_the_flag_reaches_the_decode_pool_only(tiny_checkpoint):
    from splitserve.cli.serve import deploy_options

    model = str(tiny_checkpoint("llama"))
    for text in ("{method: ngram, k: 4}", '{"method": "ngram", "k": 4}'):  # YAML or JSON
        args = parse(["serve", "--speculative", text])
        assert args.speculative == SPEC
        cfg = DeployConfig.from_options(deploy_options(args, model))
        assert cfg.pool_engine("decode")["speculative"] == SPEC
        assert "speculative" not in cfg.pool_engine("prefill")  # it runs no decode steps
    assert parse(["serve", "--speculative", "ngram"]).speculative == {"method": "ngram"}
    assert parse(["serve", "--speculative", "off"]).speculative is None
    assert DeployConfig.from_options(deploy_options(parse(["serve"]), model)).engine.get("speculative") is None


def test_the_config_file_and_the_app_args_take_it(tmp_path, tiny_checkpoint):
    from splitserve.cli.main import _with_config_file, build_parser
    from splitserve.cli.serve import deploy_options

    model = str(tiny_checkpoint("llama"))
    f = tmp_path / "serve.yaml"
    f.write_text("engine: {speculative: {method: ngram, k: 2}}\n")
    args = _with_config_file(build_parser(), ["serve", "--config", str(f)], str(f))
    assert DeployConfig.from_options(deploy_options(args, model)).pool_engine("decode")["speculative"] == \
        {"method": "ngram", "k": 2}
    # Serve app args arrive as strings (`serve run ... speculative='{k: 3}'`)
    cfg = DeployConfig.from_options({"model": model, "speculative": "{method: ngram, k: 3}"})
    assert cfg.engine["speculative"] == {"method": "ngram", "k": 3}


@pytest.mark.parametrize("text,message", [
    ("{k: 0}", "speculative.k must be an integer in [1, 16], got 0"),
    ("{method: medusa}", "speculative.method must be one of ngram, suffix, draft"),
    ("{kk: 4}", "unknown speculative keys ['kk']"),
    ("[1, 2]", "speculative must be a mapping of its fields or null"),
    ("{min_n: 4, max_n: 2}", "speculative.min_n (4) must not exceed max_n (2)"),
])
def test_bad_values_are_refused_in_our_words(text, message, capsys, tiny_checkpoint):
    with pytest.raises(SystemExit):
        parse(["serve", "--speculative", text])
    assert message in capsys.readouterr().err
    with pytest.raises(ConfigError) as e:
        DeployConfig.from_options({"model": str(tiny_checkpoint("llama")), "speculative": text})
    assert message in str(e.value)


def test_decode_pipeline_stages_refuse_it_by_name(tiny_checkpoint):
    with pytest.raises(ConfigError, match="speculative decoding is not supported with pipeline_parallel_size > 1"):
        DeployConfig(model=str(tiny_checkpoint("llama")), prefill=0, decode=1, decode_pp=2, engine={"speculative": SPEC})
    # prefill stages with speculation on: fine, the prefill pool does not take it
    DeployConfig(model=str(tiny_checkpoint("llama")), prefill=1, decode=1, prefill_pp=2, engine={"speculative": SPEC})


def test_a_draft_head_reaches_both_pools(tiny_checkpoint):
    """The prefill worker computes the prompt's draft KV (one more cache layer), so both pools
    take method draft, tensor-parallel ones too (each rank runs its shard of the head); its
    refusal under pipeline stages names the setting."""
    model = str(tiny_checkpoint("llama"))
    draft = {"method": "draft", "k": 3}
    cfg = DeployConfig(model=model, prefill=1, decode=1, engine={"speculative": draft})
    assert cfg.pool_engine("prefill")["speculative"] == cfg.pool_engine("decode")["speculative"] == draft
    with pytest.raises(ConfigError, match="pipeline_parallel_size > 1"):
        DeployConfig(model=model, prefill=1, decode=1, prefill_pp=2, engine={"speculative": draft})
    for tp in (dict(prefill_tp=2), dict(decode_tp=2), dict(prefill_tp=2, decode_tp=2)):
        cfg = DeployConfig(model=model, prefill=1, decode=1, **tp, engine={"speculative": draft})
        assert cfg.pool_engine("prefill")["speculative"] == cfg.pool_engine("decode")["speculative"] == draft


# -- /metrics -----------------------------------------------------------------------------------


def _series(m: Metrics, prefix: str) -> dict:
    text = m.exposition().decode()
    return {ln.split()[0]: float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(prefix)}


def test_the_exporter_raises_counters_to_each_workers_totals():
    from splitserve.ingress.frontend import Frontend
    from splitserve.router.policy import WorkerView

    backend = ViewsBackend([WorkerView("d1", "decode", "h", spec_proposed_tokens=40, spec_accepted_tokens=30,
                                       spec_verify_steps=10, spec_verify_step_seconds=0.5,
                                       spec_verify_step_plain_seconds=0.25),
                            WorkerView("p1", "prefill", "h")])
    front = Frontend(backend, Metrics())
    front.export_worker_gauges()
    backend.views = [dataclasses.replace(backend.views[0], spec_proposed_tokens=100, spec_accepted_tokens=50,
                                         spec_verify_steps=25, spec_verify_step_seconds=1.5,
                                         spec_verify_step_plain_seconds=0.75), backend.views[1]]
    front.export_worker_gauges()  # a second scrape: counters raised to the new totals, not added twice
    got = _series(front.metrics, "splitserve_worker_spec_")
    w = '{role="decode",worker="d1"}'
    assert got[f"splitserve_worker_spec_proposed_tokens_total{w}"] == 100
    assert got[f"splitserve_worker_spec_accepted_tokens_total{w}"] == 50
    assert got[f"splitserve_worker_spec_verify_steps_total{w}"] == 25
    assert got[f"splitserve_worker_spec_acceptance_ratio{w}"] == 0.5
    assert got[f"splitserve_worker_spec_verify_step_seconds_total{w}"] == 1.5
    assert got[f"splitserve_worker_spec_verify_step_plain_seconds_total{w}"] == 0.75
    assert not any('worker="p1"' in k for k in got)  # a worker that never proposed: no series
    backend.views = [backend.views[1]]  # d1 gone
    front.export_worker_gauges()
    assert not _series(front.metrics, "splitserve_worker_spec_")
    assert not any(front.metrics._spec_seen.values())  # its last totals forgotten too


def test_a_real_engines_verify_cost_reaches_metrics(tiny_checkpoint):
    """A speculative engine's verifying steps: their seconds and the step-time fit's seconds for
    them without proposals, counted once the fit has MIN_FIT_SAMPLES steps, through WorkerView.of
    and the exporter to /metrics."""
    from splitserve import LLM, SamplingParams
    from splitserve.engine.step_model import MIN_FIT_SAMPLES
    from splitserve.router.policy import WorkerView

    llm = LLM(str(tiny_checkpoint("llama")), num_kv_blocks=128, speculative=dict(SPEC, adaptive=False))
    eng = llm.engine
    cut = []

    class Proposer:  # proposes every step: the prompt's tokens again (mostly rejected: a cost)
        def new_state(self):
            return None

        def propose(self, tokens, state, k):
            cut.append(eng.step_model.num_samples)
            return list(tokens[:k])

    eng.speculator.proposer = Proposer()
    llm.generate([[5, 6, 7, 8, 9]], SamplingParams(temperature=0.0, max_tokens=MIN_FIT_SAMPLES // 2, ignore_eos=True))
    young = eng.stats()
    assert young.spec_verify_steps_total > 0  # verified, but before the fit is read: nothing counted
    assert young.spec_verify_step_seconds_total == young.spec_verify_step_plain_seconds_total == 0.0
    llm.generate([[5, 6, 7, 8, 9]] * 2, SamplingParams(temperature=0.0, max_tokens=2 * MIN_FIT_SAMPLES, ignore_eos=True))
    s = eng.stats()
    assert eng.step_model.num_samples > MIN_FIT_SAMPLES and max(cut) > MIN_FIT_SAMPLES
    assert s.spec_verify_step_seconds_total > 0 and s.spec_verify_step_plain_seconds_total > 0

    got = _series(exported([WorkerView.of("d1", "decode", "h", s, 0, True, False)]),
                  "splitserve_worker_spec_verify_step")
    w = '{role="decode",worker="d1"}'
    assert got[f"splitserve_worker_spec_verify_step_seconds_total{w}"] == pytest.approx(s.spec_verify_step_seconds_total)
    assert got[f"splitserve_worker_spec_verify_step_plain_seconds_total{w}"] == \
        pytest.approx(s.spec_verify_step_plain_seconds_total)
    drained(llm)


def test_a_verifying_rows_shape_without_proposals_is_a_one_token_decode(tiny_checkpoint):
    from splitserve import LLM
    from splitserve.engine.step_shape import shape_of
    from splitserve.types import Request, SamplingParams

    llm = LLM(str(tiny_checkpoint("llama")), num_kv_blocks=64, speculative=dict(SPEC, adaptive=False))
    eng = llm.engine
    eng.add_request(Request("r", [5, 6, 7, 8, 9], SamplingParams(temperature=0.0, max_tokens=8)))
    eng.step()  # the prefill
    seq = eng.scheduler.running[0]
    seq.spec_tokens = [1, 2, 3]
    sched = eng.scheduler.schedule()
    assert sched.speculative
    full, plain = shape_of(sched), shape_of(sched, proposals=False)
    ctx = seq.num_computed_tokens
    assert (full.prefill_tokens, full.decode_seqs) == (4, 0)  # last token + 3 proposals: a chunk of 4
    assert (plain.prefill_tokens, plain.decode_seqs, plain.decode_context) == (0, 1, ctx)
    eng._complete(sched, eng._forward(sched))  # the step runs as scheduled, then the rest
    while eng.has_unfinished():
        eng.step()
    drained(llm)


# -- admission ----------------------------------------------------------------------------------


def stats(accepted=0, verify_steps=0, running=8, **kw):
    return WorkerStats(num_waiting=0, num_running=running, num_preempted_total=0, kv_blocks_total=100,
                       kv_blocks_free=50, kv_blocks_cached=0, prefix_query_tokens_total=0, prefix_hit_tokens_total=0,
                       steps_total=100, step_time_coeffs=(0.01, 0.001, 0.0005, 1e-6), decode_context_tokens=512 * running,
                       spec_proposed_tokens_total=4 * verify_steps, spec_accepted_tokens_total=accepted,
                       spec_verify_steps_total=verify_steps, **kw)


def test_tokens_per_step_counts_only_once_enough_steps_were_verified_and_is_bounded():
    assert tokens_per_step(1000, MIN_VERIFY_STEPS - 1) == 1.0  # too few steps: not known yet
    assert tokens_per_step(0, 1000) == 1.0
    assert tokens_per_step(150, 100) == 2.5
    assert tokens_per_step(10_000, 100) == MAX_TOKENS_PER_STEP


def test_a_higher_acceptance_lowers_the_predicted_tpot():
    base = predict(stats(), 100, 0)
    low = predict(stats(accepted=50, verify_steps=100), 100, 0)
    high = predict(stats(accepted=200, verify_steps=100), 100, 0)
    assert high[1] < low[1] < base[1]
    assert high[1] == pytest.approx(base[1] / 3.0)  # 1 + 2 accepted per step
    assert high[0] == base[0]  # the TTFT is the prompt's: speculation does not change it
    assert predict(stats(accepted=200, verify_steps=10), 100, 0)[1] == base[1]  # too few steps yet
    # the same load and SLO: refused without speculation, admitted with its measured acceptance
    a = Admission(AdmissionConfig(tpot_slo_ms=base[1] * 1e3 * 0.6))
    assert a.decide(Plan("p", stats(), "d", stats()), Priority.STANDARD, 100).reason == "tpot_slo"
    spec = stats(accepted=200, verify_steps=100)
    assert a.decide(Plan("p", stats(), "d", spec), Priority.STANDARD, 100).admit


# -- autoscaler ---------------------------------------------------------------------------------

FIT = StepFit(base=0.01, per_prefill_token=0.0002, per_decode_seq=0.001, per_context_token=0.000002)
CFG = AutoscaleConfig(prefill=Bounds(1, 8), decode=Bounds(1, 16), interval_s=10, ttft_slo_s=1.0, tpot_slo_s=0.05,
                      up_cooldown_s=30, down_cooldown_s=120)


def _decode_target(tokens_per_step: float) -> int:
    s = Signals(0.0, PrefillSignals(1, 0.0, 0.0, 0.0, None, FIT),
                DecodeSignals(1, 60.0, 0.0, 0.2, 700.0, None, FIT, tokens_per_step=tokens_per_step))
    return AutoscalePolicy(CFG).decide(s).decode


def test_a_higher_acceptance_needs_fewer_decode_workers():
    none, some, more = _decode_target(1.0), _decode_target(1.5), _decode_target(3.0)
    assert more < some < none


def test_the_observer_reads_the_decode_pools_measured_acceptance():
    obs = SignalObserver()
    decode = {"d1": stats(accepted=120, verify_steps=60), "d2": stats(accepted=30, verify_steps=40)}
    s = obs.observe(0.0, {Role.PREFILL: 1, Role.DECODE: 2}, {}, decode, LatencyWindow(window_s=10))
    assert s.decode.tokens_per_step == pytest.approx(1 + 150 / 100)  # the pool's counters summed
    few = obs.observe(1.0, {Role.PREFILL: 1, Role.DECODE: 1}, {}, {"d1": stats(accepted=30, verify_steps=5)},
                      LatencyWindow(window_s=10))
    assert few.decode.tokens_per_step == 1.0
