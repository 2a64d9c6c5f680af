"""The cluster KV index: which worker holds which block hash, fed by the workers' KV events
(BlockStored / BlockRemoved from their BlockPools). Exact, and bounded: past `max_hashes` the
least recently stored or matched hashes are forgotten (a forgotten hash only costs a missed
cache hit).

The router asks one question of it: for a request's chain of block hashes, how many leading
blocks does each worker already hold? Hashes chain the whole prefix (splitserve.hashing), so a
leading run of matches is exactly a cached prefix. Blocks in a worker's host-memory tier
(events with `tier=Tier.HOST`) are kept apart: `host_holders` is how far each worker's prefix
goes on there past its device run (as the engine promotes them: engine/kv_cache/host_tier.py).

Each hash maps to one int, a bit per worker (workers get small slot numbers, reused after they
leave), in a native table (router/kv_table.py): walking a prompt's chain is one prefetched
lookup per block and one AND where its holders change, with no per-worker work except where a
worker's run ends — a routing decision walks it once for every worker.
"""

from __future__ import annotations

from typing import Collection, Hashable, Iterable, NamedTuple, Sequence

from splitserve.hashing import BlockHash, block_hashes
from splitserve.router.kv_table import KVTable, make_table
from splitserve.types import BlockRemoved, BlockStored, KVEvent, Tier


class Group(NamedTuple):
    """Workers sharing one value: the blocks of a prefix they hold, or the bonus a scorer gives
    them. The index finds holders a group at a time and policies score them so: a decision's
    cost grows with the distinct values, not with the holders."""

    value: float
    members: Collection[Hashable]  # the index gives frozensets: `in` at C speed


class KVIndex:
    def __init__(self, max_hashes: int = 1_000_000) -> None:
        if max_hashes <= 0:
            raise ValueError(f"max_hashes must be positive, got {max_hashes}")
        self.max_hashes = max_hashes
        self._holders = make_table()  # bit s set: slot s's worker holds it
        self._host = make_table()  # the same, for host-tier blocks
        self._slot: dict[Hashable, int] = {}
        self._workers: list[Hashable | None] = []  # by slot; None: free
        self._free: list[int] = []
        self._stored = 0  # hashes stored so far: the index's clock for touches
        self._touched: dict[BlockHash, int] = {}  # a matched run's last hash -> `_stored` when touched
        self._members: dict[int, tuple] = {}  # holder bits -> their workers (cleared when a slot changes hands)

    def __len__(self) -> int:
        return len(self._holders) + len(self._host)

    def routable_hashes(self, tokens: Sequence[int], block_size: int, salt: str | None = None,
                        check_every: int = 8) -> tuple[BlockHash, ...]:
        """The prompt's leading block hashes as far as some worker may hold them: the chain
        stops after the first `check_every`-th block nobody holds (a run ends at its first
        missing block, so no worker's prefix goes on past it). The engine hashes the rest,
        continuing the chain from the last one given (Request.prompt_hashes)."""
        return tuple(block_hashes(tokens, block_size, salt, known=(self._holders, self._host), check_every=check_every))

    def apply(self, worker_id: Hashable, events: Iterable[KVEvent]) -> None:
        bit = 1 << self._slot_of(worker_id)
        for ev in events:
            holders = self._host if ev.tier is Tier.HOST else self._holders
            if isinstance(ev, BlockStored):
                self._stored += len(ev.block_hashes)
                holders.store(ev.block_hashes, bit)
            elif isinstance(ev, BlockRemoved):
                holders.discard(ev.block_hashes, bit)
        over = len(self._holders) + len(self._host) - self.max_hashes
        if over > 0:
            from_host = min(over, len(self._host))  # host hits are worth less: they go first
            self._host.evict(from_host)
            self._holders.evict(over - from_host)

    def remove_worker(self, worker_id: Hashable) -> None:
        """A worker left (or restarted with an empty cache): forget everything it held."""
        slot = self._slot.pop(worker_id, None)
        if slot is None:
            return
        for holders in (self._holders, self._host):
            holders.drop_bit(1 << slot)
        self._workers[slot] = None
        self._free.append(slot)
        self._members.clear()

    def _slot_of(self, worker_id: Hashable) -> int:
        slot = self._slot.get(worker_id)
        if slot is None:
            slot = self._free.pop() if self._free else len(self._workers)
            if slot == len(self._workers):
                self._workers.append(None)
            self._workers[slot] = worker_id
            self._slot[worker_id] = slot
        return slot

    def holders(self, hashes: Sequence[BlockHash], workers: Iterable[Hashable] | None = None
                ) -> tuple[Group, ...]:
        """The workers holding a leading run of `hashes`, grouped by its length in blocks (the
        holders of a hot prefix mostly end together: a few groups however many holders);
        workers holding none are absent. `workers`: only these."""
        out: list[Group] = []
        self._walk(self._holders, hashes, self._bits_of(workers), out, touch=True)
        return tuple(out)

    def overlap(self, hashes: Sequence[BlockHash], workers: Iterable[Hashable] | None = None) -> dict:
        """`holders`, per worker (workers holding none are omitted, unless listed in `workers`)."""
        listed = None if workers is None else list(workers)
        groups = self.holders(hashes, listed)
        return dict.fromkeys(listed or (), 0) | {w: depth for depth, members in groups for w in members}

    def _bits_of(self, workers: Iterable[Hashable] | None) -> int:
        if workers is None:
            return (1 << len(self._workers)) - 1  # free slots hold nothing: no need to leave them out
        slots = map(self._slot.get, workers)
        return sum({1 << s for s in slots if s is not None})

    def _walk(self, holders: KVTable, hashes: Sequence[BlockHash], alive: int, out: list, touch: bool) -> None:
        """Append to `out` how many leading `hashes` `holders` has, a group per length, for the
        workers whose bits are in `alive` (none for workers with none); `touch`: mark the matched
        hashes recent. A chain's holders change at a few blocks only: Python works there, not
        per block."""
        if not alive:
            return
        depth = 0
        for end, bits in holders.runs(hashes):
            still = alive & bits
            if still != alive:
                if depth:  # some runs end here
                    out.append(Group(depth, self._members_of(alive ^ still)))
                if not still:
                    break
                alive = still
            depth = end
        else:
            if depth:
                out.append(Group(depth, self._members_of(alive)))
        if touch and depth:
            self._touch(holders, hashes[:depth])

    def _touch(self, holders: KVTable, run: Sequence[BlockHash]) -> None:
        """Mark a matched run recent — at most once per quarter of the index's capacity in new
        hashes: it then sits within the newest half of the index, which eviction never reaches,
        so a prefix matched that often stays, and the hot path skips 100+ touches per decision."""
        last = self._touched.get(run[-1])
        if last is not None and self._stored - last < self.max_hashes // 4:
            return
        if len(self._touched) >= 1 << 16:
            self._touched.clear()
        self._touched[run[-1]] = self._stored
        holders.touch(run)

    def _members_of(self, bits: int) -> frozenset:
        members = self._members.get(bits)
        if members is None:  # the same few holder sets recur (who holds a hot prefix): decoded once
            if len(self._members) >= 4096:
                self._members.clear()
            members = self._members[bits] = frozenset(self._decode(bits))
        return members

    def _decode(self, bits: int):
        while bits:
            low = bits & -bits
            yield self._workers[low.bit_length() - 1]
            bits ^= low

    def host_holders(self, hashes: Sequence[BlockHash], device: Sequence[Group]) -> tuple[Group, ...]:
        """For the workers whose host tier holds blocks right past their device run (`device`,
        as `holders` gave it; workers absent from it ran 0), how many in a row, grouped."""
        if not self._host:
            return ()
        starts: dict[int, int] = {}  # device run length -> the workers' bits
        covered = 0
        for depth, members in device:
            bits = self._bits_of(members)
            starts[depth] = starts.get(depth, 0) | bits
            covered |= bits
        rest = self._bits_of(None) & ~covered
        if rest:
            starts[0] = starts.get(0, 0) | rest
        out: list[Group] = []
        for start, alive in starts.items():
            self._walk(self._host, hashes[start:], alive, out, touch=False)
        return tuple(out)
