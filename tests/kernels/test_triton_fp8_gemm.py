"""fp8_gemm (Triton; the interpreter on CPU) against this file's own torch statement of the FP8
checkpoint formats: DeepSeek-V3's block-wise `weight_scale_inv` (`W = W_fp8 * scale[i // bn,
j // bk]`, partial edge blocks), compressed-tensors' per-tensor and per-channel `weight_scale`,
e5m2 as well as e4m3 weights —
with weights quantized from float here (`quantize_fp8`), activations in fp32 / fp16 / bf16, M = 1
and M > 1; plus the launcher's argument checks, and on a GPU of compute capability >= 8.9 the
activation-quantized `torch._scaled_mm` path.

Tolerances, relative to the output's largest magnitude (atol = tol * max|ref|): the kernel's
products are exact (e4m3 widens exactly to every activation dtype) and the reference's fp32
dequantization rounds once, so what differs is fp32 summation order and the output's rounding:
fp32 1e-5, fp16 2e-3, bf16 1.6e-2 (the interpreter truncates fp32 -> bf16: up to one ulp, 2^-7)."""

import pytest
import torch

pytest.importorskip("triton")  # the optional GPU extra; the kernels module itself must import
from splitserve.engine.kernels import triton_fp8_gemm as fp8  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
E4M3_MAX = 448.0


# -- the formats, restated ------------------------------------------------------------------------
def quantize_fp8(w: torch.Tensor, mode: str, block=(None, None)):
    """A float weight [N, K] -> (float8_e4m3fn [N, K], fp32 scale) such that the weight's
    largest magnitude in each scale's block lands on e4m3's largest value."""
    n, k = w.shape
    if mode == "tensor":
        scale = w.abs().amax() / E4M3_MAX
        full = scale.expand(n, k)
    elif mode == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / E4M3_MAX  # [N, 1]
        full = scale.expand(n, k)
    else:
        bn, bk = block
        rows, cols = -(-n // bn), -(-k // bk)
        scale = torch.empty(rows, cols)
        for i in range(rows):
            for j in range(cols):
                scale[i, j] = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().amax() / E4M3_MAX
        full = expand_blocks(scale, bn, bk, n, k)
    return (w / full).to(torch.float8_e4m3fn), scale.float()


def expand_blocks(scale, bn, bk, n, k):
    """[ceil(N / bn), ceil(K / bk)] block scales -> one per element [N, K] (edge blocks cut)."""
    return scale.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]


def dequantize(w8, scale, block=None):
    n, k = w8.shape
    if block is not None:
        return w8.float() * expand_blocks(scale.float().cpu(), *block, n, k).to(w8.device)
    return w8.float() * scale.float().reshape(-1, 1)  # [1, 1] or [N, 1]: broadcast over K


def reference(x, w8, scale, block=None):
    return (x.float() @ dequantize(w8, scale, block).t()).to(x.dtype)


# -- helpers --------------------------------------------------------------------------------------
def make(m, n, k, dtype, mode, block=(None, None), seed=0):
    g = torch.Generator().manual_seed(seed)
    # rows and columns of different magnitudes, so that wrong scales show
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 1, n)[:, None] * torch.logspace(0, 1, k)[None, :]
    w8, scale = quantize_fp8(w, mode, block)
    x = torch.randn(m, k, generator=g).to(dtype)
    return x.to(DEVICE), w8.to(DEVICE), scale.to(DEVICE)


def assert_close(out, ref):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    tol = TOL[ref.dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * ref.float().abs().max().item())


def gemm(x, w8, scale, block=None):
    return fp8.fp8_gemm(x, w8, scale, block_size=block)


# -- block-wise scales ----------------------------------------------------------------------------
# (N, K, block): edge blocks partial in both dims; blocks narrower and wider than the kernel's
# tiles; a bk that is no power of two (48: K tiles of 16); DeepSeek-V3's own [128, 128]
BLOCK_CASES = [(80, 176, (32, 32)), (72, 200, (48, 48)), (136, 272, (128, 128))]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t)[6:])
@pytest.mark.parametrize("n,k,block", BLOCK_CASES, ids=["b32", "b48", "b128"])
def test_block_scales(dtype, n, k, block):
    for m in (1, 33):
        x, w8, scale = make(m, n, k, dtype, "block", block, seed=m)
        assert_close(gemm(x, w8, scale, block), reference(x, w8, scale, block))


def test_block_scales_each_block_counts():
    """One block's scale changed changes exactly that block's rows and columns of the product."""
    x, w8, scale = make(3, 64, 96, torch.float32, "block", (32, 32))
    base = gemm(x, w8, scale, (32, 32))
    scale2 = scale.clone()
    scale2[1, 2] *= 3
    got = gemm(x, w8, scale2, (32, 32))
    assert torch.equal(got[:, :32], base[:, :32])  # rows of W in another block: untouched
    assert_close(got, reference(x, w8, scale2, (32, 32)))
    assert not torch.allclose(got[:, 32:], base[:, 32:])


# -- per-tensor and per-channel scales ------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t)[6:])
@pytest.mark.parametrize("mode,shape", [("tensor", ()), ("tensor", (1,)), ("channel", (-1, 1)), ("channel", (-1,))],
                         ids=["tensor-scalar", "tensor-1", "channel-n1", "channel-n"])
def test_tensor_and_channel_scales(dtype, mode, shape):
    n, k = 72, 136
    for m in (1, 20):
        x, w8, scale = make(m, n, k, dtype, mode, seed=m)
        s = scale.reshape(tuple(n if d == -1 else d for d in shape))
        assert_close(gemm(x, w8, s), reference(x, w8, scale))


def test_e5m2_weight():
    """float8_e5m2 weights (2 mantissa bits, fp16's exponent range) take the same path."""
    g = torch.Generator().manual_seed(3)
    w5 = (torch.randn(40, 96, generator=g) * 100).to(torch.float8_e5m2).to(DEVICE)
    scale = (torch.rand(3, 2, generator=g) + 0.5).to(DEVICE)
    for dtype in DTYPES:
        x = torch.randn(6, 96, generator=g).to(dtype).to(DEVICE)
        assert_close(gemm(x, w5, scale, (16, 48)), reference(x, w5, scale, (16, 48)))


def test_strided_x_and_out():
    x, w8, scale = make(40, 48, 64, torch.float16, "block", (16, 32))
    wide = torch.zeros(5, 100, dtype=torch.float16, device=DEVICE)
    xs = x[:5]
    wide[:, 10:74] = xs
    out = torch.full((5, 48), float("nan"), dtype=torch.float16, device=DEVICE)
    got = fp8.fp8_gemm(wide[:, 10:74], w8, scale, block_size=(16, 32), out=out)
    assert got is out
    assert_close(out, reference(xs, w8, scale, (16, 32)))


def test_empty_batch():
    x, w8, scale = make(0, 32, 64, torch.bfloat16, "tensor")
    assert gemm(x, w8, scale).shape == (0, 32)


# -- argument checks ------------------------------------------------------------------------------
def _bad_calls():
    x, w8, s = make(2, 32, 64, torch.float16, "block", (16, 32))
    _, _, st = make(2, 32, 64, torch.float16, "tensor")
    return [
        ("weight must be torch.float8_e4m3fn or float8_e5m2",
         lambda: fp8.fp8_gemm(x, w8.to(torch.float16), s, block_size=(16, 32))),
        ("weight must be \\[N, 64\\]", lambda: fp8.fp8_gemm(x, w8[:, :32].contiguous(), s, block_size=(16, 32))),
        ("weight must be contiguous", lambda: fp8.fp8_gemm(x, w8.t().contiguous().t(), st)),
        ("x must be \\[M, K\\]", lambda: fp8.fp8_gemm(x[None], w8, s, block_size=(16, 32))),
        ("x must be float32", lambda: fp8.fp8_gemm(x.to(torch.int32), w8, s, block_size=(16, 32))),
        ("x's last dim must be contiguous", lambda: fp8.fp8_gemm(torch.zeros(64, 2, dtype=x.dtype).t(), w8, st)),
        ("block scales .* must be \\[2, 2\\]", lambda: fp8.fp8_gemm(x, w8, s[:, :1], block_size=(16, 32))),
        ("must be a multiple of 16", lambda: fp8.fp8_gemm(x, w8, s, block_size=(16, 24))),
        ("block_size must be two positive ints", lambda: fp8.fp8_gemm(x, w8, s, block_size=(0, 32))),
        ("weight_scale must be float32", lambda: fp8.fp8_gemm(x, w8, st.half())),
        ("weight_scale must be a scalar, \\[32, 1\\]", lambda: fp8.fp8_gemm(x, w8, s)),
        ("out must be \\[2, 32\\]", lambda: fp8.fp8_gemm(x, w8, st, out=torch.empty(2, 32))),
        ("quantize_activations needs", lambda: fp8.fp8_gemm(x, w8, s, block_size=(16, 32), quantize_activations=True)),
    ]


@pytest.mark.parametrize("case", range(13))
def test_argument_checks(case):
    calls = _bad_calls()
    assert len(calls) == 13
    match, call = calls[case]
    with pytest.raises(ValueError, match=match):
        call()


# -- the FP8 tensor-core path ---------------------------------------------------------------------
def _fp8_tensor_cores() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not _fp8_tensor_cores(), reason="needs a CUDA GPU of compute capability >= 8.9")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=lambda t: str(t)[6:])
@pytest.mark.parametrize("m", [1, 16, 100])
def test_quantized_activations_on_gpu(dtype, m):
    """x is rounded to e4m3 too: ~2^-4 relative per element, averaging out over K."""
    x, w8, scale = make(m, 256, 512, dtype, "tensor")
    got = fp8.fp8_gemm(x, w8, scale, quantize_activations=True)
    ref = reference(x, w8, scale)
    assert got.dtype == dtype and got.shape == ref.shape
    err = (got.float() - ref.float()).abs().max() / ref.float().abs().max()
    assert err < 0.05, err
