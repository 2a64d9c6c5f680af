"""Speculative decoding (engine/speculative/): exact against the non-speculative engine and
Hugging Face, with real n-gram proposals and with a test proposer that knows the reference
continuation and corrupts part of it (so acceptances and rejections both happen for sure);
through prefix hits, chunked prefill, preemption, max_tokens and stop ids, mixed batches and
aborts; and a sampled workload's token distribution against the exact target distribution."""

from __future__ import annotations

import pytest
import torch
from greedy_parity import assert_greedy_equal, drained, hf_greedy, make_prompts

from splitserve import LLM, SamplingParams
from splitserve.config import EngineConfig, SpeculativeConfig
from splitserve.engine.speculative import verify as verify_mod
from splitserve.engine.speculative.adaptive import PROBE_EVERY, AdaptiveK
from splitserve.engine.speculative.ngram import NgramProposer
from splitserve.engine.speculative.registry import make_proposer
from splitserve.hashing import block_hashes
from splitserve.types import ConfigError, Request

NGRAM = {"method": "ngram", "k": 4, "min_n": 1, "max_n": 3}
MAX_NEW = 24


# -- config, proposer, adaptive k: no model -------------------------------------------------------

def test_config_is_validated_and_methods_are_built_by_name(tiny_checkpoint):
    model = str(tiny_checkpoint("llama"))
    cfg = EngineConfig.from_dict({"model": model, "speculative": {"method": "ngram", "k": 3}})
    assert cfg.speculative == SpeculativeConfig("ngram", 3)
    assert EngineConfig(model).speculative is None
    for bad, words in [({"method": "medusa"}, "must be one of"), ({"k": 0}, "speculative.k"),
                       ({"min_n": 4, "max_n": 2}, "must not exceed"), ({"kk": 1}, "unknown speculative keys"),
                       ({"adaptive": "yes"}, "true or false")]:
        with pytest.raises(ConfigError, match=words):
            EngineConfig(model, speculative=bad)
    with pytest.raises(ConfigError, match="pipeline_parallel_size"):
        EngineConfig(model, speculative={}, pipeline_parallel_size=2)
    with pytest.raises(ConfigError, match="data_parallel_size"):
        EngineConfig(model, speculative={}, data_parallel_size=2)
    with pytest.raises(ConfigError, match="the engine builds its proposer"):
        make_proposer(SpeculativeConfig("draft"))  # a draft head needs the model (test_speculative_draft.py)


def test_ngram_proposes_what_followed_the_most_recent_longest_match():
    p = NgramProposer(min_n=1, max_n=3)
    st = p.new_state()
    # "7 8 9" occurred twice; the most recent is followed by 4 5
    toks = [7, 8, 9, 1, 2, 3, 7, 8, 9, 4, 5, 6, 0, 7, 8, 9]
    assert p.propose(toks, st, 3) == [4, 5, 6]
    toks += [4]  # suffix "9 4": only a 2-gram match (pos 9..10) -> 5 6 0
    assert p.propose(toks, st, 3) == [5, 6, 0]
    toks += [11]  # 11 never seen before: no match at any n
    assert p.propose(toks, st, 3) == []
    assert p.propose([1, 2, 1], p.new_state(), 5) == [2, 1]  # runs into its own suffix: cut at the end
    q = NgramProposer(min_n=2, max_n=2)
    assert q.propose([5, 6, 5], q.new_state(), 2) == []  # a 1-gram match is below min_n


def test_adaptive_k_backs_off_probes_and_recovers():
    a = AdaptiveK(4)
    assert a.next_k() == 4
    for _ in range(12):
        a.observe(4, 0)
    ks = [a.next_k() for _ in range(PROBE_EVERY)]
    assert ks[:-1] == [0] * (PROBE_EVERY - 1) and ks[-1] == 1  # off, then one probe
    for _ in range(12):
        a.observe(1, 1)
    assert a.next_k() == 4
    assert AdaptiveK(3, adaptive=False).next_k() == 3


# -- greedy exactness --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    """shape -> (checkpoint, hf model, prompts, greedy continuations one prompt at a time)."""
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(shape):
        if shape not in cache:
            path = tiny_checkpoint(shape)
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            prompts = make_prompts(seed=7)
            cache[shape] = (str(path), hf, prompts, hf_greedy(hf, prompts, MAX_NEW))
        return cache[shape]

    return get


class Oracle:
    """A test proposer that knows each prompt's reference continuation: it proposes the next k
    reference tokens, with the second one replaced on every third call (so some proposals are
    accepted in full, some cut, and a wrong token follows an accepted one)."""

    def __init__(self, refs: dict[tuple[int, ...], list[int]], only=None) -> None:
        self.refs = refs
        self.only = only  # prompts to propose for (None: all)
        self.calls = 0
        self.corrupt = True

    def new_state(self):
        return None

    def propose(self, tokens, state, k):
        for prompt, ref in self.refs.items():
            if tuple(tokens[:len(prompt)]) == prompt and (self.only is None or prompt in self.only):
                done = len(tokens) - len(prompt)
                out = list(ref[done:done + k])
                self.calls += 1
                if self.corrupt and self.calls % 3 == 0 and len(out) > 1:
                    out[1] = (out[1] + 1) % 384
                return out
        return []


def with_oracle(llm: LLM, prompts, refs, only=None) -> Oracle:
    oracle = Oracle({tuple(p): r for p, r in zip(prompts, refs)}, only)
    llm.engine.speculator.proposer = oracle
    return oracle


def greedy(llm, prompts, **kw):
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, **kw))
    return [list(o.outputs[0].token_ids) for o in outs]


def assert_cache_holds_only_accepted(llm, prompts, outs):
    """Every block hash in the prefix cache is one of a real context's (prompt + output): no
    rejected proposal ever entered it."""
    real = set()
    for p, o in zip(prompts, outs):
        real.update(block_hashes(list(p) + list(o), llm.engine.block_size))
    cached = set(llm.engine.pool.cached_hashes())
    assert cached and cached <= real, f"{len(cached - real)} cached blocks hold tokens no request produced"


@pytest.mark.parametrize("shape", ["llama", "qwen3"])
def test_greedy_ngram_equals_plain_engine_and_hf(reference, shape):
    path, hf, prompts, refs = reference(shape)
    plain = greedy(LLM(path, num_kv_blocks=256), prompts)
    llm = LLM(path, num_kv_blocks=256, speculative=NGRAM)
    outs = greedy(llm, prompts)
    assert outs == plain
    for p, o, r in zip(prompts, outs, refs):
        assert_greedy_equal(hf, p, o, r)
    s = llm.engine.stats()
    assert s.spec_verify_steps_total > 0 and s.spec_proposed_tokens_total > s.spec_accepted_tokens_total > 0
    assert_cache_holds_only_accepted(llm, prompts, outs)
    drained(llm)


@pytest.mark.parametrize("case", ["plain", "prefix_hits", "chunked_prefill", "preemption"])
def test_greedy_with_accepted_and_rejected_proposals_equals_hf(reference, case):
    path, hf, prompts, refs = reference("llama")
    kw = {"chunked_prefill": dict(max_num_batched_tokens=24), "preemption": dict(num_kv_blocks=24,
                                                                                 max_num_batched_tokens=64)}
    llm = LLM(path, **{"num_kv_blocks": 256, **kw.get(case, {})}, speculative=dict(NGRAM, adaptive=False))
    with_oracle(llm, prompts, refs)
    if case == "prefix_hits":
        greedy(llm, prompts)
        hits = llm.engine.stats().prefix_hit_tokens_total
    outs = greedy(llm, prompts)
    for p, o, r in zip(prompts, outs, refs):
        assert_greedy_equal(hf, p, o, r)
    s = llm.engine.stats()
    assert s.spec_proposed_tokens_total > s.spec_accepted_tokens_total > 0
    # several tokens per step: far fewer steps than tokens
    assert s.steps_total < sum(map(len, outs)) // 2 * (2 if case == "prefix_hits" else 1)
    if case == "prefix_hits":
        assert s.prefix_hit_tokens_total > hits
    if case == "preemption":
        assert s.num_preempted_total > 0, "the pool was meant to be too small for the batch"
    assert_cache_holds_only_accepted(llm, prompts, outs)
    drained(llm)


def test_max_tokens_and_stop_ids_cut_the_accepted_run_exactly(reference):
    path, _, prompts, refs = reference("llama")
    plain = LLM(path, num_kv_blocks=256)
    llm = LLM(path, num_kv_blocks=256, speculative=dict(NGRAM, k=6, adaptive=False))
    oracle = with_oracle(llm, prompts, refs)
    oracle.corrupt = False  # every proposal runs as far as the stop rules let it
    for i, (p, r) in enumerate(zip(prompts, refs)):
        stop = r[3 + i % 5]  # a token the run reaches mid-proposal
        params = [SamplingParams(temperature=0.0, max_tokens=2 + i % 7),
                  SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop_token_ids=[stop])]
        for sp in params:
            want = plain.generate([p], sp)[0].outputs[0]
            got = llm.generate([p], sp)[0].outputs[0]
            assert (got.token_ids, got.finish_reason, got.stop_reason) == \
                (want.token_ids, want.finish_reason, want.stop_reason)
            assert len(got.token_ids) <= sp.max_tokens
    assert llm.engine.stats().spec_accepted_tokens_total > 0
    drained(llm)


def test_mixed_batch_rows_with_and_without_proposals(reference):
    """Half the prompts get proposals; greedy, penalized and logprob requests share the steps."""
    path, hf, prompts, refs = reference("llama")
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_NEW, **extra) for extra in
              ({}, {"logprobs": 2}, {"repetition_penalty": 1.3, "frequency_penalty": 0.5}, {"min_tokens": 20})]
    plist = [params[i % len(params)] for i in range(len(prompts))]
    plain = LLM(path, num_kv_blocks=256).generate(prompts, plist)
    llm = LLM(path, num_kv_blocks=256, speculative=dict(NGRAM, adaptive=False))
    # proposals for prompts 0-3 and 8-11: each kind of request with and without
    with_oracle(llm, prompts, [list(o.outputs[0].token_ids) for o in plain],
                only={tuple(p) for i, p in enumerate(prompts) if i % 8 < 4})
    outs = llm.generate(prompts, plist)
    for a, b in zip(outs, plain):
        oa, ob = a.outputs[0], b.outputs[0]
        assert oa.token_ids == ob.token_ids and oa.finish_reason == ob.finish_reason
        if ob.logprobs is not None:
            assert [(x.token_id, x.rank, [t for t, _ in x.top]) for x in oa.logprobs] == \
                [(x.token_id, x.rank, [t for t, _ in x.top]) for x in ob.logprobs]
            assert max(abs(x.logprob - y.logprob) for x, y in zip(oa.logprobs, ob.logprobs)) < 1e-4
    s = llm.engine.stats()
    assert s.spec_proposed_tokens_total > s.spec_accepted_tokens_total > 0
    drained(llm)


def test_abort_mid_run_frees_every_block(reference):
    path, _, prompts, refs = reference("llama")
    llm = LLM(path, num_kv_blocks=256, speculative=dict(NGRAM, adaptive=False))
    with_oracle(llm, prompts, refs)
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=MAX_NEW)))
    for _ in range(4):
        eng.step()
        eng.check_invariants()
    assert eng.stats().spec_verify_steps_total > 0
    for i in range(len(prompts)):
        eng.abort(f"r{i}")
    drained(llm)


def test_grammar_request_runs_beside_rows_with_proposals(demo_model_dir):
    """A grammar-constrained request (its proposals cut by its grammar: see
    test_speculative_proposers.py) and a plain request share verified steps; both equal the
    non-speculative engine's output."""
    from splitserve.types import GrammarKind, GrammarSpec

    prompt = "Repeat exactly: ab ab ab ab ab ab ab ab ab ab ab ab\nab ab ab ab ab ab ab ab ab ab ab ab\n"
    params = [SamplingParams(temperature=0.0, max_tokens=24, grammar=GrammarSpec(GrammarKind.REGEX, "(ab ){3,8}")),
              SamplingParams(temperature=0.0, max_tokens=24)]
    plain = [o.outputs[0].token_ids for o in LLM(str(demo_model_dir), num_kv_blocks=64).generate([prompt] * 2, params)]
    llm = LLM(str(demo_model_dir), num_kv_blocks=64, speculative=NGRAM)
    assert [o.outputs[0].token_ids for o in llm.generate([prompt] * 2, params)] == plain
    s = llm.engine.stats()
    assert s.spec_accepted_tokens_total > 0  # the plain request's, repeating the prompt
    drained(llm)


def test_seeded_sampled_request_is_reproducible_with_the_same_proposals(reference):
    """What verify.py promises a seeded request under speculation: the same output run to run
    when its proposals are the same (not the plain engine's stream; see the distribution test
    for exactness)."""
    path, _, prompts, refs = reference("llama")
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=MAX_NEW, seed=11)
    runs = []
    for _ in range(2):
        llm = LLM(path, num_kv_blocks=256, speculative=dict(NGRAM, adaptive=False))
        with_oracle(llm, prompts[:4], refs[:4])
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts[:4], params)])
        assert llm.engine.stats().spec_proposed_tokens_total > 0
        drained(llm)
    assert runs[0] == runs[1]


# -- sampling: the distribution is the target's --------------------------------------------------

N_SAMPLES = 2000
TOP_K = 3
TEMPERATURE = 0.8


def exact_pairs(hf, prompt, n_tokens=3):
    """The exact distribution of the sampled (t1, t2) pair: enumerate every path of the first
    `n_tokens` tokens through top-k (temperature, then top-k: the sampler's order)."""
    def dist(ctx):
        with torch.no_grad():
            logits = hf(torch.tensor([ctx])).logits[0, -1].double() / TEMPERATURE
        top = logits.topk(TOP_K)
        return dict(zip(top.indices.tolist(), torch.softmax(top.values, -1).tolist()))

    pairs: dict[tuple[int, int], float] = {}
    for t0, p0 in dist(prompt).items():
        for t1, p1 in dist(prompt + [t0]).items():
            for t2, p2 in dist(prompt + [t0, t1]).items():
                pairs[(t1, t2)] = pairs.get((t1, t2), 0.0) + p0 * p1 * p2
    return pairs


def chi_square_p(counts: dict, probs: dict, n: int) -> float:
    """Goodness of fit against exact probabilities; cells expected below 5 pooled into one."""
    from scipy.stats import chisquare

    obs, exp, rest_o, rest_e = [], [], 0, 0.0
    for cell, p in probs.items():
        if p * n >= 5:
            obs.append(counts.get(cell, 0))
            exp.append(p * n)
        else:
            rest_o += counts.get(cell, 0)
            rest_e += p * n
    assert sum(counts.values()) == n and set(counts) <= set(probs), "a sample outside the target's support"
    if rest_e > 0:
        obs.append(rest_o)
        exp.append(rest_e)
    return float(chisquare(obs, exp).pvalue)


def sample_pairs(llm, prompt):
    params = [SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, max_tokens=4, seed=s) for s in range(N_SAMPLES)]
    counts: dict[tuple[int, int], int] = {}
    for o in llm.generate([prompt] * N_SAMPLES, params):
        t = o.outputs[0].token_ids
        counts[(t[1], t[2])] = counts.get((t[1], t[2]), 0) + 1
    return counts


def test_sampled_tokens_follow_the_target_distribution(reference, monkeypatch):
    """Each request (max_tokens 4) samples token 0 in its prefill; its first decode step
    verifies proposals for tokens 1 and 2 — the most likely (t1, t2) pair, fixed — accepted with
    probability p(x) and otherwise replaced by a draw from the residual; a later step verifies
    what is left. Test: chi-square goodness of fit of the (t1, t2) counts, N = 2000 seeded
    requests, against the exact distribution enumerated from the Hugging Face model (top-3 at
    T = 0.8: at most 9 cells; cells expected below 5 pooled), at alpha = 1e-3; the
    non-speculative engine passes the same test. Power: the classic bug — on rejection, drawing
    from p instead of p without the rejected token — fails it at p < 1e-6 with these N and
    proposals (checked at the end), so it detects far smaller departures than that one.
    Seeded requests make the run deterministic (no flake)."""
    path, hf, prompts, refs = reference("qwen3")
    prompt = prompts[3]
    probs = exact_pairs(hf, prompt)
    mode = max(probs, key=probs.get)  # the most likely (t1, t2)
    plain = LLM(path, num_kv_blocks=512, max_num_seqs=512)
    assert chi_square_p(sample_pairs(plain, prompt), probs, N_SAMPLES) > 1e-3
    llm = LLM(path, num_kv_blocks=512, max_num_seqs=512, speculative=dict(NGRAM, k=2, adaptive=False))
    llm.engine.speculator.proposer = FixedTail(len(prompt), mode)
    got = sample_pairs(llm, prompt)
    s = llm.engine.stats()
    assert s.spec_proposed_tokens_total >= 2 * N_SAMPLES  # two per request at its first decode step
    assert 0 < s.spec_accepted_tokens_total < s.spec_proposed_tokens_total
    assert chi_square_p(got, probs, N_SAMPLES) > 1e-3
    drained(llm)

    # power: the same test with the residual left out (a rejection draws from p itself)
    monkeypatch.setattr(verify_mod, "_residual", lambda q, rows, rejected: None)
    assert chi_square_p(sample_pairs(llm, prompt), probs, N_SAMPLES) < 1e-6
    drained(llm)


class FixedTail:
    """Proposes `tail` as tokens 1, 2 of the output (token 0 is the prefill's)."""

    def __init__(self, prompt_len: int, tail) -> None:
        self.prompt_len, self.tail = prompt_len, list(tail)

    def new_state(self):
        return None

    def propose(self, tokens, state, k):
        done = len(tokens) - self.prompt_len
        return self.tail[done - 1:done - 1 + k] if done >= 1 else []
