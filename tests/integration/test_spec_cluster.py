"""Speculative decoding on the local Ray cluster (`engine: {speculative: {method: ngram, k: 4}}`,
which only the decode pool takes): every prompt goes through the prefill worker and its KV to a
decode worker that verifies n-gram proposals; the greedy tokens equal one plain engine's, with
proposals accepted on the decode worker. With two decode workers, one SIGKILLed mid-stream: its
streams migrate to the other and continue exactly. The same for method `draft` (an EAGLE head,
whose KV is one more cache layer): the prefill worker computes the prompt's draft KV and the
handoff carries it to the decode workers, which propose from it."""

import json
import shutil
import signal

import pytest
import ray
import torch

from splitserve.engine.model.config import ModelConfig
from splitserve.orchestrator import Cluster
from tests.chaos.harness import (Load, assert_nothing_held, assert_outcomes, busiest, migration_report, params,
                                 prompts, reference, signal_worker)
from tests.draft_heads import RefEagle, agree, predictable

pytestmark = pytest.mark.timeout(300)

SPEC = {"method": "ngram", "k": 4}
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


def repetitive_prompts(n: int, seed: int = 5) -> list[tuple[int, ...]]:
    """Each a short random pattern repeated: the n-gram proposer finds continuations to propose."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        pattern = torch.randint(3, 384, (5 + i % 4,), generator=g).tolist()
        out.append(tuple(pattern * (40 // len(pattern))))
    return out


def cluster(model, name, decode):
    return Cluster.start(model=model, name=name, prefill=1, decode=decode, disagg_min_tokens=0, num_kv_blocks=256,
                         decode_inactivity_timeout_s=1.5, speculative=SPEC)


def spec_stats(c):
    return [ray.get(w.stats.remote()) for w in c.decodes]


def test_disaggregated_greedy_tokens_equal_the_plain_engine_with_proposals_accepted(ray_session, model):
    ps, sps = repetitive_prompts(6), params(6, False, MAX_TOKENS)
    ref = reference(model, ps, sps)
    with cluster(model, "spec-pd", decode=1) as c:
        assert c.cfg.pool_engine("decode")["speculative"] == SPEC
        assert "speculative" not in c.cfg.pool_engine("prefill")
        outs = c.generate([list(p) for p in ps], sps)
        assert [tuple(o.outputs[0].token_ids) for o in outs] == ref
        (s,) = spec_stats(c)
        assert s.spec_verify_steps_total > 0 and s.spec_proposed_tokens_total >= s.spec_accepted_tokens_total > 0
        prefill = ray.get(c.prefills[0].stats.remote())
        assert prefill.spec_proposed_tokens_total == 0
        for inv in c.check_invariants():
            assert inv["in_use"] == 0, inv


def test_a_speculating_decode_worker_killed_mid_stream_its_streams_migrate_and_continue_exactly(ray_session, model):
    n = 8
    ps, sps = repetitive_prompts(n, seed=9), params(n, False, 2 * MAX_TOKENS)  # long enough to be cut mid-stream
    ref = reference(model, ps, sps)
    with cluster(model, "spec-kill-decode", decode=2) as c:
        load = Load(c, ps, sps)
        load.wait_progress(2)
        signal_worker(busiest(c.decodes), signal.SIGKILL)
        outcomes = load.result()
        assert migration_report(c)["migrated"] >= 1  # the fault landed: the killed worker's streams moved
        assert_outcomes(outcomes, ref, min_exact=n)
        assert_nothing_held(c, load)


# -- method draft: an EAGLE head across the split ---------------------------------------------------

@pytest.fixture(scope="module")
def eagle(tiny_checkpoint, tmp_path_factory):
    """(target dir, speculative config): a tiny Llama made mostly a bigram model and an EAGLE head
    that proposes that bigram's answer (tests/draft_heads.py): accepted often."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("spec-draft")
    target = predictable(tiny_checkpoint("llama"), root / "target", 0.003)
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    torch.manual_seed(1)
    head = agree(RefEagle(hf), hf).save(root / "head")
    return str(target), {"method": "draft", "k": 3, "draft_path": str(head)}


def draft_cluster(eagle, name, decode=2, decode_tp=1):
    """A 1P + 2D app with the EAGLE head (each test its own: a killed worker's replacement
    must go with the app that started it)."""
    target, spec = eagle
    return Cluster.start(model=target, name=name, prefill=1, decode=decode, decode_tp=decode_tp, disagg_min_tokens=0,
                         num_kv_blocks=256, decode_inactivity_timeout_s=1.5, speculative=spec)


def test_a_draft_head_that_cannot_fit_is_refused_before_ray_is_reached(eagle, tmp_path, monkeypatch):
    from splitserve.control import launch
    from splitserve.types import ConfigError

    def no_ray(*a, **k):
        raise AssertionError("Ray was reached for a configuration every worker would refuse")

    monkeypatch.setattr(launch, "connect_ray", no_ray)
    target, spec = eagle
    wide = tmp_path / "wide"
    shutil.copytree(spec["draft_path"], wide)
    cfg = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": 2 * cfg["num_key_value_heads"]}))
    (tmp_path / "empty").mkdir()
    for bad, why in (({"draft_path": str(tmp_path / "empty")}, "holds no EAGLE head: no config.json"),
                     ({"draft_path": str(wide)}, "num_key_value_heads"),
                     ({"draft_path": None}, "num_nextn_predict_layers is 0")):
        with pytest.raises(ConfigError, match=why):
            Cluster.start(model=target, name="spec-draft-bad", prefill=1, decode=1, speculative={**spec, **bad})
    # under tensor parallelism each rank holds a share of the head's query heads: 6 over 4 ranks do not split
    (wide / "config.json").write_text(json.dumps({**cfg, "num_attention_heads": 6, "head_dim": 8}))
    with pytest.raises(ConfigError, match="tensor_parallel_size 4 does not divide num_attention_heads 6"):
        Cluster.start(model=target, name="spec-draft-bad", prefill=1, decode=1, decode_tp=4,
                      speculative={**spec, "draft_path": str(wide)})


# decode_tp 2: one decode group of two ranks, each running its half of the head
@pytest.mark.parametrize("decode,decode_tp", [(2, 1), (1, 2)])
def test_a_draft_head_across_the_split_equals_the_plain_engine_with_the_draft_layer_handed_over(ray_session, eagle,
                                                                                               decode, decode_tp):
    target, spec = eagle
    n = 8
    with draft_cluster(eagle, f"spec-draft-tp{decode_tp}", decode, decode_tp) as c:
        ps, sps = prompts(n, seed=21), params(n, False, MAX_TOKENS)
        ref = reference(target, ps, sps)
        assert c.cfg.pool_engine("prefill")["speculative"] == c.cfg.pool_engine("decode")["speculative"] == spec
        outs = c.generate([list(p) for p in ps], sps)
        assert [tuple(o.outputs[0].token_ids) for o in outs] == ref
        # both pools' caches hold the head's layer, and every prompt's KV (that layer's too: the
        # handoff walks and checksums every layer) came from the prefill worker — none recomputed
        layers = ModelConfig.from_dir(target).num_layers + 1
        for w in [*c.prefills, *c.decodes]:
            assert ray.get(w.describe.remote()).endpoints[0].layout.num_layers == layers
        decodes = [d for d in c.check_invariants() if "transfers_by_transport" in d]
        assert len(decodes) == decode, decodes
        assert sum(sum(d["transfers_by_transport"].values()) for d in decodes) == n
        assert all(d["transfer_failures"] == {} for d in decodes)
        stats = spec_stats(c)
        assert sum(s.spec_proposed_tokens_total for s in stats) >= sum(s.spec_accepted_tokens_total for s in stats) > 0
        assert ray.get(c.prefills[0].stats.remote()).spec_proposed_tokens_total == 0  # it runs no decode step
        for inv in c.check_invariants():
            assert inv["in_use"] == 0, inv


def test_a_draft_decode_worker_killed_mid_stream_its_streams_migrate_and_continue_exactly(ray_session, eagle):
    target, _ = eagle
    n = 8
    with draft_cluster(eagle, "spec-draft-kill") as c:
        ps, sps = prompts(n, seed=23), params(n, False, 2 * MAX_TOKENS)  # long enough to be cut mid-stream
        ref = reference(target, ps, sps)
        load = Load(c, ps, sps)
        load.wait_progress(2)
        decodes = c.decodes
        victim = busiest(decodes)
        (survivor,) = [w for w in decodes if w is not victim]
        accepted = ray.get(survivor.stats.remote()).spec_accepted_tokens_total
        signal_worker(victim, signal.SIGKILL)
        outcomes = load.result()
        assert migration_report(c)["migrated"] >= 1  # the fault landed: the killed worker's streams moved
        assert_outcomes(outcomes, ref, min_exact=n)
        assert ray.get(survivor.stats.remote()).spec_accepted_tokens_total > accepted
        assert_nothing_held(c, load)
