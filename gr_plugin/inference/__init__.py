"""Serving-side glue: request batches -> KJTs and cache keys, and the scored step lifecycle."""

from gr_plugin.inference.engine import RankingEngine, StepResult
from gr_plugin.inference.inputs import batch_cache_keys, batch_to_kjts, host_batch

__all__ = ["RankingEngine", "StepResult", "batch_cache_keys", "batch_to_kjts", "host_batch"]
