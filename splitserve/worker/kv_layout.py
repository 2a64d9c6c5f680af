"""An engine's KV layout and model fingerprint, as a transport endpoint advertises them: two
workers exchange KV only if every field matches (same model weights, dtype, block geometry).

The fingerprint covers the weights' content, not their files' names and sizes (two fine-tunes of
one architecture have equal names and sizes, and their KV must never mix): each safetensors
file's header (every tensor's name, dtype, shape and offsets) and its data, all of it up to
`FULL_BYTES`, past that `SAMPLES` evenly spaced stretches of `SAMPLE_BYTES` (a fine-tune changes
nearly every weight, so any stretch tells two apart). Computed once per file and process.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

from splitserve.engine.engine import Engine
from splitserve.kv_transfer.base import KVLayout


FULL_BYTES = 64 << 20
SAMPLES = 64
SAMPLE_BYTES = 1 << 20


def model_fingerprint(model_dir: str | Path, dtype: str) -> str:
    d = Path(model_dir)
    h = hashlib.sha256((d / "config.json").read_bytes())
    for f in sorted(d.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:".encode() + _content_digest(str(f), st.st_size, st.st_mtime_ns))
    h.update(dtype.encode())
    return h.hexdigest()[:32]


@functools.lru_cache(maxsize=256)
def _content_digest(path: str, size: int, mtime_ns: int, full_bytes: int = FULL_BYTES,
                    sample_bytes: int = SAMPLE_BYTES) -> bytes:
    """A digest of a safetensors file's header and (sampled) data; size and mtime key the cache.
    (`full_bytes` >= SAMPLES * `sample_bytes`: the samples fit in a file too big to read whole.)"""
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        h.update(f.read(min(n, size)))  # the header: names, dtypes, shapes, offsets
        if size <= full_bytes:
            for chunk in iter(lambda: f.read(8 << 20), b""):
                h.update(chunk)
        else:
            step = (size - sample_bytes) // (SAMPLES - 1)
            for i in range(SAMPLES):
                h.update(os.pread(f.fileno(), sample_bytes, i * step))
    return h.digest()


def layout_of(engine: Engine) -> KVLayout:
    s = engine.kv.storage
    dtype = engine.kv.dtype_name
    return KVLayout(num_layers=s.shape[0], num_blocks=s.shape[2], block_size=s.shape[3], num_kv_heads=s.shape[4],
                    head_dim=s.shape[5], dtype=dtype, element_size=s.element_size(),
                    model_fingerprint=_fingerprint(engine, dtype))


def _fingerprint(engine: Engine, dtype: str) -> str:
    """The model's; with an EAGLE head's KV in the cache (speculative draft_path), the head's too:
    two pools with different heads have equal geometry, and their draft layers must not mix."""
    fp = model_fingerprint(engine.config.model, dtype)
    spec = engine.config.speculative
    if spec is None or spec.method != "draft" or spec.draft_path is None:
        return fp
    return hashlib.sha256((fp + model_fingerprint(spec.draft_path, dtype)).encode()).hexdigest()[:32]
