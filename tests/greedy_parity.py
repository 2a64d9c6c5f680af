"""Greedy parity against Hugging Face: the prompts, the reference continuations, and the tie rule
(a differing token is accepted only where the reference's own top-2 logit margin is below 1e-4,
a genuine tie that float rounding may break either way)."""

from __future__ import annotations

import torch

TIE_MARGIN = 1e-4


def make_prompts(seed: int, vocab: int = 384, lengths=(1, 2, 7, 15, 16, 17, 31, 33, 48, 64, 80, 97, 5, 23, 50, 70)
                 ) -> list[list[int]]:
    """A third of the prompts share a 40-token prefix (prefix-cache hits on a second pass)."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, vocab, (40,), generator=g).tolist()
    prompts = []
    for i, n in enumerate(lengths):
        tail = torch.randint(3, vocab, (n,), generator=g).tolist()
        prompts.append(prefix + tail if i % 3 == 0 else tail)
    return prompts


def hf_greedy(hf, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """The reference's greedy continuations, one prompt at a time."""
    refs = []
    for p in prompts:
        ids = torch.tensor([p])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
                          pad_token_id=0)
        refs.append(out[0, len(p):].tolist())
    return refs


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


def drained(llm) -> None:
    """Nothing left running or held; the pool's blocks all free or cached."""
    eng = llm.engine
    eng.check_invariants()
    assert not eng.has_unfinished()
    assert eng.pool.num_in_use == 0
    assert eng.pool.num_free + eng.pool.num_cached == eng.pool.num_blocks
