"""Paged attention kernels (Triton; the interpreter on CPU) against the gather + softmax torch
reference in fp32, over the full grid: fp32 / fp16 / bf16 × head_dim 64 / 128 × GQA ratios
1 / 4 / 8 × block sizes 16 / 32, with contexts that are not block multiples in scattered blocks,
a batch mixing short and long sequences; decode with split-K off (1) and on (3); prefill with
chunks that start the sequence, follow a cached prefix, are one token long, and span several
query tiles. The kernel's context step (`block_n`) is smaller than the page in some cases and
larger in others.

Tolerances, max abs error on outputs of magnitude ~1: fp32 1e-4; fp16 2e-3; bf16 2e-2. The
kernels accumulate in fp32; what differs is the rounding of the softmax weights to the input
dtype for the second matmul, and of the output. On the CPU interpreter the grid is a pairwise
cover of those axes (every pair of values of any two axes, in 9 cases; `GRID` below)."""

import itertools
import os

import pytest
import torch

pytest.importorskip("triton")  # the optional GPU extra; the kernels module itself must import
from splitserve.engine.kernels import triton_attention as att  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FULL_GRID = list(itertools.product(DTYPES, [64, 128], [1, 4, 8], [16, 32]))
# Under the interpreter (CPU) a case costs seconds: every pair of values of any two axes, once
# (a pairwise cover: 9 cases, each dtype with each head dim, GQA ratio and block size); on a
# GPU the whole grid. SPLITSERVE_FULL_GRID=1 runs the whole grid anywhere.
PAIRWISE = [(torch.float32, 64, 1, 16), (torch.float32, 128, 4, 32), (torch.float32, 64, 8, 32),
            (torch.float16, 128, 1, 32), (torch.float16, 64, 4, 16), (torch.float16, 128, 8, 16),
            (torch.bfloat16, 64, 1, 32), (torch.bfloat16, 128, 4, 16), (torch.bfloat16, 64, 8, 16)]
GRID = FULL_GRID if DEVICE == "cuda" or os.environ.get("SPLITSERVE_FULL_GRID") == "1" else PAIRWISE
# head dims that are not powers of two (padded to one inside the kernels, masked)
ODD_D = [(torch.float16, 80, 4, 16), (torch.bfloat16, 8, 4, 32), (torch.float32, 96, 1, 16)]
# (new tokens, context) per sequence: a whole prompt, a chunk after a cached prefix, a one-token
# chunk, a long chunk over a prefix (several query tiles)
CHUNKS = ((5, 5), (7, 40), (1, 33), (37, 97))
RANDOM_CASES = int(os.environ.get("SPLITSERVE_RANDOM_CASES", "6"))  # more for a deeper sweep (60 pass)


def _ids(cases):
    return ["-".join(f"{str(x)[6:]}" if isinstance(x, torch.dtype) else str(x) for x in c) for c in cases]


def _cache(dtype, d, ratio, bs, lens, hkv, num_q, seed):
    g = torch.Generator().manual_seed(seed)
    max_blocks = -(-max(lens) // bs) + 1
    nb = len(lens) * max_blocks + 3
    k = torch.randn(nb, bs, hkv, d, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(nb, bs, hkv, d, generator=g).to(dtype).to(DEVICE)
    q = torch.randn(num_q, hkv * ratio, d, generator=g).to(dtype).to(DEVICE)
    perm = torch.randperm(nb, generator=g)[: len(lens) * max_blocks]  # scattered blocks
    tables = perm.view(len(lens), max_blocks).to(torch.int32).to(DEVICE)
    return q, k, v, tables, torch.tensor(lens, dtype=torch.int32, device=DEVICE)


def _err(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == dtype
    return (out.float() - ref.float()).abs().max().item()


@pytest.mark.parametrize("dtype,d,ratio,bs", GRID + ODD_D, ids=_ids(GRID + ODD_D))
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_matches_reference(dtype, d, ratio, bs, splits):
    lens = (1, 17, 40, 97)
    q, k, v, tables, ctx = _cache(dtype, d, ratio, bs, lens, hkv=2, num_q=len(lens), seed=splits)
    out = att.paged_attention_decode(q, k, v, tables, ctx, d ** -0.5, num_splits=splits, block_n=48 - bs)
    ref = att.paged_attention_decode_reference(q, k, v, tables, ctx, d ** -0.5)
    assert _err(out, ref, dtype) <= TOL[dtype]


@pytest.mark.parametrize("dtype,d,ratio,bs", GRID + ODD_D, ids=_ids(GRID + ODD_D))
def test_prefill_matches_reference(dtype, d, ratio, bs):
    cu = torch.tensor([0, *itertools.accumulate(n for n, _ in CHUNKS)], dtype=torch.int32, device=DEVICE)
    q, k, v, tables, ctx = _cache(dtype, d, ratio, bs, [c for _, c in CHUNKS], hkv=2, num_q=int(cu[-1]), seed=1)
    gp = 1 << (ratio - 1).bit_length()
    out = att.paged_attention_prefill(q, k, v, tables, cu, ctx, d ** -0.5, block_m=max(1, 16 // gp), block_n=48 - bs)
    ref = att.paged_attention_prefill_reference(q, k, v, tables, cu, ctx, d ** -0.5)
    assert _err(out, ref, dtype) <= TOL[dtype]


def test_default_launch_strided_q_and_out_buffer():
    """The engine's call: q a strided view of a fused qkv, default tile sizes, an `out` buffer."""
    cu = torch.tensor([0, 5, 12, 13, 50], dtype=torch.int32, device=DEVICE)
    q, k, v, tables, ctx = _cache(torch.float16, 64, 4, 16, [c for _, c in CHUNKS], hkv=2, num_q=50, seed=3)
    qkv = torch.cat([q.flatten(1), torch.zeros(50, 256, dtype=q.dtype, device=DEVICE)], dim=1)
    qs = qkv[:, :512].view(50, 8, 64)
    out = torch.full_like(q, float("nan"))
    att.paged_attention_prefill(qs, k, v, tables, cu, ctx, 0.125, out=out, max_seqlen_q=37)
    ref = att.paged_attention_prefill_reference(q, k, v, tables, cu, ctx, 0.125)
    assert _err(out, ref, torch.float16) <= TOL[torch.float16]
    dec = att.paged_attention_decode(qs[:4], k, v, tables, ctx, 0.125)  # default splits and step
    assert _err(dec, att.paged_attention_decode_reference(q[:4], k, v, tables, ctx, 0.125), torch.float16) <= 2e-3


def test_the_check_can_fail():
    """A context one token short moves the output by far more than the tolerance."""
    q, k, v, tables, ctx = _cache(torch.float32, 64, 1, 16, (40, 97), hkv=2, num_q=2, seed=4)
    ref = att.paged_attention_decode_reference(q, k, v, tables, ctx, 0.125)
    short = att.paged_attention_decode(q, k, v, tables, ctx - 1, 0.125, num_splits=2)
    assert _err(short, ref, torch.float32) > 100 * TOL[torch.float32]


def test_more_splits_than_context_and_decode_splits_policy():
    q, k, v, tables, ctx = _cache(torch.float32, 64, 2, 16, (5, 20), hkv=2, num_q=2, seed=5)
    out = att.paged_attention_decode(q, k, v, tables, ctx, 0.125, num_splits=8, block_n=16)  # most splits empty
    assert _err(out, att.paged_attention_decode_reference(q, k, v, tables, ctx, 0.125), torch.float32) <= 1e-4
    assert att.decode_splits(1, 8, 2048) == 8  # a lone sequence: split so ~256 programs run
    assert att.decode_splits(64, 8, 2048) == 1  # 512 programs already: no merge pass
    assert att.decode_splits(1, 1, 100_000) == 16 and att.decode_splits(4, 8, 200) == 1


def test_bad_arguments_name_the_problem():
    q, k, v, tables, ctx = _cache(torch.float32, 64, 2, 16, (5, 20), hkv=2, num_q=2, seed=6)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    dec, pre = att.paged_attention_decode, att.paged_attention_prefill
    bad = [
        (lambda: dec(q, k, v, tables.long(), ctx, 0.1), "block_tables must be int32"),
        (lambda: dec(q, k, v, tables, ctx.long(), 0.1), "context_lens must be int32"),
        (lambda: dec(q[:, :3], k, v, tables, ctx, 0.1), "multiple of num_kv_heads"),
        (lambda: dec(q.half(), k, v, tables, ctx, 0.1), "dtypes differ"),
        (lambda: dec(q, k, v, tables, ctx * 0, 0.1), "at least 1 token"),
        (lambda: dec(q, k, v, tables, ctx + 1000, 0.1), "does not fit"),
        (lambda: dec(q, k, v, tables, ctx, 0.1, num_splits=0), "num_splits"),
        (lambda: dec(q, k, v, tables, ctx, 0.1, block_n=24), "block_n"),
        (lambda: dec(q, k, v, tables, ctx, 0.1, out=q.half()), "out must match q"),
        (lambda: dec(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, tables, ctx, 0.1), "last dimension"),
        (lambda: pre(q, k, v, tables, cu.long(), ctx, 0.1), "cu_seqlens_q must be contiguous int32"),
        (lambda: pre(q, k, v, tables, torch.tensor([0, 1, 3], dtype=torch.int32, device=DEVICE), ctx, 0.1),
         "rise from 0 to 2"),
        (lambda: pre(q, k, v, tables, cu, torch.tensor([0, 20], dtype=torch.int32, device=DEVICE), 0.1),
         "count the new tokens"),
        (lambda: dec(q.new_zeros(2, 4, 320), k.new_zeros(4, 16, 2, 320), k.new_zeros(4, 16, 2, 320), tables, ctx, 0.1),
         "head_dim must be at most 256"),
        (lambda: pre(q, k, v, tables[:1], cu, ctx, 0.1), r"block_tables must be int32 \[2"),
        (lambda: pre(q, k, v, tables, cu, ctx, 0.1, block_m=3), "block_m"),
        (lambda: pre(q, k, v[:, :8].contiguous(), tables, cu, ctx, 0.1), "k_cache / v_cache"),
    ]
    for call, msg in bad:
        with pytest.raises(ValueError, match=msg):
            call()


@pytest.mark.parametrize("seed", range(RANDOM_CASES))
def test_random_layouts_match_reference(seed):
    """Random shapes the grid does not pin down: head dims, GQA ratios, page and step sizes,
    a batch of chunks of random lengths (an empty one included) over random cached prefixes."""
    import random

    rnd = random.Random(seed)
    dtype = rnd.choice(DTYPES)
    d, ratio, bs, hkv = rnd.choice([16, 32, 48, 64, 80, 128]), rnd.choice([1, 2, 4, 8]), rnd.choice([16, 32]), rnd.choice([1, 2])
    chunks = [(q, q + rnd.randint(0, 50)) for q in (rnd.randint(1, 40) for _ in range(rnd.randint(1, 4)))] + [(0, 9)]
    rnd.shuffle(chunks)
    cu = torch.tensor([0, *itertools.accumulate(n for n, _ in chunks)], dtype=torch.int32, device=DEVICE)
    q, k, v, tables, ctx = _cache(dtype, d, ratio, bs, [c for _, c in chunks], hkv=hkv, num_q=int(cu[-1]), seed=seed)
    block_n = rnd.choice([16, 32, 64])
    out = att.paged_attention_prefill(q, k, v, tables, cu, ctx, d ** -0.5, block_n=block_n)
    assert _err(out, att.paged_attention_prefill_reference(q, k, v, tables, cu, ctx, d ** -0.5), dtype) <= TOL[dtype]
    qd = q[: len(chunks)] if q.shape[0] >= len(chunks) else torch.randn(len(chunks), *q.shape[1:]).to(dtype).to(DEVICE)
    dec = att.paged_attention_decode(qd, k, v, tables, ctx, d ** -0.5, num_splits=rnd.choice([1, 2, 5]), block_n=block_n)
    assert _err(dec, att.paged_attention_decode_reference(qd, k, v, tables, ctx, d ** -0.5), dtype) <= TOL[dtype]
