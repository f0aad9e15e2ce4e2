"""`RankingEngine`: one scored step, with or without the KV cache, as a server runs it.

Owns the step lifecycle around the model: validate the request on the host, begin a cache step
(lookup, allocate, onboard), run the cached forward, commit, or abort when anything fails; fall
back to the full pass when the batch does not fit in the cache. Used by ``recipes.infer`` and the
server; the Lightning callback runs the same lifecycle through Lightning's hooks.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gr_plugin.cache import BatchPlan
from gr_plugin.data import RequestBatch
from gr_plugin.inference.inputs import batch_cache_keys, batch_to_kjts, host_batch
from gr_plugin.modules import HSTURanker, KVCacheModule
from gr_plugin.modules.tokens import TokenLayout, host_token_layout, keys_fit

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class StepResult:
    """Logits ``[sum(C), num_tasks]`` (on the model's device) and what the cache did."""

    logits: torch.Tensor
    cached_tokens: int = 0
    onboarded_tokens: int = 0
    computed_tokens: int = 0
    fell_back: bool = False


@dataclasses.dataclass
class PreparedStep:
    """A step after `RankingEngine.prepare`: the batch's host copy, the token layout (on the device;
    on the host when the engine replays CUDA graphs of that step, which pack it themselves),
    and the cache's plan (None: a full pass; ``fell_back`` when the cache could not fit the batch).
    ``history``/``candidates``: the batch's KJTs on the host, built on first use (a graph replay
    never needs them)."""

    batch: RequestBatch
    layout: TokenLayout
    plan: BatchPlan | None
    total: int
    fell_back: bool = False

    @functools.cached_property
    def _kjts(self) -> tuple[KeyedJaggedTensor, KeyedJaggedTensor]:
        return batch_to_kjts(self.batch)

    @property
    def history(self) -> KeyedJaggedTensor:
        return self._kjts[0]

    @property
    def candidates(self) -> KeyedJaggedTensor:
        return self._kjts[1]


class RankingEngine:
    def __init__(self, model: HSTURanker, cache: KVCacheModule | None = None,
                 device: torch.device | str | None = None, *, validate: bool = True, cuda_graphs: bool = False) -> None:
        self.model = model.eval()
        self.cache = cache
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.validate = validate
        c = model.config
        # NOTE: ids validated against the model's tables already fit the cache key's bit fields.
        self._keys_checked = validate and keys_fit(c.num_items, c.num_actions, c.num_time_buckets)
        self.graphs = None  # the cached steps' graphs
        self.full_graphs = None  # the full passes' graphs (an engine without a cache)
        if cuda_graphs and self.device.type == "cuda":
            if cache is not None:
                from gr_plugin.modules.graphs import CachedStackGraphs

                graphs = CachedStackGraphs(model, cache)
                self.graphs = graphs if graphs.supported(self.device) else None
            else:
                from gr_plugin.modules.full_graphs import FullStackGraphs

                full = FullStackGraphs(model)
                self.full_graphs = full if full.supported(self.device) else None

    @torch.no_grad()
    def score(self, batch: RequestBatch) -> StepResult:
        """One step: `prepare` on the host, then `run` on the device."""
        return self.run(self.prepare(batch))

    def prepare(self, batch: RequestBatch) -> PreparedStep:
        """The host half of a step: validate, cache lookup + begin (pages, onboarding launched), and
        the token layout, built on the host and moved in one copy. The caller must `run` (or
        `discard`) the result: it may hold an in-flight cache step."""
        # NOTE: everything up to the layers runs on the host copy: the token layout is built there
        # (small int tensors) and reaches the device in one pinned, non-blocking copy, so a step
        # neither moves the whole history to the device nor waits on it. The checks, the cache keys
        # and the layout read the batch's columns as they are (on the host: the checks and the
        # layout in one C++ pass each once the cache has loaded its core, else numpy; the keys in
        # numpy): no KJT, no concatenated copy of the history.
        host = host_batch(batch)
        columns = (host.history_items, host.history_ratings, host.history_time_buckets)
        if self.validate:
            self.model.validate_ids(host.history_lengths, columns, host.candidate_lengths, host.candidate_items)
        history_lengths, cand = host.history_lengths.tolist(), host.candidate_lengths.tolist()
        total, max_cand = sum(history_lengths), max(cand)
        max_positions = self.model.config.max_positions
        plan = None
        if self.cache is not None:
            keys = batch_cache_keys(host, check=not self._keys_checked)
            plan = self.cache.begin(self.cache.lookup(host.user_ids.tolist(), history_lengths, keys))
        if plan is None:
            if self.cache is not None:
                logger.debug("batch of %d users does not fit in the cache; full pass", host.batch_size)
            layout = host_token_layout(host.history_lengths, columns, host.candidate_lengths, host.candidate_items,
                                       None, max_positions, max(h + c for h, c in zip(history_lengths, cand)))
            if self.full_graphs is None:  # (the graphs pack the host layout themselves)
                layout = layout.to(self.device)
            return PreparedStep(host, layout, None, total, fell_back=self.cache is not None)
        try:
            meta = plan.metadata
            cached = torch.tensor(plan.cached_lengths, dtype=torch.int64)
            layout = host_token_layout(host.history_lengths, columns, host.candidate_lengths, host.candidate_items,
                                       cached, max_positions, meta.max_new_len + max_cand)
            if self.graphs is None:  # the eager step reads both on the device: both copies go now
                layout = layout.to(self.device)
                meta.start_copy()
        except BaseException:
            self.cache.abort(plan)
            raise
        return PreparedStep(host, layout, plan, total)

    @torch.no_grad()
    def run(self, step: PreparedStep) -> StepResult:
        """The device half: the layers (cached or full, `forward`), then commit (abort on any error)."""
        logits = self.forward(step)
        plan = step.plan
        if plan is None:
            return StepResult(logits, computed_tokens=step.total, fell_back=step.fell_back)
        self.cache.commit(plan)
        return StepResult(logits, cached_tokens=sum(plan.cached_lengths), onboarded_tokens=sum(plan.onboard_tokens),
                          computed_tokens=sum(plan.new_lengths))

    @torch.no_grad()
    def forward(self, step: PreparedStep) -> torch.Tensor:
        """The step's logits ``[sum(C), num_tasks]``, cached (a CUDA graph's replay where one is captured,
        else the eager pass) or full, without committing its cache step: the caller commits (`run`;
        `KVCacheCallback` at the batch's end). Any error aborts the cache step and propagates."""
        if step.plan is None:
            logits = self.full_graphs.step(step.layout) if self.full_graphs is not None else None
            return self.model.forward_layout(step.layout.to(self.device)) if logits is None else logits
        plan = step.plan
        try:
            logits = self.graphs.step(step.layout, plan) if self.graphs is not None else None
            if logits is not None:  # (the replay wrote every layer's K/V; the eager pass marks its own)
                plan.appended_layers.update(range(len(self.model.layers)))
            else:
                logits = self.model.forward_cached(step.history, step.candidates, self.cache, plan,
                                                   layout=step.layout.to(self.device))
        except BaseException:
            self.cache.abort(plan)
            raise
        return logits

    def discard(self, step: PreparedStep) -> None:
        """Roll back a prepared step that will not run (its cache step is aborted)."""
        if step.plan is not None:
            self.cache.abort(step.plan)
