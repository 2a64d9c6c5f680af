"""Speculative decoding on the local Ray cluster (`engine: {speculative: {method: ngram, k: 4}}`,
which only the decode pool takes): every prompt goes through the prefill worker and its KV to a
decode worker that verifies n-gram proposals; the greedy tokens equal one plain engine's, with
proposals accepted on the decode worker. With two decode workers, one SIGKILLed mid-stream: its
streams migrate to the other and continue exactly."""

import signal

import pytest
import ray
import torch

from splitserve.orchestrator import Cluster
from tests.chaos.harness import Load, assert_nothing_held, assert_outcomes, migration_report, params, reference, \
    signal_worker

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
        signal_worker(c.decodes[0], signal.SIGKILL)
        outcomes = load.result()
        assert_outcomes(outcomes, ref, min_exact=n)
        assert migration_report(c)["migrated"] >= 1
        assert_nothing_held(c, load)
