"""Dispatch of the page append: the Triton kernel for CUDA tables, else the pure-torch reference
(`gr_plugin.cache.paged_ops.append_kv`). Pass it as `KVCacheManager`'s ``append_fn``."""

from __future__ import annotations

import torch

from gr_plugin.cache import paged_ops


def append_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
              rows: torch.Tensor | None = None) -> None:
    if kv_layer.is_cuda:
        try:
            from gr_plugin.ops.triton.append_kv import append_kv as tri
        except ImportError:
            tri = None
        if tri is not None:
            return tri(kv_layer, k, v, slots, rows)
    return paged_ops.append_kv(kv_layer, k, v, slots, rows)
