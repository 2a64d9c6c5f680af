"""bf16 greedy tokens against the fp32 truth (Hugging Face transformers in fp32), on every
supported shape, as one batch: the CPU engine's bf16 path (native paged decode over a bf16
cache, the fused native residual + RMSNorm and rotary kernels). Each prompt is compared up to its
first differing token; there, the token we chose must be a near-tie of the reference's at bf16
precision: its fp32 logit below the top one by no more than twice what bf16 moves a logit in
that very context (Hugging Face's own bf16 forward against its fp32 one, largest |difference|
over the vocabulary). How many prompts differ is printed for the record, with Hugging Face's
own bf16 run beside it (the same rule)."""

import pytest
import torch

from splitserve import LLM, SamplingParams

from tests.tiny_models import SHAPES as CONFIGS
from tests.unit.test_engine_parity import MAX_NEW, SHAPES, reference  # noqa: F401  (a fixture)

# Dense shapes only. A mixture of experts routes each token to its top-k experts, a discrete
# choice: where two experts' router scores are within bf16's rounding, the expert taken — and so
# the logits — differ by far more than bf16 moves a logit, so this rule does not apply (measured:
# one qwen3_moe prompt of 16 differs by a margin of 4.2 against a tie of 0.21, with the fused
# kernels and without). Mixtures of experts are held to Hugging Face in fp32 (test_engine_parity).
DENSE = [s for s in SHAPES if not any(k in CONFIGS[s] for k in ("num_local_experts", "num_experts", "n_routed_experts"))]


def first_difference(hf32, hf16, prompt, ours, ref):
    """None where ours == ref; else (position, fp32 margin of ref's token over ours, the tie:
    twice bf16's largest logit error in that context)."""
    if ours == ref:
        return None
    i = next((k for k, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
    if i >= min(len(ours), len(ref)):  # one stopped early (EOS): judged at the shorter one's end
        return i, 0.0, 0.0
    ctx = torch.tensor([prompt + ref[:i]])
    with torch.no_grad():
        l32 = hf32(ctx).logits[0, -1].float()
        l16 = hf16(ctx).logits[0, -1].float()
    return i, float(l32[ref[i]] - l32[ours[i]]), 2 * float((l16 - l32).abs().max())


def hf_greedy(hf, prompt):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
                          pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("shape", DENSE)
def test_bf16_greedy_is_fp32_up_to_bf16_near_ties(tiny_checkpoint, reference, shape, capsys):
    from transformers import AutoModelForCausalLM

    hf32, prompts, refs = reference(shape)
    path = str(tiny_checkpoint(shape))
    llm = LLM(path, dtype="bfloat16", num_kv_blocks=256)
    assert llm.engine.runner.model.fused, "the bf16 CPU path runs the fused native kernels"
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    hf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ours = [first_difference(hf32, hf16, p, list(o.outputs[0].token_ids), r) for p, o, r in zip(prompts, outs, refs)]
    for d in filter(None, ours):
        i, margin, tie = d
        assert margin <= tie, f"{shape}: token {i} differs from fp32's by a margin {margin:.3g} above bf16's tie {tie:.3g}"
    theirs = [first_difference(hf32, hf16, p, hf_greedy(hf16, p), r) for p, r in zip(prompts, refs)]
    with capsys.disabled():
        print(f"\n[bf16 parity] {shape}: splitserve bf16 differs from fp32 on {sum(map(bool, ours))} of "
              f"{len(prompts)} prompts (each a near-tie), Hugging Face bf16 on {sum(map(bool, theirs))}; "
              f"worst margin/tie {max((d[1] / d[2] for d in ours if d and d[2]), default=0):.2f} vs "
              f"{max((d[1] / d[2] for d in theirs if d and d[2]), default=0):.2f}")
    llm.engine.check_invariants()


