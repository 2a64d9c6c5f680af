"""The native CPU paged-decode kernel against its independent torch reference, over a grid of
head dims, GQA ratios, block sizes, context lengths that are not block multiples, scattered
block tables and a batch mixing short and long sequences; fp32 and bf16 caches."""

import pytest
import torch

from splitserve.engine.kernels import paged_decode_cpu as K

pytestmark = pytest.mark.skipif(not K.available(), reason="no C compiler: native kernel not built")


def make(num_seqs, heads, kvh, dim, bs, lens, seed=0, num_blocks=None):
    g = torch.Generator().manual_seed(seed)
    need = sum(-(-n // bs) for n in lens)
    num_blocks = num_blocks or need + 7
    k = torch.randn(num_blocks, bs, kvh, dim, generator=g)
    v = torch.randn(num_blocks, bs, kvh, dim, generator=g)
    perm = torch.randperm(num_blocks, generator=g)
    max_blocks = max(-(-n // bs) for n in lens)
    table = torch.zeros(num_seqs, max_blocks, dtype=torch.int64)
    off = 0
    for i, n in enumerate(lens):
        nb = -(-n // bs)
        table[i, :nb] = perm[off:off + nb]
        off += nb
    q = torch.randn(num_seqs, heads, dim, generator=g)
    return q, k, v, table, torch.tensor(lens, dtype=torch.int64)


@pytest.mark.parametrize("dim", [64, 128, 40])
@pytest.mark.parametrize("heads,kvh", [(4, 4), (8, 2), (16, 2)])
@pytest.mark.parametrize("bs", [16, 32])
def test_matches_reference(dim, heads, kvh, bs):
    lens = [1, 5, bs, bs + 1, 3 * bs - 1, 200, 37]
    q, k, v, table, ctx = make(len(lens), heads, kvh, dim, bs, lens, seed=dim + heads + bs)
    scale = dim ** -0.5
    out = K.paged_decode(q, k, v, table, ctx, scale)
    ref = K.reference(q, k, v, table, ctx, scale)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)  # fp32: summation order only


@pytest.mark.parametrize("heads,kvh,dim", [(9, 3, 64), (8, 2, 128), (4, 4, 40)])
def test_bf16_cache_matches_reference(heads, kvh, dim):
    """bf16 q/K/V widened exactly, fp32 arithmetic, one rounding at the end: within one bf16
    rounding step of the reference (SDPA in fp32 over the same bf16 values)."""
    lens = [1, 7, 16, 33, 200, 513]
    q, k, v, table, ctx = make(len(lens), heads, kvh, dim, 16, lens, seed=heads + dim)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    out = K.paged_decode(q, k, v, table, ctx, dim ** -0.5)
    ref = K.reference(q, k, v, table, ctx, dim ** -0.5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=8e-3)
    exact = K.reference(q.float(), k.float(), v.float(), table, ctx, dim ** -0.5)
    assert (out.float() - exact).abs().max() <= (ref.float() - exact).abs().max() * 2 + 1e-6


def test_reads_only_the_context():
    q, k, v, table, ctx = make(3, 4, 2, 64, 16, [10, 17, 40])
    out = K.paged_decode(q, k, v, table, ctx, 0.125)
    # Poison everything beyond each context (rest of the last block, unused blocks).
    k2, v2 = k.clone(), v.clone()
    used = set()
    for s, n in enumerate(ctx.tolist()):
        for t in range(n):
            used.add((int(table[s, t // 16]), t % 16))
    for b in range(k.shape[0]):
        for o in range(16):
            if (b, o) not in used:
                k2[b, o] = 1e6
                v2[b, o] = float("nan")
    torch.testing.assert_close(K.paged_decode(q, k2, v2, table, ctx, 0.125), out, atol=0, rtol=0)


def test_cache_views_with_block_stride():
    # The engine passes per-layer views of one big [layers, 2, blocks, ...] allocation.
    q, k, v, table, ctx = make(2, 4, 2, 64, 16, [30, 70])
    big = torch.zeros(3, 2, *k.shape)
    big[1, 0], big[1, 1] = k, v
    out = K.paged_decode(q, big[1, 0], big[1, 1], table, ctx, 0.125)
    torch.testing.assert_close(out, K.reference(q, k, v, table, ctx, 0.125), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("bad", ["dtype", "heads", "table_dtype", "short_table", "strides"])
def test_launcher_rejects_bad_input(bad):
    q, k, v, table, ctx = make(2, 4, 2, 64, 16, [30, 20])
    if bad == "dtype":
        q = q.double()
    elif bad == "heads":
        q = q[:, :3].contiguous()
    elif bad == "table_dtype":
        table = table.int()
    elif bad == "short_table":
        ctx = torch.tensor([30, 100])
    elif bad == "strides":
        k = k.transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(ValueError):
        K.paged_decode(q, k, v, table, ctx, 0.125)
