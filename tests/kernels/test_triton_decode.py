"""Paged decode attention (Triton; the interpreter on CPU) against a gather + softmax torch
reference in fp32: GQA ratios 1 / 4 / 8, head_dim 64 / 128, block sizes 16 / 32, a batch mixing
short and long contexts that are not block multiples, split-K off (1) and on (3), fp32 / fp16 /
bf16. Tolerances (max abs error on outputs of magnitude ~1): fp32 1e-4, fp16 2e-3, bf16 2e-2 —
the kernel accumulates in fp32, so only the output rounding differs."""

import itertools

import pytest
import torch

dec = pytest.importorskip("splitserve.engine.kernels.triton_decode")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
CASES = [(dt, d, ratio, bs, splits) for dt, (d, ratio, bs), splits in itertools.product(
    [torch.float32, torch.float16, torch.bfloat16], [(64, 1, 16), (128, 4, 32), (64, 8, 16)], [1, 3])]


def setup(dtype, d, ratio, bs, lens=(1, 17, 40, 97), hkv=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    max_blocks = -(-max(lens) // bs) + 1
    nb = len(lens) * max_blocks + 3
    k = torch.randn(nb, bs, hkv, d, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(nb, bs, hkv, d, generator=g).to(dtype).to(DEVICE)
    q = torch.randn(len(lens), hkv * ratio, d, generator=g).to(dtype).to(DEVICE)
    perm = torch.randperm(nb, generator=g)[: len(lens) * max_blocks]  # scattered blocks
    tables = perm.view(len(lens), max_blocks).to(torch.int32).to(DEVICE)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    return q, k, v, tables, ctx


@pytest.mark.parametrize("dtype,d,ratio,bs,splits", CASES,
                         ids=[f"{str(t)[6:]}-d{d}-gqa{r}-bs{b}-split{s}" for t, d, r, b, s in CASES])
def test_decode_matches_reference(dtype, d, ratio, bs, splits):
    q, k, v, tables, ctx = setup(dtype, d, ratio, bs)
    scale = d ** -0.5
    out = dec.paged_attention_decode(q, k, v, tables, ctx, scale, num_splits=splits)
    ref = dec.paged_attention_decode_reference(q, k, v, tables, ctx, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= TOL[dtype], err


def test_more_splits_than_blocks_and_bad_arguments():
    q, k, v, tables, ctx = setup(torch.float32, 64, 2, 16, lens=(5, 20))
    out = dec.paged_attention_decode(q, k, v, tables, ctx, 0.125, num_splits=8)  # most splits are empty
    ref = dec.paged_attention_decode_reference(q, k, v, tables, ctx, 0.125)
    assert (out - ref).abs().max().item() <= 1e-4
    bad = [
        (lambda: dec.paged_attention_decode(q, k, v, tables.long(), ctx, 0.1), "block_tables must be int32"),
        (lambda: dec.paged_attention_decode(q, k, v, tables, ctx.long(), 0.1), "context_lens must be int32"),
        (lambda: dec.paged_attention_decode(q[:, :3], k, v, tables, ctx, 0.1), "multiple of num_kv_heads"),
        (lambda: dec.paged_attention_decode(q.half(), k, v, tables, ctx, 0.1), "dtypes differ"),
        (lambda: dec.paged_attention_decode(q, k, v, tables, ctx * 0, 0.1), "at least 1 token"),
        (lambda: dec.paged_attention_decode(q, k, v, tables, ctx + 1000, 0.1), "does not fit"),
    ]
    for call, msg in bad:
        with pytest.raises(ValueError, match=msg):
            call()
