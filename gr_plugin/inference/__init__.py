"""Serving-side glue: request batches -> KJTs and cache keys, and the scored step lifecycle."""

from gr_plugin.inference.engine import PreparedStep, RankingEngine, StepResult
from gr_plugin.inference.inputs import batch_cache_keys, batch_to_kjts, host_batch

__all__ = ["PreparedStep", "RankingEngine", "StepResult", "batch_cache_keys", "batch_to_kjts", "host_batch"]
