"""Chained block hashes: the one definition of "the same prefix" for engine, router, simulator.

Block i's hash covers every token of blocks 0..i (it chains the parent's digest), so equal hashes
mean equal prefixes, not just equal blocks. Only full blocks are hashed. A `salt` (e.g. a tenant's
`cache_salt`) changes the root, keeping one tenant's blocks apart from another's. BLAKE2b with a
128-bit digest: fast in CPython and collision-resistant far beyond any cache's size.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Sequence

BlockHash = bytes  # 16 bytes

DIGEST_SIZE = 16
_ROOT = b"splitserve/v1"


def root_hash(salt: str | None = None) -> BlockHash:
    data = _ROOT if salt is None else _ROOT + b"/salt/" + salt.encode()
    return hashlib.blake2b(data, digest_size=DIGEST_SIZE).digest()


def hash_block(parent: BlockHash, tokens: Sequence[int]) -> BlockHash:
    h = hashlib.blake2b(parent, digest_size=DIGEST_SIZE)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def block_hashes(
    tokens: Sequence[int],
    block_size: int,
    salt: str | None = None,
    *,
    start: int = 0,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of `tokens` from block index `start` on.

    `parent` must be the hash of block `start - 1` when `start > 0` (incremental hashing as a
    sequence grows); with `start == 0` the chain starts at the (salted) root.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if start > 0 and parent is None:
        raise ValueError("parent hash is required when start > 0")
    prev = root_hash(salt) if start == 0 else parent
    out: list[BlockHash] = []
    for b in range(start, len(tokens) // block_size):
        prev = hash_block(prev, tokens[b * block_size : (b + 1) * block_size])
        out.append(prev)
    return out
