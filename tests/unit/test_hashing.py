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
