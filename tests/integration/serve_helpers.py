"""What the Serve app tests share."""

from __future__ import annotations

import httpx


def sees_both_pools(url: str, timeout_s: float = 60.0) -> None:
    """Until the ingress's own view (its /metrics) holds the READY prefill and decode workers."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = httpx.get(url + "/metrics", timeout=5).text
        if all(f'splitserve_pool_size{{role="{r}"}} 1.0' in text for r in ("prefill", "decode")):
            return
        time.sleep(0.1)
    raise AssertionError("the ingress never saw both workers")
