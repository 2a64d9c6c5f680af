"""Rotary scaling against transformers' own, bit for bit: the inverse frequencies of every rope
type (ROPE_INIT_FUNCTIONS), the attention factor cos and sin are multiplied by, the cos/sin rows
transformers' rotary class produces position by position, DeepSeek's softmax mscale, and
DeepSeek-V3's config.json as released. Dynamic NTK and longrope change their frequencies with
the sequence's length; on a tiny dynamic checkpoint, what a per-position table reproduces of
transformers' per-forward choice (layers.RotaryEmbedding's docstring): exact for a prompt within
the original length however far decoding runs past it, and for a prompt fed one token per
forward; the same tokens however the prompt is chunked."""

import copy
import dataclasses
import math

import pytest
import torch
from transformers import DeepseekV3Config, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, yarn_apply_mscale
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from splitserve import LLM, SamplingParams
from splitserve.engine.model.config import ModelConfig, RopeConfig
from splitserve.engine.model.layers import RotaryEmbedding, rope_inv_freq
from splitserve.engine.model.mla import MLAttention
from splitserve.types import ConfigError

HEAD_DIM = 64
SHORT = [1.0 + 0.05 * i for i in range(HEAD_DIM // 2)]
LONG = [1.0 + 0.9 * i for i in range(HEAD_DIM // 2)]

# name -> (config.json's rope entries, max_position_embeddings)
CASES = {
    "default": (dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0)), 256),
    "linear": (dict(rope_scaling=dict(type="linear", factor=2.0), rope_theta=10000.0), 256),
    "dynamic": (dict(rope_parameters=dict(rope_type="dynamic", factor=4.0, rope_theta=10000.0)), 96),
    "llama3": (dict(rope_parameters=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                         original_max_position_embeddings=64, rope_theta=500000.0)), 512),
    "yarn": (dict(rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64,
                                       rope_theta=1000000.0)), 256),
    # the pre-transformers-5 layout: `type`, rope_theta beside it
    "yarn_old_style": (dict(rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=64),
                            rope_theta=10000.0), 256),
    # DeepSeek-V2-Lite's: mscale = mscale_all_dim, cos/sin unscaled
    "yarn_mscale": (dict(rope_parameters=dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096,
                                              beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707,
                                              rope_theta=10000.0)), 163840),
    "yarn_mscale_unequal": (dict(rope_parameters=dict(rope_type="yarn", factor=16.0, original_max_position_embeddings=128,
                                                      mscale=1.0, mscale_all_dim=0.5, rope_theta=10000.0)), 2048),
    "yarn_explicit": (dict(rope_parameters=dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=256,
                                                attention_factor=0.9, beta_fast=16, beta_slow=2, truncate=False,
                                                rope_theta=50000.0)), 2048),
    # Phi-3's way: factor derived from the two lengths, long factors past the original length
    "longrope": (dict(rope_parameters=dict(rope_type="longrope", short_factor=SHORT, long_factor=LONG,
                                           original_max_position_embeddings=64, rope_theta=10000.0)), 256),
    "longrope_factor": (dict(rope_parameters=dict(rope_type="longrope", short_factor=SHORT, long_factor=LONG,
                                                  factor=8.0, attention_factor=1.2, original_max_position_embeddings=64,
                                                  rope_theta=10000.0)), 512),
}


def configs(name: str) -> tuple[LlamaConfig, RopeConfig]:
    """transformers' config and ours, from the same config.json."""
    rope, max_pos = CASES[name]
    raw = dict(architectures=["LlamaForCausalLM"], vocab_size=32, hidden_size=HEAD_DIM * 4, num_attention_heads=4,
               num_key_value_heads=1, num_hidden_layers=1, intermediate_size=64, max_position_embeddings=max_pos,
               **copy.deepcopy(rope))
    ours = ModelConfig.from_hf(copy.deepcopy(raw))
    assert ours.rope_dim == HEAD_DIM
    return LlamaConfig(**raw), ours.rope


def hf_row_by_row(cfg: LlamaConfig, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin for positions 0..n-1, each from its own forward in order (a sequence growing one
    token at a time), on a fresh rotary module."""
    rot = LlamaRotaryEmbedding(cfg)
    x = torch.zeros(1, 1, HEAD_DIM)
    rows = [rot(x, torch.tensor([[p]])) for p in range(n)]
    return torch.cat([c[0] for c, _ in rows]), torch.cat([s[0] for _, s in rows])


def ours_cos_sin(rope: RopeConfig, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    table = RotaryEmbedding(rope, HEAD_DIM, n)
    sin = table.sin.clone()
    sin[:, : HEAD_DIM // 2] = -sin[:, : HEAD_DIM // 2]  # stored with its first half negated
    return table.cos, sin


@pytest.mark.parametrize("name", CASES)
def test_inv_freq_and_attention_factor_are_transformers(name):
    hf_cfg, rope = configs(name)
    kind = hf_cfg.rope_parameters["rope_type"]
    init = LlamaRotaryEmbedding.compute_default_rope_parameters if kind == "default" else ROPE_INIT_FUNCTIONS[kind]
    hf_inv, hf_factor = init(hf_cfg, device=torch.device("cpu"))
    assert rope.scaling_type == kind
    assert torch.equal(rope_inv_freq(rope, HEAD_DIM), hf_inv)
    assert rope.attention_scaling == hf_factor
    # the factor latent attention's softmax would take (transformers applies it in MLA models)
    assert rope.softmax_scale(0.125) == yarn_apply_mscale(hf_cfg.rope_parameters, 0.125)


@pytest.mark.parametrize("name", CASES)
def test_cos_sin_rows_are_transformers_position_by_position(name):
    hf_cfg, rope = configs(name)
    n = min(hf_cfg.max_position_embeddings, 160) + 40  # past the original length: dynamic / longrope switch
    hf_cos, hf_sin = hf_row_by_row(hf_cfg, n)
    cos, sin = ours_cos_sin(rope, n)
    assert torch.equal(cos, hf_cos) and torch.equal(sin, hf_sin)


@pytest.mark.parametrize("name", ["dynamic", "longrope"])
def test_a_long_prompt_in_one_forward_is_where_transformers_differs(name):
    """transformers rotates a whole forward at its longest length: a prompt past the original
    length gets that length's frequencies for every token; the table, each position's own."""
    hf_cfg, rope = configs(name)
    n = rope.original_max_position_embeddings + 20
    hf_cos, hf_sin = LlamaRotaryEmbedding(hf_cfg)(torch.zeros(1, 1, HEAD_DIM), torch.arange(n)[None])
    cos, sin = ours_cos_sin(rope, n)
    assert torch.equal(cos[-1], hf_cos[0, -1]) and torch.equal(sin[-1], hf_sin[0, -1])  # the last position agrees
    assert not torch.equal(cos[1:-1], hf_cos[0, 1:-1])


# DeepSeek-V3's config.json as released (deepseek-ai/DeepSeek-V3; R1's differs in none of these)
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    },
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "pretraining_tp": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}


def test_deepseek_v3_config_as_released_parses():
    cfg = ModelConfig.from_hf(copy.deepcopy(DEEPSEEK_V3))
    assert cfg.architecture == "DeepseekV3ForCausalLM"
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.vocab_size) == (61, 7168, 128, 129280)
    assert cfg.max_position_embeddings == cfg.max_context == 163840  # 4096 × 40
    assert cfg.rope == RopeConfig(theta=10000.0, scaling_type="yarn", factor=40.0,
                                  original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                                  mscale=1.0, mscale_all_dim=1.0)
    assert cfg.rope.attention_scaling == 1.0  # mscale / mscale_all_dim
    assert cfg.mla == dataclasses.replace(cfg.mla, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                                          qk_rope_head_dim=64, v_head_dim=128, rope_interleave=True)
    assert (cfg.rope_dim, cfg.num_kv_heads, cfg.head_dim) == (64, 1, 576)
    moe = cfg.moe
    assert (moe.num_experts, moe.top_k, moe.n_group, moe.topk_group, moe.scoring) == (256, 8, 8, 4, "sigmoid")
    assert (moe.dense_layers, moe.routed_scaling_factor, moe.shared_expert_intermediate_size) == ((0, 1, 2), 2.5, 2048)
    assert cfg.eos_token_ids == (1,) and cfg.torch_dtype == "bfloat16"

    hf = DeepseekV3Config(**copy.deepcopy(DEEPSEEK_V3))
    hf_inv, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, torch.device("cpu"))
    assert torch.equal(rope_inv_freq(cfg.rope, cfg.rope_dim), hf_inv) and cfg.rope.attention_scaling == hf_factor
    with torch.device("meta"):  # the full-size layer, without its 600 MB of weights
        attn = MLAttention(cfg)
    want = yarn_apply_mscale(hf.rope_parameters, hf.qk_head_dim ** -0.5)
    assert attn.scale == want == 192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2 != 192 ** -0.5


def test_rope_config_is_frozen_and_validated():
    rope = RopeConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        rope.factor = 2.0  # type: ignore[misc]
    with pytest.raises(ConfigError, match="supported: default, linear, dynamic, yarn, longrope, llama3"):
        RopeConfig(scaling_type="su")
    with pytest.raises(ConfigError, match="short_factor and long_factor"):
        RopeConfig(scaling_type="longrope", short_factor=(1.0, 1.0), long_factor=(1.0,))
    raw = dict(architectures=["LlamaForCausalLM"], vocab_size=32, hidden_size=64, num_attention_heads=4,
               num_hidden_layers=1, intermediate_size=64)
    with pytest.raises(ConfigError, match="unsupported rope scaling type 'mrope'.*yarn"):
        ModelConfig.from_hf(dict(raw, rope_scaling=dict(type="mrope")))
    bad = ModelConfig.from_hf(dict(raw, rope_scaling=dict(type="longrope", short_factor=[1.0], long_factor=[2.0],
                                                          original_max_position_embeddings=64)))
    with pytest.raises(ConfigError, match="longrope factors have 1 entries"):
        RotaryEmbedding(bad.rope, bad.rope_dim, 8)


def test_scaled_context_length():
    def ctx(rope, max_pos=4096):
        raw = dict(architectures=["LlamaForCausalLM"], vocab_size=32, hidden_size=64, num_attention_heads=4,
                   num_hidden_layers=1, intermediate_size=64, max_position_embeddings=max_pos, rope_scaling=rope)
        return ModelConfig.from_hf(raw).max_context

    assert ctx(None) == 4096
    assert ctx(dict(type="dynamic", factor=2.0)) == 8192
    assert ctx(dict(type="linear", factor=4.0)) == 16384
    # Qwen3's recipe: yarn over the original 32768 positions, max_position_embeddings unchanged
    assert ctx(dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768), 40960) == 131072
    assert ctx(dict(rope_type="llama3", factor=8.0, original_max_position_embeddings=8192), 131072) == 131072


# --- a tiny dynamic-NTK Llama (tests/tiny_models.py "llama_dynamic": 64 positions, factor 4) ---

def _fresh(hf):
    """transformers' dynamic rotary keeps the frequencies of the longest forward so far: start
    each reference as a fresh model would."""
    rot = hf.model.rotary_emb
    rot.inv_freq = rot.original_inv_freq.clone()
    rot.max_seq_len_cached = rot.original_max_seq_len
    return hf


def _hf_generate(hf, prompt, n):
    ids = torch.tensor([prompt])
    out = _fresh(hf).generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                              pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _hf_one_token_per_forward(hf, prompt, n):
    _fresh(hf)
    cache, tokens, out = None, list(prompt), []
    with torch.no_grad():
        for i in range(len(prompt) + n - 1):
            step = hf(torch.tensor([[tokens[i]]]), cache=cache, use_cache=True)
            cache = step.cache
            if i >= len(prompt) - 1:  # the next token after the prompt's last, or a generated one
                out.append(int(step.logits[0, -1].argmax()))
                tokens.append(out[-1])
    return out


def test_dynamic_ntk_greedy_matches_transformers_where_a_table_can(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    path = str(tiny_checkpoint("llama_dynamic"))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(7)
    within = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (50, 63)]  # decode runs past 64
    beyond = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (70, 90)]
    new_within, new_beyond = 24, 6
    llm = LLM(path, num_kv_blocks=64)
    assert llm.engine.model_config.max_context == 256
    params = SamplingParams(temperature=0.0, max_tokens=new_within)
    for p, o in zip(within, llm.generate(within, params)):
        assert list(o.outputs[0].token_ids) == _hf_generate(hf, p, new_within)
    ours_beyond = [list(o.outputs[0].token_ids) for o in llm.generate(beyond, SamplingParams(temperature=0.0, max_tokens=new_beyond))]
    for p, ours in zip(beyond, ours_beyond):
        assert ours == _hf_one_token_per_forward(hf, p, new_beyond)
    # per position, not per step: the same tokens with the prompts chunked and batched otherwise
    chunked = LLM(path, num_kv_blocks=64, max_num_batched_tokens=24)
    again = chunked.generate(within + beyond, SamplingParams(temperature=0.0, max_tokens=new_beyond))
    assert [list(o.outputs[0].token_ids) for o in again[len(within):]] == ours_beyond
