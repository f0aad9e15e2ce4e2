"""Triton append: write the new tokens' K/V of one layer into their page slots in one launch.

Owns the GPU kernel behind `gr_plugin.ops.append_kv` (the reference is
`gr_plugin.cache.paged_ops.append_kv`, which it must match bit for bit): token ``i`` takes row
``rows[i]`` of ``k``/``v`` ``[Nq, H, D]`` (so the caller need not gather the new tokens first) and
lands at ``slots[i]`` (``page * page_size + offset``) of ``kv_layer [num_pages, 2, P, H, D]``.
With ``silu``, ``k``/``v`` are the layer's pre-SiLU projection and the pages get ``SiLU(k)``,
``SiLU(v)`` (`gr_plugin.ops.triton.silu`, rounded to the table's dtype): what the reference writes
from torch's SiLU of them, so the cached step needs no SiLU pass of its own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gr_plugin.ops.triton import silu as _silu
from gr_plugin.ops.triton import table_layout


@triton.jit
def _append(K, V, KV, rows, slots, layer_pages, stride_kt, stride_vt, stride_pp, stride_pkv, stride_pt,
            PAGE_SIZE: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr, SILU: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(rows + i).to(tl.int64)
    slot = tl.load(slots + i).to(tl.int64)
    dst = (slot // PAGE_SIZE + layer_pages) * stride_pp + (slot % PAGE_SIZE) * stride_pt
    for c0 in range(0, WIDTH, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        ok = c < WIDTH
        k = tl.load(K + row * stride_kt + c, mask=ok)
        v = tl.load(V + row * stride_vt + c, mask=ok)
        if SILU:
            k = _silu(k).to(K.dtype.element_ty)
            v = _silu(v).to(V.dtype.element_ty)
        tl.store(KV + dst + c, k, mask=ok)
        tl.store(KV + stride_pkv + dst + c, v, mask=ok)


def append_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
              rows: torch.Tensor | None = None, layer: int | None = None, silu: bool = False) -> None:
    """``kv_layer[slot_i] = (k[rows_i], v[rows_i])`` (their SiLU with ``silu``); ``rows`` None means
    ``arange(len(slots))``.
    With ``layer``, ``kv_layer`` is the whole table ``[L, num_pages, 2, P, H, D]`` and the tokens go
    into that layer (`table_layout`)."""
    n = slots.numel()
    if n == 0:
        return
    if rows is None:
        rows = torch.arange(n, device=slots.device)
    page_size, heads, dim = kv_layer.shape[-3:]
    width = heads * dim
    for name, t in (("k", k), ("v", v)):
        if t.stride(-1) != 1 or t.stride(-2) != dim:
            raise ValueError(f"{name} must have contiguous [H, D] rows, got strides {t.stride()}")
    if kv_layer.stride(-1) != 1 or kv_layer.stride(-2) != dim:
        raise ValueError(f"kv_layer must have contiguous [H, D] rows, got strides {kv_layer.stride()}")
    layer_pages, sp = table_layout(kv_layer, layer)
    block = min(1024, triton.next_power_of_2(width))
    _append[(n,)](k, v, kv_layer, rows, slots, layer_pages, k.stride(0), v.stride(0), sp[0], sp[1], sp[2],
                  PAGE_SIZE=page_size, WIDTH=width, BLOCK=block, SILU=bool(silu), num_warps=4)
