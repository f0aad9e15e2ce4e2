"""Result types of the manager's verbs: what a lookup found and what a step was given.

Owns `LookupResult` (per user, per tier: how many history tokens are reusable) and `BatchPlan`
(pages of one step, its metadata and its onboard copy). Both are plain data; only
`KVCacheManager` creates and changes them (a plan's pages are held by the C++ core under
``plan_id`` until commit or abort).
"""

from __future__ import annotations

import dataclasses

import torch

from gr_plugin.cache.metadata import PagedBatchMetadata
from gr_plugin.cache.request import CacheRequest
from gr_plugin.cache.transfer import CopyHandle

Key = tuple[str, int]


@dataclasses.dataclass
class LookupResult:
    """What the cache holds for each user of a request (``[B]`` lists, in batch order).

    ``device_tokens[b]``: history tokens reusable from device pages. ``tier_tokens[t][b]``: tokens
    reusable when tier ``t``'s pages are onboarded too (at least ``device_tokens[b]``).
    ``cached_tokens[b]``: the best of all tiers, what `allocate` will reuse.
    """

    request: CacheRequest
    namespace: str
    keys: list[Key]
    device_tokens: list[int]
    tier_tokens: dict[str, list[int]]
    cached_tokens: list[int]
    # tier pages held (tier name -> [B]) and state versions seen, for allocate's revalidation
    tier_pages: dict[str, list[int]]
    versions: list[tuple[int, int]]
    # a lower-tier read launched by this lookup (allocate waits for it)
    prefetch_task: int | None = None
    # the manager's `rebind` count when looked up (allocate looks up again after a rebind)
    epoch: int = 0

    @property
    def hit_rate(self) -> float:
        total = sum(self.request.history_lengths)
        return sum(self.cached_tokens) / total if total else 0.0


@dataclasses.dataclass
class BatchPlan:
    """One step's pages: valid until `commit` or `abort`.

    ``metadata`` is what kernels read; ``cached_lengths[b]`` tokens of user ``b`` are reused
    (``device_tokens`` from device pages, ``onboard_tokens`` copied up from the host tier by
    `onboard_launch`); ``new_lengths[b]`` tokens must be computed and appended.
    """

    plan_id: int
    request: CacheRequest
    keys: list[Key]
    metadata: PagedBatchMetadata
    device_tokens: list[int]
    onboard_tokens: list[int]
    cached_lengths: list[int]
    new_lengths: list[int]
    # the metadata buffer on the host (the core's kv_indices and kv_indptr name each user's
    # pages; CUDA-graph steps pack their inputs from it); internals (manager only): whole device
    # pages kept per user, onboard sources
    host_metadata: torch.Tensor
    keep_pages: list[int]
    onboard_src: list[tuple[int, int, torch.Tensor]]  # (batch index, first page, host slots)
    onboard_handle: CopyHandle | None = None
    state: str = "allocated"
    # the layers whose new K/V a forward pass has written (`KVCacheModule.forward`; a graph replay,
    # `RankingEngine.forward`): `KVCacheCallback` commits a step only when every layer is here
    appended_layers: set[int] = dataclasses.field(default_factory=set)
    # of ``onboard_tokens``, how many this step's own lower-tier read brought into the host tier, per tier
    lower_tier_tokens: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return len(self.keys)

    @property
    def num_onboard_pages(self) -> int:
        return sum(s.numel() for _, _, s in self.onboard_src)
