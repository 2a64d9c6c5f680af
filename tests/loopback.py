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


def free_port() -> int:
    """A port nothing listens on, for a server a test starts seconds later (a Serve proxy, a Ray
    head). Not one the kernel hands out for port 0: the other worker's Ray processes bind those
    all the time and took one in that gap (CI: the Serve proxy failed to start). So: a random port
    of this worker's own slice of 20000..31999, below the ephemeral range and above Ray's worker
    ports (10002..19999), free now."""
    import random
    import socket

    base = 20000 + net() % 2 * 6000
    for _ in range(200):
        port = random.randrange(base, base + 6000)
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {base}..{base + 5999}")
