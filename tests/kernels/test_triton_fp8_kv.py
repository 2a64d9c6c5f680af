"""The Triton kernels over the FP8 KV cache (kv_cache/fp8.py: uint8 rows of head_dim e4m3 bytes
and one exponent byte e, the value fp8 * 2**e), under TRITON_INTERPRET=1 on CPU:

  * `store_kv` into an FP8 cache writes the bytes `kv_fp8.encode` gives, exactly: every bfloat16
    value within e4m3's range (so every rounding case: ties to even, carries into the exponent,
    subnormals, signed zeros), rows of any magnitude in each float dtype, the scale's boundaries,
    strided K/V, skipped slots;
  * the triton backend over an FP8 cache equals the torch backend over one — the same cache bytes
    after the step, outputs within the tolerances of test_triton_attention.py (fp32 1e-4, fp16
    2e-3, bf16 2e-2) — on batches of decodes, prefill chunks with and without cached context,
    GQA, and MLA's shape (one KV head, head_dim 40); split-K decode against the reference;
  * the launchers take an FP8 cache by its dtype and say what is wrong with one.

Tiny shapes: the interpreter runs a program in about a millisecond."""

import pytest
import torch

pytest.importorskip("triton")  # the optional GPU extra; the kernels modules themselves must import
from splitserve.engine.kernels import triton_attention as att  # noqa: E402
from splitserve.engine.kernels import triton_kv  # noqa: E402

from splitserve.engine.attention.backend import AttentionBatch, SeqSlice  # noqa: E402
from splitserve.engine.attention.paged_backends import TritonBackend  # noqa: E402
from splitserve.engine.attention.torch_backend import TorchBackend  # noqa: E402
from splitserve.engine.kv_cache import fp8 as kv_fp8  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def fp8_cache(nb, bs, h, d):
    return torch.zeros(nb, bs, h, d + 1, dtype=torch.uint8, device=DEVICE)


def store_both_ways(key, value, nb, bs, slots):
    """(triton's K, V caches, the reference's), from equal random starting bytes."""
    h, d = key.shape[1], key.shape[2]
    g = torch.Generator().manual_seed(9)
    k = torch.randint(0, 256, (nb, bs, h, d + 1), generator=g, dtype=torch.uint8).to(DEVICE)
    v = torch.randint(0, 256, (nb, bs, h, d + 1), generator=g, dtype=torch.uint8).to(DEVICE)
    k_ref, v_ref = k.clone(), v.clone()
    triton_kv.store_kv(key, value, k, v, slots)
    triton_kv.store_kv_reference(key, value, k_ref, v_ref, slots)
    return (k, v), (k_ref, v_ref)


def test_store_rounds_every_bfloat16_value_as_encode_does():
    """Each row holds 447 (which pins the scale at 2**0, so values reach the rounding as they
    are) and 63 bfloat16 values: all finite bfloat16 bit patterns of magnitude <= 447."""
    bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    vals = bits[bits.isfinite() & (bits.abs() <= 447)]
    vals = torch.cat([vals, vals.new_zeros(-len(vals) % 63)])
    rows = torch.cat([torch.full((len(vals) // 63, 1), 447.0), vals.view(-1, 63)], dim=1)  # [n, 64]
    key = rows.view(-1, 2, 64).to(DEVICE)  # 2 heads a token
    n = key.shape[0]
    slots = torch.arange(n, dtype=torch.int64, device=DEVICE)
    (k, v), (k_ref, v_ref) = store_both_ways(key, -key, -(-n // 16), 16, slots)
    assert bool((k_ref.view(-1, 2, 65)[:n, :, -1] == 0).all())  # the scale was 2**0
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_store_writes_the_bytes_of_encode(dtype):
    """Rows of every magnitude the dtype holds, at and beside the scale's boundaries (amax =
    448 * 2**k and its neighbours), zero and tiny rows, 3 heads of head_dim 40, K and V strided
    views of a fused qkv, scattered and skipped slots."""
    g = torch.Generator().manual_seed(0)
    n, h, d, bs = 40, 3, 40, 16
    # (bfloat16 from 1e-35: the interpreter widens a subnormal bfloat16 wrongly; a GPU shifts its bits)
    lo, hi = {torch.float32: (-40, 37), torch.float16: (-7, 4), torch.bfloat16: (-35, 37)}[dtype]
    mags = torch.logspace(lo, hi, 2 * n, dtype=torch.float64)[:, None, None]
    x = torch.randn(2 * n, h, d, generator=g, dtype=torch.float64) * mags
    x[0], x[1, 0] = 0.0, -0.0
    for i, k in enumerate((-3, 0, 2)):  # amax exactly at a power-of-two boundary and one ulp either side
        for j, f in enumerate((1.0, 1 - 2.0 ** -10, 1 + 2.0 ** -10)):
            x[2 + i, j, :] = x[2 + i, j, :].clamp(-1, 1) * 448 * 2.0 ** k
            x[2 + i, j, 7] = 448 * 2.0 ** k * f
    qkv = x.view(n, 2, h, d).transpose(0, 1).reshape(n, 2 * h * d)  # [tokens, K | V]
    qkv = torch.cat([qkv, torch.zeros(n, 8, dtype=qkv.dtype)], dim=1).to(dtype).to(DEVICE)
    key, value = qkv[:, : h * d].view(n, h, d), qkv[:, h * d: 2 * h * d].view(n, h, d)
    slots = (torch.randperm(6 * bs, generator=g)[:n]).to(torch.int64)
    slots[[1, 17]] = -1
    slots = slots.to(DEVICE)
    (k, v), (k_ref, v_ref) = store_both_ways(key, value, 6, bs, slots)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    keep = slots >= 0
    assert torch.equal(k.view(-1, h, d + 1)[slots[keep]], kv_fp8.encode(key[keep]))  # encode's bytes, as such
    assert torch.equal(v.view(-1, h, d + 1)[slots[keep]], kv_fp8.encode(value[keep]))


# (dtype, head_dim, query heads per KV head, KV heads, block size)
CASES = [(torch.float32, 64, 4, 2, 16), (torch.float16, 32, 1, 2, 32), (torch.bfloat16, 64, 8, 1, 16),
         (torch.bfloat16, 40, 4, 1, 16)]  # the last: MLA's shape (one latent head, 32 + 8 wide)
IDS = ["fp32-d64-gqa4", "fp16-d32-mha", "bf16-d64-gqa8", "bf16-d40-mla"]


def _step(bs: int, nb: int, g):
    """A step of 2 decodes then 3 prefill chunks: a whole prompt (no cached context: it attends
    to its own K/V, read back decoded), 7 tokens after 40 cached, 5 after 20; scattered blocks."""
    perm = torch.randperm(nb, generator=g).tolist()
    shapes = [(1, 37), (1, 9), (13, 13), (7, 47), (5, 25)]  # (new tokens, context after the step)
    seqs, slots, start = [], [], 0
    for q_len, ctx in shapes:
        blocks = tuple(perm.pop() for _ in range(-(-ctx // bs)))
        seqs.append(SeqSlice(q_start=start, q_len=q_len, ctx_len=ctx, block_ids=blocks))
        slots += [blocks[p // bs] * bs + p % bs for p in range(ctx - q_len, ctx)]
        start += q_len
    return AttentionBatch(num_tokens=start, slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
                          decodes=tuple(seqs[:2]), prefills=tuple(seqs[2:]), block_size=bs)


@pytest.mark.parametrize("dtype,d,ratio,hkv,bs", CASES, ids=IDS)
def test_triton_backend_equals_torch_backend_over_fp8(dtype, d, ratio, hkv, bs):
    g = torch.Generator().manual_seed(d + ratio)
    nb = 16
    batch = _step(bs, nb, g)
    cached = torch.randn(nb, bs, hkv, d, generator=g) * torch.logspace(-2, 2, nb)[:, None, None, None]
    k0 = kv_fp8.encode(cached.to(dtype)).to(DEVICE)  # the context: rows of magnitudes 1e-2 .. 1e2, many scales
    v0 = kv_fp8.encode(torch.randn(nb, bs, hkv, d, generator=g).to(dtype)).to(DEVICE)
    n = batch.num_tokens
    q = torch.randn(n, hkv * ratio, d, generator=g).to(dtype).to(DEVICE)
    k = (torch.randn(n, hkv, d, generator=g) * 3).to(dtype).to(DEVICE)
    v = torch.randn(n, hkv, d, generator=g).to(dtype).to(DEVICE)
    outs, caches = {}, {}
    for be in (TorchBackend(dtype, fp8=True), TritonBackend(dtype, torch.device(DEVICE))):
        kc, vc = k0.clone(), v0.clone()
        outs[be.name] = be.forward(q, k, v, kc, vc, be.prepare(batch), d ** -0.5)
        caches[be.name] = (kc, vc)
    assert torch.equal(caches["triton"][0], caches["torch"][0]) and torch.equal(caches["triton"][1], caches["torch"][1])
    assert outs["triton"].dtype == dtype
    err = (outs["triton"].float() - outs["torch"].float()).abs().max().item()
    assert err <= TOL[dtype], err
    # the exponent bytes matter: with every one zeroed, the decodes' output moves far
    kz = caches["triton"][0].clone()
    kz[..., -1] = 0
    tables, lens = _tables(batch, 2), _lens(batch, 2)
    zeroed = att.paged_attention_decode(q[:2], kz, caches["triton"][1], tables, lens, d ** -0.5)
    assert (zeroed.float() - outs["triton"][:2].float()).abs().max().item() > 100 * TOL[dtype]


@pytest.mark.parametrize("dtype,d,ratio,hkv,bs", CASES[:1] + CASES[-1:], ids=IDS[:1] + IDS[-1:])
def test_split_decode_and_prefill_kernels_match_the_reference(dtype, d, ratio, hkv, bs):
    """Split-K decode (3 splits, merged) and prefill straight through the launchers, against the
    gather + softmax reference over the decoded cache."""
    g = torch.Generator().manual_seed(5)
    nb = 16
    batch = _step(bs, nb, g)
    k = kv_fp8.encode(torch.randn(nb, bs, hkv, d, generator=g).to(dtype)).to(DEVICE)
    v = kv_fp8.encode(torch.randn(nb, bs, hkv, d, generator=g).to(dtype)).to(DEVICE)
    seqs = batch.decodes + batch.prefills
    tables, lens = _tables(batch, len(seqs)), _lens(batch, len(seqs))
    q = torch.randn(batch.num_tokens, hkv * ratio, d, generator=g).to(dtype).to(DEVICE)
    qd = q[: len(seqs)]  # one query per sequence, at the end of its context
    out = att.paged_attention_decode(qd, k, v, tables, lens, d ** -0.5, num_splits=3, block_n=16)
    ref = att.paged_attention_decode_reference(qd, k, v, tables, lens, d ** -0.5)
    assert (out.float() - ref.float()).abs().max().item() <= TOL[dtype]
    cu = torch.tensor([0] + [s.q_start + s.q_len for s in seqs], dtype=torch.int32, device=DEVICE)
    out = att.paged_attention_prefill(q, k, v, tables, cu, lens, d ** -0.5, block_n=32)
    ref = att.paged_attention_prefill_reference(q, k, v, tables, cu, lens, d ** -0.5)
    assert (out.float() - ref.float()).abs().max().item() <= TOL[dtype]


def test_launchers_take_an_fp8_cache_by_its_dtype_and_check_it():
    k, v = fp8_cache(4, 16, 2, 40), fp8_cache(4, 16, 2, 40)
    key = torch.zeros(3, 2, 40, device=DEVICE)
    slots = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    q = torch.zeros(2, 4, 40, device=DEVICE)
    tables = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE)
    lens = torch.ones(2, dtype=torch.int32, device=DEVICE)
    bad = [
        (lambda: triton_kv.store_kv(torch.zeros(3, 2, 41, device=DEVICE), key, k, v, slots), r"\[num_tokens, 2, 40\]"),
        (lambda: triton_kv.store_kv(key.to(torch.int32), key, k, v, slots), "an FP8 cache takes float32"),
        (lambda: triton_kv.store_kv(key, key, k, v.view(torch.int8), slots), "differ in dtype"),
        (lambda: att.paged_attention_decode(q[..., :39], k, v, tables, lens, 0.1),
         r"q must be \[num_tokens, num_heads, 40\]"),
        (lambda: att.paged_attention_decode(q, k, v.view(torch.int8), tables, lens, 0.1), "dtypes differ"),
    ]
    for call, msg in bad:
        with pytest.raises(ValueError, match=msg):
            call()
    assert att.paged_attention_decode(q.half(), k, v, tables, lens, 0.1).dtype == torch.float16  # any q dtype


def _tables(batch, n):
    seqs = (batch.decodes + batch.prefills)[:n]
    width = max(len(s.block_ids) for s in seqs)
    rows = [list(s.block_ids) + [0] * (width - len(s.block_ids)) for s in seqs]
    return torch.tensor(rows, dtype=torch.int32, device=DEVICE)


def _lens(batch, n):
    return torch.tensor([s.ctx_len for s in (batch.decodes + batch.prefills)[:n]], dtype=torch.int32, device=DEVICE)
