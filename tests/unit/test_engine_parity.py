"""Greedy tokens equal Hugging Face transformers', token for token, on every supported shape,
run as one batch: plain, with prefix-cache hits, with chunked prefill forced, with preemption
forced. A differing token is accepted only where the reference's top-2 logit margin is below
1e-4 (a genuine tie that float rounding may break either way)."""

import pytest
import torch

from splitserve import LLM, SamplingParams

SHAPES = ["llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3",
          "qwen3_yarn", "deepseek_v3_yarn"]
MAX_NEW = 16
TIE_MARGIN = 1e-4


def make_prompts(seed: int, vocab: int = 384) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, vocab, (40,), generator=g).tolist()
    lengths = [1, 2, 7, 15, 16, 17, 31, 33, 48, 64, 80, 97, 5, 23, 50, 70]
    prompts = []
    for i, n in enumerate(lengths):
        tail = torch.randint(3, vocab, (n,), generator=g).tolist()
        prompts.append(prefix + tail if i % 3 == 0 else tail)  # a third share a 40-token prefix
    return prompts


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    """shape -> (hf model, prompts, greedy continuations computed one prompt at a time)."""
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(shape):
        if shape not in cache:
            hf = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(shape), dtype=torch.float32).eval()
            prompts = make_prompts(seed=len(shape))
            refs = []
            for p in prompts:
                ids = torch.tensor([p])
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=MAX_NEW, pad_token_id=0)
                refs.append(out[0, len(p):].tolist())
            cache[shape] = (hf, prompts, refs)
        return cache[shape]

    return get


def assert_greedy_equal(hf, prompt, ours, ref):
    if ours == ref:
        return
    i = next((k for k, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + ref[:i]])).logits[0, -1]
    top = logits.topk(2).values
    margin = float(top[0] - top[1])
    assert margin < TIE_MARGIN, (
        f"token {i} differs (ours {ours[i:i+3]}, reference {ref[i:i+3]}) and the reference's top-2 "
        f"margin there is {margin:.3g}, not a tie")


def run_and_compare(llm, reference, shape):
    hf, prompts, refs = reference(shape)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    assert len(outs) == len(prompts)
    for p, o, r in zip(prompts, outs, refs):
        assert_greedy_equal(hf, p, list(o.outputs[0].token_ids), r)
    return outs


def drained(llm):
    eng = llm.engine
    eng.check_invariants()
    assert not eng.has_unfinished()
    assert eng.pool.num_in_use == 0
    assert eng.pool.num_free + eng.pool.num_cached == eng.pool.num_blocks


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
