"""rms_norm (+ fused residual add) and apply_rotary (Triton; the interpreter on CPU) against their
torch references, which are first proven equal, bit for bit, to the engine's own layers
(layers.RMSNorm, RotaryEmbedding + apply_rope); plus the launchers' argument checks.

Tolerances, relative to the output's largest magnitude (atol = tol * max|ref|, rtol = tol):
fp32 1e-6 (reduction order, rsqrt; on GPU also FMA), fp16 1e-3, bf16 1e-2 (about one ulp).
The kernels repeat every rounding torch does in the half dtypes, so fp16/bf16 results must also
be bit-identical for at least 99% of elements (fp32 noise in the row reduction can flip a rare
rounding), and the residual sum and the rotary outputs are in practice fully identical.
Exception: the Triton interpreter casts fp32 -> bf16 by truncation (runtime/interpreter.py,
`cast_impl` -> `_convert_float` without a rounding mode) where GPUs round to nearest even, so
interpreted bf16 results are checked against the tolerance only."""

import itertools
import os

import pytest
import torch

pytest.importorskip("triton")  # the optional GPU extra; the kernels module itself must import
from splitserve.engine.kernels import triton_norm as tn  # noqa: E402
from splitserve.engine.model.config import RopeConfig  # noqa: E402
from splitserve.engine.model.layers import RMSNorm, RotaryEmbedding, apply_rope  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1e-2}
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
EPS = 1e-5


def bit_exact_expected(dtype: torch.dtype) -> bool:
    return dtype != torch.float32 and not (dtype == torch.bfloat16 and INTERPRETED)


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    tol = TOL[ref.dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * ref.abs().max().item())
    if bit_exact_expected(ref.dtype):
        assert (out == ref).float().mean().item() >= 0.99


def rows(n, hidden, dtype, seed, strided):
    """[n, hidden] with row scales from 0.01 to ~3 (eps matters for the small rows); strided =
    a column slice of a wider tensor, so rows are not contiguous with each other."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-2, 0.5, n)[:, None]
    if not strided:
        return (torch.randn(n, hidden, generator=g) * scale).to(dtype).to(DEVICE)
    wide = (torch.randn(n, hidden + 24, generator=g) * scale).to(dtype).to(DEVICE)
    return wide[:, 8:8 + hidden]


def weight(hidden, dtype, seed=7):
    g = torch.Generator().manual_seed(seed)
    return (1 + 0.5 * torch.randn(hidden, generator=g)).to(dtype).to(DEVICE)


NORM_GRID = list(itertools.product(DTYPES, [64, 96, 4096], [False, True], [False, True]))


@pytest.mark.parametrize("dtype,hidden,with_res,strided", NORM_GRID,
                         ids=[f"{str(t)[6:]}-h{h}-{'res' if r else 'nores'}-{'strided' if s else 'contig'}"
                              for t, h, r, s in NORM_GRID])
def test_rms_norm_matches_reference(dtype, hidden, with_res, strided):
    x, w = rows(5, hidden, dtype, 0, strided), weight(hidden, dtype)
    if not with_res:
        out, want = tn.rms_norm(x, w, EPS), tn.rms_norm_reference(x, w, EPS)
        assert out.is_contiguous()
        assert_matches(out, want)
        return
    res = rows(5, hidden, dtype, 1, strided)
    x0, res0 = x.clone(), res.clone()
    (out, new_res), (want, want_res) = tn.rms_norm(x, w, EPS, res), tn.rms_norm_reference(x, w, EPS, res)
    assert out.is_contiguous() and new_res.is_contiguous()
    assert torch.equal(x, x0) and torch.equal(res, res0)  # inputs untouched
    if dtype != torch.bfloat16 or not INTERPRETED:
        assert torch.equal(new_res, want_res)  # one rounding of the exact sum, as torch's `x + residual`
    assert_matches(new_res, want_res)
    assert_matches(out, want)


def test_rms_norm_long_rows_and_no_tokens():
    bf16 = torch.bfloat16
    x, res, w = rows(2, 16384, bf16, 0, False), rows(2, 16384, bf16, 1, False), weight(16384, bf16)
    out, new_res = tn.rms_norm(x, w, EPS, res)
    want, want_res = tn.rms_norm_reference(x, w, EPS, res)
    assert_matches(new_res, want_res)
    assert_matches(out, want)
    empty = torch.empty(0, 64, device=DEVICE)
    assert tn.rms_norm(empty, weight(64, torch.float32), EPS).shape == (0, 64)


@pytest.mark.parametrize("dtype", DTYPES, ids=[str(t)[6:] for t in DTYPES])
def test_rms_norm_is_the_engines_rmsnorm(dtype):
    """The decoder layer's `x = x + attn(norm(x))`, fused: rms_norm(attn_out, w, eps, residual=x)
    gives (next layer's norm(x + attn_out), x + attn_out)."""
    norm = RMSNorm(96, EPS)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(96, generator=torch.Generator().manual_seed(3)))
        norm = norm.to(device=DEVICE, dtype=dtype)
        x, attn_out = rows(6, 96, dtype, 0, False), rows(6, 96, dtype, 1, False)
        want_res = x + attn_out
        want = norm(want_res)
        ref, ref_res = tn.rms_norm_reference(attn_out, norm.weight, norm.eps, x)
        assert torch.equal(ref, want) and torch.equal(ref_res, want_res)
        assert torch.equal(tn.rms_norm_reference(x, norm.weight, norm.eps), norm(x))
        out, new_res = tn.rms_norm(attn_out, norm.weight, norm.eps, residual=x)
    assert_matches(new_res, want_res)
    assert_matches(out, want)


def qkv_and_tables(n, h, hkv, d, dtype):
    """A fused qkv projection output, its qk view (token stride (h + 2 hkv) d, as llama.py
    slices it) and the engine's Llama-3.1-scaled cos / signed sin for scattered positions."""
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(n, (h + 2 * hkv) * d, generator=g).to(dtype).to(DEVICE)
    qk = qkv[:, :(h + hkv) * d].view(n, h + hkv, d)
    rope = RopeConfig(theta=500000.0, scaling_type="llama3", factor=8.0, original_max_position_embeddings=8192)
    rotary = RotaryEmbedding(rope, d, 4096).to(DEVICE)
    positions = torch.tensor([0, 1, 7, 300, 4095][:n], device=DEVICE)
    cos, sin = rotary(positions, dtype)
    return qkv, qk, cos, sin


ROPE_GRID = list(itertools.product(DTYPES, [64, 128]))


@pytest.mark.parametrize("dtype,d", ROPE_GRID, ids=[f"{str(t)[6:]}-d{d}" for t, d in ROPE_GRID])
def test_apply_rotary_matches_the_engines_rope(dtype, d):
    qkv, qk, cos, sin = qkv_and_tables(5, 4, 2, d, dtype)
    want = apply_rope(qk, cos, sin)  # what llama.py computes
    assert torch.equal(tn.apply_rotary_reference(qk, cos, sin), want)
    qkv0 = qkv.clone()
    out = tn.apply_rotary(qk, cos, sin)
    assert out.is_contiguous() and torch.equal(qkv, qkv0)
    assert_matches(out, want)
    if bit_exact_expected(dtype):
        assert torch.equal(out, want)
    # In place, through the strided view: q and k rotated, v (the rest of each row) untouched.
    assert tn.apply_rotary(qk, cos, sin, out=qk) is qk
    assert torch.equal(qk, out)
    assert torch.equal(qkv[:, qk.shape[1] * d:], qkv0[:, qk.shape[1] * d:])


def test_apply_rotary_general_tables_odd_sizes():
    """2-D tables whose halves differ (not RotaryEmbedding's), head_dim 96 (half not a power of
    two) and 20 heads (two head blocks, the second partial)."""
    g = torch.Generator().manual_seed(1)
    qk = torch.randn(3, 20, 96, generator=g).half().to(DEVICE)
    cos, sin = (torch.randn(3, 96, generator=g).half().to(DEVICE) for _ in range(2))
    out, want = tn.apply_rotary(qk, cos, sin), tn.apply_rotary_reference(qk, cos, sin)
    assert torch.equal(want, apply_rope(qk, cos[:, None], sin[:, None]))
    assert_matches(out, want)
    assert torch.equal(out, want)


def test_launchers_refuse_bad_arguments_clearly():
    f32 = dict(device=DEVICE)  # float32 by default
    x, w = torch.zeros(3, 64, **f32), torch.ones(64, **f32)
    qk, cos = torch.zeros(3, 6, 64, **f32), torch.zeros(3, 1, 64, **f32)
    bad = [
        (lambda: tn.rms_norm(torch.zeros(3, 2, 64, **f32), w, EPS), r"x must be \[num_tokens, hidden\]"),
        (lambda: tn.rms_norm(x.to(torch.float64), w.double(), EPS), "x must be float32, float16 or bfloat16"),
        (lambda: tn.rms_norm(x, torch.ones(32, **f32), EPS), r"weight must be \[64\]"),
        (lambda: tn.rms_norm(x.half(), w, EPS), "weight must have x's dtype"),
        (lambda: tn.rms_norm(torch.zeros(64, 3, **f32).t(), w, EPS), "x's last dim must be contiguous"),
        (lambda: tn.rms_norm(x, w, EPS, torch.zeros(2, 64, **f32)), r"residual must be \(3, 64\)"),
        (lambda: tn.rms_norm(x, w, EPS, x.half()), "residual is torch.float16"),
        (lambda: tn.rms_norm(x, w, -1.0), "eps must be >= 0"),
        (lambda: tn.apply_rotary(qk[0], cos, cos), r"qk must be \[num_tokens, heads, head_dim\]"),
        (lambda: tn.apply_rotary(torch.zeros(3, 6, 63, **f32), cos, cos), "head_dim must be even"),
        (lambda: tn.apply_rotary(torch.zeros(3, 6, 512, **f32), cos, cos), "head_dim must be even"),
        (lambda: tn.apply_rotary(qk.transpose(0, 1), cos, cos), "qk's heads must be contiguous"),
        (lambda: tn.apply_rotary(qk, cos[:2], cos), r"cos must be \[3, 1, 64\] or \[3, 64\]"),
        (lambda: tn.apply_rotary(qk, cos, cos.half()), "signed_sin is torch.float16"),
        (lambda: tn.apply_rotary(qk.half(), cos.half(), cos), "signed_sin is torch.float32"),
        (lambda: tn.apply_rotary(qk, torch.zeros(3, 1, 128, **f32)[..., ::2], cos),
         "cos's last dim must be contiguous"),
        (lambda: tn.apply_rotary(qk, cos, cos, out=torch.zeros(3, 5, 64, **f32)), r"out must be \(3, 6, 64\)"),
        (lambda: tn.apply_rotary(qk, cos, cos, out=torch.zeros(6, 3, 64, **f32).transpose(0, 1)), "out's heads"),
    ]
    for call, msg in bad:
        with pytest.raises(ValueError, match=msg):
            call()
