"""bf16 linears widened to fp32 for many-row inputs (engine/model/widened_linear.py): the result
is torch's bf16 matmul up to summation order (bf16 products are exact in fp32; one rounding to
bf16 at the end), few-row inputs take the bf16 layer itself, and the engine wraps exactly the
decoder layers' linears on a CPU without AMX."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from splitserve import LLM
from splitserve.engine.model.loader import cpu_has_amx
from splitserve.engine.model.widened_linear import WIDE_ROWS, WidenedLinear


@pytest.mark.parametrize("bias", [False, True])
def test_wide_inputs_match_the_bf16_matmul_up_to_rounding(bias):
    torch.manual_seed(0)
    lin = nn.Linear(96, 160, bias=bias).to(torch.bfloat16)
    w = WidenedLinear(lin)
    for rows in (1, WIDE_ROWS - 1, WIDE_ROWS, 300):
        x = torch.randn(rows, 96).to(torch.bfloat16)
        got = w(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 160)
        exact = F.linear(x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double())
        if rows < WIDE_ROWS:
            assert torch.equal(got, lin(x))  # the bf16 layer itself
        else:
            assert torch.equal(got, F.linear(x.float(), lin.weight.float(),
                                             None if lin.bias is None else lin.bias.float()).to(torch.bfloat16))
        # either way within one bf16 rounding (plus fp32 summation noise) of the exact product
        torch.testing.assert_close(got.double(), exact, atol=1e-2, rtol=2 ** -7)


@pytest.mark.skipif(cpu_has_amx(), reason="with AMX, bf16 matmuls stay bf16")
def test_the_cpu_bf16_engine_widens_the_decoder_linears_only(tiny_checkpoint):
    model = LLM(str(tiny_checkpoint("llama")), dtype="bfloat16", num_kv_blocks=16).engine.runner.model
    wrapped = [m for m in model.modules() if isinstance(m, WidenedLinear)]
    assert len(wrapped) == 4 * len(model.layers)  # qkv, o, gate_up, down per layer
    assert not isinstance(model.lm_head, WidenedLinear)
    fp32 = LLM(str(tiny_checkpoint("llama")), dtype="float32", num_kv_blocks=16).engine.runner.model
    assert not any(isinstance(m, WidenedLinear) for m in fp32.modules())


def test_latent_attention_reads_its_widened_projection(tiny_checkpoint):
    """DeepSeek-V3 in bf16 where the CPU lacks AMX: latent attention reads kv_b_proj's weight
    directly, which a widened kv_b_proj must still give (generating raised AttributeError)."""
    from splitserve import SamplingParams
    from splitserve.engine.model.widened_linear import widen_linears

    llm = LLM(str(tiny_checkpoint("deepseek_v3")), dtype="bfloat16", num_kv_blocks=64)
    model = llm.engine.runner.model
    if not isinstance(model.layers[0].self_attn.kv_b_proj, WidenedLinear):
        widen_linears(model)  # an AMX CPU leaves them plain: widen them here
    proj = model.layers[0].self_attn.kv_b_proj
    assert isinstance(proj, WidenedLinear) and proj.weight is proj.linear.weight
    prompts = [list(range(5, 5 + n)) for n in (3, 40, 150)]  # 150 rows: the fp32 path
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8, 8]
