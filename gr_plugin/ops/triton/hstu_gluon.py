"""The HSTU attention's kernel for Hopper in Gluon (Triton's tile-level dialect): the split grid of
`gr_plugin.ops.triton.hstu_attention` (a program per query tile and key split, fp32 parts summed by
that module's passes), the same mask and the same SiLU as its ``FAST`` form.

Per program the query tile lives in shared memory, where both warpgroup MMAs read it; full key
blocks arrive by TMA into a ring of ``STAGES`` buffers tracked by mbarriers, and the next block's
``q k^T`` is issued before this block's ``p v``, so the SiLU of one overlaps the other's MMA. Blocks
at the causal edge or past a user's last key are read with masked pointer loads (zeros past the
history, so stale or NaN page slots never reach a sum). A candidate's own key and value are added by
the tile's first split as a per-row weight, rounded as a block's weights are.

`hstu_attention._launch` takes it for paged launches captured into a CUDA graph on Hopper in bf16
(`hstu_attention._gluon_choice`); it needs Hopper's ``wgmma`` (not on Blackwell). The full pass
(``PAGED=False``, `hstu_attention.hstu_attention_jagged` captured) reads its key blocks by TMA from the
keys and values themselves, seen as rows of ``H * D``, and runs the query tiles heaviest first.
NOTE: measured on the H200 against the Triton kernel (docs/BENCHMARKS.md, `scripts/gpu/gluon_attention.py
time`, graphed, the norm gate included, 4096 history; the tiles and split counts the package takes): bs 8 /
head_dim 128 64.5 vs 87.6 µs, head_dim 256 bs 1 26.6 vs 40.6 and bs 8 149.5 vs 171.6; bs 1 / head_dim
128 15.3 vs 15.6. Its outputs were within 2x the Triton kernel's error against an fp32 reference in
every case of `gluon_attention.py check`, and some were the Triton kernel's bits at equal split counts.
The full pass (`gluon_attention.py full`, graphed µs, 4096 history + 256 candidates): head_dim 128 bs 1
54.4 vs 77.7, bs 8 324.8 vs 397.7; head_dim 256 bs 1 128.7 vs 185.1, bs 8 798.0 vs 886.3; its errors
equalled the Triton kernel's in every case of that script's check.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from gr_plugin.ops.triton import tma_covers, tma_covers_rows


@gluon.jit
def _silu(s, alpha):
    """``SiLU(alpha s)`` as the Triton kernel's FAST form: ``h (1 + tanh(h))``, ``h = alpha s / 2``."""
    h = s * (0.5 * alpha)
    t = gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [h], dtype=gl.float32, is_pure=True, pack=1)
    return h + h * t


@gluon.jit
def _key_row(kv_indices, page_base, layer_pages, n0, rows_pp, key_row0, PAGE_SIZE: gl.constexpr,
             PAGED: gl.constexpr):
    """The descriptor row of the key block at history position ``n0``: paged, its page's row in the
    table seen as rows of ``H * D`` (a load of the page's index); else row ``key_row0 + n0``."""
    if PAGED:
        page = gl.load(kv_indices + page_base + n0 // PAGE_SIZE).to(gl.int64) + layer_pages
        row = (page * rows_pp + n0 % PAGE_SIZE).to(gl.int32)
    else:
        row = key_row0 + n0
    return row


@gluon.jit
def _issue(KD, VD, row, col, v_rows, bar, k_dst, v_dst):
    """TMA loads of the key and value block at descriptor row ``row`` (`_key_row`) into ``k_dst`` /
    ``v_dst``, completing on ``bar``: paged, ``KD`` = ``VD`` (the values ``v_rows`` rows after the
    keys); else the keys ``KD`` and values ``VD`` themselves (``v_rows`` 0)."""
    mbarrier.expect(bar, 2 * KD.block_type.nbytes)
    tma.async_copy_global_to_shared(KD, [row, col], bar, k_dst)
    tma.async_copy_global_to_shared(VD, [row + v_rows, col], bar, v_dst)


@gluon.jit
def _self_weight(Q, K, q_smem, q_start, m0, q_len, new, h, stride_kt, stride_kh, alpha, HEAD_DIM: gl.constexpr,
                 BLOCK_M: gl.constexpr, o_layout: gl.constexpr, num_warps: gl.constexpr):
    """A candidate's weight on its own key: ``SiLU(alpha q.k)`` rounded as a block's weights are (0 for
    the tile's other rows), in the accumulator's row layout; ``q.k`` in column chunks of 64 (what
    registers hold beside the accumulator)."""
    CH: gl.constexpr = 64 if HEAD_DIM > 64 else HEAD_DIM
    ch_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (CH // 8), CH // 8], [num_warps, 1], [1, 0])
    rows_c = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ch_layout))
    d_c = gl.arange(0, CH, layout=gl.SliceLayout(0, ch_layout))
    cand_c = (rows_c < q_len) & (rows_c >= new)
    k_rows = (q_start + rows_c) * stride_kt + h * stride_kh
    w = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, ch_layout))
    for c in gl.static_range(HEAD_DIM // CH):
        qc = q_smem.slice(c * CH, CH, dim=1).load(ch_layout)
        kc = gl.load(K + k_rows[:, None] + c * CH + d_c[None, :], mask=cand_c[:, None], other=0.0)
        w += gl.sum(qc.to(gl.float32) * kc.to(gl.float32), axis=1)
    w = gl.where(cand_c, _silu(w, alpha).to(Q.dtype.element_ty).to(gl.float32), 0.0)
    return gl.convert_layout(w, gl.SliceLayout(1, o_layout))


@gluon.jit
def _add_self(V, acc, w_o, q_start, m0, q_len, new, h, stride_vt, stride_vh, HEAD_DIM: gl.constexpr,
              BLOCK_M: gl.constexpr, o_layout: gl.constexpr):
    """``acc`` plus each candidate's own value times its weight ``w_o`` (`_self_weight`)."""
    rows_v = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    d_v = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    cand_v = (rows_v < q_len) & (rows_v >= new)
    vo = gl.load(V + ((q_start + rows_v) * stride_vt + h * stride_vh)[:, None] + d_v[None, :],
                 mask=cand_v[:, None], other=0.0)
    return acc + w_o[:, None] * vo.to(gl.float32)


@gluon.jit
def _paged_fwd(Q, K, V, Out, KV, KD, VD, kv_indices, kv_indptr, layer_pages, q_offsets, hist_lens, new_lens, splits,
               stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_os, stride_ot, stride_oh,
               stride_pp, stride_pkv, stride_pt, stride_ph, alpha, inv_norm,
               PAGE_SIZE: gl.constexpr, PAGED: gl.constexpr, HEAVY_FIRST: gl.constexpr, HEAD_DIM: gl.constexpr,
               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, TC: gl.constexpr,
               num_warps: gl.constexpr):
    dt: gl.constexpr = Q.dtype.element_ty
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TC, TC], [num_warps, 1], [1, 0])
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dt)
    kv_sl: gl.constexpr = KD.layout

    pid = gl.program_id(0)
    pid_m = pid // splits
    if HEAVY_FIRST:  # the last query tiles first: under a causal mask they see the most keys
        pid_m = gl.num_programs(0) // splits - 1 - pid_m
    split = pid % splits
    b = gl.program_id(1)
    h = gl.program_id(2)
    m0 = pid_m * BLOCK_M
    if PAGED:
        page_base = gl.load(kv_indptr + b).to(gl.int64)
    else:
        page_base = 0
    q_start = gl.load(q_offsets + b).to(gl.int64)
    q_len = (gl.load(q_offsets + b + 1) - q_start).to(gl.int32)
    hist = gl.load(hist_lens + b).to(gl.int32)
    new = gl.load(new_lens + b).to(gl.int32)
    if m0 >= q_len:
        return
    # the tile's key range: up to the last key its last row sees; unmasked blocks up to its first row's
    last = gl.minimum(m0 + BLOCK_M, q_len) - 1
    q_last = gl.where(last < new, hist - new + last, hist - 1)
    kv_end = gl.minimum(hist, q_last + 1)
    nb = (gl.maximum(kv_end, 0) + BLOCK_N - 1) // BLOCK_N
    kv_lo = (nb * split // splits) * BLOCK_N
    kv_hi = gl.minimum(kv_end, (nb * (split + 1) // splits) * BLOCK_N)
    q_first = gl.where(m0 < new, hist - new + m0, hist - 1)
    full_hi = gl.maximum(kv_lo, gl.minimum(kv_hi, ((q_first + 1) // BLOCK_N) * BLOCK_N))
    n_full = (full_hi - kv_lo) // BLOCK_N

    rows_ld = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld_layout))
    d_ld = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ld_layout))
    row_ok_ld = rows_ld < q_len
    q_rows = q_start + rows_ld
    q = gl.load(Q + q_rows[:, None] * stride_qt + h * stride_qh + d_ld[None, :], mask=row_ok_ld[:, None], other=0.0)
    q_smem = gl.allocate_shared_memory(dt, [BLOCK_M, HEAD_DIM], q_sl, q)
    k_bufs = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, HEAD_DIM], kv_sl)
    v_bufs = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, HEAD_DIM], kv_sl)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()
    gl.thread_barrier()

    if PAGED:  # the table seen as rows of H * D: a page's rows, the values' offset, a head's column
        rows_pp = stride_pp // stride_pt
        v_rows = (stride_pkv // stride_pt).to(gl.int32)
        col = (h * stride_ph).to(gl.int32)
    else:
        rows_pp = 0
        v_rows = 0
        col = (h * stride_kh).to(gl.int32)
    key_row0 = q_start.to(gl.int32)
    for i in gl.static_range(STAGES):
        if i < n_full:
            row = _key_row(kv_indices, page_base, layer_pages, kv_lo + i * BLOCK_N, rows_pp, key_row0, PAGE_SIZE, PAGED)
            _issue(KD, VD, row, col, v_rows, bars.index(i), k_bufs.index(i), v_bufs.index(i))

    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    if n_full > 0:
        mbarrier.wait(bars.index(0), 0)
        s = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), s_zero, use_acc=False)
        p = gl.convert_layout(_silu(s, alpha).to(dt), p_layout)
        for j in range(0, n_full - 1):
            st = (j + 1) % STAGES
            # the refill's page index loaded now, its latency under this block's MMAs (NOTE: on the H200,
            # docs/BENCHMARKS.md: 6% off the launch at head_dim 256 / bs 8, 4% at 128 / bs 8, same bits)
            row = _key_row(kv_indices, page_base, layer_pages, kv_lo + gl.minimum(j + STAGES, n_full - 1) * BLOCK_N,
                           rows_pp, key_row0, PAGE_SIZE, PAGED)
            mbarrier.wait(bars.index(st), ((j + 1) // STAGES) & 1)
            # the next block's q k^T, then this block's p v; the SiLU of the next runs during the p v
            s = warpgroup_mma(q_smem, k_bufs.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            acc = warpgroup_mma(p, v_bufs.index(j % STAGES), acc, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s, ))
            p = gl.convert_layout(_silu(s, alpha).to(dt), p_layout)
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            if j + STAGES < n_full:
                gl.thread_barrier()  # every warp is done with the stage before TMA overwrites it
                _issue(KD, VD, row, col, v_rows, bars.index(j % STAGES), k_bufs.index(j % STAGES),
                       v_bufs.index(j % STAGES))
        acc = warpgroup_mma(p, v_bufs.index((n_full - 1) % STAGES), acc)

    # masked blocks (the causal edge, a partial last page): pointer loads with zeros past kv_hi
    if full_hi < kv_hi:
        km = gl.allocate_shared_memory(dt, [BLOCK_N, HEAD_DIM], kv_sl)
        vm = gl.allocate_shared_memory(dt, [BLOCK_N, HEAD_DIM], kv_sl)
        rows_s = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        qpos = gl.where(rows_s < new, hist - new + rows_s, hist - 1)
        row_ok_s = rows_s < q_len
        for n0 in range(full_hi, kv_hi, BLOCK_N):
            cols_ld = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld_layout))
            ok = cols_ld < kv_hi
            if PAGED:
                page = gl.load(kv_indices + page_base + cols_ld // PAGE_SIZE, mask=ok, other=0).to(gl.int64) \
                    + layer_pages
                base = page * stride_pp + (cols_ld % PAGE_SIZE).to(gl.int64) * stride_pt + h * stride_ph
                kt = gl.load(KV + base[:, None] + d_ld[None, :], mask=ok[:, None], other=0.0)
                vt = gl.load(KV + stride_pkv + base[:, None] + d_ld[None, :], mask=ok[:, None], other=0.0)
            else:
                key_rows = q_start + cols_ld
                kt = gl.load(K + (key_rows * stride_kt + h * stride_kh)[:, None] + d_ld[None, :], mask=ok[:, None],
                             other=0.0)
                vt = gl.load(V + (key_rows * stride_vt + h * stride_vh)[:, None] + d_ld[None, :], mask=ok[:, None],
                             other=0.0)
            gl.thread_barrier()
            km.store(kt)
            vm.store(vt)
            fence_async_shared()
            gl.thread_barrier()
            s = warpgroup_mma(q_smem, km.permute((1, 0)), s_zero, use_acc=False)
            cols_s = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            allowed = (cols_s[None, :] <= qpos[:, None]) & (cols_s < kv_hi)[None, :] & row_ok_s[:, None]
            p = gl.where(allowed, _silu(s, alpha), 0.0)
            acc = warpgroup_mma(gl.convert_layout(p.to(dt), p_layout), vm, acc)

    # a candidate also sees itself, added by the tile's first split: its own weight times its own value
    # (NOTE: taking the weight before the key loop instead, its key's load under the first blocks' TMA,
    # was measured on the H200 and not kept: the launch -2.3% to +3.0%, slower at head_dim 128 / bs 1,
    # walls within 1%; docs/BENCHMARKS.md)
    if (split == 0) & (last >= new):
        w_o = _self_weight(Q, K, q_smem, q_start, m0, q_len, new, h, stride_kt, stride_kh, alpha, HEAD_DIM, BLOCK_M,
                           o_layout, num_warps)
        acc = _add_self(V, acc, w_o, q_start, m0, q_len, new, h, stride_vt, stride_vh, HEAD_DIM, BLOCK_M, o_layout)

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    rows_o = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    d_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    out_rows = q_start + rows_o
    out_ptrs = Out + split.to(gl.int64) * stride_os + out_rows[:, None] * stride_ot + h * stride_oh + d_o[None, :]
    gl.store(out_ptrs, (acc * inv_norm).to(Out.dtype.element_ty), mask=(rows_o < q_len)[:, None])


def _rows(t: torch.Tensor, block_n: int, layout) -> TensorDescriptor:
    """A TMA descriptor over ``[T, H, D]`` keys or values seen as ``T`` rows of ``H * D`` (`tma_covers_rows`)."""
    return TensorDescriptor(t, [t.shape[0], t.shape[1] * t.shape[2]], [t.stride(0), 1], [block_n, t.shape[2]], layout)


def launch(grid, q, k, v, target, kv, kv_indices, kv_indptr, layer_pages, q_offsets, hist_lens, new_lens, splits,
           split_stride, strides, alpha, inv_norm, blocks, heavy_first=None) -> None:
    """Launch `_paged_fwd` over ``grid`` (``hstu_attention._launch``'s split grid and arguments);
    ``blocks``: (BLOCK_M, BLOCK_N, warps, stages), BLOCK_M 16 rows a warp. ``kv`` None: the full pass
    (keys and values read from ``k`` and ``v``, ``hist_lens`` = ``new_lens``: every row a query);
    ``heavy_first`` (default: the full pass) runs the query tiles last to first."""
    block_m, block_n, warps, stages = blocks
    dim = q.shape[2]
    paged = kv is not None
    layout = gl.NVMMASharedLayout.get_default_for([block_n, dim], gl.bfloat16)
    if paged:
        kd = vd = TensorDescriptor.from_tensor(kv.view(-1, kv.stride(-3)), [block_n, dim], layout)
    else:
        kd, vd = _rows(k, block_n, layout), _rows(v, block_n, layout)
    _paged_fwd[grid](
        q, k, v, target, kv if paged else k, kd, vd, kv_indices, kv_indptr, layer_pages, q_offsets, hist_lens,
        new_lens, splits, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), split_stride,
        target.stride(-3), target.stride(-2), *strides, float(alpha), float(inv_norm),
        PAGE_SIZE=kv.shape[-3] if paged else block_n, PAGED=paged,
        HEAVY_FIRST=not paged if heavy_first is None else bool(heavy_first), HEAD_DIM=dim, BLOCK_M=block_m,
        BLOCK_N=block_n, STAGES=stages, TC=min(32, dim // 8), num_warps=warps)


def supported(q: torch.Tensor, kv: torch.Tensor | None, blocks, k: torch.Tensor | None = None,
              v: torch.Tensor | None = None) -> str | None:
    """Why this kernel cannot take a launch (None: it can); ``kv`` None: the full pass over ``k`` and ``v``."""
    block_m, block_n, warps, _ = blocks
    tensors = (q, kv) if kv is not None else (q, k, v)
    if any(t.dtype != torch.bfloat16 for t in tensors):
        names = "q, the table" if kv is not None else "q, k, v"
        return f"bf16 only, got {', '.join(str(t.dtype) for t in tensors)} ({names})"
    if not (q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9):
        return "Hopper only (warpgroup MMA)"
    if q.shape[2] not in (64, 128, 256):
        return f"head_dim 64, 128 or 256 only, got {q.shape[2]}"
    if block_m != 16 * warps or (kv is not None and kv.shape[-3] % block_n):
        page = f"page {kv.shape[-3]}, " if kv is not None else ""
        return f"pages a multiple of BLOCK_N and 16 query rows a warp only: {page}blocks {blocks}"
    if kv is not None and not tma_covers(kv):
        return "a non-empty, contiguous, 16-byte aligned table of fewer than 2^31 rows only (one TMA descriptor)"
    if kv is None and not (tma_covers_rows(k) and tma_covers_rows(v)):
        return ("keys and values one TMA descriptor covers only (heads packed, 16-byte aligned base and row stride, "
                f"fewer than 2^31 rows): k strides {k.stride()}, v strides {v.stride()}")
    return None
