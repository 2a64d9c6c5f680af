import os
import sys
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels run under the interpreter; it must be chosen before triton
# is first imported (this conftest loads before any test module).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import build_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(shape) -> directory of a random-init HF checkpoint, built once per run."""
    built: dict[str, Path] = {}

    def get(shape: str) -> Path:
        if shape not in built:
            built[shape] = build_checkpoint(shape, tmp_path_factory.mktemp(shape))
        return built[shape]

    return get
