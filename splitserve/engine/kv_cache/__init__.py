from splitserve.engine.kv_cache.block_pool import (
    BlockPool,
    BlockRemoved,
    BlockStored,
    KVEvent,
    OutOfBlocks,
    PrefixMatch,
)
from splitserve.engine.kv_cache.host_tier import HostTier
from splitserve.engine.kv_cache.tensors import KVCacheTensors

__all__ = ["BlockPool", "BlockRemoved", "BlockStored", "HostTier", "KVEvent", "OutOfBlocks", "PrefixMatch",
           "KVCacheTensors"]
