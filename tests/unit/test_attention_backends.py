"""Attention backends: the `triton` backend (our kernels; the Triton interpreter on CPU) gives
the engine the same greedy tokens as the `torch` reference backend on tiny models — GQA 1 / 2 /
4, prefix-cache hits, chunked prefill, decodes and prefills in one batch — with a 16-bit KV cache
and with the FP8 one, and backend choice explains itself when a backend cannot run."""

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.attention import get_backend
from splitserve.types import ConfigError

pytest.importorskip("triton")

# head_dim / GQA ratio: llama 8 / 4 (head_dim padded inside the kernels), qwen3 32 / 4 (q/k norm),
# qwen2 16 / 2 (biases), mistral 16 / 1
SHAPES = ["llama", "qwen3", "qwen2", "mistral"]


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 384, (40,), generator=g).tolist()
    tails = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (1, 9, 23, 50, 17)]
    return [prefix + t if i % 2 == 0 else t for i, t in enumerate(tails)]  # some share a 40-token prefix


def _greedy(ckpt, backend: str, prompts, **kw) -> list[list[int]]:
    if backend == "torch":
        kw.setdefault("fused_kernels", False)  # the reference: torch ops only, on a GPU too
    llm = LLM(str(ckpt), attention_backend=backend, num_kv_blocks=64, dtype="float32", **kw)
    assert llm.engine.runner.backend.name == backend
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp)]
    again = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp)]  # prefix-cache hits now
    assert again == first
    assert llm.engine.stats().prefix_hit_tokens_total > 0
    llm.engine.check_invariants()
    assert llm.engine.pool.num_in_use == 0
    return first


@pytest.mark.parametrize("shape", SHAPES)
def test_triton_greedy_equals_torch(tiny_checkpoint, shape):
    prompts = _prompts(seed=len(shape))
    # a 24-token budget splits the long prompts into chunks that follow cached context, and
    # mixes decodes with prefill chunks in one step
    ref = _greedy(tiny_checkpoint(shape), "torch", prompts, max_num_batched_tokens=24)
    assert _greedy(tiny_checkpoint(shape), "triton", prompts, max_num_batched_tokens=24) == ref


def test_backend_choice_says_why(tiny_checkpoint, monkeypatch):
    cpu = torch.device("cpu")
    assert get_backend("auto", torch.float32, cpu).name in ("cpu", "torch")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # (read per call, so this holds on a GPU box too)
    assert get_backend("triton", torch.float32, cpu, head_dim=32).name == "triton"
    with pytest.raises(ConfigError, match="head_dim up to 256, the model has 320"):
        get_backend("triton", torch.float32, cpu, head_dim=320)
    with pytest.raises(ConfigError, match="flash-attn runs only on CUDA"):
        get_backend("flash_attn", torch.bfloat16, cpu)
    assert get_backend("triton", torch.bfloat16, cpu, head_dim=40, fp8_kv=True).name == "triton"
    with pytest.raises(ConfigError, match="'flash_attn' cannot run here: it does not read an FP8 KV cache: "
                                          "flash-attn 2 takes fp16/bf16 K/V only"):
        get_backend("flash_attn", torch.bfloat16, cpu, block_size=256, fp8_kv=True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # an A100
    with pytest.raises(ConfigError, match="e4m3 in hardware, from compute capability 8.9 .*this GPU is 8.0"):
        get_backend("triton", torch.bfloat16, torch.device("cuda"), fp8_kv=True)
    assert get_backend("auto", torch.bfloat16, torch.device("cuda"), fp8_kv=True).name == "torch"
    with pytest.raises(ConfigError, match="known: auto, torch, cpu, triton, flash_attn"):
        get_backend("flash-magic")
    with pytest.raises(ConfigError, match="'flash_attn' cannot run here"):
        LLM(str(tiny_checkpoint("llama")), attention_backend="flash_attn", device="cpu", num_kv_blocks=8)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ConfigError, match="runs on CUDA; on cpu only under the Triton interpreter"):
        get_backend("triton", torch.float32, cpu)


def test_decode_graphs_replay_equals_eager(tiny_checkpoint):
    """Decode steps replayed through captured graphs (here `eager_capture`: the CPU stand-in
    for a CUDA graph, same static buffers, bucketing and padding) give the torch backend's
    tokens; steps of more sequences than the largest bucket, and prefill steps, run eagerly."""
    from splitserve.engine.decode_graphs import default_buckets, eager_capture

    assert default_buckets(256)[:6] == (1, 2, 4, 8, 16, 24) and default_buckets(256)[-2:] == (224, 256)
    assert default_buckets(5) == (1, 2, 4, 5) and default_buckets(100)[-2:] == (96, 100)
    prompts = _prompts(seed=7)
    ref = _greedy(tiny_checkpoint("qwen3"), "torch", prompts)
    llm = LLM(str(tiny_checkpoint("qwen3")), attention_backend="triton", num_kv_blocks=64, dtype="float32")
    runner = llm.engine.runner
    runner.capture_decode_graphs(max_batch=4, max_model_len=llm.engine.max_model_len, capture=eager_capture)
    assert runner.graphs.buckets == (1, 2, 4)
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    # 5 sequences decode eagerly (over the largest bucket); 3 replay bucket 4 with a padding row
    outs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp)]
    subset = [list(o.outputs[0].token_ids) for o in llm.generate(prompts[:3], sp)]
    assert outs == ref and subset == ref[:3]
    assert runner.graphs.replays >= 5
    llm.engine.check_invariants()
    with pytest.raises(ValueError, match="need the triton attention backend"):
        LLM(str(tiny_checkpoint("qwen3")), attention_backend="torch", num_kv_blocks=8).engine.runner \
            .capture_decode_graphs(4, 64, eager_capture)


@pytest.mark.parametrize("shape", ["qwen2", "qwen3"])
def test_fused_norm_and_rotary_give_the_same_tokens(tiny_checkpoint, shape):
    """The model with residual + RMSNorm and rotary through the Triton kernels (what the
    engine uses on CUDA) gives the torch model's greedy tokens (q/k norm: qwen3; biases, tied
    embeddings: qwen2), and the same hidden states up to fp32 rounding noise."""
    prompts = _prompts(seed=11)
    ref = _greedy(tiny_checkpoint(shape), "torch", prompts)
    llm = LLM(str(tiny_checkpoint(shape)), attention_backend="torch", num_kv_blocks=64, dtype="float32",
              fused_kernels=False)
    model = llm.engine.runner.model
    assert not model.fused
    dev = llm.engine.device
    ids = torch.tensor(prompts[3][:20], device=dev)
    pos = torch.arange(20, device=dev)
    backend = llm.engine.runner.backend

    def hidden():
        from splitserve.engine.attention import AttentionBatch, SeqSlice

        batch = AttentionBatch(20, torch.arange(20, device=dev), (), (SeqSlice(0, 20, 20, (0, 1)),), 16)
        with torch.inference_mode():
            return model(ids, pos, llm.engine.kv.layers, backend, backend.prepare(batch))

    plain = hidden()
    model.use_triton_kernels()
    fused = hidden()
    assert (fused - plain).abs().max().item() < 1e-4 * plain.abs().max().item()
    model.use_triton_kernels(False)
    assert not model.fused and torch.equal(hidden(), plain)  # back to the torch ops exactly
    model.use_triton_kernels()
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp)] == ref


def test_flash_attn_backend_calls_the_varlen_api_as_documented(tiny_checkpoint, monkeypatch):
    """flash-attn is not installed here (CUDA only): a stand-in `flash_attn_varlen_func` with
    the documented semantics (paged K/V through `block_table`, per-sequence lengths from
    cu_seqlens, causal aligned bottom-right) computed by the torch reference checks that the
    backend's arguments describe the batch — decodes and chunks after cached prefixes — by
    giving the torch backend's tokens."""
    import sys
    import types

    from splitserve.engine.attention.paged_backends import FlashAttnBackend
    from splitserve.engine.kernels.triton_attention import paged_attention_prefill_reference

    calls = []

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False, block_table=None):
        lens_q, lens_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
        assert causal and block_table is not None and block_table.dtype == torch.int32
        assert int(lens_q.max()) <= max_q and int(lens_k.max()) <= max_k and int(cu_q[-1]) == q.shape[0]
        calls.append(int((lens_q == 1).sum()))
        return paged_attention_prefill_reference(q, k, v, block_table, cu_q, lens_k, softmax_scale)

    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=varlen))
    prompts = _prompts(seed=13)
    ref = _greedy(tiny_checkpoint("qwen3"), "torch", prompts, max_num_batched_tokens=24)
    llm = LLM(str(tiny_checkpoint("qwen3")), attention_backend="torch", num_kv_blocks=64, dtype="float32",
              max_num_batched_tokens=24)
    llm.engine.runner.backend = FlashAttnBackend(torch.float32, torch.device("cpu"))
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp)] == ref
    assert calls and max(calls) > 0  # decode rows went through it too



@pytest.mark.parametrize("shape", ["qwen3", "deepseek_v3"])
def test_triton_reads_the_fp8_cache_as_torch_does(tiny_checkpoint, shape):
    """kv_cache_dtype fp8: the triton backend (its store kernel encoding the rows, its attention
    kernels upcasting them in registers) gives the torch backend's greedy tokens — GQA with
    head_dim 32 (qwen3), MLA's one latent KV head of head_dim 40 (deepseek_v3) — over chunked
    prefill after cached context, decodes beside prefill chunks, and prefix hits on a second pass.
    Three prompts and four tokens: the interpreter is slow, the kernels' own tests sweep shapes."""
    g = torch.Generator().manual_seed(17)
    prefix = torch.randint(3, 384, (40,), generator=g).tolist()
    prompts = [prefix + [5, 6, 7], torch.randint(3, 384, (9,), generator=g).tolist(),
               prefix + torch.randint(3, 384, (20,), generator=g).tolist()]
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    got = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(tiny_checkpoint(shape)), attention_backend=backend, num_kv_blocks=64, dtype="float32",
                  kv_cache_dtype="fp8", max_num_batched_tokens=24, fused_kernels=False)
        assert llm.engine.runner.backend.name == backend and llm.engine.kv.fp8
        got[backend] = [[list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp)] for _ in range(2)]
        assert llm.engine.stats().prefix_hit_tokens_total > 0
        llm.engine.check_invariants()
        assert llm.engine.pool.num_in_use == 0
    assert got["triton"] == got["torch"] and got["torch"][0] == got["torch"][1]
