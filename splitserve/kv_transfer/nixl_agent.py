"""Starting a NIXL agent well: UCX transports chosen for the machine, the NIXL package imported
with an install hint when missing, and a progress thread that sleeps between rounds instead of
spinning a core. nixl.py is the transport itself.
"""

from __future__ import annotations

import os
import threading

INSTALL_HINT = "pip install 'splitserve[nixl]'  (or: pip install nixl)"

# Microseconds the NIXL progress thread sleeps between rounds; 0 = NIXL's own busy-spinning.
PROGRESS_DELAY_US = 100


def default_ucx_tls() -> None:
    """Choose UCX transports unless the user already has (UCX reads UCX_TLS when the agent's
    backend starts, so this must run before the agent is created).

    On a machine with neither RDMA devices nor CUDA, tcp+cma is the fastest path between two
    processes (CMA copies host memory directly; several GB/s here, plain TCP ~0.6) and spares
    UCX probing transports that cannot work. Where
    RDMA or CUDA exists we leave UCX to pick rc/dc/cuda_ipc: forcing tcp,cma there would turn
    the RDMA path DESIGN.md chose NIXL for into plain TCP.
    """
    if "UCX_TLS" in os.environ:
        return
    if _has_rdma_device() or _cuda_available():
        return
    os.environ["UCX_TLS"] = "tcp,cma"


def _has_rdma_device() -> bool:
    try:
        return bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        return False


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch is a hard dependency
        return False


def import_nixl():
    try:
        import nixl  # noqa: F401  (the meta package picks the nixl_cu12/cu13 backend wheel)
        from nixl import _api
    except ImportError as e:
        raise RuntimeError(f"the nixl KV transport needs the NIXL Python package ({e}); install it with: {INSTALL_HINT}") from e
    return _api


class _PacedBindings:
    """The NIXL bindings module, except that agents get a progress-thread delay.

    nixl_agent hard-codes pthrDelay=0, so its progress thread spins a whole core even when idle
    (measured ~0.9 core). Any delay > 0 lets it sleep (~0.02 core idle here). The thread itself
    is needed: a passive peer must progress UCX for connection wire-up and for TCP reads.
    """

    def __init__(self, real, delay_us: int) -> None:
        self._real, self._delay_us = real, delay_us

    def __getattr__(self, name):
        return getattr(self._real, name)

    def nixlAgent(self, name, config):  # noqa: N802 - mirrors the binding's name
        config.pthrDelay = self._delay_us
        return self._real.nixlAgent(name, config)


_AGENT_LOCK = threading.Lock()  # the bindings swap below is process-wide while an agent starts


def make_agent(api, name: str, config, progress_delay_us: int):
    if not config.enable_pthread or progress_delay_us <= 0:
        return api.nixl_agent(name, config)
    with _AGENT_LOCK:
        real = api.nixlBind
        api.nixlBind = _PacedBindings(real, progress_delay_us)
        try:
            return api.nixl_agent(name, config)
        finally:
            api.nixlBind = real
