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


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


@dataclasses.dataclass
class _Bucket:
    users: int  # B_b: batch rows of the graph (the real users, then padding users)
    tokens: int  # query rows of the graph
    new: int  # new-token rows of the graph
    max_q_len: int
    x: torch.Tensor
    ys: list[torch.Tensor]
    q_offsets: torch.Tensor
    rows: torch.Tensor
    slots: torch.Tensor
    kv_indices: torch.Tensor
    kv_indptr: torch.Tensor
    total_lengths: torch.Tensor
    new_lengths: torch.Tensor
    scratch_slots: torch.Tensor
    graphs: list[torch.cuda.CUDAGraph] = dataclasses.field(default_factory=list)


class CachedStackGraphs:
    """See the module docstring. Shapes are padded up to buckets (users to a power of two plus one
    padding user, query rows to a multiple of ``token_quantum``, new rows to a multiple of
    ``new_quantum``): padding query rows belong to a padding user with no history (they only see
    themselves, and are dropped), padding new rows write their K/V into a reserved scratch page.
    """

    def __init__(self, model: HSTURanker, cache: KVCacheModule, max_buckets: int = 32, capture_after: int = 2,
                 token_quantum: int = 256, new_quantum: int = 128) -> None:
        self.model, self.cache, self.max_buckets = model, cache, max_buckets
        self.capture_after, self.token_quantum, self.new_quantum = capture_after, token_quantum, new_quantum
        self._buckets: dict[tuple[int, ...], _Bucket] = {}
        self._seen: dict[tuple[int, ...], int] = {}
        self._pool = None
        cfg = cache.config
        self._max_history = cfg.num_pages * cfg.page_size
        self._scratch: int | None = None
        self.captures = 0
        self.replays = 0

    def _layer(self, b: _Bucket, i: int) -> None:
        layer = self.model.layers[i]
        table = self.cache.kv_table[i]
        u, q, k, v = layer.project(b.ys[i])
        self.cache.manager.append_fn(table, k, v, b.slots, b.rows)
        a = paged_hstu_attention(q, k, v, table, b.kv_indices, b.kv_indptr, b.total_lengths, b.q_offsets,
                                 b.new_lengths, alpha=layer.alpha, n_norm=layer.n_norm, max_q_len=b.max_q_len,
                                 max_history_len=self._max_history, num_history_tokens=0)
        b.ys[i + 1].copy_(layer.finish(b.ys[i], u, a))

    def _load(self, b: _Bucket, x: torch.Tensor, layout: TokenLayout, plan: BatchPlan) -> None:
        meta = plan.metadata
        nq, n, bsz = x.shape[0], meta.num_new_tokens, meta.batch_size
        # NOTE: every tail is reset too: a bucket's previous step may have had more users or new
        # tokens, and a stale slot would make a padding row overwrite a real page.
        b.x[:nq].copy_(x)
        b.x[nq:].zero_()
        b.q_offsets[: bsz + 1].copy_(layout.q_offsets)
        b.q_offsets[bsz + 1 :].fill_(b.tokens)  # the padding user's segment is [nq, tokens)
        b.rows[:n].copy_(layout.new_rows)
        b.rows[n:].zero_()
        b.slots[:n].copy_(meta.new_token_slots)
        b.slots[n:].copy_(b.scratch_slots[n:])
        b.kv_indices[: meta.num_batch_pages].copy_(meta.kv_indices)
        b.kv_indptr[: bsz + 1].copy_(meta.kv_indptr)
        b.kv_indptr[bsz + 1 :].fill_(meta.num_batch_pages)
        b.total_lengths[:bsz].copy_(meta.total_lengths)
        b.total_lengths[bsz:].zero_()
        b.new_lengths[:bsz].copy_(meta.new_lengths)
        b.new_lengths[bsz:].zero_()

    def _new_bucket(self, key: tuple[int, ...], x: torch.Tensor) -> _Bucket:
        users, tokens, new, max_q = key
        dev = x.device
        i64 = dict(dtype=torch.int64, device=dev)
        if self._scratch is None:
            self._scratch = self.cache.manager.reserve_scratch_pages(1)[0]
        page = self.cache.config.page_size
        scratch = self._scratch * page + torch.arange(new, **i64) % page
        b = _Bucket(users=users, tokens=tokens, new=new, max_q_len=max_q, scratch_slots=scratch,
                    x=torch.zeros(tokens, x.shape[1], dtype=x.dtype, device=dev), ys=[],
                    q_offsets=torch.zeros(users + 1, **i64),
                    # padding new rows: any query row, written into the scratch page
                    rows=torch.zeros(new, **i64),
                    slots=scratch.clone(),
                    kv_indices=torch.zeros(self.cache.config.num_pages, **i64),
                    kv_indptr=torch.zeros(users + 1, **i64), total_lengths=torch.zeros(users, **i64),
                    new_lengths=torch.zeros(users, **i64))
        b.ys = [b.x] + [torch.empty_like(b.x) for _ in self.model.layers]
        return b

    def _capture(self, b: _Bucket, plan: BatchPlan) -> None:
        dev = b.x.device
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        # NOTE: warm-up writes this plan's own K/V into its own pages: the same values a replay writes.
        with torch.cuda.stream(side), torch.no_grad():
            for i in range(len(self.model.layers)):
                self.cache.manager.wait_layer(plan, i)
                self._layer(b, i)
        torch.cuda.current_stream(dev).wait_stream(side)
        with torch.no_grad():
            for i in range(len(self.model.layers)):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self._pool):
                    self._layer(b, i)
                if self._pool is None:
                    self._pool = g.pool()
                b.graphs.append(g)
        self.captures += 1
        logger.info("captured the cached layer stack for bucket %s", (b.users, b.tokens, b.new))

    def run(self, x: torch.Tensor, layout: TokenLayout, plan: BatchPlan) -> torch.Tensor | None:
        """The layer stack's output ``[Nq, D]`` for the step, or None when the step runs eagerly: a
        bucket is captured the ``capture_after``-th time it is seen (a capture costs far more than
        an eager step), and only when the Triton kernels serve the layers."""
        if not x.is_cuda or self.cache.config.head_dim not in _TRITON_HEAD_DIMS:
            return None
        meta = plan.metadata
        nq = x.shape[0]
        tokens = _round_up(nq + 1, self.token_quantum)  # + 1: the padding user always has a row
        key = (_pow2(meta.batch_size + 1), tokens, _round_up(max(meta.num_new_tokens, 1), self.new_quantum),
               _round_up(max(layout.max_q_len, tokens - nq), 64))
        key = (*key[:3], max(key[3], key[1]))  # grid rows: any segment, the padding user's included
        b = self._buckets.get(key)
        if b is None:
            self._seen[key] = self._seen.get(key, 0) + 1
            if self._seen[key] < self.capture_after or len(self._buckets) >= self.max_buckets:
                return None
            b = self._buckets[key] = self._new_bucket(key, x)
            self._load(b, x, layout, plan)
            self._capture(b, plan)
        else:
            self._load(b, x, layout, plan)
        for i, g in enumerate(b.graphs):
            self.cache.manager.wait_layer(plan, i)
            g.replay()
        self.replays += 1
        return b.ys[-1][:nq]
