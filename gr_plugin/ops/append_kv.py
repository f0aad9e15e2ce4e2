"""Dispatch of the page append: the Triton kernel for CUDA tables, else the pure-torch reference
(`gr_plugin.cache.paged_ops.append_kv`). Pass it as `KVCacheManager`'s ``append_fn``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

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


def silu_append_kv(kv_layer: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                   rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The cached step's activation and append in one pass, from the layer's projection before its
    SiLU (`HSTULayer.project` with ``activate=False``): returns ``F.silu`` of ``q, k, v`` and writes
    the new tokens' (rows ``rows``) ``F.silu(k), F.silu(v)`` at ``slots``, as `append_kv` of the
    activated ``k, v`` would. The Triton kernel for CUDA tables (one launch, its SiLU rounded as
    torch's), else the torch ops."""
    if kv_layer.is_cuda:
        try:
            from gr_plugin.ops.triton.append_kv import silu_append_kv as tri
        except ImportError:
            tri = None
        if tri is not None:
            return tri(kv_layer, q, k, v, slots, rows)
    q, k, v = F.silu(q), F.silu(k), F.silu(v)
    paged_ops.append_kv(kv_layer, k, v, slots, rows)
    return q, k, v
