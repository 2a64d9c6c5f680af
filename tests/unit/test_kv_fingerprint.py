"""The KV transfer fingerprint covers the weights' content: workers of two fine-tunes never
exchange KV."""


def test_the_kv_fingerprint_tells_fine_tunes_apart(tmp_path, tiny_checkpoint):
    """Two checkpoints of one architecture with files of equal names and sizes but other weights
    (a fine-tune) get different fingerprints, so their workers never exchange KV; a copy gets
    the same one; so does a file too big to read whole, through its samples."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from splitserve.kv_transfer.layout import SAMPLES, _content_digest, model_fingerprint

    src = tiny_checkpoint("llama")
    copy, tuned = tmp_path / "copy", tmp_path / "tuned"
    shutil.copytree(src, copy)
    shutil.copytree(src, tuned)
    for f in tuned.glob("*.safetensors"):
        w = load_file(f)
        name = sorted(w)[len(w) // 2]
        w[name] = w[name] + 0.01 * torch.ones_like(w[name])
        save_file(w, f, metadata={"format": "pt"})
        assert f.stat().st_size == (src / f.name).stat().st_size  # names and sizes equal
    fp = model_fingerprint(src, "float32")
    assert model_fingerprint(copy, "float32") == fp and model_fingerprint(src, "bfloat16") != fp
    assert model_fingerprint(tuned, "float32") != fp
    f = next(tuned.glob("*.safetensors"))
    size = f.stat().st_size
    small = max(1, size // (4 * SAMPLES))
    sampled = _content_digest(str(f), size, 0, SAMPLES * small, small)
    assert sampled == _content_digest(str(f), size, 1, SAMPLES * small, small) != _content_digest(str(f), size, 0)
    assert sampled != _content_digest(str(next(copy.glob("*.safetensors"))), size, 0, SAMPLES * small, small)
