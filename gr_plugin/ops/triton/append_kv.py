"""Triton append: write the new tokens' K/V of one layer into their page slots in one launch.

Owns the GPU kernels behind `gr_plugin.ops.append_kv` and `gr_plugin.ops.silu_append` (the
references are `gr_plugin.cache.paged_ops.append_kv`, which they must match bit for bit, and
torch's SiLU): token ``i`` takes row ``rows[i]`` of ``k``/``v`` ``[Nq, H, D]`` (so the caller need
not gather the new tokens first) and lands at ``slots[i]`` (``page * page_size + offset``) of
``kv_layer [num_pages, 2, P, H, D]``. `silu_append` also applies the layer's SiLU to the
projection in the same launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from gr_plugin.ops.triton import table_layout


@triton.jit
def _append(K, V, KV, rows, slots, layer_pages, stride_kt, stride_vt, stride_pp, stride_pkv, stride_pt,
            PAGE_SIZE: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(rows + i).to(tl.int64)
    slot = tl.load(slots + i).to(tl.int64)
    dst = (slot // PAGE_SIZE + layer_pages) * stride_pp + (slot % PAGE_SIZE) * stride_pt
    for c0 in range(0, WIDTH, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        ok = c < WIDTH
        tl.store(KV + dst + c, tl.load(K + row * stride_kt + c, mask=ok), mask=ok)
        tl.store(KV + stride_pkv + dst + c, tl.load(V + row * stride_vt + c, mask=ok), mask=ok)


def append_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
              rows: torch.Tensor | None = None, layer: int | None = None) -> None:
    """``kv_layer[slot_i] = (k[rows_i], v[rows_i])``; ``rows`` None means ``arange(len(slots))``.
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
                  PAGE_SIZE=page_size, WIDTH=width, BLOCK=block, num_warps=4)


@triton.jit
def _silu(x, CUDA: tl.constexpr):
    """torch's CUDA SiLU of fp32 ``x``, the same bits: ``x / (1 + exp(-x))`` with the accurate
    ``expf`` and a correctly rounded division (Triton's ``tl.exp`` and ``/`` are approximations).
    Under the interpreter (CPU), plain numpy arithmetic."""
    if CUDA:
        return tl.math.div_rn(x, 1.0 + libdevice.exp(-x))
    return x / (1.0 + tl.exp(-x))


@triton.jit
def _silu_append(Z, S, KV, rows, slots, layer_pages, n_rows, stride_z, stride_s, k_col, v_col, stride_pp, stride_pkv,
                 stride_pt, PAGE_SIZE: tl.constexpr, WIDTH: tl.constexpr, KV_WIDTH: tl.constexpr,
                 BLOCK: tl.constexpr, CUDA: tl.constexpr):
    i = tl.program_id(0)
    # NOTE: the two branches name their values apart (a compiled if/else must give a name one type)
    if i < n_rows:  # the first n_rows programs: SiLU of row i of the projection
        z_row = Z + i.to(tl.int64) * stride_z
        s_row = S + i.to(tl.int64) * stride_s
        for c0 in range(0, WIDTH, BLOCK):
            c = c0 + tl.arange(0, BLOCK)
            ok = c < WIDTH
            x = tl.load(z_row + c, mask=ok, other=0.0).to(tl.float32)
            tl.store(s_row + c, _silu(x, CUDA).to(S.dtype.element_ty), mask=ok)
    else:  # then one per new token: its K and V columns, SiLU'd again from Z (S is being written)
        j = i - n_rows
        row = tl.load(rows + j).to(tl.int64)
        slot = tl.load(slots + j).to(tl.int64)
        at = (slot // PAGE_SIZE + layer_pages) * stride_pp + (slot % PAGE_SIZE) * stride_pt
        z_new = Z + row * stride_z
        for c0 in range(0, KV_WIDTH, BLOCK):
            c = c0 + tl.arange(0, BLOCK)
            ok = c < KV_WIDTH
            k = _silu(tl.load(z_new + k_col + c, mask=ok, other=0.0).to(tl.float32), CUDA)
            v = _silu(tl.load(z_new + v_col + c, mask=ok, other=0.0).to(tl.float32), CUDA)
            tl.store(KV + at + c, k.to(KV.dtype.element_ty), mask=ok)
            tl.store(KV + stride_pkv + at + c, v.to(KV.dtype.element_ty), mask=ok)


def silu_append(z: torch.Tensor, kv_layer: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, k_col: int,
                v_col: int, layer: int | None = None) -> torch.Tensor:
    """``s = SiLU(z)`` for the projection ``z [N, W]`` (a new contiguous tensor, torch's bits), and
    `append_kv` of the new tokens' ``s[rows_i, k_col:k_col + H*D]`` / ``s[rows_i, v_col:...]`` at
    ``slots_i`` of ``kv_layer``, in one launch (``layer``: as `append_kv`)."""
    n, width = z.shape
    page_size, heads, dim = kv_layer.shape[-3:]
    kv_width = heads * dim
    if z.stride(-1) != 1:
        raise ValueError(f"z must have contiguous rows, got strides {z.stride()}")
    for name, col in (("k_col", k_col), ("v_col", v_col)):
        if not 0 <= col <= width - kv_width:
            raise ValueError(f"{name} must be in [0, {width - kv_width}] (z has {width} columns, K/V rows "
                             f"{kv_width}), got {col}")
    if kv_layer.stride(-1) != 1 or kv_layer.stride(-2) != dim:
        raise ValueError(f"kv_layer must have contiguous [H, D] rows, got strides {kv_layer.stride()}")
    if rows.numel() != slots.numel():
        raise ValueError(f"rows has {rows.numel()} entries, slots {slots.numel()}")
    layer_pages, sp = table_layout(kv_layer, layer)
    s = torch.empty((n, width), dtype=z.dtype, device=z.device)
    programs = n + slots.numel()
    if programs == 0:
        return s
    block = min(1024, triton.next_power_of_2(width))
    _silu_append[(programs,)](z, s, kv_layer, rows, slots, layer_pages, n, z.stride(0), s.stride(0), k_col, v_col,
                              sp[0], sp[1], sp[2], PAGE_SIZE=page_size, WIDTH=width, KV_WIDTH=kv_width, BLOCK=block,
                              CUDA=z.is_cuda, num_warps=4)
    return s
