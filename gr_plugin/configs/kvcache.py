"""Schema of the ``kvcache`` config group (``+kvcache=none|gpu|native|flexkv``).

Owns `KVCacheOptions` and its registration as ``kvcache/base_kvcache`` in Hydra's ConfigStore;
every option's YAML (packaged in ``gr_plugin/conf/kvcache``) starts from it, so a typo such as
``kvcache.page_sise=64`` is rejected. Imports no torch.
"""

from __future__ import annotations

import dataclasses

from hydra.core.config_store import ConfigStore

BACKENDS = ("none", "gpu", "native", "flexkv")


@dataclasses.dataclass
class KVCacheOptions:
    """``backend``: ``none`` (recompute everything: the oracle), ``gpu`` (device pages),
    ``native`` (device pages + pinned host tier), ``flexkv`` (device + host + SSD + remote tiers).
    ``num_pages`` device pages of ``page_size`` tokens; ``host_cache_gb`` of host memory;
    ``dtype`` null = the model's dtype; ``namespace`` salts identities (model name/version)."""

    backend: str = "native"
    page_size: int = 32
    num_pages: int = 4096
    host_cache_gb: float = 1.0
    dtype: str | None = None
    namespace: str = "gr_plugin"
    write_through: bool = True


def register() -> None:
    ConfigStore.instance().store(group="kvcache", name="base_kvcache", node=KVCacheOptions)


register()
