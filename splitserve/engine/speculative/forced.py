"""Jump-forward proposals: a grammar-constrained sequence is proposed the tokens its grammar
forces from where it stands (`GrammarMatcher.forced`), ahead of the proposer's guess.

Where a grammar forces text — a forced tool call's `<tool_call>\n`, its const function name, a
schema's keys, the closing of the call — the mask at each of those positions allows only tokens
that spell it, so the model's argmax under the mask is the forced token unless it prefers another
tokenization of the same bytes (the forced tokens are the tokenizer's canonical ones, which a
model trained on that tokenizer nearly always picks). Verification masks every position by the
grammar as usual (verify.py), so the output is the non-speculative engine's whatever is
proposed; forced tokens only make the accepted runs longer.

They go out whatever the request's adaptive k (which learns from the proposer's guesses alone,
speculator.py), up to the configured k: one verify row each, accepted nearly always. The guess
is kept where it agrees with them and runs past them (an earlier call of the same tool, say);
where it contradicts them it is wrong at that token, and the forced tokens are proposed alone."""

from __future__ import annotations


def with_forced(forced: list[int], guess: list[int], room: int) -> tuple[list[int], int]:
    """(the proposal, how many of its leading tokens the grammar forces), from the grammar's
    forced tokens and the proposer's guess, both continuing the sequence as it stands; at most
    `room` tokens (the guess is at most that already)."""
    forced = forced[:room]
    if len(guess) > len(forced) and guess[:len(forced)] == forced:
        return guess, len(forced)
    return forced, len(forced)
