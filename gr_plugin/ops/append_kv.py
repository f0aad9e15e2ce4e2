"""Dispatch of the page append: the Triton kernel for CUDA tables, else the pure-torch reference
(`gr_plugin.cache.paged_ops.append_kv`). Pass it as `KVCacheManager`'s ``append_fn``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gr_plugin.cache import paged_ops


def append_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
              rows: torch.Tensor | None = None, *, silu: bool = False) -> None:
    """`paged_ops.append_kv`; with ``silu``, ``k``/``v`` are the layer's pre-SiLU projection and the
    pages get ``F.silu(k)``, ``F.silu(v)`` (fused into the kernel's pass where it serves)."""
    if kv_layer.is_cuda:
        try:
            from gr_plugin.ops.triton.append_kv import append_kv as tri
        except ImportError:
            tri = None
        if tri is not None:
            return tri(kv_layer, k, v, slots, rows, silu=silu)
    if silu:
        k, v = F.silu(k), F.silu(v)
    return paged_ops.append_kv(kv_layer, k, v, slots, rows)
