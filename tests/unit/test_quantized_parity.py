"""Quantized checkpoints as released: greedy tokens equal Hugging Face's on tiny checkpoints in
each format — DeepSeek-V3 with yarn rope and FP8 128x128-style block scales (8x8 here, the tiny
shapes' size; under TP 2 too),
a Llama in compressed-tensors FP8 (per-channel), a Qwen3 in AWQ int4 and in GPTQ int4 (act-order)
— plain, with prefix hits, chunked and preempted; and the dequantized weights are the stored
values times their scales, not the float weights they were made from."""

import pytest
import torch
from greedy_parity import assert_greedy_equal, drained, hf_greedy, make_prompts

from splitserve import LLM, SamplingParams
from splitserve.engine.model.config import ModelConfig
from splitserve.types import ConfigError

CASES = [("deepseek_v3_yarn", "fp8"), ("llama", "ct_fp8"), ("qwen3", "awq"), ("qwen3", "gptq")]
MAX_NEW = 12
LENGTHS = (1, 7, 17, 33, 64, 97, 23, 50)


@pytest.fixture(scope="module")
def reference(quantized_checkpoint):
    """(shape, fmt) -> (checkpoint, hf model, prompts, reference continuations)."""
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(case):
        if case not in cache:
            ours, ref_dir = quantized_checkpoint(*case)
            hf = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
            prompts = make_prompts(seed=len(case[1]), lengths=LENGTHS)
            cache[case] = (ours, hf, prompts, hf_greedy(hf, prompts, MAX_NEW))
        return cache[case]

    return get


def run_and_compare(reference, case, **engine):
    ours, hf, prompts, refs = reference(case)
    llm = LLM(str(ours), num_kv_blocks=engine.pop("num_kv_blocks", 256), **engine)
    for _ in range(2 if engine.get("enable_prefix_caching", True) else 1):
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
        for p, o, r in zip(prompts, outs, refs):
            assert_greedy_equal(hf, p, list(o.outputs[0].token_ids), r)
    return llm


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_plain_and_prefix_hits(reference, case):
    llm = run_and_compare(reference, case)  # the second pass hits the prompts' cached blocks
    assert llm.engine.stats().prefix_hit_tokens_total > 0
    assert llm.engine.model_config.quant is not None
    drained(llm)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_chunked_and_preempted(reference, case):
    llm = run_and_compare(reference, case, num_kv_blocks=12, max_num_batched_tokens=24, enable_prefix_caching=False)
    assert llm.engine.stats().num_preempted_total > 0, "the pool was meant to be too small for the batch"
    drained(llm)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_weights_are_the_stored_values_not_the_floats_they_came_from(tiny_checkpoint, quantized_checkpoint, case):
    """Our dequantized weights equal the reference's to the last bit, and differ from the float
    checkpoint the quantized one was made from (the quantization error is really there)."""
    from splitserve.engine.model.loader import load_model

    shape, fmt = case
    ours_dir, ref_dir = quantized_checkpoint(shape, fmt)
    mc, plain = ModelConfig.from_dir(ours_dir), ModelConfig.from_dir(tiny_checkpoint(shape))
    ours = dict(load_model(ours_dir, mc, torch.float32, 64).named_parameters())
    ref = dict(load_model(ref_dir, ModelConfig.from_dir(ref_dir), torch.float32, 64).named_parameters())
    orig = dict(load_model(tiny_checkpoint(shape), plain, torch.float32, 64).named_parameters())
    name = "layers.1.self_attn.o_proj.weight"
    assert torch.equal(ours[name], ref[name])
    assert not torch.equal(ours[name], orig[name])
    assert all(torch.equal(ours[k], ref[k]) for k in ours)


def test_a_format_we_do_not_serve_is_refused_by_name(tiny_checkpoint):
    import json

    cfg = json.loads((tiny_checkpoint("qwen3") / "config.json").read_text())
    for q, words in [({"quant_method": "bitsandbytes"}, "unsupported quantization method 'bitsandbytes'"),
                     ({"quant_method": "awq", "version": "gemv"}, "unsupported awq version 'gemv'"),
                     ({"quant_method": "gptq", "bits": 3}, "unsupported gptq width 3 bits"),
                     ({"quant_method": "fp8", "fmt": "e3m4"}, "unsupported fp8 format 'e3m4'"),
                     ({"quant_method": "compressed-tensors", "format": "pack-quantized"},
                      "unsupported compressed-tensors format 'pack-quantized'")]:
        with pytest.raises(ConfigError, match=words):
            ModelConfig.from_hf(dict(cfg, quantization_config=q))


def test_fp8_deepseek_under_tensor_parallelism(reference):
    """The FP8 DeepSeek-V3 at TP 2: each rank dequantizes the whole tensor and keeps its heads
    (MLA under TP) and experts; prefix hits on the second pass."""
    case = ("deepseek_v3_yarn", "fp8")
    ours, hf, prompts, refs = reference(case)
    with LLM(str(ours), num_kv_blocks=96, max_num_batched_tokens=64, tensor_parallel_size=2) as llm:
        assert llm.engine.runner.model.cfg.num_heads == 2
        for _ in range(2):
            outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
            for p, o, r in zip(prompts, outs, refs):
                assert_greedy_equal(hf, p, list(o.outputs[0].token_ids), r)
        assert llm.engine.stats().prefix_hit_tokens_total > 0
        drained(llm)


def test_start_up_says_what_memory_the_engine_holds(quantized_checkpoint, caplog):
    """Weights as held (dequantized) next to what the checkpoint stored, the KV cache and the
    tokens it holds, an activation estimate — logged once at start for sizing pools."""
    import logging

    ours, _ = quantized_checkpoint("deepseek_v3_yarn", "fp8")
    with caplog.at_level(logging.INFO, logger="splitserve.engine.engine"):
        llm = LLM(str(ours), num_kv_blocks=32, dtype="float32")
    m = llm.engine.memory
    params = sum(p.numel() * 4 for p in llm.engine.runner.model.parameters())
    assert m.weights_bytes >= params and m.weights_dtype == "float32"
    assert m.stored_bytes < m.weights_bytes / 2  # FP8 bytes + block scales vs fp32
    assert m.kv_tokens == 32 * 16 and m.kv_bytes == llm.engine.kv.storage.numel() * 4
    assert m.activation_bytes > 0 and "fp8" in m.stored_format
    assert any("KV cache" in r.getMessage() and "512 tokens" in r.getMessage() for r in caplog.records)


def test_a_multi_token_prediction_layer_is_skipped_and_a_stray_layer_is_not(quantized_checkpoint, tmp_path):
    """DeepSeek-V3 as released carries its MTP module as layer num_hidden_layers (with
    num_nextn_predict_layers: 1): loaded past, not refused; a layer nothing declares still is."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from splitserve.engine.model.loader import load_model

    src, _ = quantized_checkpoint("deepseek_v3_yarn", "fp8")
    out = tmp_path / "mtp"
    shutil.copytree(src, out)
    weights = load_file(str(out / "model.safetensors"))
    n = json.loads((out / "config.json").read_text())["num_hidden_layers"]
    extra = {k.replace("model.layers.1.", f"model.layers.{n}."): v.clone() for k, v in weights.items()
             if k.startswith("model.layers.1.")}
    save_file({**weights, **extra}, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(cfg, num_nextn_predict_layers=0)))
    with pytest.raises(ConfigError, match=f"checkpoint tensor 'model.layers.{n}."):
        load_model(out, ModelConfig.from_dir(out), torch.float32, 64)
    (out / "config.json").write_text(json.dumps(dict(cfg, num_nextn_predict_layers=1)))
    mc = ModelConfig.from_dir(out)
    assert mc.extra_layers == 1 and mc.num_layers == n
    ours = dict(load_model(out, mc, torch.float32, 64).named_parameters())
    ref = dict(load_model(src, ModelConfig.from_dir(src), torch.float32, 64).named_parameters())
    assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ours)
