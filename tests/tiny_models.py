"""Tiny random-init Hugging Face checkpoints, built deterministically on the spot (no hub).

Each shape exercises what its family adds: Llama (GQA, llama3 rope scaling, sharded
safetensors), Qwen2 (q/k/v bias, tied embeddings), Qwen3 (q/k RMSNorm, explicit head_dim),
Mistral, the mixtures of experts Mixtral, Qwen2-MoE (shared expert, a dense layer) and
Qwen3-MoE, and DeepSeek-V3 (latent attention, grouped sigmoid routing); yarn and dynamic NTK
rope scaling on Qwen3, DeepSeek-V3 and Llama. Weights are drawn with a larger spread than HF's
default init so that greedy choices are decisive rather than near-ties between almost uniform
logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    "Paris is the capital of France; Berlin is the capital of Germany; Rome of Italy.",
    "def add(a, b):\n    return a + b  # numbers 0123456789 and symbols !@#$%^&*()",
    "Prefill and decode run on separate workers; the KV cache moves between them.",
    "In 2024 there were 365 + 1 days; naïve café résumé über straße 東京 😀.",
]

BASE = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, rms_norm_eps=1e-6,
            max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0)

SHAPES: dict[str, dict] = {
    "llama": dict(BASE, architectures=["LlamaForCausalLM"], model_type="llama", num_attention_heads=8,
                  num_key_value_heads=2, tie_word_embeddings=False, rope_theta=10000.0,
                  rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=128)),
    "qwen2": dict(BASE, architectures=["Qwen2ForCausalLM"], model_type="qwen2", num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1000000.0,
                  use_sliding_window=False, sliding_window=4096),
    "qwen3": dict(BASE, architectures=["Qwen3ForCausalLM"], model_type="qwen3", num_attention_heads=4,
                  num_key_value_heads=1, head_dim=32, tie_word_embeddings=False, rope_theta=1000000.0,
                  attention_bias=False),
    "mistral": dict(BASE, architectures=["MistralForCausalLM"], model_type="mistral", num_attention_heads=4,
                    num_key_value_heads=4, tie_word_embeddings=False, rope_theta=10000.0, sliding_window=None),
    # mixture-of-experts: 4 experts, top 2, renormalised
    "mixtral": dict(BASE, architectures=["MixtralForCausalLM"], model_type="mixtral", num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                    tie_word_embeddings=False, rope_theta=1000000.0, sliding_window=None),
    # a gated shared expert beside 4 routed ones (top 2, not renormalised); layer 1 stays dense
    "qwen2_moe": dict(BASE, architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", num_attention_heads=4,
                      num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64, norm_topk_prob=False, decoder_sparse_step=1,
                      mlp_only_layers=[1], tie_word_embeddings=False, rope_theta=1000000.0,
                      use_sliding_window=False, sliding_window=4096),
    # q/k norm, one KV head (replicated under tensor parallelism), 8 experts, top 2, renormalised
    "qwen3_moe": dict(BASE, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_attention_heads=4,
                      num_key_value_heads=1, head_dim=32, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                      tie_word_embeddings=False, rope_theta=1000000.0, attention_bias=False),
    # latent attention (q through a low-rank projection, interleaved rope) and DeepSeek's routing:
    # 8 experts in 2 groups, the best group's top 2, sigmoid scores with a correction bias, a
    # shared expert; layer 0 dense
    "deepseek_v3": dict(BASE, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
                        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                        num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=32,
                        n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                        norm_topk_prob=True, rope_interleave=True, tie_word_embeddings=False,
                        rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
}
# rope scaling: the prompts (up to ~150 positions) run past the original 64 positions
_YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)
SHAPES.update({
    # cos/sin times yarn's attention factor (0.1 ln 4 + 1)
    "qwen3_yarn": dict(SHAPES["qwen3"], rope_parameters=dict(_YARN, rope_theta=1000000.0)),
    # DeepSeek's mscale = mscale_all_dim: cos/sin unscaled, the softmax scale times mscale² instead
    "deepseek_v3_yarn": dict(SHAPES["deepseek_v3"],
                             rope_parameters=dict(_YARN, rope_theta=10000.0, mscale=1.0, mscale_all_dim=1.0)),
    # dynamic NTK past 64 positions (tests/unit/test_rope_scaling.py: what matches transformers)
    "llama_dynamic": dict(SHAPES["llama"], max_position_embeddings=64,
                          rope_scaling=dict(rope_type="dynamic", factor=4.0)),
})


def build_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE}))


def build_checkpoint(shape: str, out: Path, seed: int = 0, std: float = 0.3) -> Path:
    """Write a random-init checkpoint of `shape` to `out` and return it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    cfg_dict = dict(SHAPES[shape])
    config = AutoConfig.for_model(cfg_dict.pop("model_type"), **cfg_dict)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, std if p.dim() > 1 else 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek's router bias: make it matter
                b.copy_(0.2 * torch.randn_like(b))
    # Llama's checkpoint is sharded to exercise the index.
    model.save_pretrained(out, safe_serialization=True, max_shard_size="200KB" if shape == "llama" else "2GB")
    build_tokenizer(out, config.vocab_size)
    return out
