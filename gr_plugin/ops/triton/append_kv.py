"""Triton append: write the new tokens' K/V of one layer into their page slots in one launch.

Owns the GPU kernel behind `gr_plugin.ops.append_kv` (the reference is
`gr_plugin.cache.paged_ops.append_kv`, which it must match bit for bit): token ``i`` takes row
``rows[i]`` of ``k``/``v`` ``[Nq, H, D]`` (so the caller need not gather the new tokens first) and
lands at ``slots[i]`` (``page * page_size + offset``) of ``kv_layer [num_pages, 2, P, H, D]``.

``silu_append_kv`` is the cached step's form from the layer's projection before its SiLU: one launch
takes ``SiLU`` of every query row's ``q, k, v`` into a new buffer (what the attention reads) and writes
the new tokens' ``SiLU(k), SiLU(v)`` into their slots, instead of a SiLU pass over the whole projection
and the append after it (`gr_plugin.ops.triton.silu`; torch's bits with `EXACT_SILU`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gr_plugin.ops.append_kv import check_silu_append
from gr_plugin.ops.triton import exact_silu, silu, table_layout


@triton.jit
def _put_token(K, V, KV, rows, slots, i, layer_pages, stride_kt, stride_vt, stride_pp, stride_pkv, stride_pt,
               PAGE_SIZE: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr, ACTIVATE: tl.constexpr,
               EXACT: tl.constexpr):
    """Token ``i``: row ``rows[i]`` of ``K``/``V`` into slot ``slots[i]`` of the table ``KV`` (with
    ``ACTIVATE``, their `silu` in the table's dtype)."""
    row = tl.load(rows + i).to(tl.int64)
    slot = tl.load(slots + i).to(tl.int64)
    dst = (slot // PAGE_SIZE + layer_pages) * stride_pp + (slot % PAGE_SIZE) * stride_pt
    for c0 in range(0, WIDTH, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        ok = c < WIDTH
        k = tl.load(K + row * stride_kt + c, mask=ok)
        v = tl.load(V + row * stride_vt + c, mask=ok)
        if ACTIVATE:
            k = silu(k, EXACT).to(KV.dtype.element_ty)
            v = silu(v, EXACT).to(KV.dtype.element_ty)
        tl.store(KV + dst + c, k, mask=ok)
        tl.store(KV + stride_pkv + dst + c, v, mask=ok)


@triton.jit
def _append(K, V, KV, rows, slots, layer_pages, stride_kt, stride_vt, stride_pp, stride_pkv, stride_pt,
            PAGE_SIZE: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    _put_token(K, V, KV, rows, slots, tl.program_id(0), layer_pages, stride_kt, stride_vt, stride_pp, stride_pkv,
               stride_pt, PAGE_SIZE, WIDTH, BLOCK, False, False)


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
def _silu_append(Q, K, V, Out, KV, rows, slots, n_rows, layer_pages, stride_qt, stride_kt, stride_vt, stride_ot,
                 stride_op, stride_pp, stride_pkv, stride_pt, PAGE_SIZE: tl.constexpr, WIDTH: tl.constexpr,
                 BLOCK: tl.constexpr, EXACT: tl.constexpr):
    """Programs ``[0, n_rows)``: row ``i``'s ``SiLU(q), SiLU(k), SiLU(v)`` into ``Out[i, 0..2]``; program
    ``n_rows + j``: new token ``j`` (row ``rows[j]``) into slot ``slots[j]``. Both read only the inputs,
    so no program reads what another writes."""
    pid = tl.program_id(0)
    dt = Out.dtype.element_ty
    if pid < n_rows:
        row = pid.to(tl.int64)
        out = Out + row * stride_ot
        for c0 in range(0, WIDTH, BLOCK):
            c = c0 + tl.arange(0, BLOCK)
            ok = c < WIDTH
            tl.store(out + c, silu(tl.load(Q + row * stride_qt + c, mask=ok), EXACT).to(dt), mask=ok)
            tl.store(out + stride_op + c, silu(tl.load(K + row * stride_kt + c, mask=ok), EXACT).to(dt), mask=ok)
            tl.store(out + 2 * stride_op + c, silu(tl.load(V + row * stride_vt + c, mask=ok), EXACT).to(dt), mask=ok)
    else:
        _put_token(K, V, KV, rows, slots, pid - n_rows, layer_pages, stride_kt, stride_vt, stride_pp, stride_pkv,
                   stride_pt, PAGE_SIZE, WIDTH, BLOCK, True, EXACT)


def silu_append_kv(kv_layer: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                   rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``SiLU`` of ``q, k, v [N, H, D]``, returned as views of one new ``[N, 3, H, D]`` buffer, and
    ``kv_layer[slot_i] = (SiLU(k[rows_i]), SiLU(v[rows_i]))``, in one launch; the inputs as
    `gr_plugin.ops.append_kv.check_silu_append` takes them, checked first (on the GPU it cannot see
    the slots' and rows' values without a sync: they must lie in the table and in ``[0, N)``)."""
    check_silu_append(kv_layer, q, k, v, slots, rows)
    n, heads, dim = q.shape
    out = torch.empty((n, 3, heads, dim), dtype=q.dtype, device=q.device)
    layer_pages, sp = table_layout(kv_layer, None)
    width = heads * dim
    if n + slots.numel():
        _silu_append[(n + slots.numel(),)](q, k, v, out, kv_layer, rows, slots, n, layer_pages, q.stride(0),
                                           k.stride(0), v.stride(0), out.stride(0), out.stride(1), sp[0], sp[1], sp[2],
                                           PAGE_SIZE=kv_layer.shape[-3], WIDTH=width,
                                           BLOCK=min(1024, triton.next_power_of_2(width)), EXACT=exact_silu(q),
                                           num_warps=4)
    return out[:, 0], out[:, 1], out[:, 2]
