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


def check_silu_append(kv_layer: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      slots: torch.Tensor, rows: torch.Tensor) -> None:
    """`silu_append_kv`'s inputs, checked before anything is written (both forms): a table
    ``[num_pages, 2, P, H, D]`` with contiguous ``[H, D]`` rows; ``q, k, v [N, H, D]`` of its dtype and
    device, their ``[H, D]`` rows contiguous (rows may be strided); ``slots`` and ``rows`` int64, one
    per new token, on its device. Where they are host tensors, every slot lies in the table and every
    row in ``[0, N)`` (on the GPU that would cost a device sync: the caller's plan guarantees it)."""
    if kv_layer.dim() != 5:
        raise ValueError(f"kv_layer must be [num_pages, 2, P, H, D], got {tuple(kv_layer.shape)}")
    if q.dim() != 3:
        raise ValueError(f"q must be [N, H, D], got {tuple(q.shape)}")
    n, heads, dim = q.shape
    if kv_layer.shape[-2:] != (heads, dim) or kv_layer.stride(-1) != 1 or kv_layer.stride(-2) != dim:
        raise ValueError(f"kv_layer must hold [{heads}, {dim}] rows (q's), contiguous, got shape "
                         f"{tuple(kv_layer.shape)} and strides {kv_layer.stride()}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if (t.shape != q.shape or t.dtype != kv_layer.dtype or t.device != kv_layer.device or t.stride(-1) != 1
                or t.stride(-2) != dim):
            raise ValueError(f"{name} must be {tuple(q.shape)} {kv_layer.dtype} on {kv_layer.device} with contiguous "
                             f"[H, D] rows, got {tuple(t.shape)} {t.dtype} on {t.device}, strides {t.stride()}")
    for name, t in (("slots", slots), ("rows", rows)):
        if t.dim() != 1 or t.dtype != torch.int64 or t.device != kv_layer.device:
            raise ValueError(f"{name} must be 1-D int64 on {kv_layer.device}, got {tuple(t.shape)} {t.dtype} on "
                             f"{t.device}")
    if rows.numel() != slots.numel():
        raise ValueError(f"rows and slots must name one new token each, got {rows.numel()} and {slots.numel()}")
    if slots.numel() and not slots.is_cuda:
        capacity = kv_layer.shape[0] * kv_layer.shape[2]
        if int(slots.min()) < 0 or int(slots.max()) >= capacity:
            raise ValueError(f"slots must lie in [0, {capacity}) (the table's), got {int(slots.min())} to "
                             f"{int(slots.max())}")
        if int(rows.min()) < 0 or int(rows.max()) >= n:
            raise ValueError(f"rows must lie in [0, {n}) (q's rows), got {int(rows.min())} to {int(rows.max())}")


def silu_append_kv(kv_layer: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                   rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The cached step's activation and append in one pass, from the layer's projection before its
    SiLU (`HSTULayer.project` with ``activate=False``): returns ``F.silu`` of ``q, k, v`` and writes
    the new tokens' (rows ``rows``) ``F.silu(k), F.silu(v)`` at ``slots``, as `append_kv` of the
    activated ``k, v`` would. Inputs as `check_silu_append` takes them (a bad one is named and nothing
    is written). The Triton kernel for CUDA tables (one launch; torch's bits with
    ``gr_plugin.ops.triton.EXACT_SILU``, else its approximate SiLU), else the torch ops, which also
    serve a gradient (the kernel has none)."""
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if kv_layer.is_cuda and not needs_grad:
        try:
            from gr_plugin.ops.triton.append_kv import silu_append_kv as tri
        except ImportError:
            tri = None
        if tri is not None:
            return tri(kv_layer, q, k, v, slots, rows)  # (which runs `check_silu_append` first)
    check_silu_append(kv_layer, q, k, v, slots, rows)
    q, k, v = F.silu(q), F.silu(k), F.silu(v)
    paged_ops.append_kv(kv_layer, k.detach(), v.detach(), slots, rows)
    return q, k, v
