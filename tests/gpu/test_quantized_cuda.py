"""On a CUDA machine only (skipped elsewhere), issue 34's GPU paths end to end on tiny models:
`quantized_weights=auto` keeps an FP8 / AWQ / GPTQ checkpoint's weights as stored and multiplies
them with the Triton GEMMs (the decode steps replayed from CUDA graphs), and the tokens agree with
the path that dequantizes at load; the triton backend reads an FP8 KV cache as the torch backend
does. The kernels round differently from a dense matmul (fp32 accumulation over dequantized
tiles; TF32 on the dense side), so greedy tokens are compared where the dense path's own top-2
margin is decisive, and the chosen tokens' logprobs must agree closely."""

import pytest
import torch

from splitserve import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SP = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)


def prompts():
    g = torch.Generator().manual_seed(2)
    return [torch.randint(3, 384, (n,), generator=g).tolist() for n in (1, 9, 23, 50, 17, 70)]


def run(path, **kw):
    llm = LLM(str(path), device="cuda", dtype="float32", num_kv_blocks=128, max_num_seqs=8, max_num_batched_tokens=32,
              **kw)
    return llm, llm.generate(prompts(), SP)


def assert_agree(outs, ref, decisive=0.05, tol=0.02):
    """Where the reference's top-2 logprob gap at a step exceeds `decisive`, the same token; the
    chosen tokens' logprobs within `tol` up to the first divergence."""
    for o, r in zip(outs, ref):
        a, b = o.outputs[0], r.outputs[0]
        for i, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
            top = sorted((lp for _, lp in b.logprobs[i].top), reverse=True)
            if ta != tb:
                assert top[0] - top[1] < decisive, (i, ta, tb, top)
                break
            assert abs(a.logprobs[i].logprob - b.logprobs[i].logprob) < tol, (i, a.logprobs[i], b.logprobs[i])


@pytest.mark.parametrize("shape,fmt", [("llama", "ct_fp8"), ("deepseek_v3_yarn", "fp8"), ("qwen3", "awq"),
                                       ("qwen3", "gptq")])
def test_weights_kept_quantized_agree_with_dequantized(quantized_checkpoint, shape, fmt):
    path, _ = quantized_checkpoint(shape, fmt, block=(8, 16))
    ref_llm, ref = run(path, quantized_weights="dequantize", attention_backend="triton")
    llm, outs = run(path, attention_backend="triton")  # auto: kept on CUDA
    assert "held quantized" in llm.engine.memory.held, llm.engine.memory
    assert llm.engine.memory.weights_bytes < ref_llm.engine.memory.weights_bytes
    runner = llm.engine.runner
    if shape != "deepseek_v3_yarn":  # a mixture of experts is not captured (engine.py)
        assert runner.graphs is not None and runner.graphs.replays > 0
    assert_agree(outs, ref)


@pytest.mark.parametrize("shape", ["qwen3", "llama"])
def test_triton_reads_an_fp8_kv_cache_as_torch_does(tiny_checkpoint, shape):
    _, ref = run(tiny_checkpoint(shape), kv_cache_dtype="fp8", attention_backend="torch")
    llm, outs = run(tiny_checkpoint(shape), kv_cache_dtype="fp8", attention_backend="triton")
    assert llm.engine.kv.dtype_name == "fp8_e4m3" and llm.engine.runner.graphs.replays > 0
    assert_agree(outs, ref)
