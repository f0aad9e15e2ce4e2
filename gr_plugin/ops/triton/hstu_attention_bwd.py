"""Triton backward of the full (jagged) HSTU attention, and the autograd function training runs on CUDA.

Owns the gradient of `gr_plugin.ops.triton.hstu_attention.hstu_attention_jagged` (the forward stays
there); the semantics are the pure-torch reference's (`gr_plugin.ops.pytorch.hstu_attention`). Per user
and head, with ``s = alpha q_i.k_j``, ``w = SiLU(s) / n_norm`` where the mask allows (i, j) and
``out_i = sum_j w_ij v_j``:

- ``dv_j = sum_i w_ij do_i``;
- ``dp_ij = (do_i . v_j) SiLU'(s) alpha / n_norm`` (allowed pairs), ``SiLU'(s) = sig(s) (1 + s (1 - sig(s)))``;
- ``dq_i = sum_j dp_ij k_j`` and ``dk_j = sum_i dp_ij q_i``.

HSTU has no softmax, so nothing of the forward is kept but its inputs: no row statistics, no output.
Two kernels, each recomputing the scores: one program per (key block, user, head) sums ``dk``/``dv``
over the query blocks that see those keys; one per (query block, user, head) sums ``dq`` over the key
blocks it sees. Each gradient row is written by one program (no atomics: the same bits every run).
Products are accumulated in fp32; bf16/fp16 operands of the second products (``w``, ``dp``) are rounded
to the inputs' dtype as the forward rounds its weights; fp32 inputs take the forward's fp32 dots
(`hstu_attention.FP32_DOTS`). The mask
(history causal, a candidate sees the history and itself) as a pair test: ``j <= i and (j < hist or
i == j)``. Works under ``TRITON_INTERPRET=1`` on CPU tensors, which the CPU tests use.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gr_plugin.ops.kernel_grad import refuse_second_order
from gr_plugin.ops.triton import hstu_attention as fwd


@triton.jit
def _pairs(q, k, rows, cols, seq_len, hist, alpha, DOTS: tl.constexpr):
    """``s = alpha q k^T`` of a query block and a key block (fp32), and the mask of pairs it may use."""
    s = tl.dot(q, tl.trans(k), input_precision=DOTS) * alpha
    i = rows[:, None]
    j = cols[None, :]
    allowed = (j <= i) & ((j < hist) | (i == j)) & (i < seq_len)
    return s, allowed


@triton.jit
def _dot(a, b, DOTS: tl.constexpr):
    return tl.dot(a, b, input_precision=DOTS)


@triton.jit
def _bwd_dkdv(Q, K, V, DO, DK, DV, seq_offsets, num_candidates, alpha, inv_norm, stride_qt, stride_qh, stride_kt,
              stride_kh, stride_vt, stride_vh, stride_dt, stride_dh, stride_gt, stride_gh, HEAD_DIM: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOTS: tl.constexpr):
    """``dk``/``dv`` of keys ``n0..n0+BLOCK_N`` of one user and head: over query rows from the block's own
    (a key is seen by rows at or after it) to the sequence's end, or to the block's end for a block of
    candidates' keys only (each seen by its own row alone)."""
    n0 = tl.program_id(0) * BLOCK_N
    b = tl.program_id(1)
    h = tl.program_id(2)
    start = tl.load(seq_offsets + b)
    seq_len = (tl.load(seq_offsets + b + 1) - start).to(tl.int32)
    if n0 >= seq_len:
        return
    hist = seq_len - tl.load(num_candidates + b).to(tl.int32)
    d = tl.arange(0, HEAD_DIM)
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = cols < seq_len
    c64 = (start + cols).to(tl.int64)[:, None]
    k = tl.load(K + c64 * stride_kt + h * stride_kh + d[None, :], mask=col_ok[:, None], other=0.0)
    v = tl.load(V + c64 * stride_vt + h * stride_vh + d[None, :], mask=col_ok[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    m_end = tl.where(n0 < hist, seq_len, tl.minimum(seq_len, n0 + BLOCK_N))
    for m0 in range((n0 // BLOCK_M) * BLOCK_M, m_end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        r64 = (start + rows).to(tl.int64)[:, None]
        row_ok = rows < seq_len
        q = tl.load(Q + r64 * stride_qt + h * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0)
        do = tl.load(DO + r64 * stride_dt + h * stride_dh + d[None, :], mask=row_ok[:, None], other=0.0)
        s, allowed = _pairs(q, k, rows, cols, seq_len, hist, alpha, DOTS)
        sig = tl.sigmoid(s)
        w = tl.where(allowed, s * sig, 0.0)
        dv = dv + _dot(tl.trans(w.to(do.dtype)), do, DOTS)
        dw = _dot(do, tl.trans(v), DOTS)
        dp = tl.where(allowed, dw * sig * (1.0 + s * (1.0 - sig)), 0.0)
        dk = dk + _dot(tl.trans(dp.to(q.dtype)), q, DOTS)
    g_off = c64 * stride_gt + h * stride_gh + d[None, :]
    tl.store(DK + g_off, (dk * (alpha * inv_norm)).to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(DV + g_off, (dv * inv_norm).to(DV.dtype.element_ty), mask=col_ok[:, None])


@triton.jit
def _bwd_dq(Q, K, V, DO, DQ, seq_offsets, num_candidates, alpha, inv_norm, stride_qt, stride_qh, stride_kt,
            stride_kh, stride_vt, stride_vh, stride_dt, stride_dh, stride_gt, stride_gh, HEAD_DIM: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOTS: tl.constexpr):
    """``dq`` of query rows ``m0..m0+BLOCK_M`` of one user and head: over the history keys up to the
    block's last row, then (a block holding candidates) the keys of its own rows, each seen by its row."""
    m0 = tl.program_id(0) * BLOCK_M
    b = tl.program_id(1)
    h = tl.program_id(2)
    start = tl.load(seq_offsets + b)
    seq_len = (tl.load(seq_offsets + b + 1) - start).to(tl.int32)
    if m0 >= seq_len:
        return
    hist = seq_len - tl.load(num_candidates + b).to(tl.int32)
    d = tl.arange(0, HEAD_DIM)
    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < seq_len
    r64 = (start + rows).to(tl.int64)[:, None]
    q = tl.load(Q + r64 * stride_qt + h * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + r64 * stride_dt + h * stride_dh + d[None, :], mask=row_ok[:, None], other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    last = tl.minimum(m0 + BLOCK_M, seq_len) - 1
    hist_end = tl.cdiv(tl.minimum(hist, last + 1), BLOCK_N) * BLOCK_N  # key blocks holding seen history keys
    # NOTE: the candidates' own keys lie at or after m0; the blocks between hist_end and m0 hold none a row sees
    own_start = tl.maximum(hist_end, (m0 // BLOCK_N) * BLOCK_N)
    own_end = tl.where(last >= hist, last + 1, own_start)
    for n0 in range(0, hist_end + (own_end - own_start), BLOCK_N):
        n = tl.where(n0 < hist_end, n0, own_start + (n0 - hist_end))
        cols = n + tl.arange(0, BLOCK_N)
        col_ok = cols < seq_len
        c64 = (start + cols).to(tl.int64)[:, None]
        k = tl.load(K + c64 * stride_kt + h * stride_kh + d[None, :], mask=col_ok[:, None], other=0.0)
        v = tl.load(V + c64 * stride_vt + h * stride_vh + d[None, :], mask=col_ok[:, None], other=0.0)
        s, allowed = _pairs(q, k, rows, cols, seq_len, hist, alpha, DOTS)
        sig = tl.sigmoid(s)
        dw = _dot(do, tl.trans(v), DOTS)
        dp = tl.where(allowed, dw * sig * (1.0 + s * (1.0 - sig)), 0.0)
        dq = dq + _dot(dp.to(k.dtype), k, DOTS)
    tl.store(DQ + r64 * stride_gt + h * stride_gh + d[None, :], (dq * (alpha * inv_norm)).to(DQ.dtype.element_ty),
             mask=row_ok[:, None])


def blocks(head_dim: int, dtype: torch.dtype, device: torch.device,
           fp32_dots: str | None = None) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of both backward kernels, by head size, element size,
    device and, for fp32, the dots' precision (`hstu_attention.dot_precision`).

    NOTE: measured on the H200 (`scripts/gpu/tune_attention_bwd.py`, bs 8, 2048-event histories + 256
    candidates, 4 heads, the backward alone; docs/BENCHMARKS.md, "Training"): bf16 at head_dim 128, 128x64
    tiles on 8 warps 0.863 ms (64x64 on 4 warps 0.948, on 8 warps 1.37); at 256 the same tiles 1.42 ms
    (64x32 on 4 warps 2.17); at 64, 64x64 on 4 warps 0.550 (128x64 0.657). The 128x64 tiles take 98-213 KB
    of shared memory (head_dim 128-256), so only a device with about 200 KB a block (Hopper) gets them;
    others take 64x64 at 128 (57-73 KB) and 32x32 at 256 (57-67 KB), not measured for speed. fp32 (IEEE
    FMA dots) at 128: 32x32 tiles 23.7 ms, 16x32 27.0, 32x64 403 (spilled) -- slower than the reference's
    forward and backward (13.8 ms). fp32 on tf32x3 dots (the default; same sweep, 2026-12-02 from 15:05):
    16x32 tiles 5.68 ms at 128 (32x32 6.86, 32x64 9.52, 64x32 12.7; with the forward 7.0 ms against the
    reference's 12.6) and 22.2 at 256 (32x32 222: spilled; larger tiles out of shared memory; with the
    forward 25.7 against 18.4). Smaller heads on tf32x3 (2026-12-02 from 17:09, call 1) take larger tiles:
    head_dim 64 64x32 2.53 ms (16x32 3.01, 32x32 2.82, 64x64 3.06), 32 and 16 64x64 1.12 / 0.845 ms (16x32
    3.04 / 2.74). Not measured: those heads on IEEE dots (32x32, as at 128), fp16 (bf16's tiles)."""
    if dtype.itemsize == 4:
        if fwd.dot_precision(dtype, fp32_dots) == "ieee":
            return 32, 32, 4, 1
        return (64, 64, 4, 1) if head_dim <= 32 else (64, 32, 4, 1) if head_dim <= 64 else (16, 32, 4, 1)
    if head_dim >= 128 and fwd._large_tiles_fit(device):
        return 128, 64, 8, 1
    if head_dim >= 256:
        return 32, 32, 4, 1
    return 64, 64, 4, 1


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` ``[T, H, D]`` with unit stride on D (the kernels take any T and H strides: a layer's q, k, v
    are views of one projection)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def hstu_attention_jagged_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   seq_offsets: torch.Tensor, num_candidates: torch.Tensor, *, alpha: float,
                                   n_norm: float, max_seq_len: int,
                                   tiles: tuple[int, int, int, int] | None = None,
                                   needs: tuple[bool, bool, bool] = (True, True, True),
                                   fp32_dots: str | None = None,
                                   ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(dq, dk, dv)`` ``[T, H, D]`` of the full-sequence attention given ``dout``; rows outside every
    sequence get zeros. ``tiles``: (BLOCK_M, BLOCK_N, num_warps, num_stages), default `blocks`. ``needs``:
    which of the three to compute (None for the others; dk and dv come from one kernel). ``fp32_dots``: the
    dots' precision for fp32 inputs (`hstu_attention.dot_precision`; None: its ``FP32_DOTS``)."""
    if q.shape != k.shape or v.shape != k.shape or dout.shape != q.shape or q.dim() != 3:
        raise ValueError(f"dout, q, k, v must share a [T, H, D] shape, got {tuple(dout.shape)}, {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    dots = fwd.dot_precision(q.dtype, fp32_dots)
    q, k, v, dout = (_unit_stride(t) for t in (q, k, v, dout.to(q.dtype)))
    _, heads, dim = q.shape
    bsz = seq_offsets.numel() - 1
    dq = torch.zeros_like(q, memory_format=torch.contiguous_format) if needs[0] else None
    dk, dv = ((torch.zeros_like(q, memory_format=torch.contiguous_format) for _ in range(2))
              if needs[1] or needs[2] else (None, None))
    if bsz == 0 or q.shape[0] == 0 or max_seq_len <= 0:
        return dq, (dk if needs[1] else None), (dv if needs[2] else None)
    block_m, block_n, warps, stages = tiles or blocks(dim, q.dtype, q.device, fp32_dots)
    common = dict(HEAD_DIM=dim, BLOCK_M=block_m, BLOCK_N=block_n, DOTS=dots, num_warps=warps, num_stages=stages)
    strides = (*q.stride()[:2], *k.stride()[:2], *v.stride()[:2], *dout.stride()[:2], heads * dim, dim)
    args = (seq_offsets, num_candidates, float(alpha), 1.0 / float(n_norm), *strides)
    if dk is not None:
        _bwd_dkdv[(triton.cdiv(max_seq_len, block_n), bsz, heads)](q, k, v, dout, dk, dv, *args, **common)
    if dq is not None:
        _bwd_dq[(triton.cdiv(max_seq_len, block_m), bsz, heads)](q, k, v, dout, dq, *args, **common)
    return dq, (dk if needs[1] else None), (dv if needs[2] else None)


class JaggedAttention(torch.autograd.Function):
    """The full-sequence attention with a gradient: the Triton forward, the backward above (first-order
    only: `gr_plugin.ops.kernel_grad`)."""

    @staticmethod
    def forward(q, k, v, seq_offsets, num_candidates, alpha, n_norm, max_seq_len):
        return fwd.hstu_attention_jagged(q, k, v, seq_offsets, num_candidates, alpha=alpha, n_norm=n_norm,
                                         max_seq_len=max_seq_len)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, seq_offsets, num_candidates, alpha, n_norm, max_seq_len = inputs
        ctx.save_for_backward(q, k, v, seq_offsets, num_candidates)
        ctx.sizes = (alpha, n_norm, max_seq_len)

    @staticmethod
    def backward(ctx, dout):
        refuse_second_order("the Triton")
        q, k, v, seq_offsets, num_candidates = ctx.saved_tensors
        alpha, n_norm, max_seq_len = ctx.sizes
        dq, dk, dv = hstu_attention_jagged_backward(dout, q, k, v, seq_offsets, num_candidates, alpha=alpha,
                                                    n_norm=n_norm, max_seq_len=max_seq_len,
                                                    needs=tuple(ctx.needs_input_grad[:3]))
        return dq, dk, dv, None, None, None, None, None


def hstu_attention_jagged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_offsets: torch.Tensor,
                          num_candidates: torch.Tensor, *, alpha: float, n_norm: float,
                          max_seq_len: int) -> torch.Tensor:
    """`gr_plugin.ops.triton.hstu_attention.hstu_attention_jagged` with a backward (training)."""
    return JaggedAttention.apply(q, k, v, seq_offsets, num_candidates, alpha, n_norm, max_seq_len)
