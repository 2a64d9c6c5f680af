"""The reference side of results/int4_vs_gptqmodel.json: transformers + gptqmodel's greedy tokens for an AWQ or
GPTQ checkpoint (from tests/quantized_models.py) and its dequantized weights. It needs a venv of its own
(gptqmodel 7.7 wants torch>=2.14.1): torch 2.14.1, transformers 5.25, accelerate, optimum, gptqmodel 7.7.0.

    /tmp/venv-gptq/bin/python benchmarks/int4_vs_gptqmodel.py CKPT_DIR PROMPTS.json OUT.json [float32|bfloat16]

PROMPTS.json: a list of token-id lists. Compare OUT.json's tokens with splitserve's, and its weights
(HF names, [out, in]) with splitserve.engine.model.loader.load_model's."""
import json, sys, torch
from transformers import AutoModelForCausalLM

ckpt, prompts, out, dtype = sys.argv[1], json.load(open(sys.argv[2])), sys.argv[3], (sys.argv[4:] or ["float32"])[0]
m = AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, dtype), device_map="cpu").eval()
q = {n: mod for n, mod in m.named_modules() if hasattr(mod, "qweight")}
print("QuantLinear:", {type(mod).__name__ for mod in q.values()})
weights = {n + ".weight": mod.dequantize_weight().t().float().tolist() for n, mod in q.items()}  # before a bf16 forward repacks
with torch.no_grad():
    tokens = [m.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), do_sample=False,
                         max_new_tokens=12, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
json.dump({"kernel": sorted({type(mod).__name__ for mod in q.values()}), "tokens": tokens, "weights": weights}, open(out, "w"))
