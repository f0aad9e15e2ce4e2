"""The paged KV-cache core: page pool, identity, LRU, host tier, lower tiers, transfers.

Imports only torch, the standard library and xxhash (and ``redis`` inside the remote store). Start
with `KVCacheManager`. Names are loaded on first use, so torch-free modules of this package (the
tier configuration) can be imported by Hydra plugins without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "KVBackend": "backend",
    "KVCacheConfig": "config",
    "HostTier": "host_tier",
    "KVCacheManager": "manager",
    "TierReadError": "manager",
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


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
