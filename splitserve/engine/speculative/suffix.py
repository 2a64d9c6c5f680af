"""Suffix proposals: continue a sequence the way its tenant's recent text continued.

One engine (one worker) keeps, per tenant, a frequency-weighted n-gram index over the prompts
and outputs of that tenant's recent requests (finished and running: a sequence's tokens are
entered as they arrive, so nothing waits for a request to end). A proposal walks it: the
longest n-gram (max_n down to min_n) ending the context picks the continuation seen MOST
OFTEN after it (ties: the most recent), that token joins the context, and the walk repeats up
to k times. Frequency over recency because the text a tenant's requests share — a schema's
keys, a template, a system prompt's boilerplate — is what recurs across them, and the
continuation most of them took is the one the next is likeliest to take; one request's own
quirk, seen once, does not override it. Where the index has nothing, the request's own prompt
and output are searched as `ngram` does (most recent occurrence).

Tenants never share: the index is keyed by `Request.cache_salt` — what keeps one tenant's
prefix-cache blocks apart (None: the anonymous tenant) — so one tenant's text is never proposed
to, and so never inferable by, another.

Bounded by tokens: each token entered is one entry, held at most `per_tenant` per tenant and
`total` for the engine. Past a bound the oldest entries go first — of the tenant itself, or,
for the engine bound, of the least recently used tenant (a proposal or an entry uses it).
Within a tenant eviction is by insertion order, not refreshed by hits: refreshing would move
entries around in the queue for every hit, and recent text is what recurs anyway."""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Sequence

from splitserve.engine.speculative.ngram import NgramIndex


class TenantIndex:
    """One tenant's n-grams -> {next token: [count, last seen]}, and its entries oldest first."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.by_n: dict[int, dict[tuple, dict[int, list[int]]]] = {n: {} for n in range(max_n, min_n - 1, -1)}
        self.entries: deque[tuple[tuple, int]] = deque()  # (up to max_n tokens before, next token)
        self.clock = 0

    def add(self, before: tuple, nxt: int) -> None:
        self.clock += 1
        for n, table in self.by_n.items():
            if len(before) >= n:
                seen = table.setdefault(before[-n:], {}).setdefault(nxt, [0, 0])
                seen[0] += 1
                seen[1] = self.clock
        self.entries.append((before, nxt))

    def evict_oldest(self) -> None:
        before, nxt = self.entries.popleft()
        for n, table in self.by_n.items():
            if len(before) >= n:
                key = before[-n:]
                nexts = table[key]
                seen = nexts[nxt]
                seen[0] -= 1
                if seen[0] == 0:
                    del nexts[nxt]
                    if not nexts:
                        del table[key]

    def next_token(self, context: Sequence[int]) -> int | None:
        """The most frequent continuation of the longest n-gram ending `context`."""
        size = len(context)
        for n, table in self.by_n.items():
            if size >= n:
                nexts = table.get(tuple(context[size - n:]))
                if nexts:
                    return max(nexts.items(), key=lambda kv: (kv[1][0], kv[1][1]))[0]
        return None

    def __len__(self) -> int:
        return len(self.entries)


@dataclass
class SuffixState:
    """One sequence's: its tenant, how many of its tokens are entered, its own n-gram index."""

    tenant: str | None
    own: NgramIndex
    entered: int = 0
    context: list[int] = field(default_factory=list)  # its last max_n entered tokens


class SuffixProposer:
    def __init__(self, min_n: int, max_n: int, per_tenant: int, total: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.per_tenant, self.total = per_tenant, total
        self.tenants: OrderedDict[str | None, TenantIndex] = OrderedDict()  # least recently used first
        self.size = 0  # entries over all tenants

    def new_state(self, tenant: str | None = None) -> SuffixState:
        return SuffixState(tenant, NgramIndex(self.min_n, self.max_n))

    def propose(self, tokens: Sequence[int], state: SuffixState, k: int) -> list[int]:
        index = self._tenant(state.tenant)
        self._enter(tokens, state, index)
        out: list[int] = []
        context = list(tokens[-self.max_n:])
        while len(out) < k:
            nxt = index.next_token(context)
            if nxt is None:
                break
            out.append(nxt)
            context = context[1:] + [nxt] if len(context) >= self.max_n else context + [nxt]
        if out:
            return out
        state.own.update(tokens)
        start = state.own.lookup(tokens)
        return [] if start is None else list(tokens[start:start + k])

    def _tenant(self, tenant: str | None) -> TenantIndex:
        index = self.tenants.get(tenant)
        if index is None:
            index = self.tenants[tenant] = TenantIndex(self.min_n, self.max_n)
        self.tenants.move_to_end(tenant)
        return index

    def _enter(self, tokens: Sequence[int], state: SuffixState, index: TenantIndex) -> None:
        """Enter the sequence's tokens since the last call (each with the max_n before it)."""
        for pos in range(max(state.entered, 1), len(tokens)):
            index.add(tuple(tokens[max(0, pos - self.max_n):pos]), tokens[pos])
            self.size += 1
            self._bound(index)
        state.entered = max(state.entered, len(tokens))

    def _bound(self, index: TenantIndex) -> None:
        if len(index) > self.per_tenant:
            index.evict_oldest()
            self.size -= 1
        while self.size > self.total:  # others hold entries: total >= per_tenant >= len(index)
            lru_tenant, lru = next(iter(self.tenants.items()))
            if len(lru):
                lru.evict_oldest()
                self.size -= 1
            if not len(lru) and lru is not index:
                del self.tenants[lru_tenant]

    def check(self) -> None:
        """Invariants (tests): every bound holds, and the counts match the entries."""
        assert self.size == sum(len(t) for t in self.tenants.values()) <= self.total
        for t in self.tenants.values():
            assert len(t) <= self.per_tenant
            for n, table in t.by_n.items():
                assert sum(s[0] for nexts in table.values() for s in nexts.values()) == \
                    sum(1 for before, _ in t.entries if len(before) >= n)
