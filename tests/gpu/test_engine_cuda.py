"""On a CUDA machine only (skipped elsewhere): the engine with the triton backend, its decode
steps replayed from real CUDA graphs and fused RMSNorm/rotary, gives the torch backend's greedy
tokens on the tiny models."""

import pytest
import torch

from splitserve import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("shape", ["qwen3", "qwen2", "mistral"])
def test_triton_with_cuda_graphs_equals_torch(tiny_checkpoint, shape):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (1, 9, 23, 50, 17, 70)]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def run(backend):
        llm = LLM(str(tiny_checkpoint(shape)), attention_backend=backend, device="cuda", dtype="float32",
                  num_kv_blocks=128, max_num_seqs=8, max_num_batched_tokens=32)
        outs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp)]
        return outs, llm.engine.runner

    ref, _ = run("torch")
    outs, runner = run("triton")
    assert runner.graphs is not None and runner.graphs.replays > 0 and runner.model.fused
    assert outs == ref
