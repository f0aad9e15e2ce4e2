"""Page stores below the pinned host tier: local SSD slabs and a shared Redis/Valkey server.

Each store keeps the `PageStore` contract (`types`): whole pages keyed by `PageKey`, batched
``put_many`` / ``get_many`` / ``match``, verified reads, thread safety, and no exception for I/O or
network failures. `TierConfig` describes the tiers in FlexKV's terms. This package does not move
pages between the device, the host tier and these stores; the tiered backend does. ``redis`` is
imported only when a `RedisPageStore` is built.
"""

from gr_plugin.cache.tiers.flexkv_config import TierConfig, load_tier_config, tier_config_to_yaml
from gr_plugin.cache.tiers.remote import RedisPageStore
from gr_plugin.cache.tiers.ssd import SSDPageStore
from gr_plugin.cache.tiers.types import PageKey, PageStore

__all__ = [
    "PageKey",
    "PageStore",
    "RedisPageStore",
    "SSDPageStore",
    "TierConfig",
    "load_tier_config",
    "tier_config_to_yaml",
]
