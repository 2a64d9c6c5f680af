"""The sampler: turns one step's logits into the next token of every running sequence.

Where it sits in a request's life (DESIGN.md §1): `Engine.add_request` builds one
`SamplingState` per sequence (its `SamplingParams`, prompt ids and, for a seeded request, a
`torch.Generator` from `make_generator`). Every `Engine.step` runs the model, gathers the
logits of each sequence that needs a next token (its last prefill chunk, or a decode step)
into one `[num_seqs, vocab]` tensor, and calls `Sampler()(logits, states)` once. The engine
appends each returned token to `output_token_ids`, checks EOS / stop ids / max_tokens and
emits `TokenChunk`s. A prefill worker samples the first token with this same code; the
decode worker continues with `make_generator(params, num_output_tokens=1)`, so a seeded
request draws the same numbers whichever worker (or how many, after a migration) serves it.

Per row, in order (vLLM v1 / OpenAI semantics):
  0. logit_bias added; then a grammar's mask (structured output, engine/grammar.py): the tokens
     its grammar does not allow get -inf (only rows that carry a grammar; a batch without one
     does no mask work);
  1. penalties: repetition over prompt + output (positive logits divided, negative
     multiplied), then frequency and presence over the output (OpenAI: subtracted);
  2. min_tokens: EOS (unless ignore_eos) and stop ids get -inf while the output is short;
  3. greedy (temperature < 1e-5): argmax, ties to the lowest id;
  4. otherwise temperature, top-k, top-p, min-p (last, as in HF transformers; vLLM v1
     applies it before top-k/top-p), then one inverse-CDF draw.
Logprobs are "raw": log_softmax of the model's logits, before any of the above.

Speculative decoding verifies proposals against `target`: per row the token greedy takes, or
the probabilities a draw would use (steps 0-4 without the draw); engine/speculative/verify.py
decides what is accepted.

The batch is never looped over the vocabulary in Python: rows are grouped by the features
they use, and each group is handled with batched tensor ops.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from splitserve.types import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from splitserve.engine.grammar import GrammarMasks, GrammarMatcher

# top-p histogram: logit buckets 1/64 nat wide over the 32 nats below each row's best.
_BUCKETS = 2048
_BUCKET_SPAN = 32.0
_CDF_BLOCK = 256  # tokens per block of the two-level inverse CDF
_TOP_P_BLOCK_TOKENS = 1 << 22  # top-p works on blocks of rows: its bucket index is int64 per token
_NEG_INF = float("-inf")
_MAX_LOGIT = 1e30  # a penalty's +inf, kept finite through any temperature (>= 1e-5: at most 1e35)


@dataclass
class SamplingState:
    """One running sequence as the sampler sees it; owned and updated by the engine."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: list[int]  # the engine appends after each step
    eos_token_ids: tuple[int, ...]  # masked by min_tokens unless params.ignore_eos
    generator: torch.Generator | None  # make_generator(params); None if no seed
    grammar: GrammarMatcher | None = None  # params.grammar's matcher, advanced by the engine
    # The prompt as a tensor, built on first use: penalties need it every step.
    _prompt_tensor: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)


def make_generator(
    params: SamplingParams, *, num_output_tokens: int = 0, device: torch.device | str = "cpu"
) -> torch.Generator | None:
    """The per-request generator of a seeded request (None without a seed).

    Each sampled token consumes exactly one draw, so `num_output_tokens` fast-forwards the
    generator past tokens generated elsewhere (prefill worker, a migrated decode worker) and
    the continuation is the one the request would have had on a single worker. `device`
    must be the logits' device.
    """
    if params.seed is None:
        return None
    gen = torch.Generator(device=device).manual_seed(params.seed)
    if not params.greedy:  # greedy rows never draw
        for _ in range(num_output_tokens):
            _draw_uniform(gen)
    return gen


def draw_uniform(gen: torch.Generator) -> torch.Tensor:
    """One U[0, 1) from a request's generator (float64, 0-dim): every draw a seeded request makes."""
    return _draw_uniform(gen)


def _draw_uniform(gen: torch.Generator) -> torch.Tensor:
    return torch.rand((), generator=gen, dtype=torch.float64, device=gen.device)


@dataclass(frozen=True)
class Target:
    """What the sampler would draw each row from: greedy rows' argmax, random rows' probabilities
    (after every processing step; a row need not sum to 1 — normalize before use)."""

    greedy: list[int]  # rows
    greedy_tokens: list[int]  # their argmax, in order
    random: list[int]  # rows
    probs: torch.Tensor | None  # [len(random), vocab] fp32, rows in `random`'s order


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # None where params.logprobs is None


class Sampler:
    """One instance per engine; call once per step with the batch's logits. It holds nothing
    about requests: `masks` is the engine's grammar compiler, set once a request carries one."""

    def __init__(self) -> None:
        self.masks: GrammarMasks | None = None

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, states: Sequence[SamplingState], ahead=None) -> SamplerOutput:
        """`ahead`: grammar masks filled during the forward pass (GrammarMasks.fill_ahead)."""
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits must be [num_seqs={len(states)}, vocab], got {tuple(logits.shape)}")
        if not states:
            return SamplerOutput([], [])
        plan = _Plan.of(states, logits.shape[1])
        if plan.plain_greedy:  # the common decode batch: one argmax, nothing else
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * len(states))
        x, owned = self._process(logits, states, plan, ahead)
        tokens = torch.empty(len(states), dtype=torch.long, device=x.device)
        if plan.greedy:
            # owned=True: argmax only reads, so x itself will do when every row is greedy.
            _assign(tokens, plan.greedy, _rows(x, plan.greedy, owned=True).argmax(dim=-1))
        if plan.random:
            chosen = _sample(_rows(x, plan.random, owned), [states[i] for i in plan.random])
            _assign(tokens, plan.random, chosen)
        token_list = tokens.tolist()
        return SamplerOutput(token_list, _logprobs(logits, tokens, token_list, plan.with_logprobs, states))

    @torch.inference_mode()
    def target(self, logits: torch.Tensor, states: Sequence[SamplingState], ahead=None) -> Target:
        """Each row's target distribution: steps 0-4 above, without the draw (no generator moves)."""
        plan = _Plan.of(states, logits.shape[1])
        if plan.plain_greedy:
            return Target(list(range(len(states))), logits.argmax(dim=-1).tolist(), [], None)
        x, owned = self._process(logits, states, plan, ahead)
        greedy = _rows(x, plan.greedy, owned=True).argmax(dim=-1).tolist() if plan.greedy else []
        probs = _probs(_rows(x, plan.random, owned), [states[i] for i in plan.random]) if plan.random else None
        return Target(plan.greedy, greedy, plan.random, probs)

    def _process(self, logits: torch.Tensor, states: Sequence[SamplingState], plan: "_Plan", ahead):
        """Steps 0-2 on a float32 copy where they modify (the caller's logits stay raw: logprobs
        are computed from them); (x, whether x is not the caller's tensor)."""
        x = logits.to(torch.float32, memory_format=torch.contiguous_format)
        if plan.modifies and x.data_ptr() == logits.data_ptr():
            x = x.clone()
        owned = x.data_ptr() != logits.data_ptr()
        if plan.biased:
            _apply_logit_bias(x, plan.biased, states)
        if plan.constrained:
            self.masks.apply(x, plan.constrained, [states[i].grammar for i in plan.constrained], ahead)
        if plan.penalized:
            _apply_penalties(x, plan.penalized, states)
        if plan.min_token_cells[0]:
            rows, cols = plan.min_token_cells
            x[torch.tensor(rows, device=x.device), torch.tensor(cols, device=x.device)] = _NEG_INF
        return x, owned


@dataclass(frozen=True)
class _Plan:
    """Which rows use which features; built once per step from the states (O(num_seqs))."""

    greedy: list[int]
    random: list[int]
    penalized: list[int]
    with_logprobs: list[int]
    min_token_cells: tuple[list[int], list[int]]  # (rows, token ids) to set to -inf
    biased: list[int]  # rows with a logit_bias
    constrained: list[int]  # rows with a grammar

    @staticmethod
    def of(states: Sequence[SamplingState], vocab: int) -> _Plan:
        greedy, random, penalized, with_logprobs, biased, constrained = [], [], [], [], [], []
        rows: list[int] = []
        cols: list[int] = []
        for i, s in enumerate(states):
            p = s.params
            (greedy if p.greedy else random).append(i)
            if p.has_penalties:
                penalized.append(i)
            if p.logprobs is not None:
                with_logprobs.append(i)
            if p.logit_bias:
                biased.append(i)
            if s.grammar is not None:
                constrained.append(i)
            if len(s.output_token_ids) < p.min_tokens:
                banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(s.eos_token_ids))
                ids = sorted(t for t in banned if t < vocab)  # an id past the vocab can't be drawn
                rows += [i] * len(ids)
                cols += ids
        return _Plan(greedy, random, penalized, with_logprobs, (rows, cols), biased, constrained)

    @property
    def modifies(self) -> bool:
        """Some row's logits change before sampling."""
        return bool(self.penalized or self.min_token_cells[0] or self.biased or self.constrained)

    @property
    def plain_greedy(self) -> bool:
        return not (self.random or self.with_logprobs or self.modifies)


def _rows(x: torch.Tensor, rows: list[int], owned: bool) -> torch.Tensor:
    """x restricted to `rows`, as a tensor the caller may modify in place."""
    if len(rows) == x.shape[0]:  # rows are always ascending, so this is all of them
        return x if owned else x.clone()
    return x[torch.tensor(rows, device=x.device)]


def _assign(dst: torch.Tensor, rows: list[int], values: torch.Tensor) -> None:
    if len(rows) == dst.shape[0]:
        dst.copy_(values)
    else:
        dst[torch.tensor(rows, device=dst.device)] = values


# ---------------------------------------------------------------- logit bias


def _apply_logit_bias(x: torch.Tensor, rows: list[int], states: Sequence[SamplingState]) -> None:
    vocab = x.shape[1]
    cells = [(r, tok, bias) for r in rows for tok, bias in states[r].params.logit_bias if tok < vocab]
    if cells:
        r, tok, bias = zip(*cells)
        idx = (torch.tensor(r, device=x.device), torch.tensor(tok, device=x.device))
        x.index_put_(idx, torch.tensor(bias, dtype=x.dtype, device=x.device), accumulate=True)


# ---------------------------------------------------------------- penalties


def _prompt_tensor(state: SamplingState) -> torch.Tensor:
    if state._prompt_tensor is None:
        state._prompt_tensor = torch.as_tensor(list(state.prompt_token_ids), dtype=torch.long)
    return state._prompt_tensor


def _flat_ids(id_tensors: list[torch.Tensor], vocab: int, device: torch.device) -> torch.Tensor:
    """Token ids of row j shifted by j * vocab: indices into a flattened [rows, vocab] tensor."""
    shifted = [t + j * vocab for j, t in enumerate(id_tensors)]
    return torch.cat(shifted).to(device) if shifted else torch.empty(0, dtype=torch.long, device=device)


def _apply_penalties(x: torch.Tensor, rows: list[int], states: Sequence[SamplingState]) -> None:
    """Repetition (prompt + output), then frequency and presence (output), on x's `rows`."""
    _on_rows(x, rows, lambda sub: _penalize(sub, [states[i] for i in rows]))


def _penalize(x: torch.Tensor, states: Sequence[SamplingState]) -> None:
    """Touches only the tokens seen in each row: O(prompt + output), not O(vocab)."""
    vocab, dev = x.shape[1], x.device
    flat = x.view(-1)  # x is contiguous; index (row j, token t) as j * vocab + t
    params = [s.params for s in states]
    out_flat = _flat_ids([torch.as_tensor(s.output_token_ids, dtype=torch.long) for s in states], vocab, dev)
    if any(p.repetition_penalty != 1.0 for p in params):
        prompt_flat = _flat_ids([_prompt_tensor(s) for s in states], vocab, dev)
        seen = torch.unique(torch.cat([prompt_flat, out_flat]))
        rep = torch.tensor([p.repetition_penalty for p in params], device=dev)[seen // vocab]
        vals = flat[seen]
        # HF / vLLM: shrink a seen token's logit toward zero whatever its sign. A penalty near
        # zero (5e-324 is in range) divides by what float32 holds as 0: +inf becomes a huge
        # finite logit, 0 / 0 no logit at all, so the draw never sees a NaN.
        flat[seen] = torch.where(vals > 0, vals / rep, vals * rep).nan_to_num_(nan=_NEG_INF, posinf=_MAX_LOGIT)
    if out_flat.numel() and any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        tokens, counts = torch.unique(out_flat, return_counts=True)
        row = tokens // vocab
        freq = torch.tensor([p.frequency_penalty for p in params], device=dev)[row]
        pres = torch.tensor([p.presence_penalty for p in params], device=dev)[row]
        flat[tokens] -= freq * counts + pres  # OpenAI: count-scaled, plus once if present


# ---------------------------------------------------------------- random sampling


def _sample(x: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then a draw; x ([rows, vocab]) is modified in place."""
    return _inverse_cdf(_probs(x, states), _uniforms(states, x.device))


def _probs(x: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p: the probabilities a draw uses (x is modified in place;
    min-p leaves rows unnormalized)."""
    params = [s.params for s in states]
    dev = x.device
    if any(p.temperature != 1.0 for p in params):
        x /= torch.tensor([p.temperature for p in params], device=dev).unsqueeze(1)
    vocab = x.shape[1]
    top_k = [i for i, p in enumerate(params) if 0 < p.top_k < vocab]
    if top_k:
        _on_rows(x, top_k, lambda part: _top_k(part, [params[i].top_k for i in top_k]))
    top_p = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if top_p:
        _on_rows(x, top_p, lambda part: _top_p(part, [params[i].top_p for i in top_p]))
    probs = torch.softmax(x, dim=-1)
    min_p = [i for i, p in enumerate(params) if p.min_p > 0.0]
    if min_p:
        _on_rows(probs, min_p, lambda part: _min_p(part, [params[i].min_p for i in min_p]))
    return probs


def _on_rows(x: torch.Tensor, rows: list[int], fn) -> None:
    """Apply the in-place `fn` to x's `rows` (to x itself when that is every row)."""
    if len(rows) == x.shape[0]:
        fn(x)
        return
    idx = torch.tensor(rows, device=x.device)
    part = x[idx]
    fn(part)
    x[idx] = part


def _top_k(x: torch.Tensor, ks: list[int]) -> None:
    """Keep each row's k best logits (and any tied with the k-th)."""
    k = torch.tensor(ks, device=x.device).unsqueeze(1)
    kth = _best_values(x, max(ks)).gather(1, k - 1)
    x.masked_fill_(x < kth, _NEG_INF)


def _top_p(x: torch.Tensor, ps: list[float]) -> None:
    """Keep the smallest set of best tokens whose probability reaches p (ties at the edge kept).

    No full-vocab sort: a histogram of probability mass over logit buckets finds the bucket
    where the nucleus ends, and only that bucket's tokens are ordered. Blocks of rows bound
    the memory of the per-token bucket index.
    """
    p = torch.tensor(ps, dtype=torch.float64, device=x.device).unsqueeze(1)
    block = max(1, _TOP_P_BLOCK_TOKENS // x.shape[1])
    for s in range(0, x.shape[0], block):
        _top_p_block(x[s : s + block], p[s : s + block])


def _top_p_block(x: torch.Tensor, p: torch.Tensor) -> None:
    mx = x.amax(dim=-1, keepdim=True)
    weight = (x - mx).exp_()  # unnormalized probabilities: compare masses with p * total
    total = weight.sum(dim=-1, keepdim=True)
    target = p * total
    # Bucket 0 holds the best logits; everything more than _BUCKET_SPAN nats below the
    # best (each token < e^-32 of it) shares the last bucket. -inf lands there too. Any
    # bucket count is exact (the edge bucket is sorted); more buckets, smaller edge bucket.
    n = min(_BUCKETS, x.shape[1])
    bucket = (mx - x).mul_(n / _BUCKET_SPAN).clamp_(max=n - 1).long()
    mass = torch.zeros(x.shape[0], n, device=x.device).scatter_add_(1, bucket, weight)
    cum = mass.cumsum(dim=-1, dtype=torch.float64)
    edge = (cum < target).sum(dim=-1, keepdim=True).clamp_max_(n - 1)  # where the nucleus ends
    above = torch.where(edge > 0, cum.gather(1, (edge - 1).clamp_min(0)), 0.0)  # mass of better buckets
    in_edge = bucket == edge
    n_edge = in_edge.sum(dim=-1, keepdim=True)
    best = _best_values(torch.where(in_edge, x, _NEG_INF), max(int(n_edge.max()), 1))
    w = (best - mx).exp_()
    before = above + w.cumsum(dim=-1, dtype=torch.float64) - w  # mass strictly ahead of each
    # Never past the edge bucket's own tokens: summed in another order, its mass may round
    # short of the target, and the -inf padding after it would then lift the threshold.
    n_keep = torch.minimum((before < target).sum(dim=-1, keepdim=True), n_edge).clamp_min_(1)
    x.masked_fill_(x < best.gather(1, n_keep - 1), _NEG_INF)


def _best_values(x: torch.Tensor, m: int) -> torch.Tensor:
    """The m largest values of each row, descending: a selection when m is small."""
    if m * 4 < x.shape[1]:
        return x.topk(m, dim=-1).values
    if x.device.type == "cpu":  # numpy sorts values only, several times faster than torch.sort
        return torch.from_numpy(-np.sort(-x.numpy(), axis=-1)[:, :m])
    return x.sort(dim=-1, descending=True).values[:, :m]


def _min_p(probs: torch.Tensor, min_ps: list[float]) -> None:
    """Drop tokens less likely than min_p times the best one (probs need not renormalize)."""
    scale = torch.tensor(min_ps, device=probs.device).unsqueeze(1)
    probs.masked_fill_(probs < scale * probs.amax(dim=-1, keepdim=True), 0.0)


def _uniforms(states: Sequence[SamplingState], device: torch.device) -> torch.Tensor:
    """One U[0, 1) per row: a seeded row from its own generator, the others in one batch."""
    u = torch.rand(len(states), dtype=torch.float64, device=device)
    for j, s in enumerate(states):
        if s.generator is not None:
            u[j] = _draw_uniform(s.generator).to(device)
    return u


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token i with probability probs[i] / sum(probs): the first whose cumulative mass passes u.

    Two levels, so that no sequential scan runs over the whole vocabulary: block sums
    (vectorized) pick a block of _CDF_BLOCK tokens, a scan of that block picks the token.
    Sums are float64: in float32, rounding over ~1e5 tokens would move probability mass
    between neighbouring tail tokens. One uniform per row (the exponential race needs one
    per token) keeps both the draw and a seed's state cheap.
    """
    rows, vocab = probs.shape
    pad = -vocab % _CDF_BLOCK
    blocks = torch.nn.functional.pad(probs, (0, pad)).view(rows, -1, _CDF_BLOCK)
    block_cdf = blocks.sum(dim=-1, dtype=torch.float64).cumsum(dim=-1)
    target = u.unsqueeze(1) * block_cdf[:, -1:]
    b = _first_above(block_cdf, target).clamp_(max=block_cdf.shape[1] - 1)  # [rows, 1]
    ahead = torch.where(b > 0, block_cdf.gather(1, (b - 1).clamp_min(0)), 0.0)
    within = blocks[torch.arange(rows, device=probs.device), b.squeeze(1)]
    t = _first_above(ahead + within.cumsum(dim=-1, dtype=torch.float64), target)
    return (b * _CDF_BLOCK + t).squeeze(1).clamp_(max=vocab - 1)  # (a pad token is never drawn)


def _first_above(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cumulative mass exceeds target, never one without mass.

    Rounding may put target at or past the row's last value; the last index that adds
    mass (where the cdf first reaches its final value) is then the right answer.
    """
    picked = torch.searchsorted(cdf, target, right=True)
    last = torch.searchsorted(cdf, cdf[:, -1:].contiguous(), right=False)
    return torch.minimum(picked, last)


# ---------------------------------------------------------------- logprobs


def _logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    token_list: list[int],
    rows: list[int],
    states: Sequence[SamplingState],
) -> list[TokenLogprob | None]:
    """Raw logprobs (before penalties and temperature) of the chosen token and the top-n.

    rank is 1 + the number of tokens strictly more likely than the chosen one (a token tied
    with the best has rank 1).
    """
    out: list[TokenLogprob | None] = [None] * len(states)
    if not rows:
        return out
    idx = torch.tensor(rows, device=logits.device)
    lp = torch.log_softmax(logits[idx].float(), dim=-1)
    chosen = tokens[idx].unsqueeze(1)
    chosen_lp = lp.gather(1, chosen)
    ranks = ((lp > chosen_lp).sum(dim=-1) + 1).tolist()
    n_top = max(states[i].params.logprobs for i in rows)
    top_lp, top_ids = lp.topk(n_top, dim=-1) if n_top else (lp[:, :0], chosen[:, :0])
    top_lp, top_ids, chosen_lp = top_lp.tolist(), top_ids.tolist(), chosen_lp.squeeze(1).tolist()
    for j, i in enumerate(rows):
        n = states[i].params.logprobs
        top = tuple(zip(top_ids[j][:n], top_lp[j][:n]))
        out[i] = TokenLogprob(token_list[i], chosen_lp[j], ranks[j], top)
    return out


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of `probs` ([rows, vocab], unnormalized), the token the uniform `u[row]` picks."""
    return _inverse_cdf(probs, u)


def logprobs_of(logits: torch.Tensor, tokens: list[int], rows: list[int],
                states: Sequence[SamplingState]) -> list[TokenLogprob | None]:
    """Raw logprobs of `tokens[row]` for each of `rows` (None for the others), as a step reports them."""
    t = torch.tensor(tokens, dtype=torch.long, device=logits.device)
    return _logprobs(logits, t, tokens, rows, states)
