"""`CachedLayerStack`: the cached step's layer stack as an exportable module.

Owns the graph the exporter sees: the HSTU layers (the model's own modules, shared weights), and as
inputs the step's small metadata tensors and the device KV table, which the graph mutates through
``gr_kv::append_kv_layer`` (an input, not a buffer: a compiled package then writes the caller's cache
table instead of a copy baked into the package; the whole table with a layer index, not a per-layer
view, because AOTInductor loses a mutable view's offset when the table's page count is dynamic).
Lookup, allocation and LRU stay outside, in `KVCacheManager`, which produces those tensors. The
whole step around it (embeddings, head) is `gr_plugin.export.model`.
"""

from __future__ import annotations

import torch
from torch import nn

from gr_plugin.modules.hstu import HSTURanker
from gr_plugin.ops import library  # noqa: F401 - registers gr_kv::*


class CachedLayerStack(nn.Module):
    def __init__(self, model: HSTURanker) -> None:
        super().__init__()
        self.layers = model.layers

    def forward(self, x: torch.Tensor, q_offsets: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
                kv_indices: torch.Tensor, kv_indptr: torch.Tensor, history_lengths: torch.Tensor,
                new_lengths: torch.Tensor, kv_table: torch.Tensor) -> torch.Tensor:
        """``x [Nq, D]`` (per user: new events, then candidates) -> ``[Nq, D]``; ``rows``/``slots``
        ``[N]`` place the new events' K/V in ``kv_table [L, num_pages, 2, P, H, D]`` (mutated); the
        rest is the plan's CSR page metadata."""
        for i, layer in enumerate(self.layers):
            u, q, k, v = layer.project(x)
            torch.ops.gr_kv.append_kv_layer(kv_table, i, k, v, slots, rows)
            a = torch.ops.gr_kv.paged_hstu_attention_layer(q, k, v, kv_table, i, kv_indices, kv_indptr,
                                                           history_lengths, q_offsets, new_lengths, layer.alpha,
                                                           layer.n_norm)
            x = layer.finish(x, u, a)
        return x
