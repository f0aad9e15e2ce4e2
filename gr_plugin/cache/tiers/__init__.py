"""Page stores below the pinned host tier: local SSD slabs and a shared Redis/Valkey server.

Each store keeps the `PageStore` contract (`types`): whole pages keyed by `PageKey`, batched
``put_many`` / ``get_many`` / ``match``, verified reads, thread safety, and no exception for I/O or
network failures (but `PageStoreUnavailable` from a remote ``match`` or ``get_many`` asked with
``strict=True``).
`TierConfig` describes the tiers in FlexKV's terms. This package does not move pages between the
device, the host tier and these stores; the tiered backend does. ``redis`` is imported only when a
`RedisPageStore` is built; names load on first use (`flexkv_config` imports no torch, so Hydra
plugins can use it cheaply).
"""

from __future__ import annotations

from gr_plugin._lazy import lazy_exports

_EXPORTS = {
    "TierConfig": "flexkv_config",
    "load_tier_config": "flexkv_config",
    "tier_config_to_yaml": "flexkv_config",
    "RedisPageStore": "remote",
    "SSDPageStore": "ssd",
    "PageKey": "types",
    "PageStore": "types",
    "PageStoreUnavailable": "types",
    "aligned_empty": "types",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS, globals())
