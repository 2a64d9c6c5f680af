import os

import torch

# Without a GPU the Triton kernels run under the interpreter; it must be chosen before triton
# decorates them (this conftest loads before any module of this directory).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
