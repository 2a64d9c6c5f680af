"""Quantized weights kept as stored (`quantized_weights="keep"`, engine/quant/linear.py), run here
by the GEMM kernels under the Triton interpreter: greedy tokens equal Hugging Face's (within the
tie rule) for DeepSeek-V3 FP8 blocks (MLA, a shared expert; under TP 2 too), a Llama in
compressed-tensors FP8 and a Qwen3 in AWQ and GPTQ int4, plain and chunked; the layers really hold
FP8 / int32 tensors and the memory report's weights shrink. Below the engine: a cut (one rank's
rows / columns) and a fusion (q/k/v, gate/up) of the stored tensors dequantize to exactly the cut
and the concatenation of the dense weight, or say why they cannot."""

import logging

import pytest
import torch
import torch.nn.functional as F
from greedy_parity import assert_greedy_equal, drained, hf_greedy, make_prompts

from splitserve import LLM, SamplingParams
from splitserve.config import EngineConfig
from splitserve.engine.quant.config import QuantMethod, WeightQuant
from splitserve.engine.quant.linear import QuantLinear, keep_quantized
from splitserve.engine.quant.stored import StoredWeight, cut, fuse
from splitserve.types import ConfigError

BLOCK = (8, 16)  # FP8 scale blocks: the kernel's K tiles need 16 columns or more
CASES = [("deepseek_v3_yarn", "fp8"), ("llama", "ct_fp8"), ("qwen3", "awq"), ("qwen3", "gptq")]
# projections held quantized; GPTQ: the builder draws each projection's act order on its own, so
# q/k/v and gate/up cannot share one g_idx and those two fused projections a layer are dequantized
HELD = {"deepseek_v3_yarn": 12, "llama": 8, "qwen3": 8}
MAX_NEW = 5
LENGTHS = (1, 9, 20, 33)


@pytest.fixture(scope="module")
def reference(quantized_checkpoint):
    """(shape, fmt) -> (checkpoint, hf model, prompts, reference continuations)."""
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(case):
        if case not in cache:
            ours, ref_dir = quantized_checkpoint(*case, block=BLOCK)
            hf = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
            prompts = make_prompts(seed=len(case[1]), lengths=LENGTHS)
            cache[case] = (ours, hf, prompts, hf_greedy(hf, prompts, MAX_NEW))
        return cache[case]

    return get


def run_and_compare(llm, hf, prompts, refs) -> None:
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    for p, o, r in zip(prompts, outs, refs):
        assert_greedy_equal(hf, p, list(o.outputs[0].token_ids), r)
    drained(llm)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_kept_weights_give_the_same_tokens_in_fewer_bytes(reference, case):
    """Whole prompts in one step; the AWQ case in chunks of 32 (prompts of up to 73 tokens; the
    FP8 case is chunked under TP 2 below). The interpreter is slow: one pass each."""
    ours, hf, prompts, refs = reference(case)
    with LLM(str(ours), num_kv_blocks=8, quantized_weights="dequantize") as dense:
        dense_bytes = dense.engine.memory.weights_bytes
    chunked = dict(max_num_batched_tokens=32, enable_prefix_caching=False) if case[1] == "awq" else {}
    with LLM(str(ours), num_kv_blocks=64, quantized_weights="keep", **chunked) as llm:
        model = llm.engine.runner.model
        held = [m for m in model.modules() if isinstance(m, QuantLinear)]
        assert len(held) == model.quant_holding.quantized == HELD[case[0]] // (2 if case[1] == "gptq" else 1)
        for m in held:
            if "fp8" in case[1]:
                assert m.weight.dtype == torch.float8_e4m3fn and m.scale.dtype == torch.float32
            else:
                assert m.qweight.dtype == m.qzeros.dtype == torch.int32 and m.scales.dtype == torch.float16
        assert llm.engine.memory.weights_bytes < dense_bytes
        assert "held quantized" in llm.engine.memory.describe()
        run_and_compare(llm, hf, prompts, refs)


def test_kept_fp8_deepseek_under_tensor_parallelism(reference):
    """Each rank holds its heads' rows of q_b_proj, its columns of o_proj and of the MLPs' down
    projections, its rows of gate/up — cut along the 8-row scale blocks, as stored —; prompts of
    up to 41 tokens in chunks of 24."""
    ours, hf, prompts, refs = reference(CASES[0])
    with LLM(str(ours), num_kv_blocks=32, max_num_batched_tokens=24, tensor_parallel_size=2,
             quantized_weights="keep") as llm:
        q_b = llm.engine.runner.model.layers[0].self_attn.q_b_proj
        assert isinstance(q_b, QuantLinear) and q_b.weight.shape == (2 * 24, 32) and q_b.scale.shape == (6, 2)
        run_and_compare(llm, hf, prompts[:3], refs[:3])


def test_a_format_the_kernels_do_not_take_is_dequantized_and_said(quantized_checkpoint, caplog):
    ours, _ = quantized_checkpoint("llama", "fp8")  # 8x8 blocks: K tiles of 8 columns
    with caplog.at_level(logging.WARNING, logger="splitserve.engine.quant.linear"):
        llm = LLM(str(ours), num_kv_blocks=8, quantized_weights="keep")
    assert not any(isinstance(m, QuantLinear) for m in llm.engine.runner.model.modules())
    assert "dequantized at load" in llm.engine.memory.describe()
    assert any("multiple of 16 columns" in r.getMessage() for r in caplog.records)
    llm.close()


def test_the_setting_is_checked(tiny_checkpoint, monkeypatch):
    with pytest.raises(ConfigError, match="quantized_weights must be one of auto, dequantize, keep"):
        EngineConfig(model=str(tiny_checkpoint("llama")), quantized_weights="sometimes")
    q, cpu = WeightQuant(QuantMethod.AWQ, group_size=32, bits=4), torch.device("cpu")
    assert not keep_quantized("auto", q, cpu) and not keep_quantized("dequantize", q, cpu)
    assert keep_quantized("keep", q, cpu) and not keep_quantized("keep", None, cpu)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ConfigError, match="quantized_weights keep: the quantized GEMM kernels run on CUDA"):
        keep_quantized("keep", q, cpu)


# -- the stored tensors, cut and fused -------------------------------------------------------------
def _int32(*shape):
    return torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32)


def stored(fmt: str, n: int, k: int, gen_seed: int = 0, g_idx: torch.Tensor | None = None
           ) -> tuple[StoredWeight, WeightQuant]:
    """Random stored tensors of a format (their meaning is the kernels' and the parity tests'; here
    only how they cut and fuse)."""
    torch.manual_seed(gen_seed)
    if fmt in ("fp8_block", "fp8_channel", "fp8_tensor"):
        quant = WeightQuant(QuantMethod.FP8, block=BLOCK if fmt == "fp8_block" else None)
        scale = {"fp8_block": (-(-n // BLOCK[0]), -(-k // BLOCK[1])), "fp8_channel": (n, 1), "fp8_tensor": ()}[fmt]
        raw = {"weight": (torch.randn(n, k) * 40).to(torch.float8_e4m3fn), "scale": torch.rand(scale) + 0.5}
        return StoredWeight.of(raw, quant), quant
    group = 16
    groups = k // group
    awq = fmt == "awq"
    quant = WeightQuant(QuantMethod.AWQ if awq else QuantMethod.GPTQ, bits=4, group_size=group, zeros_minus_one=True)
    raw = {"qweight": _int32(k, n // 8) if awq else _int32(k // 8, n), "qzeros": _int32(groups, n // 8),
           "scales": (torch.rand(groups, n) + 0.5).half()}
    if g_idx is not None:
        raw["g_idx"] = g_idx
    return StoredWeight.of(raw, quant), quant


def _halves_act_order(k: int, group: int = 16) -> torch.Tensor:
    """Act-order groups that stay within each half of the input rows (a TP 2 cut keeps half)."""
    g = torch.arange(k) // group
    half = k // 2
    return torch.cat((g[:half][torch.randperm(half)], g[half:][torch.randperm(half)])).to(torch.int32)


@pytest.mark.parametrize("fmt", ["fp8_block", "fp8_channel", "fp8_tensor", "awq", "gptq", "gptq_act_order"])
def test_a_cut_is_the_dense_weight_cut_and_a_fusion_its_concatenation(fmt):
    n, k = 48, 64
    g_idx = _halves_act_order(k) if fmt == "gptq_act_order" else None
    w, quant = stored(fmt.removesuffix("_act_order"), n, k, g_idx=g_idx)
    dense = w.dequantize(quant)
    for rows, cols in [(slice(0, 24), slice(0, k)), (slice(24, 48), slice(0, k)), (slice(0, n), slice(32, 64)),
                       (slice(16, 40), slice(0, 32))]:
        part = cut(w, rows, cols, quant)
        assert isinstance(part, StoredWeight), part
        assert torch.equal(part.dequantize(quant), dense[rows, cols])
    parts = [stored(fmt.removesuffix("_act_order"), m, k, gen_seed=i, g_idx=g_idx)[0] for i, m in enumerate((32, 8, 8))]
    fused = fuse(parts)
    assert isinstance(fused, StoredWeight), fused
    assert torch.equal(fused.dequantize(quant), torch.cat([p.dequantize(quant) for p in parts]))


def test_what_cannot_be_cut_or_fused_says_why():
    w, quant = stored("fp8_block", 48, 64)
    assert "split the 8x16 scale blocks" in cut(w, slice(0, 20), slice(0, 64), quant)
    assert "split the 8x16 scale blocks" in cut(w, slice(0, 48), slice(0, 24), quant)
    parts = [stored("fp8_block", m, 64, gen_seed=i)[0] for i, m in enumerate((12, 12))]
    assert "not multiples of the 8-row scale blocks" in fuse(parts)
    w, quant = stored("awq", 48, 64)
    assert "split AWQ's 8-column words" in cut(w, slice(0, 20), slice(0, 64), quant)
    assert "split groups of 16" in cut(w, slice(0, 48), slice(0, 24), quant)
    spread = torch.arange(64, dtype=torch.int32)[torch.randperm(64)] // 16  # act order over all rows
    w, quant = stored("gptq", 48, 64, g_idx=spread)
    assert "use 4 act-order groups" in cut(w, slice(0, 48), slice(0, 32), quant)
    other = stored("gptq", 48, 64, gen_seed=1, g_idx=spread.flip(0).contiguous())[0]
    assert "g_idx differ" in fuse([w, other])


@pytest.mark.parametrize("fmt", ["fp8_block", "fp8_channel", "awq", "gptq_act_order"])
def test_a_quant_linear_multiplies_as_the_dense_weight_does(fmt):
    n, k = 40, 64
    w, quant = stored(fmt.removesuffix("_act_order"), n, k, g_idx=_halves_act_order(k) if "act" in fmt else None)
    layer = QuantLinear(k, n, bias=True)
    with torch.no_grad():
        layer.bias.copy_(torch.randn(n))
    layer.hold(w, quant, torch.device("cpu"))
    layer.to(torch.float32)  # a dtype cast leaves the stored tensors as they are
    assert all(b.dtype in (torch.float8_e4m3fn, torch.int32, torch.float16, torch.float32) for b in layer.buffers())
    x = torch.randn(2, 3, k)
    want = F.linear(x, w.dequantize(quant), layer.bias)
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-4)
