"""Dispatch of the page append: the Triton kernel for CUDA tables, else the pure-torch reference
(`gr_plugin.cache.paged_ops.append_kv`). Pass it as `KVCacheManager`'s ``append_fn``.
`silu_append` fuses the layer's SiLU into it (the graphed cached steps)."""

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


def silu_append(z: torch.Tensor, kv_layer: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, k_col: int,
                v_col: int) -> torch.Tensor:
    """``SiLU(z)`` of a layer's projection ``z [N, W]``, after writing its new tokens' K and V
    (columns ``k_col`` and ``v_col`` onwards, ``H*D`` each, of rows ``rows``) at ``slots`` of
    ``kv_layer``: what ``F.silu`` then `append_kv` compute, in one Triton launch on CUDA."""
    if kv_layer.is_cuda and z.is_cuda:
        try:
            from gr_plugin.ops.triton.append_kv import silu_append as tri
        except ImportError:
            tri = None
        if tri is not None:
            return tri(z, kv_layer, slots, rows, k_col, v_col)
    s = F.silu(z)
    heads, dim = kv_layer.shape[-2:]
    kv = [s[:, c : c + heads * dim].reshape(-1, heads, dim) for c in (k_col, v_col)]
    paged_ops.append_kv(kv_layer, *kv, slots, rows)
    return s
