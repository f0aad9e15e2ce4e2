"""`RankingEngine`: one scored step, with or without the KV cache, as a server runs it.

Owns the step lifecycle around the model: validate the request on the host, begin a cache step
(lookup, allocate, onboard), run the cached forward, commit, or abort when anything fails; fall
back to the full pass when the batch does not fit in the cache. Used by ``recipes.infer`` and the
server; the Lightning callback runs the same lifecycle through Lightning's hooks.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from gr_plugin.data import RequestBatch
from gr_plugin.inference.inputs import batch_cache_keys, batch_to_kjts, host_batch
from gr_plugin.modules import HSTURanker, KVCacheModule

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class StepResult:
    """Logits ``[sum(C), num_tasks]`` (on the model's device) and what the cache did."""

    logits: torch.Tensor
    cached_tokens: int = 0
    onboarded_tokens: int = 0
    computed_tokens: int = 0
    fell_back: bool = False


class RankingEngine:
    def __init__(self, model: HSTURanker, cache: KVCacheModule | None = None,
                 device: torch.device | str | None = None, *, validate: bool = True, cuda_graphs: bool = False) -> None:
        self.model = model.eval()
        self.cache = cache
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.validate = validate
        self.graphs = None
        if cuda_graphs and cache is not None and self.device.type == "cuda":
            from gr_plugin.modules.graphs import CachedStackGraphs

            self.graphs = CachedStackGraphs(model, cache)

    @torch.no_grad()
    def score(self, batch: RequestBatch) -> StepResult:
        host = host_batch(batch)
        if self.validate:
            self.model.validate(*batch_to_kjts(host))
        total = int(host.history_lengths.sum())
        lookup = None
        if self.cache is not None:
            # NOTE: lookup first: lower-tier reads it starts overlap the transfer and KJT building.
            lookup = self.cache.lookup(host.user_ids.tolist(), host.history_lengths.tolist(), batch_cache_keys(host))
        dev = batch.to(self.device)
        history, candidates = batch_to_kjts(dev)
        cand = host.candidate_lengths
        sizes = (total + int(cand.sum()), int((host.history_lengths + cand).max()), int(cand.sum()))
        if self.cache is None:
            return StepResult(self.model(history, candidates, *sizes), computed_tokens=total)
        plan = self.cache.begin(lookup)
        if plan is None:
            logger.debug("batch of %d users does not fit in the cache; full pass", host.batch_size)
            return StepResult(self.model(history, candidates, *sizes), computed_tokens=total, fell_back=True)
        try:
            logits = self.model.forward_cached(history, candidates, self.cache, plan,
                                               num_candidates=int(cand.sum()), max_candidates=int(cand.max()),
                                               graphs=self.graphs)
        except BaseException:
            self.cache.abort(plan)
            raise
        self.cache.commit(plan)
        return StepResult(logits, cached_tokens=sum(plan.cached_lengths), onboarded_tokens=sum(plan.onboard_tokens),
                          computed_tokens=sum(plan.new_lengths))
