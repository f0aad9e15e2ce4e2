"""The paged KV-cache core: page pool, identity, LRU, host tier, transfers.

Imports only torch, the standard library and xxhash. Start with `KVCacheManager`.
"""

from gr_plugin.cache.backend import KVBackend
from gr_plugin.cache.config import KVCacheConfig
from gr_plugin.cache.host_tier import HostTier
from gr_plugin.cache.manager import KVCacheManager, UserInFlightError
from gr_plugin.cache.metadata import PagedBatchMetadata, build_metadata
from gr_plugin.cache.plan import BatchPlan, LookupResult
from gr_plugin.cache.request import CacheRequest
from gr_plugin.cache.stats import KVCacheStats
from gr_plugin.cache.transfer import CopyHandle, TransferError

__all__ = [
    "BatchPlan",
    "CacheRequest",
    "CopyHandle",
    "HostTier",
    "KVBackend",
    "KVCacheConfig",
    "KVCacheManager",
    "KVCacheStats",
    "LookupResult",
    "PagedBatchMetadata",
    "TransferError",
    "UserInFlightError",
    "build_metadata",
]
