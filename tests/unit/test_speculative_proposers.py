"""Suffix proposals (engine/speculative/suffix.py) and grammar-cut proposals: a tenant's earlier
text is proposed to its later requests and never to another tenant's (on the proposer and
through the engine's counters); the index stays within its bounds and evicts oldest first;
greedy output with suffix proposals equals the non-speculative engine's and Hugging Face's
(plain, chunked prefill, preemption); a grammar-constrained request's proposals are cut at the
first token its grammar refuses and verified under each position's mask — its output equals the
non-speculative engine's and validates by `jsonschema`."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from greedy_parity import assert_greedy_equal, drained
from test_speculative import MAX_NEW, greedy, reference  # noqa: F401  (reference: a fixture)

from splitserve import LLM, SamplingParams
from splitserve.config import EngineConfig, SpeculativeConfig
from splitserve.engine.speculative.registry import make_proposer
from splitserve.engine.speculative.suffix import SuffixProposer
from splitserve.text.grammar import json_schema_spec
from splitserve.types import ConfigError, Request

SUFFIX = {"method": "suffix", "k": 4, "min_n": 1, "max_n": 3}


def feed(p: SuffixProposer, tokens, tenant, k=4):
    """Run one sequence through the proposer as the engine does (one call per token), the last
    call's proposal returned."""
    st = p.new_state(tenant)
    out = []
    for end in range(1, len(tokens) + 1):
        out = p.propose(tokens[:end], st, k)
    return out


# -- the proposer alone ---------------------------------------------------------------------------

def test_config_bounds_are_validated_and_suffix_is_registered(tiny_checkpoint):
    assert isinstance(make_proposer(SpeculativeConfig("suffix")), SuffixProposer)
    model = str(tiny_checkpoint("llama"))
    cfg = EngineConfig.from_dict({"model": model, "speculative": {"method": "suffix", "suffix_tokens_per_tenant": 10,
                                                                  "suffix_tokens": 20}})
    assert (cfg.speculative.suffix_tokens_per_tenant, cfg.speculative.suffix_tokens) == (10, 20)
    for bad, words in [({"suffix_tokens": 0}, "suffix_tokens must be"),
                       ({"suffix_tokens_per_tenant": 30, "suffix_tokens": 20}, "must not exceed")]:
        with pytest.raises(ConfigError, match=words):
            EngineConfig(model, speculative=dict(bad, method="suffix"))


def test_a_tenants_earlier_text_is_proposed_to_it_and_never_to_another_tenant():
    p = SuffixProposer(min_n=1, max_n=3, per_tenant=1000, total=10_000)
    first = list(range(100, 130))  # no token repeats: only another sequence's text can match
    feed(p, first, "acme")
    head = first[:10]
    assert feed(p, head, "acme") == first[10:14]  # the earlier request's continuation
    assert feed(p, head, "globex") == []  # another tenant: nothing of acme's
    assert feed(p, head, None) == []  # the anonymous tenant is a tenant too
    st = p.new_state("globex")  # its own text, as ngram: the fallback when its index has nothing
    assert p.propose([1, 2, 3, 9, 1, 2], st, 2) == [3, 9]
    p.check()


def test_the_most_frequent_continuation_wins_ties_to_the_most_recent():
    p = SuffixProposer(min_n=2, max_n=2, per_tenant=1000, total=1000)
    for tail in ([7, 7], [8, 8], [8, 8], [9, 9]):
        feed(p, [1, 2] + tail, "t")
    assert feed(p, [1, 2], "t", k=1) == [8]  # seen twice
    feed(p, [1, 2, 9, 9], "t")
    assert feed(p, [1, 2], "t", k=1) == [9]  # 8 and 9 twice each: 9 more recently
    p.check()


def test_the_index_stays_within_its_bounds_and_evicts_oldest_first():
    p = SuffixProposer(min_n=1, max_n=3, per_tenant=300, total=500)
    rng = random.Random(3)
    texts = {}
    for i in range(60):
        tenant = f"t{i % 3}"
        texts[i] = [rng.randrange(1000, 100_000) for _ in range(40)]
        feed(p, texts[i], tenant)
        p.check()  # counts match entries; per-tenant and per-worker bounds hold after every request
        assert p.size <= 500 and all(len(t) <= 300 for t in p.tenants.values())
    assert p.size == 500  # full: every later token evicted an earlier one
    assert feed(p, texts[0][:5], "t0") == []  # the oldest text is gone
    assert feed(p, texts[57][:5], "t0") == texts[57][5:9]  # the newest is held
    # the worker's bound takes from the least recently used tenant first
    q = SuffixProposer(min_n=1, max_n=2, per_tenant=100, total=100)
    feed(q, list(range(1, 61)), "old")
    feed(q, list(range(200, 230)), "new")
    feed(q, list(range(1, 3)), "old")  # "old" used last: "new" is now the least recently used
    feed(q, list(range(300, 320)), "third")
    assert (len(q.tenants["old"]), len(q.tenants["new"]), q.size) == (60, 21, 100)  # 59 + 1 entries kept
    q.check()


# -- through the engine ----------------------------------------------------------------------------

def run(engine, reqs):
    """Run requests one after another: outputs and the (proposed, accepted) each added."""
    outs, counts = [], []
    for r in reqs:
        before = engine.stats()
        engine.add_request(r)
        got = []
        while engine.has_unfinished():
            for c in engine.step():
                got += c.token_ids
        after = engine.stats()
        outs.append(got)
        counts.append((after.spec_proposed_tokens_total - before.spec_proposed_tokens_total,
                       after.spec_accepted_tokens_total - before.spec_accepted_tokens_total))
    return outs, counts


def test_tenants_share_proposals_through_the_engine_only_within_themselves(reference):
    path, _, prompts, _ = reference("llama")
    prompt = prompts[9]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)

    def req(i, salt):
        return Request(f"r{i}", prompt, params, cache_salt=salt)

    llm = LLM(path, num_kv_blocks=256, speculative=SUFFIX)
    outs, counts = run(llm.engine, [req(0, "acme"), req(1, "acme"), req(2, "globex")])
    alone = LLM(path, num_kv_blocks=256, speculative=SUFFIX)
    outs_alone, counts_alone = run(alone.engine, [req(2, "globex")])
    assert outs[0] == outs[1] == outs[2] == outs_alone[0]
    # acme's second request repeats the first's output: its proposals come from it, accepted
    assert counts[1][1] > counts[0][1] and counts[1][1] >= MAX_NEW // 2
    # globex's request behind acme's is proposed exactly what it is proposed on an engine alone
    assert counts[2] == counts_alone[0]
    drained(llm)
    drained(alone)


@pytest.mark.parametrize("case", ["plain", "chunked_prefill", "preemption"])
def test_greedy_suffix_equals_plain_engine_and_hf(reference, case):
    path, hf, prompts, refs = reference("llama")
    kw = {"chunked_prefill": dict(max_num_batched_tokens=24), "preemption": dict(num_kv_blocks=24,
                                                                                 max_num_batched_tokens=64)}
    llm = LLM(path, **{"num_kv_blocks": 256, **kw.get(case, {})}, speculative=SUFFIX)
    plain = greedy(LLM(path, num_kv_blocks=256), prompts)
    for _ in range(2):  # the second pass is proposed the first's outputs
        outs = greedy(llm, prompts)
        assert outs == plain
    for p, o, r in zip(prompts, outs, refs):
        assert_greedy_equal(hf, p, o, r)
    s = llm.engine.stats()
    assert s.spec_accepted_tokens_total >= sum(map(len, outs)) // 2
    if case == "preemption":
        assert s.num_preempted_total > 0, "the pool was meant to be too small for the batch"
    llm.engine.speculator.proposer.check()
    drained(llm)


# -- grammar-cut proposals -------------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                   "kind": {"enum": ["cat", "dog", "bird"]},
                   "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["n", "kind", "tags"],
    "additionalProperties": False,
}


class Scrambler:
    """Proposes the reference continuation with one token swapped for a token the grammar may
    refuse (cut there) or allow but the model rejects; k raw tokens per call, recorded."""

    def __init__(self, refs: dict[tuple[int, ...], list[int]]) -> None:
        self.refs, self.calls, self.raw = refs, 0, 0

    def new_state(self):
        return None

    def propose(self, tokens, state, k):
        for prompt, ref in self.refs.items():
            if tuple(tokens[:len(prompt)]) == prompt:
                done = len(tokens) - len(prompt)
                out = list(ref[done:done + k]) + [0] * max(0, k - len(ref[done:]))  # past the end: junk
                self.calls += 1
                if self.calls % 2 == 0 and len(out) > 2:
                    out[2] = (out[2] * 7 + 1) % 384
                self.raw += len(out)
                return out
        return []


def test_grammar_proposals_are_cut_and_verified_under_each_positions_mask(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    prompts = [[5, 6, 7, 8 + i] for i in range(6)]
    gparams = SamplingParams(temperature=0.0, max_tokens=120, grammar=json_schema_spec(SCHEMA))
    plain = LLM(path, num_kv_blocks=128).generate(prompts, gparams)
    refs = [list(o.outputs[0].token_ids) for o in plain]
    llm = LLM(path, num_kv_blocks=128, speculative=dict(SUFFIX, k=5, adaptive=False))
    scrambler = Scrambler({tuple(p): r for p, r in zip(prompts, refs)})
    llm.engine.speculator.proposer = scrambler
    outs = llm.generate(prompts, gparams)
    for got, want in zip(outs, plain):
        g, w = got.outputs[0], want.outputs[0]
        assert (g.token_ids, g.finish_reason) == (w.token_ids, w.finish_reason)
        jsonschema.validate(json.loads(g.text), SCHEMA)
    s = llm.engine.stats()
    assert s.spec_accepted_tokens_total > 0
    assert s.spec_proposed_tokens_total < scrambler.raw  # the grammar cut some proposals short
    # sampled: every emitted token (a bonus one after accepted proposals too) is under its mask
    sparams = [SamplingParams(temperature=1.0, seed=s, max_tokens=120, grammar=json_schema_spec(SCHEMA))
               for s in range(len(prompts))]
    for o in llm.generate(prompts, sparams):
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    drained(llm)


def test_a_repeated_grammar_request_is_sped_up_by_suffix_and_unchanged(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    params = SamplingParams(temperature=0.0, max_tokens=120, grammar=json_schema_spec(SCHEMA))
    want = LLM(path, num_kv_blocks=128).generate([[5, 6, 7, 8]], params)[0].outputs[0]
    llm = LLM(path, num_kv_blocks=128, speculative=SUFFIX)
    for _ in range(2):
        got = llm.generate([[5, 6, 7, 8]], params)[0].outputs[0]
        assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)
        jsonschema.validate(json.loads(got.text), SCHEMA)
    assert llm.engine.stats().spec_accepted_tokens_total >= len(want.token_ids) // 2
    drained(llm)
