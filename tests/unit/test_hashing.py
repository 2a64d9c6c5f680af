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


def test_the_definition_is_salted_blake2b_of_int64_ids():
    """Block i = BLAKE2b-128 of its tokens (little-endian int64) with block i-1's digest as the
    BLAKE2b salt; spelled out here with hashlib, independently of hashing.py's code."""
    import hashlib
    import struct

    from splitserve.hashing import root_hash

    toks = [5, -7, 2**40, 31999] * 8  # two 16-token blocks
    h0 = hashlib.blake2b(struct.pack("<16q", *toks[:16]), digest_size=16, salt=root_hash("s")).digest()
    h1 = hashlib.blake2b(struct.pack("<16q", *toks[16:]), digest_size=16, salt=h0).digest()
    assert block_hashes(toks, 16, "s") == [h0, h1]


def test_the_native_chain_equals_hashlib_block_by_block():
    """One native call per prompt (csrc/chained_blake2b.c, reading the list itself) gives
    hashlib's digests exactly: block sizes from 1 to 2048, salts, incremental starts, token ids
    over the whole int64 range and small ones, messages of one and of many BLAKE2b blocks (8·bs bytes); ids
    that are not int64s are refused as hashlib's path refuses them."""
    import os
    import random
    import shutil

    from splitserve import hashing

    if not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")) or os.environ.get("SPLITSERVE_NO_NATIVE"):
        pytest.skip("no C compiler (or native code turned off): hashlib block by block is the only path")
    assert hashing._native() is not None, "a C compiler is here: the native chain must build"
    r = random.Random(0)
    for bs in (1, 2, 14, 16, 17, 32, 256, 1024, 2048):
        # ids over the whole int64 range, and the small ones a tokenizer gives (read from the
        # object's one digit: 0, the largest one-digit int, and negatives take the other path)
        tokens = [r.choice((r.randrange(-2**63, 2**63), r.randrange(2**30), 0, 2**30 - 1, 2**30, -1, True))
                  for _ in range(bs * 9 + 3)]
        for salt in (None, "tenant-a"):
            fast = hashing.block_hashes(tokens, bs, salt)
            slow = hashing._python_chain(hashing.root_hash(salt), tokens, bs, 0, len(tokens) // bs)
            assert fast == slow and len(fast) == len(tokens) // bs
            assert hashing.block_hashes(tuple(tokens), bs, salt, start=4, parent=fast[3]) == fast[4:]
    assert hashing.block_hashes(range(64), 16) == hashing._python_chain(hashing.root_hash(), range(64), 16, 0, 4)
    for bad, err in (([2**63] * 16, OverflowError), ([1.5] * 16, TypeError), (["x"] * 16, TypeError)):
        with pytest.raises(err):
            hashing.block_hashes(bad, 16)


def test_the_chain_stops_after_the_first_checked_block_nothing_knows():
    """`known`: the native chain and hashlib's both look up every check_every-th block (and the
    last) and end after the first one no container holds, from any start."""
    import random
    from collections import OrderedDict

    from splitserve import hashing

    r = random.Random(1)
    tokens = [r.randrange(32000) for _ in range(16 * 50 + 5)]
    full = hashing.block_hashes(tokens, 16)
    for held, every, start in ((0, 8, 0), (19, 8, 0), (19, 1, 0), (24, 8, 0), (50, 8, 0), (30, 7, 3), (19, 8, 25)):
        device, host = OrderedDict.fromkeys(full[:held], 1), {h: 1 for h in full[held : held + 5]}
        last = next((b for b in range(start, 50) if (b - start + 1) % every == 0 and full[b] not in device
                     and full[b] not in host), 49)
        parent = full[start - 1] if start else None
        got = hashing.block_hashes(tokens, 16, start=start, parent=parent, known=(device, host), check_every=every)
        slow = hashing._python_chain(parent or hashing.root_hash(), tokens, 16, start, 50 - start, (device, host), every)
        assert got == slow == full[start : last + 1], (held, every, start)
    with pytest.raises(ValueError):
        hashing.block_hashes(tokens, 16, known=({},), check_every=0)


def test_remembered_chains_give_the_digests_hashlib_gives():
    """The native chain remembers recent chains and reuses a block's digest when its ids and
    parent equal a remembered one's: prompts sharing prefixes of every length, diverging inside
    a block, under other salts, block sizes and starts, more families than it remembers, and
    chains longer than it keeps, all still equal hashlib block by block."""
    import os
    import random
    import shutil

    from splitserve import hashing

    if not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")) or os.environ.get("SPLITSERVE_NO_NATIVE"):
        pytest.skip("no C compiler (or native code turned off): hashlib block by block is the only path")
    r = random.Random(7)
    systems = [[r.randrange(32000) for _ in range(16 * r.randrange(1, 40))] for _ in range(12)]  # > the 8 ways
    long = [r.randrange(32000) for _ in range(70_000)]  # past what one remembered chain keeps
    for trial in range(300):
        bs, salt = r.choice((16, 16, 16, 4, 32)), r.choice((None, None, "a", "b"))
        if trial % 50 == 0:
            tokens = long[: r.randrange(60_000, 70_000)]
        else:
            head = r.choice(systems)
            tokens = head[: r.randrange(len(head) + 1)] + [r.randrange(32000) for _ in range(r.randrange(0, 80))]
            if tokens and r.random() < 0.3:
                tokens[r.randrange(len(tokens))] += 1  # one id changed anywhere
        n = len(tokens) // bs
        want = hashing._python_chain(hashing.root_hash(salt), tokens, bs, 0, n)
        assert hashing.block_hashes(list(map((0).__add__, tokens)), bs, salt) == want, trial
        if n > 2:
            s = r.randrange(1, n)
            assert hashing.block_hashes(tokens, bs, salt, start=s, parent=want[s - 1]) == want[s:], trial
