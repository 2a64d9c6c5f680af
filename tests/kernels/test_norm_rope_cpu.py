"""The native CPU residual + RMSNorm and rotary kernels against the torch definitions the model
uses (layers.RMSNorm after a residual add, layers.apply_rope): bf16 bit for bit (each step
rounds as torch's op does); fp32 within rounding noise (the row sum's order); strided rows as the
fused qkv output gives them; bad arguments refused by name."""

import pytest
import torch

from splitserve.engine.kernels import norm_rope_cpu as K
from splitserve.engine.model.layers import RMSNorm, apply_rope

pytestmark = pytest.mark.skipif(not K.available(), reason="no C compiler: native kernels not built")


def torch_norm(x, w, eps, residual=None):
    h0 = x + residual if residual is not None else x
    norm = RMSNorm(x.shape[1], eps)
    norm.weight.data = w
    return norm(h0), h0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,hidden", [(1, 64), (37, 576), (300, 96)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_matches_torch(dtype, n, hidden, with_residual):
    g = torch.Generator().manual_seed(n + hidden)
    wide = torch.randn(n, hidden + 8, generator=g).to(dtype)
    x = wide[:, 4:4 + hidden]  # strided rows
    r = torch.randn(n, hidden, generator=g).to(dtype) if with_residual else None
    w = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    ref, h0 = torch_norm(x, w, 1e-5, r)
    got = K.rms_norm(x, w, 1e-5, residual=r)
    if with_residual:
        got, new_res = got
        assert torch.equal(new_res, h0)
    if dtype == torch.bfloat16:
        mismatch = (got != ref).float().mean().item()
        assert mismatch < 1e-3, mismatch  # a row sum in another order flips a rounding rarely
        torch.testing.assert_close(got, ref, atol=0, rtol=2 ** -7)
    else:
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,heads,dim", [(1, 2, 8), (33, 12, 64), (5, 3, 128)])
def test_rotary_matches_torch_exactly(dtype, n, heads, dim):
    g = torch.Generator().manual_seed(heads * dim)
    qkv = torch.randn(n, (heads + 2) * dim, generator=g).to(dtype)
    qk = qkv[:, : heads * dim].view(n, heads, dim)  # a view of the fused qkv output: strided tokens
    cos = torch.randn(n, 1, dim, generator=g).to(dtype)
    sin = torch.randn(n, 1, dim, generator=g).to(dtype)
    assert torch.equal(K.apply_rotary(qk, cos, sin), apply_rope(qk, cos, sin))
    assert torch.equal(K.apply_rotary(qk, cos[:, 0], sin[:, 0]), apply_rope(qk, cos, sin))


def test_bad_arguments_are_named():
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match="weight"):
        K.rms_norm(x, torch.ones(16, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        K.rms_norm(x, torch.ones(16), 1e-5, residual=torch.randn(4, 8))
    with pytest.raises(ValueError, match="x must be float32 or bfloat16"):
        K.rms_norm(x.double(), torch.ones(16).double(), 1e-5)
    qk = torch.randn(4, 2, 8)
    with pytest.raises(ValueError, match="head_dim"):
        K.apply_rotary(torch.randn(4, 2, 7), torch.randn(4, 7), torch.randn(4, 7))
    with pytest.raises(ValueError, match="cos"):
        K.apply_rotary(qk, torch.randn(3, 8), torch.randn(4, 8))
    with pytest.raises(ValueError, match="contiguous"):
        K.apply_rotary(qk.transpose(1, 2).contiguous().transpose(1, 2), torch.randn(4, 8), torch.randn(4, 8))
