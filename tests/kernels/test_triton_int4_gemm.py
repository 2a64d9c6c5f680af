"""awq_gemm and gptq_gemm (Triton; the interpreter on CPU) against this file's own torch statement
of the two int4 checkpoint layouts — packing with plain shifts (`pack_*`), unpacking likewise
(`unpack_*`), weights quantized from float here (`quantize_int4`) — over AWQ's interleaved nibble
order, GPTQ's K-packed words with v1 (zero - 1 stored) and v2 zeros, symmetric GPTQ without
qzeros, act-order g_idx, one group over all of K (group_size -1), a K that is not a multiple of
the group (AWQ), activations in fp32 / fp16 / bf16, M = 1 and M > 1; plus the launchers'
argument checks.

Tolerances, relative to the output's largest magnitude (atol = tol * max|ref|): the reference
dequantizes in fp32; the kernel rounds each dequantized weight to x's dtype before its dot (as
vLLM's Triton AWQ kernel does), so fp16 2e-3, bf16 1.6e-2 (the interpreter truncates to bf16),
fp32 1e-5."""

import pytest
import torch

pytest.importorskip("triton")  # the optional GPU extra; the kernels module itself must import
from splitserve.engine.kernels import triton_int4_gemm as i4  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of an AWQ word holds column AWQ_ORDER[i] of its 8
PLAIN_ORDER = list(range(8))


# -- the layouts, restated ------------------------------------------------------------------------
def to_int32(words: torch.Tensor) -> torch.Tensor:
    """uint32 bit patterns held in int64 -> the int32 a checkpoint stores."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_cols(q: torch.Tensor, order) -> torch.Tensor:
    """[R, N] nibbles -> [R, N / 8] int32 words; nibble i of word j = column 8j + order[i]."""
    r, n = q.shape
    cols = q.to(torch.int64).view(r, n // 8, 8)
    return to_int32(sum(cols[..., order[i]] << (4 * i) for i in range(8)))


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """[K, N] nibbles -> [K / 8, N] int32 words; nibble i of word r = row 8r + i (GPTQ's qweight)."""
    k, n = q.shape
    rows = q.to(torch.int64).view(k // 8, 8, n)
    return to_int32(sum(rows[:, i] << (4 * i) for i in range(8)))


def unpack_cols(words: torch.Tensor, order) -> torch.Tensor:
    r, w = words.shape
    out = torch.empty(r, w, 8, dtype=torch.int64)
    for i in range(8):
        out[..., order[i]] = (words.to(torch.int64) >> (4 * i)) & 0xF
    return out.view(r, 8 * w)


def unpack_rows(words: torch.Tensor) -> torch.Tensor:
    r, n = words.shape
    return torch.stack([(words.to(torch.int64) >> (4 * i)) & 0xF for i in range(8)], dim=1).view(8 * r, n)


def awq_dequantize(qweight, qzeros, scales, g):
    q, z = unpack_cols(qweight.cpu(), AWQ_ORDER), unpack_cols(qzeros.cpu(), AWQ_ORDER)
    grp = torch.arange(q.shape[0]) // g
    return (q - z[grp]).float() * scales.cpu().float()[grp]


def gptq_dequantize(qweight, qzeros, scales, g_idx, *, sym, v1):
    q = unpack_rows(qweight.cpu())
    grp = g_idx.cpu().long()
    z = torch.full_like(q, 8) if sym else (unpack_cols(qzeros.cpu(), PLAIN_ORDER) + int(v1))[grp]
    return (q - z).float() * scales.cpu().float()[grp]


def reference(x, w):
    return (x.float().cpu() @ w).to(x.dtype).to(x.device)


# -- quantizing a float weight --------------------------------------------------------------------
def quantize_int4(w: torch.Tensor, grp: torch.Tensor, groups: int, sym: bool, scale_dtype=torch.float16):
    """W [K, N] float, grp [K] each row's group -> q [K, N], zeros [groups, N], scales [groups, N]:
    asymmetric min/max (zero in 0..15) or symmetric (zero 8, scale amax / 7)."""
    k, n = w.shape
    zeros = torch.full((groups, n), 8, dtype=torch.int64)
    scales = torch.empty(groups, n)
    for j in range(groups):
        rows = w[grp == j]
        if sym:
            scales[j] = rows.abs().amax(0) / 7
        else:
            lo, hi = rows.amin(0).clamp(max=0), rows.amax(0).clamp(min=0)
            scales[j] = (hi - lo) / 15
            zeros[j] = torch.round(-lo / scales[j]).clamp(0, 15).long()
    scales = scales.to(scale_dtype)
    s = scales.float()[grp]
    q = (torch.round(w / s) + zeros[grp]).clamp(0, 15).long()
    return q, zeros, scales


def weight(k, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(k, n, generator=g) * torch.logspace(-1, 0.5, n)[None, :]  # columns of differing range


def act(m, k, dtype, seed):
    g = torch.Generator().manual_seed(seed + 100)
    return torch.randn(m, k, generator=g).to(dtype).to(DEVICE)


def act_order(k, g, seed):
    """GPTQ's desc_act: rows quantized in a permuted order, so each row's group is its rank // g."""
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // g).to(torch.int32)
    return g_idx


def assert_close(out, ref):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    tol = TOL[ref.dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * ref.float().abs().max().item())


def assert_round_trip(w, deq, scales, grp):
    """The packed layer means the float weight: within half a quantization step (+ fp16 scale)."""
    step = scales.float()[grp]
    assert ((deq - w).abs() <= step * 0.5 + 1e-3 * w.abs() + 1e-6).float().mean() > 0.99


# -- AWQ ------------------------------------------------------------------------------------------
def make_awq(k, n, g, seed=0, scale_dtype=torch.float16):
    w = weight(k, n, seed)
    gs = k if g == -1 else g
    grp = torch.arange(k) // gs
    q, z, s = quantize_int4(w, grp, -(-k // gs), sym=False, scale_dtype=scale_dtype)
    qweight, qzeros = pack_cols(q, AWQ_ORDER), pack_cols(z, AWQ_ORDER)
    deq = awq_dequantize(qweight, qzeros, s, gs)
    assert_round_trip(w, deq, s, grp)
    return [t.to(DEVICE) for t in (qweight, qzeros, s)], deq


# (K, N, group): tiles inside one group; groups narrower than a tile; a partial last group; -1
AWQ_CASES = [(128, 72, 32), (96, 40, 8), (80, 48, 32), (64, 24, -1)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t)[6:])
@pytest.mark.parametrize("k,n,g", AWQ_CASES, ids=["g32", "g8", "partial", "g-1"])
def test_awq(dtype, k, n, g):
    (qweight, qzeros, scales), deq = make_awq(k, n, g, seed=k + n)
    for m in (1, 21):
        x = act(m, k, dtype, m)
        assert_close(i4.awq_gemm(x, qweight, qzeros, scales, g), reference(x, deq))


def test_awq_nibble_order_matters():
    """AWQ's interleaved columns, read in plain order, give another weight: the order is tested."""
    (qweight, qzeros, scales), deq = make_awq(32, 16, 16)
    plain = awq_dequantize(pack_cols(unpack_cols(qweight.cpu(), AWQ_ORDER), PLAIN_ORDER), qzeros.cpu(), scales, 16)
    assert not torch.allclose(plain, deq)


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_awq_scale_dtypes(scale_dtype):
    (qweight, qzeros, scales), deq = make_awq(64, 32, 16, scale_dtype=scale_dtype)
    x = act(5, 64, torch.float32, 0)
    assert_close(i4.awq_gemm(x, qweight, qzeros, scales, 16), reference(x, deq))


# -- GPTQ -----------------------------------------------------------------------------------------
def make_gptq(k, n, g, *, sym, v1, desc_act, seed=0):
    w = weight(k, n, seed)
    gs = k if g == -1 else g
    groups = -(-k // gs)
    g_idx = act_order(k, gs, seed) if desc_act else (torch.arange(k) // gs).to(torch.int32)
    q, z, s = quantize_int4(w, g_idx.long(), groups, sym=sym)
    if v1:
        assert (z >= 1).all(), "v1 stores zero - 1: a zero of 0 has no nibble"
    stored = z - 1 if v1 else z
    qweight, qzeros = pack_rows(q), pack_cols(stored, PLAIN_ORDER)
    deq = gptq_dequantize(qweight, qzeros, s, g_idx, sym=sym, v1=v1)
    assert_round_trip(w, deq, s, g_idx.long())
    return qweight.to(DEVICE), qzeros.to(DEVICE), s.to(DEVICE), g_idx.to(DEVICE), deq


# (K, N, group, sym, format, g_idx passed, desc_act)
GPTQ_CASES = [
    (128, 72, 32, False, "gptq", False, False),   # v1 zeros, default g_idx
    (96, 40, 16, False, "gptq_v2", True, False),  # v2 zeros, the trivial g_idx passed explicitly
    (128, 56, 32, False, "gptq", True, True),     # act-order: rows' groups permuted
    (64, 48, 16, True, "gptq", True, True),       # symmetric + act-order
    (96, 24, -1, False, "gptq_v2", False, False),  # one group over K
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t)[6:])
@pytest.mark.parametrize("case", GPTQ_CASES, ids=["v1", "v2", "act-order", "sym-act-order", "g-1"])
def test_gptq(dtype, case):
    k, n, g, sym, fmt, pass_g_idx, desc_act = case
    qweight, qzeros, scales, g_idx, deq = make_gptq(k, n, g, sym=sym, v1=fmt == "gptq", desc_act=desc_act, seed=k)
    for m in (1, 21):
        x = act(m, k, dtype, m)
        got = i4.gptq_gemm(x, qweight, qzeros, scales, g_idx if pass_g_idx else None, group_size=g, sym=sym,
                           checkpoint_format=fmt)
        assert_close(got, reference(x, deq))


def test_gptq_sym_reads_no_zeros():
    qweight, qzeros, scales, g_idx, deq = make_gptq(64, 32, 16, sym=True, v1=True, desc_act=False)
    x = act(3, 64, torch.float16, 0)
    kw = dict(group_size=16, sym=True, checkpoint_format="gptq")
    assert torch.equal(i4.gptq_gemm(x, qweight, None, scales, **kw), i4.gptq_gemm(x, qweight, qzeros, scales, **kw))
    assert_close(i4.gptq_gemm(x, qweight, None, scales, **kw), reference(x, deq))


def test_gptq_formats_differ_by_one():
    """The same stored zeros read as v1 are one more than read as v2."""
    qweight, qzeros, scales, g_idx, _ = make_gptq(32, 16, 16, sym=False, v1=True, desc_act=False)
    x = act(2, 32, torch.float32, 0)
    kw = dict(group_size=16, sym=False)
    v1 = i4.gptq_gemm(x, qweight, qzeros, scales, checkpoint_format="gptq", **kw)
    v2 = i4.gptq_gemm(x, qweight, qzeros, scales, checkpoint_format="gptq_v2", **kw)
    shift = x.float() @ scales.float()[g_idx.long()]  # x @ (1 * s) per column
    assert_close(v2 - v1, shift)


def test_out_and_empty_batch():
    (qweight, qzeros, scales), deq = make_awq(32, 16, 16)
    x = act(4, 32, torch.float16, 0)
    out = torch.full((4, 16), float("nan"), dtype=torch.float16, device=DEVICE)
    assert i4.awq_gemm(x, qweight, qzeros, scales, 16, out=out) is out
    assert_close(out, reference(x, deq))
    assert i4.awq_gemm(x[:0], qweight, qzeros, scales, 16).shape == (0, 16)


# -- argument checks ------------------------------------------------------------------------------
def _bad_calls():
    (aw, az, as_), _ = make_awq(32, 16, 16)
    gw, gz, gs, gi, _ = make_gptq(32, 16, 16, sym=False, v1=False, desc_act=False)
    x = act(2, 32, torch.float16, 0)

    def gptq(*a, **kw):
        return i4.gptq_gemm(x, *a, **{"group_size": 16, "sym": False, "checkpoint_format": "gptq", **kw})

    return [
        ("qweight must be \\[32, N / 8\\]", lambda: i4.awq_gemm(x, aw[:16], az, as_, 16)),
        ("qweight must be int32", lambda: i4.awq_gemm(x, aw.long(), az, as_, 16)),
        ("qzeros must be \\[2, 2\\]", lambda: i4.awq_gemm(x, aw, az[:1], as_, 16)),
        ("qzeros must be int32", lambda: i4.awq_gemm(x, aw, az.long(), as_, 16)),
        ("scales must be \\[2, 16\\]", lambda: i4.awq_gemm(x, aw, az, as_[:, :8], 16)),
        ("scales must be float16", lambda: i4.awq_gemm(x, aw, az, as_.to(torch.int32), 16)),
        ("group_size must be a positive int or -1", lambda: i4.awq_gemm(x, aw, az, as_, 0)),
        ("x must be float32", lambda: i4.awq_gemm(x.to(torch.int8), aw, az, as_, 16)),
        ("qweight must be \\[4, N\\]", lambda: gptq(gw[:2], gz, gs)),
        ("K must be a multiple of 8", lambda: i4.gptq_gemm(x[:, :28], gw, gz, gs, group_size=16, sym=False,
                                                             checkpoint_format="gptq")),
        ("checkpoint_format must be one of", lambda: gptq(gw, gz, gs, checkpoint_format="v1")),
        ("sym must be a bool", lambda: gptq(gw, gz, gs, sym=1)),
        ("qzeros is needed unless sym=True", lambda: gptq(gw, None, gs)),
        ("g_idx must be int32 \\[32\\]", lambda: gptq(gw, gz, gs, gi.long())),
        ("g_idx's groups must lie in \\[0, 2\\)", lambda: gptq(gw, gz, gs, gi + 1)),
        ("out must be \\[2, 16\\]", lambda: gptq(gw, gz, gs, out=torch.empty(2, 16, device=DEVICE))),
    ]


@pytest.mark.parametrize("case", range(16))
def test_argument_checks(case):
    calls = _bad_calls()
    assert len(calls) == 16
    match, call = calls[case]
    with pytest.raises(ValueError, match=match):
        call()
