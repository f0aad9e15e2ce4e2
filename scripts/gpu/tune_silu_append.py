"""The cached layer's SiLU and page append as one launch (`silu_append`) vs the two it replaces.

python3 scripts/gpu/tune_silu_append.py

At the block's shapes (hidden 1024, 4 heads of 128 / page 128 and of 256 / page 32; 128 new tokens
and 256 candidates per user at bs 1, 2, 8), graphed (CUDA graph replays, min of 3 interleaved
rounds of ``triton.testing.do_bench_cudagraph``): ``F.silu`` of the projection then the Triton
append of its new K/V (what the cached step runs), each alone, and `silu_append`. Checks that the
fused launch writes the same bits as the pair (its output and the whole table). The fused kernel
lives here, not in the package: measured on the H200 (docs/BENCHMARKS.md) it saves under 1 us a
layer at bs 1 and is slower at bs 8.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

from gr_plugin.ops.triton import table_layout
from gr_plugin.ops.triton.append_kv import append_kv

CASES = ((128, 128, 1), (128, 128, 2), (128, 128, 8), (256, 32, 1), (256, 32, 8))  # head_dim, page, bs
HEADS, NEW, CANDIDATES = 4, 128, 256


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


def graphed_us(fn) -> float:
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    for dim, page, bs in CASES:
        width = HEADS * dim
        n = bs * (NEW + CANDIDATES)
        x = (torch.randn(n, 4 * width, device="cuda", generator=g) * 2).to(torch.bfloat16)
        pages = 4 * bs * NEW // page + 16
        table = torch.zeros(pages, 2, page, HEADS, dim, dtype=torch.bfloat16, device="cuda")
        rows = torch.cat([torch.arange(b * (NEW + CANDIDATES), b * (NEW + CANDIDATES) + NEW) for b in range(bs)]).cuda()
        slots = torch.randperm(pages * page, device="cuda", generator=g)[: bs * NEW]
        ref_table = table.clone()

        def pair():
            y = F.silu(x)
            _, v, _, k = y.chunk(4, dim=-1)
            append_kv(ref_table, k.view(n, HEADS, dim), v.view(n, HEADS, dim), slots, rows)
            return y

        def fused():
            return silu_append(table, x, slots, rows)

        y_ref, y = pair(), fused()
        same = torch.equal(y, y_ref) and torch.equal(table, ref_table)
        _, v_ref, _, k_ref = (t.view(n, HEADS, dim) for t in y_ref.chunk(4, dim=-1))
        fns = {"F.silu + append": pair, "silu_append": fused, "F.silu alone": lambda: F.silu(x),
               "append alone": lambda: append_kv(ref_table, k_ref, v_ref, slots, rows)}
        best = dict.fromkeys(fns, float("inf"))
        for _ in range(3):
            for label, fn in fns.items():
                best[label] = min(best[label], graphed_us(fn))
        print(f"head_dim {dim} page {page} bs {bs} ({n} rows, {bs * NEW} new): same bits {same}; "
              + ", ".join(f"{label} {us:.2f} us" for label, us in best.items()))


if __name__ == "__main__":
    main()
