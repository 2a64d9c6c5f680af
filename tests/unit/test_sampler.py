"""Sampler: each feature against an independent, straightforward reference.

Statistical tests draw many samples from one call (one row per draw) with a fixed torch
seed, so they are deterministic; their thresholds would still hold for almost any seed.
"""

from __future__ import annotations

import math

import pytest
import torch

from splitserve.engine import sampler
from splitserve.engine.sampler import (
    Sampler,
    SamplerOutput,
    SamplingState,
    _apply_penalties,
    _first_above,
    _inverse_cdf,
    _top_p,
    make_generator,
)
from splitserve.types import SamplingParams

EOS = 0


def state(params: SamplingParams, prompt=(1, 2), output=(), eos=(EOS,)) -> SamplingState:
    return SamplingState(params, list(prompt), list(output), tuple(eos), make_generator(params))


def sample(logits: torch.Tensor, states) -> SamplerOutput:
    return Sampler()(logits, states)


def draws(logits_row: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    """n independent samples from one distribution: n identical rows in one call."""
    out = sample(logits_row.expand(n, -1).contiguous(), [state(params) for _ in range(n)])
    return torch.tensor(out.token_ids)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


# 99.9th percentile of chi-square with df degrees of freedom (Wilson-Hilferty).
def chi2_crit(df: int) -> float:
    z = 3.09
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def ref_nucleus(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Boolean mask of the tokens top-k then top-p keep, by sorting (reference)."""
    vals, order = logits.sort(descending=True)
    keep = torch.zeros_like(logits, dtype=torch.bool)
    k = top_k if 0 < top_k < len(vals) else len(vals)
    probs = torch.softmax(vals[:k].double(), dim=0)
    mass = 0.0
    for j in range(k):
        if mass >= top_p:
            break
        keep[order[j]] = True
        mass += float(probs[j])
    return keep


# ---------------------------------------------------------------- greedy


def test_greedy_is_argmax_with_ties_to_lowest_id():
    torch.manual_seed(0)
    logits = torch.randn(32, 500)
    logits[3, [7, 9, 400]] = 50.0  # a three-way tie: the lowest id wins
    out = sample(logits, [state(SamplingParams(temperature=0.0)) for _ in range(32)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.token_ids[3] == 7
    assert out.logprobs == [None] * 32


def test_greedy_accepts_half_precision():
    torch.manual_seed(1)
    logits = torch.randn(8, 300).bfloat16()
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=2)] * 4
    out = sample(logits, [state(p) for p in params])
    assert out.token_ids == logits.float().argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [0.3, 1.0, 7.0, 100.0])
def test_top_k_one_is_greedy_at_any_temperature(temperature):
    torch.manual_seed(2)
    logits = torch.randn(64, 1000)
    out = sample(logits, [state(SamplingParams(temperature=temperature, top_k=1)) for _ in range(64)])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_tiny_top_p_is_greedy():
    torch.manual_seed(3)
    logits = torch.randn(64, 3000) * 0.1  # flat: a wide nucleus unless top_p cuts at the best
    out = sample(logits, [state(SamplingParams(temperature=1.5, top_p=1e-6)) for _ in range(64)])
    assert out.token_ids == logits.argmax(-1).tolist()


# ---------------------------------------------------------------- distributions


def test_temperature_frequencies_match_softmax():
    torch.manual_seed(4)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 10000
    for temperature in (0.5, 1.0, 2.0):
        got = torch.bincount(draws(logits, SamplingParams(temperature=temperature), n), minlength=6)
        stat = chi_square(got.double(), torch.softmax(logits.double() / temperature, 0))
        assert stat < chi2_crit(5), (temperature, got.tolist(), stat)
    # The test can tell temperatures apart: T=2 draws do not fit T=0.5 probabilities.
    got = torch.bincount(draws(logits, SamplingParams(temperature=2.0), n), minlength=6)
    assert chi_square(got.double(), torch.softmax(logits.double() / 0.5, 0)) > chi2_crit(5)


def test_min_p_keeps_exactly_tokens_above_threshold():
    torch.manual_seed(5)
    probs = torch.tensor([0.40, 0.25, 0.13, 0.11, 0.06, 0.03, 0.02])  # min_p 0.3 -> >= 0.12
    logits = probs.log()
    got = torch.bincount(draws(logits, SamplingParams(min_p=0.3), 10000), minlength=7)
    kept = probs >= 0.3 * probs.max()
    assert kept.tolist() == [True, True, True, False, False, False, False]
    assert (got[~kept] == 0).all(), got.tolist()
    renorm = torch.where(kept, probs, torch.zeros(())).double()
    assert chi_square(got.double(), renorm / renorm.sum()) < chi2_crit(2)


def test_top_k_top_p_sample_from_renormalized_nucleus():
    torch.manual_seed(6)
    logits = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.9, 0.0, -1.0, -2.0])
    for top_k, top_p in [(4, 1.0), (0, 0.8), (5, 0.9), (3, 0.5)]:
        params = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p)
        got = torch.bincount(draws(logits, params, 10000), minlength=8)
        scaled = logits / 0.8
        keep = ref_nucleus(scaled, top_k, top_p)
        assert (got[~keep] == 0).all(), (top_k, top_p, got.tolist())
        expected = torch.where(keep, torch.softmax(scaled.double(), 0), torch.zeros((), dtype=torch.float64))
        expected /= expected.sum()
        df = max(int(keep.sum()) - 1, 1)
        assert chi_square(got.double(), expected) < chi2_crit(df), (top_k, top_p, got.tolist())


@pytest.mark.parametrize("scale", [5.0, 0.05])  # peaked: a few tokens to order; flat: most of them
def test_top_p_mask_matches_sorting_reference(scale, monkeypatch):
    monkeypatch.setattr(sampler, "_TOP_P_BLOCK_TOKENS", 10_000)  # blocks of 2 rows
    torch.manual_seed(7)
    vocab = 5000
    logits = torch.randn(6, vocab) * scale
    ps = [0.9, 0.5, 0.99, 0.3, 0.95, 0.7]
    ks = [vocab, vocab, 40, vocab, 2000, 300]
    x = logits.clone()
    for i, k in enumerate(ks):  # top-k is applied before top-p, as in the sampler
        if k < vocab:
            x[i][x[i] < x[i].topk(k).values[-1]] = float("-inf")
    _top_p(x, ps)
    for i in range(6):
        expected = ref_nucleus(logits[i], ks[i], ps[i])
        assert torch.equal(x[i] > float("-inf"), expected), i


def test_inverse_cdf_never_picks_a_token_without_mass():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0, 0.0]] * 3)
    u = torch.tensor([0.0, 0.5, 1.0 - 2.0**-53], dtype=torch.float64)
    assert _inverse_cdf(probs, u).tolist() == [1, 3, 3]
    # Rounding can put the target at (or past) the final cumulative mass: take the last token
    # with mass, not the zero-mass tail (or an index past the end).
    cdf = torch.tensor([[0.0, 0.5, 0.5, 1.0, 1.0, 1.0]], dtype=torch.float64)
    assert _first_above(cdf, torch.tensor([[1.0]], dtype=torch.float64)).item() == 3


def test_two_level_inverse_cdf_matches_a_flat_search():
    torch.manual_seed(13)
    probs = torch.rand(3, 1000) ** 8  # uneven masses; 1000 tokens: 4 blocks, the last padded
    probs[:, 200:800] = 0.0  # whole blocks without mass
    probs[2, :-1] = 0.0  # all the mass on the last token
    n = 2000
    for row in range(3):
        u = torch.rand(n, dtype=torch.float64)
        cdf = probs[row].double().cumsum(0)
        expected = torch.searchsorted(cdf, u * cdf[-1], right=True)
        assert torch.equal(_inverse_cdf(probs[row].expand(n, -1), u), expected), row
    assert (expected == 999).all()


# ---------------------------------------------------------------- seeds


def run_steps(row_logits: torch.Tensor, target: SamplingState, neighbours: list, position: int) -> list[int]:
    """Five decode steps of `target`, placed at `position` among `neighbours`."""
    torch.manual_seed(position + 100)  # the unseeded neighbours differ from run to run
    tokens = []
    for step in range(5):
        states = list(neighbours)
        states.insert(position, target)
        logits = torch.randn(len(states), row_logits.shape[1])
        logits[position] = row_logits[step]
        token = sample(logits, states).token_ids[position]
        target.output_token_ids.append(token)
        tokens.append(token)
    return tokens


@pytest.mark.parametrize("params", [
    SamplingParams(seed=1234, temperature=1.0),
    SamplingParams(seed=99, temperature=0.9, top_p=0.9, min_p=0.01),  # wide nucleus: the sort path
    SamplingParams(seed=7, temperature=1.2, top_k=50, presence_penalty=0.5),
])
def test_seed_reproduces_across_batch_compositions(params):
    torch.manual_seed(8)
    row_logits = torch.randn(5, 4096) * 0.5
    batches = [
        ([], 0),
        ([state(SamplingParams(temperature=0.0)), state(SamplingParams(top_p=0.5))], 2),
        ([state(SamplingParams(seed=5, top_k=3)), state(SamplingParams())] * 3, 1),
        ([state(SamplingParams(logprobs=3, repetition_penalty=1.5))] * 7, 7),
    ]
    results = [run_steps(row_logits, state(params), nb, pos) for nb, pos in batches]
    assert all(r == results[0] for r in results), results
    other = run_steps(row_logits, state(SamplingParams(**{**params.__dict__, "seed": params.seed + 1})), [], 0)
    assert other != results[0]  # the seed matters (4096 nearly flat choices, 5 steps)


def test_generator_fast_forwards_past_tokens_sampled_elsewhere():
    torch.manual_seed(9)
    params = SamplingParams(seed=42, temperature=1.0)
    logits = torch.randn(6, 2000)
    whole = state(params)
    full = [sample(logits[i : i + 1], [whole]).token_ids[0] for i in range(6)]
    # A decode worker picks the request up after the prefill worker sampled the first two.
    resumed = SamplingState(params, [1, 2], full[:2], (EOS,), make_generator(params, num_output_tokens=2))
    rest = [sample(logits[i : i + 1], [resumed]).token_ids[0] for i in range(2, 6)]
    assert rest == full[2:]
    assert make_generator(SamplingParams()) is None


# ---------------------------------------------------------------- penalties


def ref_penalize(row: torch.Tensor, prompt, output, p: SamplingParams) -> torch.Tensor:
    """Per-token loops, straight from the definitions (HF repetition, OpenAI presence/frequency)."""
    row = row.clone().double()
    for t in set(prompt) | set(output):
        r = p.repetition_penalty
        row[t] = row[t] / r if row[t] > 0 else row[t] * r
    for t in set(output):
        row[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return row.float()


PENALTY_CASES = [
    (SamplingParams(repetition_penalty=1.3), (5, 6, 7), (7, 8, 8, 9)),
    (SamplingParams(repetition_penalty=0.7), (1, 2), (3,)),
    (SamplingParams(presence_penalty=1.5), (5, 6), (6, 6, 11)),
    (SamplingParams(frequency_penalty=0.8), (5,), (2, 2, 2, 4)),
    (SamplingParams(frequency_penalty=-0.5, presence_penalty=-1.0), (5,), (3, 3)),
    (SamplingParams(repetition_penalty=1.8, presence_penalty=0.3, frequency_penalty=0.4), (1, 2, 3), (3, 4, 4, 4)),
    (SamplingParams(repetition_penalty=1.2), (3, 4), ()),  # no output yet: prompt only
]


def test_penalties_change_logits_as_the_formulas_say():
    torch.manual_seed(10)
    logits = torch.randn(len(PENALTY_CASES) + 1, 16) * 3
    states = [state(p, prompt, out) for p, prompt, out in PENALTY_CASES] + [state(SamplingParams())]
    x = logits.clone()
    _apply_penalties(x, list(range(len(PENALTY_CASES))), states)
    for i, (p, prompt, out) in enumerate(PENALTY_CASES):
        expected = ref_penalize(logits[i], prompt, list(out), p)
        assert float((x[i] - expected).abs().max()) <= 1e-5, (i, x[i], expected)
    assert torch.equal(x[-1], logits[-1])  # a row without penalties is untouched


def test_greedy_with_penalties_picks_argmax_of_penalized_logits():
    torch.manual_seed(11)
    vocab, n = 40, 200
    logits = torch.randn(n, vocab) * 2
    raw = logits.clone()
    states, expected = [], []
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        p = SamplingParams(
            temperature=0.0,
            repetition_penalty=float(torch.empty(()).uniform_(0.5, 2.0, generator=g)),
            presence_penalty=float(torch.empty(()).uniform_(-2, 2, generator=g)),
            frequency_penalty=float(torch.empty(()).uniform_(-2, 2, generator=g)),
        )
        prompt = torch.randint(vocab, (5,), generator=g).tolist()
        out = torch.randint(vocab, (int(torch.randint(0, 8, (), generator=g)),), generator=g).tolist()
        states.append(state(p, prompt, out))
        expected.append(int(ref_penalize(logits[i], prompt, out, p).argmax()))
    assert sample(logits, states).token_ids == expected
    assert torch.equal(logits, raw)  # the caller's logits are not modified
    assert sum(e != a for e, a in zip(expected, raw.argmax(-1).tolist())) > n // 10  # penalties mattered


@pytest.mark.parametrize("temperature", [0.0, 0.95, 1e-4])
def test_a_repetition_penalty_near_zero_draws_a_real_token(temperature):
    """5e-324 is a valid penalty (> 0) that float32 holds as 0: a seen positive logit divided by
    it is +inf, a seen zero logit 0 / 0. Found by the HTTP fuzzer as a 500 (an index past the
    vocabulary): now the seen positive token is drawn, every time, and nothing is NaN."""
    logits = torch.tensor([[0.5, 0.0, 3.0, -1.0, 0.2]]).expand(64, -1).contiguous()
    p = SamplingParams(temperature=temperature, repetition_penalty=5e-324, seed=None)
    out = sample(logits, [state(p, prompt=(1, 2, 3)) for _ in range(64)])
    assert out.token_ids == [2] * 64


# ---------------------------------------------------------------- min_tokens


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_blocks_eos_and_stop_ids(temperature):
    vocab = 10
    logits = torch.zeros(4, vocab)
    logits[:, EOS] = 60.0  # EOS would always win (at temperature 1 too: 9 is e^-32 as likely)
    logits[:, 5] = 29.0  # then stop id 5
    logits[:, 9] = 28.0  # then 9, an EOS of the model's second EOS id list
    mk = lambda **kw: SamplingParams(temperature=temperature, min_tokens=3, stop_token_ids=(5,), **kw)
    states = [
        state(mk(), output=[1, 1], eos=(EOS, 9)),  # 2 < 3: EOS, 9 and 5 all blocked
        state(mk(), output=[1, 1, 1]),  # reached min_tokens: EOS allowed again
        state(mk(ignore_eos=True), output=[1], eos=(EOS, 9)),  # EOS not masked, stop id still is
        state(SamplingParams(temperature=temperature, min_tokens=2, ignore_eos=True), output=[]),
    ]
    out = sample(logits, states).token_ids
    assert out[0] not in (EOS, 5, 9)
    assert out[1] == EOS
    assert out[2] == EOS
    assert out[3] == EOS


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_with_rank_and_sorted_top():
    torch.manual_seed(12)
    vocab = 300
    logits = torch.randn(5, vocab) * 2
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.7, top_p=0.9, logprobs=0, repetition_penalty=1.5),
        SamplingParams(temperature=1.3, logprobs=20, presence_penalty=2.0, seed=3),
        SamplingParams(temperature=1.0),  # no logprobs
        SamplingParams(temperature=0.0, logprobs=1, frequency_penalty=2.0),
    ]
    states = [state(p, prompt=(1, 2, 3), output=[int(logits[i].argmax())] * 2) for i, p in enumerate(params)]
    out = sample(logits, states)
    ref = torch.log_softmax(logits.double(), -1)
    for i, p in enumerate(params):
        lp = out.logprobs[i]
        if p.logprobs is None:
            assert lp is None
            continue
        tok = out.token_ids[i]
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(float(ref[i, tok]), abs=1e-5)
        assert lp.rank == 1 + int((ref[i] > ref[i, tok]).sum())
        assert len(lp.top) == p.logprobs
        top_ids = ref[i].argsort(descending=True)[: p.logprobs].tolist()
        assert [t for t, _ in lp.top] == top_ids
        assert [v for _, v in lp.top] == pytest.approx([float(ref[i, t]) for t in top_ids], abs=1e-5)
    # The penalized greedy row chose something other than the raw best, and the rank says so.
    assert out.logprobs[4].rank > 1


def test_batch_shape_is_checked_and_empty_batch_is_fine():
    assert sample(torch.empty(0, 10), []) == SamplerOutput([], [])
    with pytest.raises(ValueError):
        sample(torch.zeros(2, 10), [state(SamplingParams())])
