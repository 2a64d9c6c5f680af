"""Which data-parallel replica a new request goes to: the one whose live requests hold the fewest
context tokens (prompt + tokens generated so far), ties to the one with fewer requests, then the
lowest replica.

Why context tokens: a replica's step is its attention over its requests' context (decode reads
all of it, a prefill computes its prompt) and its KV cache holds exactly those tokens, and the
replicas run every step in lockstep (the MoE all-to-alls), so the busiest replica sets the step
time for all — and the fullest is the first to preempt. The front counts them itself from the
requests it placed and the chunks it returned: no report from the replicas, never stale (a burst
of adds between two steps spreads at once)."""

from __future__ import annotations


class LeastTokens:
    def __init__(self, replicas: int) -> None:
        self.tokens = [0] * replicas
        self.requests = [0] * replicas
        self._held: dict[str, tuple[int, int]] = {}  # request id -> (replica, its tokens counted)

    def place(self, request_id: str, tokens: int) -> int:
        r = min(range(len(self.tokens)), key=lambda i: (self.tokens[i], self.requests[i], i))
        self._held[request_id] = (r, 0)
        self.requests[r] += 1
        self.grew(request_id, tokens)
        return r

    def grew(self, request_id: str, tokens: int) -> None:
        r, n = self._held[request_id]
        self._held[request_id] = (r, n + tokens)
        self.tokens[r] += tokens

    def owner(self, request_id: str) -> int | None:
        held = self._held.get(request_id)
        return None if held is None else held[0]

    def done(self, request_id: str) -> int | None:
        """The request left (finished or aborted); its replica, None if unknown."""
        held = self._held.pop(request_id, None)
        if held is None:
            return None
        r, n = held
        self.tokens[r] -= n
        self.requests[r] -= 1
        return r

    def live(self) -> bool:
        return bool(self._held)
