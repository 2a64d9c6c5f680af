"""Which KV transport one (prefill, decode) pair uses (DESIGN.md §4 "KV transfer"): a placement
decision, so the router makes it, from where the two run and what each offers."""

from __future__ import annotations

from typing import Sequence

from splitserve.config import KV_TRANSPORTS


def choose_transport(same_node: bool, source: Sequence[str], reader: Sequence[str]) -> str:
    """Shared memory when both run on one node, else NIXL, else TCP. A pair that shares only one
    takes that one (a transport chosen by name)."""
    common = [t for t in source if t in reader]
    if len(common) == 1:
        return common[0]
    if same_node and "shm" in common:
        return "shm"
    for name in ("nixl", "tcp"):
        if name in common:
            return name
    raise ValueError(f"no KV transport in common: the source offers {list(source)}, the reader {list(reader)}; "
                     f"known: {', '.join(sorted(KV_TRANSPORTS))}")
