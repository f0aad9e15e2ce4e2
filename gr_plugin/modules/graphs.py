"""`CachedStackGraphs`: the cached layer stack of an `HSTURanker` as CUDA graphs, per shape bucket.

Owns the static buffers and the per-layer graphs of the cached step. A bucket is the step's shape
(users, query tokens, new tokens, candidates, longest query segment); the first batch of a bucket
is captured (one graph per layer, sharing one memory pool), later ones copy their inputs and page
metadata into the bucket's static buffers and replay. Each layer is its own graph so the layerwise
onboard wait of layer ``l`` sits between replays. Inputs that vary inside a bucket (history
lengths, pages) are read by the kernels from device tensors, so replays compute exactly what the
eager step computes. Embeddings, the token layout and the head stay eager.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from gr_plugin.cache import BatchPlan
from gr_plugin.modules.hstu import HSTURanker
from gr_plugin.modules.kv_cache import KVCacheModule
from gr_plugin.modules.tokens import TokenLayout
from gr_plugin.ops import paged_hstu_attention

logger = logging.getLogger(__name__)

_TRITON_HEAD_DIMS = (16, 32, 64, 128, 256)  # the graphed layers need the Triton kernels (no host sizes)


@dataclasses.dataclass
class _Bucket:
    x: torch.Tensor
    ys: list[torch.Tensor]
    q_offsets: torch.Tensor
    rows: torch.Tensor
    slots: torch.Tensor
    kv_indices: torch.Tensor
    kv_indptr: torch.Tensor
    total_lengths: torch.Tensor
    new_lengths: torch.Tensor
    graphs: list[torch.cuda.CUDAGraph] = dataclasses.field(default_factory=list)


class CachedStackGraphs:
    def __init__(self, model: HSTURanker, cache: KVCacheModule, max_buckets: int = 32, capture_after: int = 2) -> None:
        self.model, self.cache, self.max_buckets = model, cache, max_buckets
        self.capture_after = capture_after
        self._buckets: dict[tuple[int, ...], _Bucket] = {}
        self._seen: dict[tuple[int, ...], int] = {}
        self._pool = None
        cfg = cache.config
        self._max_history = cfg.num_pages * cfg.page_size
        self.captures = 0
        self.replays = 0

    def _layer(self, b: _Bucket, i: int, max_q_len: int) -> None:
        layer = self.model.layers[i]
        table = self.cache.kv_table[i]
        u, q, k, v = layer.project(b.ys[i])
        self.cache.manager.append_fn(table, k, v, b.slots, b.rows)
        a = paged_hstu_attention(q, k, v, table, b.kv_indices, b.kv_indptr, b.total_lengths, b.q_offsets,
                                 b.new_lengths, alpha=layer.alpha, n_norm=layer.n_norm, max_q_len=max_q_len,
                                 max_history_len=self._max_history, num_history_tokens=0)
        b.ys[i + 1].copy_(layer.finish(b.ys[i], u, a))

    def _load(self, b: _Bucket, x: torch.Tensor, layout: TokenLayout, plan: BatchPlan) -> None:
        meta = plan.metadata
        b.x.copy_(x)
        b.q_offsets.copy_(layout.q_offsets)
        b.rows.copy_(layout.new_rows)
        b.slots.copy_(meta.new_token_slots)
        b.kv_indices[: meta.num_batch_pages].copy_(meta.kv_indices)
        b.kv_indptr.copy_(meta.kv_indptr)
        b.total_lengths.copy_(meta.total_lengths)
        b.new_lengths.copy_(meta.new_lengths)

    def _capture(self, key: tuple[int, ...], x: torch.Tensor, layout: TokenLayout, plan: BatchPlan) -> _Bucket:
        meta, dev = plan.metadata, x.device
        i64 = dict(dtype=torch.int64, device=dev)
        b = _Bucket(x=torch.empty_like(x), ys=[], q_offsets=torch.empty(meta.batch_size + 1, **i64),
                    rows=torch.empty(meta.num_new_tokens, **i64), slots=torch.empty(meta.num_new_tokens, **i64),
                    kv_indices=torch.zeros(self.cache.config.num_pages, **i64),
                    kv_indptr=torch.empty(meta.batch_size + 1, **i64),
                    total_lengths=torch.empty(meta.batch_size, **i64), new_lengths=torch.empty(meta.batch_size, **i64))
        b.ys = [b.x] + [torch.empty_like(x) for _ in self.model.layers]
        self._load(b, x, layout, plan)
        max_q = key[-1]
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        # NOTE: warm-up writes this plan's own K/V into its own pages: the same values a replay writes.
        with torch.cuda.stream(side), torch.no_grad():
            for i in range(len(self.model.layers)):
                self.cache.manager.wait_layer(plan, i)
                self._layer(b, i, max_q)
        torch.cuda.current_stream(dev).wait_stream(side)
        with torch.no_grad():
            for i in range(len(self.model.layers)):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self._pool):
                    self._layer(b, i, max_q)
                if self._pool is None:
                    self._pool = g.pool()
                b.graphs.append(g)
        self.captures += 1
        logger.info("captured the cached layer stack for bucket %s", key)
        return b

    def run(self, x: torch.Tensor, layout: TokenLayout, plan: BatchPlan) -> torch.Tensor | None:
        """The layer stack's output for the step, or None when the step runs eagerly: a bucket is
        captured the ``capture_after``-th time it is seen (a capture costs far more than an eager
        step, so one-off shapes stay eager), and only when the Triton kernels serve the layers."""
        if not x.is_cuda or self.cache.config.head_dim not in _TRITON_HEAD_DIMS:
            return None
        meta = plan.metadata
        key = (meta.batch_size, x.shape[0], meta.num_new_tokens, layout.candidate_rows.numel(), layout.max_q_len)
        b = self._buckets.get(key)
        if b is None:
            self._seen[key] = self._seen.get(key, 0) + 1
            if self._seen[key] < self.capture_after or len(self._buckets) >= self.max_buckets:
                return None
            b = self._buckets[key] = self._capture(key, x, layout, plan)
        else:
            self._load(b, x, layout, plan)
        for i, g in enumerate(b.graphs):
            self.cache.manager.wait_layer(plan, i)
            g.replay()
        self.replays += 1
        return b.ys[-1]
