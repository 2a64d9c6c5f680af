"""An engine's KV layout and model fingerprint, as a transport endpoint advertises them: two
workers exchange KV only if every field matches (same model weights, dtype, block geometry)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from splitserve.engine.engine import Engine
from splitserve.kv_transfer.base import KVLayout


def model_fingerprint(model_dir: str | Path, dtype: str) -> str:
    d = Path(model_dir)
    h = hashlib.sha256((d / "config.json").read_bytes())
    for f in sorted(d.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    h.update(dtype.encode())
    return h.hexdigest()[:32]


def layout_of(engine: Engine) -> KVLayout:
    s = engine.kv.storage
    dtype = str(s.dtype).removeprefix("torch.")
    return KVLayout(num_layers=s.shape[0], num_blocks=s.shape[2], block_size=s.shape[3], num_kv_heads=s.shape[4],
                    head_dim=s.shape[5], dtype=dtype, element_size=s.element_size(),
                    model_fingerprint=model_fingerprint(engine.config.model, dtype))
