"""Lightning integration: the ranking LightningModule and `KVCacheCallback`."""

from gr_plugin.lightning.callback import KVCacheCallback
from gr_plugin.lightning.module import HSTURankingModule

__all__ = ["HSTURankingModule", "KVCacheCallback"]
