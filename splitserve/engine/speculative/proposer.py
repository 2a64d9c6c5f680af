"""What a proposer is: given a sequence's tokens so far, up to k tokens it guesses come next.

Proposers here are deterministic (a point mass per proposed token), which is what the
verifier's rejection rule assumes (verify.py). Each keeps its per-sequence state in an object
it makes (`new_state`), which the sequence carries, so nothing outlives the request.

A draft head (draft.py) proposes from the model's hidden states, not from tokens, and for every
decoding sequence at once (one batched chain): a `BatchProposer`."""

from __future__ import annotations

from typing import Protocol, Sequence


class Proposer(Protocol):
    def new_state(self) -> object:
        """The state one sequence's proposals need (an index over its tokens, say)."""

    def propose(self, tokens: Sequence[int], state: object, k: int) -> list[int]:
        """Up to `k` tokens to follow `tokens` (prompt + output); [] for none. `tokens` only
        ever grows between calls for one state."""


class BatchProposer(Protocol):
    def new_state(self) -> object:
        """The state one sequence's proposals need (None for a draft head: its tail is on the sequence)."""

    def propose_batch(self, wants: list[tuple[object, int]]) -> list[list[int]]:
        """For each (sequence, k), up to k tokens to follow its tokens; [] for none."""
