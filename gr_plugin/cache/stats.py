"""Counters of a cache manager: what was reused, computed, moved and evicted.

Owns `KVCacheStats`, a plain dataclass of monotonically increasing counters (plus a few gauges
filled in by `KVCacheManager.stats()`); it computes nothing but ratios.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class KVCacheStats:
    lookups: int = 0
    lookup_users: int = 0
    plans: int = 0
    commits: int = 0
    aborts: int = 0
    alloc_failures: int = 0
    tokens_requested: int = 0
    tokens_reused_device: int = 0
    tokens_reused_host: int = 0  # onboarded from the host tier, including the two below
    tokens_reused_ssd: int = 0  # read from the SSD into the host tier by the same step
    tokens_reused_remote: int = 0  # read from the remote store into the host tier by the same step
    tokens_computed: int = 0
    pages_allocated: int = 0
    evicted_users: int = 0
    evicted_pages: int = 0
    onboard_pages: int = 0
    onboard_bytes: int = 0
    offload_pages: int = 0
    offload_bytes: int = 0
    offload_skipped: int = 0
    offload_failed: int = 0
    host_blocking_waits: int = 0

    @property
    def tokens_reused(self) -> int:
        return self.tokens_reused_device + self.tokens_reused_host

    @property
    def hit_rate(self) -> float:
        """Fraction of requested history tokens that were not recomputed."""
        return self.tokens_reused / self.tokens_requested if self.tokens_requested else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["tokens_reused"] = self.tokens_reused
        out["hit_rate"] = self.hit_rate
        return out
