"""torchrec-style modules: the HSTU ranking model and the KV cache as an ``nn.Module``."""

from gr_plugin.modules.hstu import HSTUConfig, HSTURanker
from gr_plugin.modules.kv_cache import KVCacheModule
from gr_plugin.modules.tokens import TokenLayout, cache_token_keys

__all__ = ["HSTUConfig", "HSTURanker", "KVCacheModule", "TokenLayout", "cache_token_keys"]
