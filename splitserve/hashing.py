"""Chained block hashes: the one definition of "the same prefix" for engine, router, simulator.

Block i's hash covers every token of blocks 0..i (it chains the parent's digest), so equal hashes
mean equal prefixes, not just equal blocks. Only full blocks are hashed. A `salt` (e.g. a tenant's
`cache_salt`) changes the root, keeping one tenant's blocks apart from another's. BLAKE2b with a
128-bit digest: collision-resistant far beyond any cache's size, and not forgeable by a client
who wants to land on another prompt's cached blocks. The parent digest is BLAKE2b's own 16-byte
salt parameter and the block's tokens (little-endian int64) its message, so a 16-token block is
one 128-byte compression.

A whole prompt is hashed in one native call (csrc/chained_blake2b.c, the same digests: the
tests check it against hashlib) that reads the list of ids itself, small ids straight from the
int objects: ~0.25 µs a 16-token block here, where hashlib block by block costs ~2 µs. It
remembers the last few chains it hashed (a system prompt, a conversation's earlier turns), and a
block whose ids and parent equal a remembered one's takes its digest: a comparison, not a
compression. Where no compiler (or
no Python headers) works, hashlib block by block.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import struct
from pathlib import Path
from typing import Container, Sequence

BlockHash = bytes  # 16 bytes

DIGEST_SIZE = 16
_ROOT = b"splitserve/v2"


@functools.lru_cache(maxsize=4096)  # one per tenant salt; every prompt's chain starts here
def root_hash(salt: str | None = None) -> BlockHash:
    data = _ROOT if salt is None else _ROOT + b"/salt/" + salt.encode()
    return hashlib.blake2b(data, digest_size=DIGEST_SIZE).digest()


def hash_block(parent: BlockHash, tokens: Sequence[int]) -> BlockHash:
    data = struct.pack(f"<{len(tokens)}q", *tokens)
    return hashlib.blake2b(data, digest_size=DIGEST_SIZE, salt=parent).digest()


def block_hashes(
    tokens: Sequence[int],
    block_size: int,
    salt: str | None = None,
    *,
    start: int = 0,
    parent: BlockHash | None = None,
    stop: int | None = None,
    known: tuple[Container[BlockHash], ...] | None = None,
    check_every: int = 8,
) -> list[BlockHash]:
    """Hashes of the full blocks of `tokens` from block index `start` on (up to block `stop`,
    exclusive, when given).

    `parent` must be the hash of block `start - 1` when `start > 0` (incremental hashing as a
    sequence grows); with `start == 0` the chain starts at the (salted) root.

    `known`: stop early. Every `check_every`-th block's hash (and the last one's) is looked up
    in these containers, and the chain ends after the first one that none of them holds (for a
    caller that wants only hashes something may know).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if start > 0 and parent is None:
        raise ValueError("parent hash is required when start > 0")
    if check_every <= 0:
        raise ValueError(f"check_every must be positive, got {check_every}")
    prev = root_hash(salt) if start == 0 else parent
    n = min(len(tokens) // block_size, len(tokens) if stop is None else stop) - start
    if n <= 0:
        return []
    fn = _native()
    if fn is None:
        return _python_chain(prev, tokens, block_size, start, n, known, check_every)
    return fn(tokens if isinstance(tokens, (list, tuple)) else list(tokens), start, n, block_size, prev,
              None if known is None else tuple(known), check_every)


def _python_chain(prev: BlockHash, tokens: Sequence[int], block_size: int, start: int, n: int,
                  known=None, check_every: int = 8) -> list[BlockHash]:
    out: list[BlockHash] = []
    for b in range(start, start + n):
        prev = hash_block(prev, tokens[b * block_size : (b + 1) * block_size])
        out.append(prev)
        if known is not None and (len(out) % check_every == 0 or b + 1 == start + n):
            if not any(prev in k for k in known):
                break
    return out


@functools.cache
def _native():
    """The native chain, built on first use (None: no compiler or Python headers here)."""
    from splitserve import native

    return native.python_function(Path(__file__).parent / "csrc" / "chained_blake2b.c", "chained_blake2b_128",
                                  [ctypes.py_object, ctypes.c_ssize_t, ctypes.c_ssize_t, ctypes.c_ssize_t,
                                   ctypes.c_char_p, ctypes.py_object, ctypes.c_ssize_t])
