"""N-gram proposals (prompt lookup): find the most recent earlier occurrence of the sequence's
last n tokens — n from max_n down to min_n, the longest match wins — in its prompt and output,
and propose the k tokens that followed it there.

The index is incremental: each n-gram is entered once, when the token after it exists, so a
lookup is one dict probe per n, whatever the context length."""

from __future__ import annotations

from typing import Sequence


class NgramIndex:
    """For each n, each n-gram of the tokens seen so far -> where its most recent occurrence
    ends (the index of the token after it)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.by_n = {n: {} for n in range(max_n, min_n - 1, -1)}  # longest first
        self.indexed = 0  # n-grams ending before this position are entered

    def update(self, tokens: Sequence[int]) -> None:
        last = len(tokens) - 1  # an n-gram ending at the last token has no successor yet
        for end in range(self.indexed + 1, last + 1):
            for n, table in self.by_n.items():
                if end >= n:
                    table[tuple(tokens[end - n:end])] = end
        self.indexed = max(self.indexed, last)

    def lookup(self, tokens: Sequence[int]) -> int | None:
        """Where the continuation of the longest matching suffix starts, or None."""
        size = len(tokens)
        for n, table in self.by_n.items():
            if size > n:
                end = table.get(tuple(tokens[size - n:]))
                if end is not None:
                    return end
        return None


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def new_state(self) -> NgramIndex:
        return NgramIndex(self.min_n, self.max_n)

    def propose(self, tokens: Sequence[int], state: NgramIndex, k: int) -> list[int]:
        state.update(tokens)
        start = state.lookup(tokens)
        return [] if start is None else list(tokens[start:start + k])
