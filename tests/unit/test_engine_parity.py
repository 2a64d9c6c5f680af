"""Greedy tokens equal Hugging Face transformers', token for token, on every supported shape,
run as one batch: plain, with prefix-cache hits, with chunked prefill forced, with preemption
forced. A differing token is accepted only where the reference's top-2 logit margin is below
1e-4 (a genuine tie that float rounding may break either way)."""

import pytest
import torch
from greedy_parity import assert_greedy_equal, drained, hf_greedy, make_prompts  # noqa: F401  (re-exported)

from splitserve import LLM, SamplingParams

SHAPES = ["llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3",
          "qwen3_yarn", "deepseek_v3_yarn"]
MAX_NEW = 16


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    """shape -> (hf model, prompts, greedy continuations computed one prompt at a time)."""
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(shape):
        if shape not in cache:
            hf = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(shape), dtype=torch.float32).eval()
            prompts = make_prompts(seed=len(shape))
            cache[shape] = (hf, prompts, hf_greedy(hf, prompts, MAX_NEW))
        return cache[shape]

    return get


def run_and_compare(llm, reference, shape):
    hf, prompts, refs = reference(shape)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    assert len(outs) == len(prompts)
    for p, o, r in zip(prompts, outs, refs):
        assert_greedy_equal(hf, p, list(o.outputs[0].token_ids), r)
    return outs


@pytest.mark.parametrize("shape", SHAPES)
def test_plain_batch(tiny_checkpoint, reference, shape):
    llm = LLM(str(tiny_checkpoint(shape)), num_kv_blocks=256)
    outs = run_and_compare(llm, reference, shape)
    assert all(o.outputs[0].finish_reason in ("length", "stop") for o in outs)
    drained(llm)


@pytest.mark.parametrize("shape", SHAPES)
def test_prefix_cache_hits(tiny_checkpoint, reference, shape):
    llm = LLM(str(tiny_checkpoint(shape)), num_kv_blocks=256)
    run_and_compare(llm, reference, shape)  # fills the cache
    hits_before = llm.engine.stats().prefix_hit_tokens_total
    outs = run_and_compare(llm, reference, shape)  # every prompt >= 17 tokens now hits
    _, prompts, _ = reference(shape)
    for p, o in zip(prompts, outs):
        assert o.num_cached_tokens == ((len(p) - 1) // 16) * 16, (len(p), o.num_cached_tokens)
    assert llm.engine.stats().prefix_hit_tokens_total > hits_before
    drained(llm)


@pytest.mark.parametrize("shape", SHAPES)
def test_chunked_prefill(tiny_checkpoint, reference, shape):
    llm = LLM(str(tiny_checkpoint(shape)), num_kv_blocks=256, max_num_batched_tokens=24)
    run_and_compare(llm, reference, shape)
    drained(llm)


@pytest.mark.parametrize("shape", SHAPES)
def test_preemption(tiny_checkpoint, reference, shape):
    llm = LLM(str(tiny_checkpoint(shape)), num_kv_blocks=24, max_num_batched_tokens=64)
    run_and_compare(llm, reference, shape)
    assert llm.engine.stats().num_preempted_total > 0, "the pool was meant to be too small for the batch"
    drained(llm)
