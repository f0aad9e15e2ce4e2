"""The paged KV-cache core: page pool, identity, LRU, host tier, lower tiers, transfers.

Imports only torch, the standard library and xxhash (and ``redis`` inside the remote store). Start
with `KVCacheManager`. Names are loaded on first use, so torch-free modules of this package (the
tier configuration) can be imported by Hydra plugins without importing torch.
"""

from __future__ import annotations

from gr_plugin._lazy import lazy_exports

_EXPORTS = {
    "KVBackend": "backend",
    "KVCacheConfig": "config",
    "HostTier": "host_tier",
    "KVCacheManager": "manager",
    "TierReadError": "backend",
    "UserInFlightError": "manager",
    "PagedBatchMetadata": "metadata",
    "build_metadata": "metadata",
    "BatchPlan": "plan",
    "LookupResult": "plan",
    "CacheRequest": "request",
    "KVCacheStats": "stats",
    "TieredBackend": "tiered",
    "CopyHandle": "transfer",
    "TransferError": "transfer",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS, globals())
