"""Verification: from the logits of a sequence's last token and its k proposals (one forward
pass), the tokens it emits this step — a prefix of the proposals the target accepts, then one
token of the target's own, so 1..k+1 tokens.

The target at each position is the sampler's distribution there (engine/sampler.py: logit
bias, penalties, min_tokens, temperature, top-k/top-p/min-p), computed as if the proposals
before it had been emitted already — exactly what the non-speculative engine would sample from
after emitting them.

- Greedy: accept while the proposal equals the target's argmax; then the argmax where they
  first differ (or after the last proposal). The output is the non-speculative engine's.
- Sampling: the proposers here are deterministic (a point mass q = onehot(x)), for which the
  standard rejection rule (Leviathan et al., Chen et al.) reduces to: accept x with probability
  p(x); on rejection draw from normalize(max(p - onehot(x), 0)) — p with x removed; after k
  acceptances draw the bonus token from the next position's p. Each emitted token is then
  distributed exactly as the target's, so the output distribution equals the non-speculative
  one.

Seeded requests: a seeded request with proposals draws k + 1 uniforms per step from its
generator (one accept test per proposal, one for the final token). Its output is a valid draw
from the same distribution, and reproducible run to run as long as its proposals are the same
(same config, and no step's budget or free blocks cut them — which other traffic can); it is
NOT the token sequence the non-speculative engine draws for that seed, and a migration's
fast-forward (one draw per token, sampler.make_generator) continues it with a different, still
exactly distributed, stream. Rows without proposals draw once, as without speculation.

Logprobs are reported per emitted token, from the raw logits at its position (as without
speculation)."""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence as Seq

import torch

from splitserve.engine.sampler import Sampler, SamplingState, Target, draw_uniform, inverse_cdf, logprobs_of
from splitserve.engine.sequence import Sequence

Verified = tuple[Sequence, tuple[int, ...], tuple | None]  # (sequence, emitted tokens, their logprobs)


def verify(sampler: Sampler, logits: torch.Tensor, seqs: Seq[Sequence], rows_per_seq: Seq[int],
           ahead=None) -> list[Verified]:
    """`logits`: rows_per_seq[i] rows per sequence, in order (its last token, then each of its
    `spec_tokens`)."""
    states, starts = _states(seqs, rows_per_seq)
    target = sampler.target(logits, states, ahead)
    greedy = dict(zip(target.greedy, target.greedy_tokens))
    emitted: list[list[int]] = [None] * len(seqs)  # type: ignore[list-item]
    sampled = []
    for i, (seq, start) in enumerate(zip(seqs, starts)):
        if seq.request.params.greedy:
            emitted[i] = _accept_greedy(seq.spec_tokens, [greedy[start + j] for j in range(rows_per_seq[i])])
        else:
            sampled.append(i)
    if sampled:
        _accept_sampled(target, seqs, starts, sampled, emitted)
    return [(seq, tuple(toks), lps) for seq, toks, lps in zip(seqs, emitted, _logprobs(logits, seqs, starts, emitted,
                                                                                          states))]


def _states(seqs: Seq[Sequence], rows_per_seq: Seq[int]) -> tuple[list[SamplingState], list[int]]:
    """One sampling state per logits row: row j of a sequence sees its proposals before j as
    output already (penalties and min_tokens count them; a grammar has consumed them)."""
    states: list[SamplingState] = []
    starts = []
    for seq, rows in zip(seqs, rows_per_seq):
        starts.append(len(states))
        base = seq.sampling
        states.append(base)
        grammar = base.grammar
        for j in range(1, rows):
            # a grammar's mask at row j is its state after the proposals before j
            grammar = None if grammar is None else grammar.advanced(seq.spec_tokens[j - 1:j])
            s = replace(base, output_token_ids=base.output_token_ids + seq.spec_tokens[:j], generator=None,
                        grammar=grammar)
            s._prompt_tensor = base._prompt_tensor  # built once per request, not per row
            states.append(s)
    return states, starts


def _accept_greedy(proposal: list[int], argmax: list[int]) -> list[int]:
    a = 0
    while a < len(proposal) and proposal[a] == argmax[a]:
        a += 1
    return proposal[:a] + [argmax[a]]


def _accept_sampled(target: Target, seqs, starts, which: list[int], emitted: list) -> None:
    """Rejection sampling for the sampled sequences `which`; fills emitted[i] for each."""
    probs = target.probs
    at = {row: r for r, row in enumerate(target.random)}  # logits row -> row of probs
    dev = probs.device
    u = _uniforms([seqs[i] for i in which], dev)  # k + 1 per sequence
    test_rows, test_tokens = [], []
    for i in which:
        for j, x in enumerate(seqs[i].spec_tokens):
            test_rows.append(at[starts[i] + j])
            test_tokens.append(x)
    ratio = []
    if test_rows:
        rows_t = torch.tensor(test_rows, device=dev)
        p = probs[rows_t].double()
        ratio = (p.gather(1, torch.tensor(test_tokens, device=dev).unsqueeze(1)).squeeze(1) / p.sum(-1)).tolist()
    u_list = u.tolist()
    final_rows, rejected, last_u, t, off = [], [], [], 0, 0
    for i in which:
        spec = seqs[i].spec_tokens
        a = 0
        while a < len(spec) and u_list[off + a] < ratio[t + a]:
            a += 1
        t += len(spec)
        off += len(spec) + 1
        last_u.append(off - 1)  # the final token's own uniform
        emitted[i] = spec[:a]
        final_rows.append(at[starts[i] + a])
        rejected.append(spec[a] if a < len(spec) else -1)
    q = probs[torch.tensor(final_rows, device=dev)]
    hit = [(r, x) for r, x in enumerate(rejected) if x >= 0]
    if hit:
        r, x = zip(*hit)
        _residual(q, torch.tensor(r, device=dev), torch.tensor(x, device=dev))
    for i, tok in zip(which, inverse_cdf(q, u[torch.tensor(last_u, device=dev)]).tolist()):
        emitted[i].append(tok)


def _residual(q: torch.Tensor, rows: torch.Tensor, rejected: torch.Tensor) -> None:
    """normalize(max(p - onehot(x), 0)) for a point-mass proposal x: p without x (inverse_cdf
    normalizes)."""
    q[rows, rejected] = 0.0


def _uniforms(seqs: Seq[Sequence], device: torch.device) -> torch.Tensor:
    """k + 1 uniforms per sequence, in order: a seeded one's from its generator, the rest in one batch."""
    sizes = [len(s.spec_tokens) + 1 for s in seqs]
    u = torch.rand(sum(sizes), dtype=torch.float64, device=device)
    off = 0
    for s, n in zip(seqs, sizes):
        gen = s.sampling.generator
        if gen is not None:
            for j in range(n):
                u[off + j] = draw_uniform(gen).to(device)
        off += n
    return u


def _logprobs(logits, seqs, starts, emitted, states) -> list[tuple | None]:
    """Emitted token i of a sequence is scored at its row start + i."""
    want = [i for i, s in enumerate(seqs) if s.request.params.logprobs is not None]
    if not want:
        return [None] * len(seqs)
    tokens = [0] * logits.shape[0]
    rows = []
    for i in want:
        for j, tok in enumerate(emitted[i]):
            tokens[starts[i] + j] = tok
            rows.append(starts[i] + j)
    lps = logprobs_of(logits, tokens, rows, states)
    out: list[tuple | None] = [None] * len(seqs)
    for i in want:
        out[i] = tuple(lps[starts[i] + j] for j in range(len(emitted[i])))
    return out
