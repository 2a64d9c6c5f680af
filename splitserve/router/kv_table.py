"""One tier of the cluster KV index (router/kv_index.py): block hash -> the bitmask of the
workers holding it, least recently stored or matched first, so the index evicts from the front.

Native (csrc/kv_table.c): the 16-byte digest sits in the table's entry and is its own hash, and
a chain's lookups are prefetched together; a routing decision looks up every block of a prompt
(136 for an 8K-token prompt behind a shared 2K-token system prompt) in up to a million hashes,
where a dict of bytes pays three cache misses a lookup. Where it cannot build, `PythonKVTable`
does the same over an OrderedDict (the tests hold the two to the same answers).

Both: `store(hashes, bit)` / `discard(hashes, bit)` add / remove a holder (a hash nobody holds
is forgotten), `drop_bit(bit)` removes one everywhere, `evict(n)` forgets the n least recent,
`touch(hashes)` makes held ones the newest, `runs(hashes)` says how far a chain goes in runs of
equal holders ([(end, bits), ...], each run hashes[previous end:end]), plus `get`, `keys()`
(least recent first), `len` and `in`. Keys are 16-byte digests (splitserve.hashing).
"""

from __future__ import annotations

import functools
import itertools
from collections import OrderedDict
from pathlib import Path
from typing import Iterable, Protocol, Sequence

from splitserve import native
from splitserve.hashing import DIGEST_SIZE, BlockHash


class KVTable(Protocol):
    def __len__(self) -> int: ...
    def __contains__(self, h: object) -> bool: ...
    def get(self, h: BlockHash) -> int | None: ...
    def keys(self) -> list[BlockHash]: ...
    def store(self, hashes: Iterable[BlockHash], bit: int) -> None: ...
    def discard(self, hashes: Iterable[BlockHash], bit: int) -> None: ...
    def drop_bit(self, bit: int) -> None: ...
    def evict(self, n: int) -> None: ...
    def touch(self, hashes: Sequence[BlockHash]) -> None: ...
    def runs(self, hashes: Sequence[BlockHash]) -> list[tuple[int, int]]: ...


def make_table() -> KVTable:
    native_type = _native_type()
    return PythonKVTable() if native_type is None else native_type()


class PythonKVTable:
    def __init__(self) -> None:
        self._d: OrderedDict[BlockHash, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, h: object) -> bool:
        return _key(h) in self._d

    def get(self, h: BlockHash) -> int | None:
        return self._d.get(_key(h))

    def keys(self) -> list[BlockHash]:
        return list(self._d)

    def store(self, hashes: Iterable[BlockHash], bit: int) -> None:
        _bit(bit)
        d = self._d
        for h in map(_key, hashes):
            d[h] = d.get(h, 0) | bit
            d.move_to_end(h)

    def discard(self, hashes: Iterable[BlockHash], bit: int) -> None:
        _bit(bit)
        for h in map(_key, hashes):
            self._drop(h, bit)

    def drop_bit(self, bit: int) -> None:
        _bit(bit)
        for h in [h for h, held in self._d.items() if held & bit]:
            self._drop(h, bit)

    def _drop(self, h: BlockHash, bit: int) -> None:
        held = self._d.get(h)
        if held is not None:
            if held & ~bit:
                self._d[h] = held & ~bit
            else:
                del self._d[h]

    def evict(self, n: int) -> None:
        for _ in range(min(n, len(self._d))):
            self._d.popitem(last=False)

    def touch(self, hashes: Sequence[BlockHash]) -> None:
        for h in map(_key, hashes):
            if h in self._d:
                self._d.move_to_end(h)

    def runs(self, hashes: Sequence[BlockHash]) -> list[tuple[int, int]]:
        held = list(map(self._d.get, map(_key, hashes)))
        if None in held:
            del held[held.index(None):]
        runs, end = [], 0
        for bits, run in itertools.groupby(held):
            end += len(list(run))
            runs.append((end, bits))
        return runs


def _key(h: object) -> BlockHash:
    if type(h) is not bytes or len(h) != DIGEST_SIZE:
        raise TypeError("a block hash is 16 bytes (splitserve.hashing)")
    return h


def _bit(bit: int) -> None:
    if not isinstance(bit, int) or bit <= 0:
        raise TypeError("a holder bit is a positive int")


@functools.cache
def _native_type():
    """The native table's type, built on first use (None: no compiler or Python headers here)."""
    fn = native.python_function(Path(__file__).parent / "csrc" / "kv_table.c", "kv_table_type", [])
    return None if fn is None else fn()
