import pytest

from splitserve.hashing import DIGEST_SIZE, block_hashes


def test_chain_covers_the_whole_prefix():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and all(len(h) == DIGEST_SIZE for h in a)
    assert a[1] != b[1], "same second block after a different first block must hash differently"


def test_partial_block_not_hashed_and_incremental_matches():
    toks = list(range(37))
    full = block_hashes(toks, 16)
    assert len(full) == 2
    first = block_hashes(toks[:16], 16)
    rest = block_hashes(toks, 16, start=1, parent=first[-1])
    assert first + rest == full


def test_salt_and_token_width():
    toks = list(range(16))
    assert block_hashes(toks, 16) != block_hashes(toks, 16, salt="t1")
    assert block_hashes(toks, 16, salt="t1") == block_hashes(toks, 16, salt="t1")
    # Large ids are not truncated.
    assert block_hashes([2**40] * 16, 16) != block_hashes([0] * 16, 16)


def test_bad_arguments():
    with pytest.raises(ValueError):
        block_hashes([1], 0)
    with pytest.raises(ValueError):
        block_hashes([1] * 32, 16, start=1)


def test_the_native_chain_equals_hashlib_block_by_block():
    """One native call per prompt (csrc/chained_blake2b.c) gives hashlib's digests exactly: every
    block size, salts, incremental starts, token ids up to int64, a message of one and of several
    BLAKE2b blocks (16 + 8·bs bytes: 24 .. 8208)."""
    import random
    import shutil

    from splitserve import hashing

    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler: hashlib block by block is the only path")
    assert hashing._native() is not None, "a C compiler is here: the native chain must build"
    r = random.Random(0)
    for bs in (1, 2, 14, 16, 17, 32, 256, 1024):
        tokens = [r.randrange(-2**63, 2**63) for _ in range(bs * 9 + 3)]
        for salt in (None, "tenant-a"):
            fast = hashing.block_hashes(tokens, bs, salt)
            slow = hashing._python_chain(hashing.root_hash(salt), tokens, bs, 0, len(tokens) // bs)
            assert fast == slow and len(fast) == len(tokens) // bs
            assert hashing.block_hashes(tokens, bs, salt, start=4, parent=fast[3]) == fast[4:]
    big = list(range(2 * 2048))  # a block size the native buffer does not take: hashlib, same chain
    assert hashing.block_hashes(big, 2048) == hashing._python_chain(hashing.root_hash(), big, 2048, 0, 2)
