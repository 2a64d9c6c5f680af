"""Bad configuration and bad sampling parameters fail at construction, with a message that
names the field and what would be accepted."""

import dataclasses
import json
import math
import shutil

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.config import EngineConfig
from splitserve.engine.model.config import ModelConfig
from splitserve.types import ConfigError


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=math.nan), "temperature"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=math.inf), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-5), "max_tokens"),
    (dict(n=0), "n"),
    (dict(logprobs=21), "logprobs"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(temperature="hot"), "temperature"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_normalise():
    sp = SamplingParams(stop="###", top_k=-1)
    assert sp.stop == ("###",) and sp.top_k == 0
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_size=0), "block_size"),
    (dict(block_size=24), "power of two"),
    (dict(max_num_seqs=-1), "max_num_seqs"),
    (dict(num_kv_blocks=True), "num_kv_blocks"),
    (dict(kv_cache_memory_gib=0), "kv_cache_memory_gib"),
    (dict(device="tpu"), "device"),
])
def test_bad_engine_config(tiny_checkpoint, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(model=str(tiny_checkpoint("llama")), **kwargs)


def test_missing_model_and_unknown_keys(tiny_checkpoint, tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        EngineConfig(model=str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="unknown engine config keys"):
        LLM(str(tiny_checkpoint("llama")), max_batch=3)
    with pytest.raises(ValueError, match="known: auto"):
        LLM(str(tiny_checkpoint("llama")), attention_backend="flash-magic", num_kv_blocks=8)
    with pytest.raises(ConfigError, match="dtype"):
        LLM(str(tiny_checkpoint("llama")), dtype="int3", num_kv_blocks=8)
    with pytest.raises(ConfigError, match="context length"):
        LLM(str(tiny_checkpoint("llama")), max_model_len=10**6, num_kv_blocks=8)


def test_unsupported_architecture_names_the_supported(tiny_checkpoint, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_checkpoint("llama"), d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match="LlamaForCausalLM.*Qwen3ForCausalLM"):
        ModelConfig.from_dir(d)


def test_yaml_config(tiny_checkpoint, tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(f"engine:\n  model: {tiny_checkpoint('llama')}\n  block_size: 32\n")
    assert EngineConfig.from_yaml(p).block_size == 32
    p.write_text(f"engine:\n  model: {tiny_checkpoint('llama')}\n  blok_size: 32\n")
    with pytest.raises(ConfigError, match="blok_size"):
        EngineConfig.from_yaml(p)


def test_gpu_memory_utilization(tiny_checkpoint):
    """The KV budget on a GPU: what is left of the share after what is in use, less headroom."""
    from splitserve.engine.engine import kv_budget_bytes

    gib = 1 << 30
    assert kv_budget_bytes(total=80 * gib, free=64 * gib, utilization=0.9) == int(72 * gib) - 16 * gib - gib
    with pytest.raises(ConfigError, match="leaves no room for a KV cache: 60.0 GiB of 80.0 GiB"):
        kv_budget_bytes(total=80 * gib, free=20 * gib, utilization=0.5)
    for bad in (0, 1.5, True, "0.9"):
        with pytest.raises(ConfigError, match="gpu_memory_utilization must be in"):
            EngineConfig(model=str(tiny_checkpoint("llama")), gpu_memory_utilization=bad)
    # on a CPU it is not consulted: kv_cache_memory_gib sizes the cache
    llm = LLM(str(tiny_checkpoint("llama")), device="cpu", gpu_memory_utilization=0.9, kv_cache_memory_gib=0.001)
    assert llm.engine.pool.num_blocks * llm.engine.kv.bytes_per_block(2, 16, 2, 8, torch.float32) <= 0.001 * gib


@pytest.mark.parametrize("checkpoint, amx, want", [
    ("float32", True, torch.float32),  # full precision asked for: the same tokens on any CPU
    ("float32", False, torch.float32),
    ("bfloat16", True, torch.bfloat16),  # a half checkpoint: bf16 where AMX makes it pay
    ("bfloat16", False, torch.float32),
    (None, True, torch.bfloat16),
])
def test_auto_dtype_on_a_cpu(tiny_checkpoint, monkeypatch, checkpoint, amx, want):
    from splitserve.engine.model import loader

    monkeypatch.setattr(loader, "cpu_has_amx", lambda: amx)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = dataclasses.replace(ModelConfig.from_dir(tiny_checkpoint("llama")), torch_dtype=checkpoint)
    assert loader.resolve_dtype("auto", cfg) is want
    assert loader.resolve_dtype("float16", cfg) is torch.float16  # a named dtype is never second-guessed
