"""store_kv and pack/unpack_blocks (Triton; the interpreter on CPU) against their torch
references, over dtypes, head_dim 64 / 128, kv heads 1 / 2 / 8, block sizes 16 / 32, skipped
slots and partial blocks; plus the launchers' argument checks. Moves are exact: the kernels copy
bits, so results must be equal, not close, in every dtype."""

import itertools

import pytest
import torch

pytest.importorskip("triton")  # the optional GPU extra; the kernels module itself must import
from splitserve.engine.kernels import triton_kv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GRID = list(itertools.product([torch.float32, torch.float16, torch.bfloat16], [64, 128], [1, 2, 8], [16, 32]))


def caches(nb, bs, h, d, dtype, layers=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda: torch.randn(nb, bs, h, d, generator=g).to(dtype).to(DEVICE)  # noqa: E731
    return [mk() for _ in range(layers)], [mk() for _ in range(layers)]


@pytest.mark.parametrize("dtype,d,h,bs", GRID, ids=[f"{t}-d{d}-h{h}-bs{b}".replace("torch.", "") for t, d, h, b in GRID])
def test_store_kv_matches_reference(dtype, d, h, bs):
    nb, n = 6, 2 * bs + 5  # tokens spanning 3 blocks, the last one partial
    (k,), (v,) = caches(nb, bs, h, d, dtype)
    k_ref, v_ref = k.clone(), v.clone()
    g = torch.Generator().manual_seed(1)
    key = torch.randn(n, h, d, generator=g).to(dtype).to(DEVICE)
    value = torch.randn(n, h, d, generator=g).to(dtype).to(DEVICE)
    blocks = torch.tensor([4, 1, 3])  # scattered, out of order
    pos = torch.arange(n)
    slots = (blocks[pos // bs] * bs + pos % bs).to(torch.int64)
    slots[[0, 7, n - 1]] = -1  # skipped (already cached, padding)
    slots = slots.to(DEVICE)
    triton_kv.store_kv(key, value, k, v, slots)
    triton_kv.store_kv_reference(key, value, k_ref, v_ref, slots)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    assert not torch.equal(k.view(-1, h, d)[slots[1]], caches(nb, bs, h, d, dtype)[0][0].view(-1, h, d)[slots[1]])


def test_store_kv_reads_strided_tokens():
    """key/value as views of a fused qkv output: tokens strided, each token's heads contiguous."""
    (k,), (v,) = caches(4, 16, 2, 64, torch.float32)
    k_ref, v_ref = k.clone(), v.clone()
    qkv = torch.randn(20, 6 * 64, device=DEVICE)
    key, value = qkv[:, 2 * 64:4 * 64].view(20, 2, 64), qkv[:, 4 * 64:].view(20, 2, 64)
    slots = torch.arange(20, dtype=torch.int64, device=DEVICE) + 3
    triton_kv.store_kv(key, value, k, v, slots)
    triton_kv.store_kv_reference(key, value, k_ref, v_ref, slots)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


@pytest.mark.parametrize("dtype,d,h,bs", [(torch.bfloat16, 128, 8, 16), (torch.float16, 64, 2, 32),
                                          (torch.float32, 64, 1, 16)])
def test_pack_then_unpack_round_trips(dtype, d, h, bs):
    ks, vs = caches(7, bs, h, d, dtype, layers=3)
    ids = [5, 0, 3]
    buf = triton_kv.pack_blocks(ks, vs, ids)
    assert buf.shape == (3, 2, 3, bs, h, d) and buf.is_contiguous()
    assert torch.equal(buf, triton_kv.pack_blocks_reference(ks, vs, ids))
    dst_k, dst_v = caches(9, bs, h, d, dtype, layers=3, seed=5)
    ref_k, ref_v = [x.clone() for x in dst_k], [x.clone() for x in dst_v]
    triton_kv.unpack_blocks(buf, dst_k, dst_v, [8, 2, 6])
    triton_kv.unpack_blocks_reference(buf, ref_k, ref_v, [8, 2, 6])
    assert all(torch.equal(a, b) for a, b in zip(dst_k + dst_v, ref_k + ref_v))
    assert torch.equal(dst_k[1][2], ks[1][0])  # block 0 of layer 1 landed in block 2


def test_launchers_refuse_bad_arguments_clearly():
    (k,), (v,) = caches(4, 16, 2, 64, torch.float32)
    key = torch.zeros(3, 2, 64, device=DEVICE)
    slots = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    bad = [
        (lambda: triton_kv.store_kv(key, key, k, v, slots.to(torch.int32)), "int64"),
        (lambda: triton_kv.store_kv(key.half(), key.half(), k, v, slots), "dtype|float16"),
        (lambda: triton_kv.store_kv(torch.zeros(3, 4, 64, device=DEVICE), key, k, v, slots), r"\[num_tokens, 2, 64\]"),
        (lambda: triton_kv.store_kv(key, key, k, v, slots[:2]), r"slot_mapping must be \[3\]"),
        (lambda: triton_kv.store_kv(key, key, k, v[:2], slots), "v_cache"),
        (lambda: triton_kv.pack_blocks([k], [v], [0, 4]), r"block_ids must be in \[0, 4\)"),
        (lambda: triton_kv.pack_blocks([k], [], [0]), "one K and one V cache per layer"),
        (lambda: triton_kv.unpack_blocks(torch.zeros(1, 2, 2, 16, 2, 64, device=DEVICE), [k], [v], [0]), "buffer must be"),
    ]
    for call, msg in bad:
        with pytest.raises(ValueError, match=msg):
            call()
