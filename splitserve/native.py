"""Build and load splitserve's small C sources (the engine's CPU kernels, the chained block
hash) with the system compiler.

Plain C with OpenMP, no torch headers (called through ctypes): a build takes about a second and
needs only `cc` (and Python's own headers for a source that builds Python objects itself, loaded
with the GIL held: `load(src, python=True)`). The shared object is cached per source, compiler
and CPU (it is built with -march=native), written
atomically so that concurrent first uses cannot see half a file. Where no compiler works the
loader returns None and callers use their Python / PyTorch path instead. Imports neither torch
nor Ray (the router loads the hash through it).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sysconfig
import tempfile
import threading
from pathlib import Path

from splitserve.config import default_cache_dir

log = logging.getLogger(__name__)
# -fno-math-errno lets `omp simd` loops call glibc's vector expf (libmvec).
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC", "-std=c11"]
_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def _cpu_id() -> str:
    try:
        return next((ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")), "")
    except OSError:
        return ""


def load(src: Path, python: bool = False) -> ctypes.CDLL | None:
    """The compiled C file `src`, or None when it cannot be built here. `python`: the source
    includes Python.h and its functions are called with the GIL held (ctypes.PyDLL)."""
    with _lock:
        if str(src) not in _loaded:
            _loaded[str(src)] = _build_and_load(src, python)
        return _loaded[str(src)]


def python_function(src: Path, name: str, argtypes: list, restype=ctypes.py_object):
    """Function `name` of the C file `src` built against Python.h (`load(src, python=True)`),
    typed; None when it cannot be built here."""
    lib = load(src, python=True)
    if lib is None:
        return None
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = argtypes, restype
    return fn


def _build_and_load(src: Path, python: bool) -> ctypes.CDLL | None:
    if os.environ.get("SPLITSERVE_NO_NATIVE"):
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler found: native CPU kernels disabled, using the PyTorch path")
        return None
    name = src.stem
    flags = _FLAGS + ([f"-I{sysconfig.get_paths()['include']}"] if python else [])
    key = hashlib.sha256(src.read_bytes() + cc.encode() + " ".join(flags).encode() + _cpu_id().encode())
    out = default_cache_dir() / "kernels" / f"{name}-{key.hexdigest()[:16]}.so"
    if not out.exists():
        try:
            _compile(cc, flags, src, out)
        except (OSError, subprocess.CalledProcessError) as e:
            log.warning("building native code %s failed, using the Python / PyTorch path: %s", name, e)
            return None
    return (ctypes.PyDLL if python else ctypes.CDLL)(str(out))


def _compile(cc: str, flags: list[str], src: Path, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        subprocess.run([cc, *flags, str(src), "-o", tmp, "-lm"], check=True, capture_output=True, timeout=120)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
