"""Triton append: write the new tokens' K/V of one layer into their page slots in one launch.

Owns the GPU kernel behind `gr_plugin.ops.append_kv` (the reference is
`gr_plugin.cache.paged_ops.append_kv`, which it must match bit for bit): token ``i`` takes row
``rows[i]`` of ``k``/``v`` ``[Nq, H, D]`` (so the caller need not gather the new tokens first) and
lands at ``slots[i]`` (``page * page_size + offset``) of ``kv_layer [num_pages, 2, P, H, D]``.
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
def _silu(x, LIBDEVICE: tl.constexpr):
    """torch's ``F.silu`` formula in fp32: ``x / (1 + exp(-x))`` with an accurate ``exp`` (CUDA's
    libdevice ``expf``, as torch's kernel calls; ``tl.exp`` is the approximate one) and a correctly
    rounded division, so the rounded result has torch's bits. ``LIBDEVICE`` False: ``tl.exp``, for
    the interpreter (numpy's exp), which has no libdevice."""
    x = x.to(tl.float32)
    if LIBDEVICE:
        e = libdevice.exp(-x)
    else:
        e = tl.exp(-x)
    return tl.math.div_rn(x, 1.0 + e)


@triton.jit
def _silu_append(X, Y, KV, rows, slots, layer_pages, n_rows, tile_programs, stride_x, stride_y, stride_pp,
                 stride_pkv, stride_pt, K_COL: tl.constexpr, V_COL: tl.constexpr, WIDTH: tl.constexpr,
                 TOKEN_WIDTH: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr, LIBDEVICE: tl.constexpr):
    """Programs ``[0, tile_programs)``: ``Y = SiLU(X)`` tile by tile (``BLOCK_R`` rows, ``BLOCK_C``
    columns); the rest: one new token each, ``SiLU`` of its K and V columns of ``X`` into its slot."""
    pid = tl.program_id(0)
    if pid < tile_programs:
        col_tiles: tl.constexpr = (WIDTH + BLOCK_C - 1) // BLOCK_C
        r = (pid // col_tiles) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = (pid % col_tiles) * BLOCK_C + tl.arange(0, BLOCK_C)
        ok = (r < n_rows)[:, None] & (c < WIDTH)[None, :]
        r64 = r.to(tl.int64)[:, None]
        x = tl.load(X + r64 * stride_x + c[None, :], mask=ok, other=0.0)
        tl.store(Y + r64 * stride_y + c[None, :], _silu(x, LIBDEVICE).to(Y.dtype.element_ty), mask=ok)
    else:
        i = pid - tile_programs
        row = tl.load(rows + i).to(tl.int64)
        slot = tl.load(slots + i).to(tl.int64)
        dst = (slot // PAGE_SIZE + layer_pages) * stride_pp + (slot % PAGE_SIZE) * stride_pt
        for c0 in range(0, TOKEN_WIDTH, BLOCK_T):
            c = c0 + tl.arange(0, BLOCK_T)
            ok = c < TOKEN_WIDTH
            k = _silu(tl.load(X + row * stride_x + K_COL + c, mask=ok), LIBDEVICE)
            v = _silu(tl.load(X + row * stride_x + V_COL + c, mask=ok), LIBDEVICE)
            tl.store(KV + dst + c, k.to(KV.dtype.element_ty), mask=ok)
            tl.store(KV + stride_pkv + dst + c, v.to(KV.dtype.element_ty), mask=ok)


def silu_append(kv_layer: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor,
                layer: int | None = None) -> torch.Tensor:
    """``y = SiLU(x)`` for the HSTU projection ``x [Nq, 4 * H * D]`` (columns ``u, v, q, k``), and
    the new tokens' K and V of ``y`` written into their slots as `append_kv` writes them (token ``i``
    = row ``rows[i]`` at ``slots[i]``), in one launch. Returns ``y``; the same bits as ``F.silu(x)``
    followed by `append_kv` of its K and V columns."""
    page_size, heads, dim = kv_layer.shape[-3:]
    width = heads * dim
    if x.dim() != 2 or x.shape[1] != 4 * width or x.stride(1) != 1:
        raise ValueError(f"x must be [Nq, {4 * width}] with contiguous columns, got {tuple(x.shape)} strides "
                         f"{x.stride()}")
    if x.dtype != kv_layer.dtype:
        raise ValueError(f"x is {x.dtype}, kv_layer is {kv_layer.dtype}")
    if kv_layer.stride(-1) != 1 or kv_layer.stride(-2) != dim:
        raise ValueError(f"kv_layer must have contiguous [H, D] rows, got strides {kv_layer.stride()}")
    if slots.numel() != rows.numel():
        raise ValueError(f"slots has {slots.numel()} entries, rows has {rows.numel()}")
    y = torch.empty_like(x)
    n_rows = x.shape[0]
    if n_rows == 0:
        return y
    layer_pages, sp = table_layout(kv_layer, layer)
    block_c = min(1024, triton.next_power_of_2(4 * width))
    block_r = max(1, 4096 // block_c)
    tiles = triton.cdiv(n_rows, block_r) * triton.cdiv(4 * width, block_c)
    _silu_append[(tiles + slots.numel(),)](
        x, y, kv_layer, rows, slots, layer_pages, n_rows, tiles, x.stride(0), y.stride(0), sp[0], sp[1], sp[2],
        K_COL=3 * width, V_COL=width, WIDTH=4 * width, TOKEN_WIDTH=width, PAGE_SIZE=page_size, BLOCK_R=block_r,
        BLOCK_C=block_c, BLOCK_T=min(1024, triton.next_power_of_2(width)), LIBDEVICE=x.is_cuda, num_warps=4)
    return y
