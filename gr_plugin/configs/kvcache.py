"""Schema of the ``kvcache`` config group (``+kvcache=none|gpu|native|flexkv``).

Owns `KVCacheOptions` and its registration as ``gr_plugin_schema/kvcache`` in Hydra's ConfigStore;
every option's YAML (packaged in ``gr_plugin/conf/kvcache``) starts from it
(``- /gr_plugin_schema/kvcache@_here_``), so a typo such as ``kvcache.page_sise=64`` is rejected. It
lives outside the ``kvcache`` group, so Hydra never offers it as a ``kvcache`` option. Imports no torch.
"""

from __future__ import annotations

import dataclasses

from hydra.core.config_store import ConfigStore

from gr_plugin.cache.tiers.flexkv_config import TierConfig

BACKENDS = ("none", "gpu", "native", "flexkv")


@dataclasses.dataclass
class KVCacheOptions:
    """``backend``: ``none`` (recompute everything: the oracle), ``gpu`` (device pages),
    ``native`` (device pages + pinned host tier), ``flexkv`` (device + host + SSD + remote tiers).
    ``num_pages`` device pages of ``page_size`` tokens; ``host_cache_gb`` of host memory;
    ``dtype`` null = the model's dtype; ``namespace`` salts identities (model name/version);
    ``cuda_graphs``: on CUDA, replay the steps as CUDA graphs per shape bucket: `KVCacheCallback`'s
    cached steps (the Lightning evaluation of ``recipes.train``) and both of ``recipes.infer``'s passes,
    cached and recomputed; the server reads its own ``cuda_graphs``.
    ``flexkv`` reads its tiers from ``tiers`` (FlexKV's keys: ``cpu_cache_gb`` replaces
    ``host_cache_gb``, ``ssd_cache_gb``, ``ssd_cache_dir``, ``enable_3rd_remote``, ...) or, when
    ``tier_config`` names one, from a FlexKV tier YAML file (the keys it names override ``tiers``'s, except
    those set on the command line: the command line wins, then the file, then the config group)."""

    backend: str = "native"
    page_size: int = 32
    num_pages: int = 4096
    host_cache_gb: float = 1.0
    dtype: str | None = None
    namespace: str = "gr_plugin"
    write_through: bool = True
    cuda_graphs: bool = True
    tiers: TierConfig = dataclasses.field(default_factory=TierConfig)
    tier_config: str | None = None


def register() -> None:
    ConfigStore.instance().store(group="gr_plugin_schema", name="kvcache", node=KVCacheOptions)


register()
