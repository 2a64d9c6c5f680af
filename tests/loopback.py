"""Loopback addresses of this test process's own. The suite runs in two pytest-xdist workers,
each with its own local Ray cluster: each worker's nodes live on a /24 of their own (127.0.N.x,
N its worker number), so two workers' clusters never meet."""

from __future__ import annotations

import os


def net() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")  # gw0, gw1, ...; unset without xdist
    return int(worker[2:]) if worker[2:].isdigit() else 0


def ip(host: int) -> str:
    return f"127.0.{net()}.{host}"
