"""The KV cache: the block pool and prefix cache (pure Python), the host-memory tier below it and
the cache tensors (both torch: imported when first asked for, so the simulator's import path
has no torch)."""

from splitserve.engine.kv_cache.block_pool import (
    BlockPool,
    BlockRemoved,
    BlockStored,
    KVEvent,
    OutOfBlocks,
    PrefixMatch,
)


def __getattr__(name: str):
    if name == "HostTier":
        from splitserve.engine.kv_cache.host_tier import HostTier

        return HostTier
    if name == "KVCacheTensors":
        from splitserve.engine.kv_cache.tensors import KVCacheTensors

        return KVCacheTensors
    raise AttributeError(name)


__all__ = ["BlockPool", "BlockRemoved", "BlockStored", "HostTier", "KVEvent", "OutOfBlocks", "PrefixMatch",
           "KVCacheTensors"]
