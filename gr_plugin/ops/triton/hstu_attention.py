"""Triton HSTU attention: one kernel for the full (jagged) and the cached (paged) forms.

Owns the GPU kernel behind `gr_plugin.ops.hstu_attention`; the semantics are the pure-torch
reference's (`gr_plugin.ops.pytorch.hstu_attention`). Per program: one user, one head, BLOCK_M query
rows of that user's query segment. History keys are read block by block, from the jagged ``k``/``v``
(full pass: the segment starts with the whole history) or through the page table (cached step:
``kv_indices``/``kv_indptr``, any page size, keys gathered per row), ``SiLU(alpha q.k) / n_norm`` is
masked (history causal, candidates see all history) and accumulated in fp32; a candidate adds its
own key/value (the diagonal). Key blocks past the last position any query in the block may see are
skipped. Works under ``TRITON_INTERPRET=1`` on CPU tensors (fp32/fp16), which the CPU tests use.

Options of the paged form (`_launch`): full key blocks read through a TMA descriptor when the launch
is captured into a CUDA graph on Hopper or newer (`_use_tma`), and a stream-K grid
(``schedule="stream"``; measured slower than the default split grid on the H200, kept tested). On
Hopper a captured bf16 launch of either form naming no tiles, TMA setting, stream-K, warp
specialisation or exact SiLU takes the Gluon kernel of `hstu_gluon` instead (`_gluon_choice`; faster
on the H200): the same split grid, mask and fp32 parts, its outputs within the project's error rule
but not the Triton kernel's bits (the parts are summed in another split order). This module keeps its
split rule.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from gr_plugin.ops.triton import layer_norm, table_layout, tma_covers
from gr_plugin.ops.triton.parts import sum_splits


@triton.jit
def _load_kv(K, V, KV, KVD, kv_indices, page_base, layer_pages, q_start, n0, kv_hi, h, d, stride_kt, stride_kh,
             stride_vt, stride_vh, stride_pp, stride_pkv, stride_pt, stride_ph,
             PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
             TMA: tl.constexpr, HEAD_DIM: tl.constexpr):
    """K and V ``[BLOCK_N, HEAD_DIM]`` of history positions ``n0..n0+BLOCK_N`` (zeros past ``kv_hi``);
    a page index ``p`` of ``kv_indices`` is page ``layer_pages + p`` of ``KV``. ``TMA`` (unmasked
    blocks within one page): through the tensor descriptor ``KVD`` of the table seen as rows of
    ``stride_pt`` elements (the copy engine of Hopper's TMA instead of per-thread addresses)."""
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = cols < kv_hi
    if PAGED:
        if PAGE_SIZE % BLOCK_N == 0:  # the whole block lies in one page: one index, contiguous rows
            page = tl.load(kv_indices + page_base + n0 // PAGE_SIZE).to(tl.int64) + layer_pages
            if TMA and not MASKED:
                row = (page * (stride_pp // stride_pt) + n0 % PAGE_SIZE).to(tl.int32)
                k = KVD.load([row, h * stride_ph])
                v = KVD.load([row + (stride_pkv // stride_pt).to(tl.int32), h * stride_ph])
                return k, v
            base = page * stride_pp + (n0 % PAGE_SIZE + tl.arange(0, BLOCK_N)).to(tl.int64) * stride_pt \
                + h * stride_ph
        elif MASKED:
            page = tl.load(kv_indices + page_base + cols // PAGE_SIZE, mask=col_ok, other=0).to(tl.int64) + layer_pages
            base = page * stride_pp + (cols % PAGE_SIZE).to(tl.int64) * stride_pt + h * stride_ph
        else:
            page = tl.load(kv_indices + page_base + cols // PAGE_SIZE).to(tl.int64) + layer_pages
            base = page * stride_pp + (cols % PAGE_SIZE).to(tl.int64) * stride_pt + h * stride_ph
        k_ptrs = KV + base[:, None] + d[None, :]
        v_ptrs = KV + stride_pkv + base[:, None] + d[None, :]
    else:
        rows = (q_start + cols).to(tl.int64)
        k_ptrs = K + rows[:, None] * stride_kt + h * stride_kh + d[None, :]
        v_ptrs = V + rows[:, None] * stride_vt + h * stride_vh + d[None, :]
    if MASKED:
        k = tl.load(k_ptrs, mask=col_ok[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=col_ok[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    return k, v


@triton.jit
def _weights(q, k, alpha, DOTS: tl.constexpr, FAST: tl.constexpr):
    """``SiLU(alpha q k^T)`` of a query block and a key block, in fp32; the ``1 / n_norm`` is applied
    once to the accumulated output instead (one multiply per output element, not per weight). The
    weights are rounded to the values' dtype for the second matmul unscaled: in fp16 that overflows
    only where ``alpha q.k`` passes 65504, and no longer underflows small weights divided by n_norm.

    ``FAST`` (CUDA, bf16 only): ``SiLU(y) = y/2 (1 + tanh(y/2))`` with the hardware ``tanh.approx``,
    one special-function op per weight instead of two (exp and reciprocal); its relative error
    (about 2^-11) is below the bf16 rounding the weights get before the second matmul.
    """
    s = tl.dot(q, tl.trans(k), input_precision=DOTS)
    if FAST:
        h = s * (0.5 * alpha)
        t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [h], dtype=tl.float32, is_pure=True, pack=1)
        return h + h * t
    s = s * alpha
    return s * tl.sigmoid(s)


@triton.jit
def _accumulate(acc, p, v, DOTS: tl.constexpr):
    return acc + tl.dot(p.to(v.dtype), v, input_precision=DOTS)


@triton.jit
def _block_count(q_len, hist, new, m0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key blocks that the query rows ``m0..m0+BLOCK_M`` of a user see: the history up to the last
    key any of those rows sees (its own position for a history row, the whole history for a
    candidate). Elementwise: one tile (scalars) or every tile at once (`_stream_tiles`)."""
    last = tl.minimum(m0 + BLOCK_M, q_len) - 1
    kv_end = tl.minimum(hist, tl.where(last < new, hist - new + last, hist - 1) + 1)
    return tl.cdiv(tl.maximum(kv_end, 0), BLOCK_N)


@triton.jit
def _holds_candidates(q_len, new, m0, BLOCK_M: tl.constexpr):
    """Whether the query rows ``m0..m0+BLOCK_M`` of a user hold a candidate (a row past the new
    history tokens), whose own key `_tile` adds."""
    return tl.minimum(m0 + BLOCK_M, q_len) > new


@triton.jit
def _key_blocks(q_offsets, hist_lens, new_lens, b, m0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(q_len, key blocks)`` of the query rows ``m0..m0+BLOCK_M`` of user ``b``."""
    q_len = (tl.load(q_offsets + b + 1) - tl.load(q_offsets + b)).to(tl.int32)
    hist = tl.load(hist_lens + b).to(tl.int32)
    new = tl.load(new_lens + b).to(tl.int32)
    return q_len, _block_count(q_len, hist, new, m0, BLOCK_M, BLOCK_N)


@triton.jit
def _tile(Q, K, V, KV, KVD, kv_indices, page_base, layer_pages, q_offsets, hist_lens, new_lens, b, h, m0,
          blk_lo, blk_hi, first, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
          stride_pp, stride_pkv, stride_pt, stride_ph, alpha,
          PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr, DOTS: tl.constexpr, FAST: tl.constexpr, TMA: tl.constexpr, WS: tl.constexpr):
    """The fp32 sum (before ``1 / n_norm``) over key blocks ``[blk_lo, blk_hi)`` of query rows
    ``m0..m0+BLOCK_M`` of user ``b``, head ``h``, plus each candidate's own key/value when ``first``
    (exactly one of the programs sharing a tile); ``page_base``: the user's first entry in
    ``kv_indices`` (paged form), which the caller loads.

    NOTE: the caller computes where the rows go itself. Inductor's analysis of which arguments a
    kernel writes (a traced launch, AOTInductor) follows a store's address back through its ops, and
    through a function call to every argument of the call: an address built from this function's
    results would mark Q, K, V and the KV table as written, and the table would be copied."""
    q_start = tl.load(q_offsets + b).to(tl.int64)
    q_len = (tl.load(q_offsets + b + 1) - q_start).to(tl.int32)
    hist = tl.load(hist_lens + b).to(tl.int32)
    new = tl.load(new_lens + b).to(tl.int32)
    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len
    d = tl.arange(0, HEAD_DIM)
    q_rows = (q_start + rows).to(tl.int64)
    q = tl.load(Q + q_rows[:, None] * stride_qt + h * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0)
    is_hist = rows < new
    # last key position each query may see: its own position (history) or the last history token
    qpos = tl.where(is_hist, hist - new + rows, hist - 1)
    kv_end = tl.minimum(hist, tl.max(tl.where(row_ok, qpos, -1), axis=0) + 1)
    # NOTE: HSTU attention has no softmax, so sums over key ranges taken by different programs add up.
    kv_lo = blk_lo * BLOCK_N
    kv_hi = tl.minimum(kv_end, blk_hi * BLOCK_N)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # NOTE: key blocks that every query of this block may see need no mask: run them first.
    q_min = tl.min(tl.where(row_ok, qpos, hist), axis=0)
    full_hi = tl.maximum(kv_lo, tl.minimum(kv_hi, ((q_min + 1) // BLOCK_N) * BLOCK_N))
    for n0 in tl.range(kv_lo, full_hi, BLOCK_N, warp_specialize=WS):
        k, v = _load_kv(K, V, KV, KVD, kv_indices, page_base, layer_pages, q_start, n0, kv_hi, h, d, stride_kt,
                        stride_kh, stride_vt, stride_vh, stride_pp, stride_pkv, stride_pt, stride_ph,
                        PAGE_SIZE, PAGED, BLOCK_N, False, TMA, HEAD_DIM)
        acc = _accumulate(acc, _weights(q, k, alpha, DOTS, FAST), v, DOTS)
    for n0 in range(full_hi, kv_hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < kv_hi
        k, v = _load_kv(K, V, KV, KVD, kv_indices, page_base, layer_pages, q_start, n0, kv_hi, h, d, stride_kt,
                        stride_kh, stride_vt, stride_vh, stride_pp, stride_pkv, stride_pt, stride_ph,
                        PAGE_SIZE, PAGED, BLOCK_N, True, TMA, HEAD_DIM)
        allowed = (cols[None, :] <= qpos[:, None]) & col_ok[None, :] & row_ok[:, None]
        acc = _accumulate(acc, tl.where(allowed, _weights(q, k, alpha, DOTS, FAST), 0.0), v, DOTS)
    # A candidate also sees itself, added once, by the program taking the tile's first part, and only
    # where the tile holds candidates: the rows' own keys and values as one more key block, of which
    # each candidate row keeps its diagonal weight.
    # NOTE: measured on the H200 (scripts/gpu/probe_attention_timeline.py, docs/BENCHMARKS.md): as an
    # elementwise row sum in every program, this took ~2.9 us of a ~12 us program at bs 1 (~6.6 us of
    # ~90 at bs 8); as this block, ~2 us (about 1.5 key blocks), in a tile's first program only.
    if first & _holds_candidates(q_len, new, m0, BLOCK_M):
        cand = row_ok & (rows >= new)
        k_own = tl.load(K + q_rows[:, None] * stride_kt + h * stride_kh + d[None, :], mask=cand[:, None], other=0.0)
        v_own = tl.load(V + q_rows[:, None] * stride_vt + h * stride_vh + d[None, :], mask=cand[:, None], other=0.0)
        own = (rows[:, None] == rows[None, :]) & cand[:, None]
        acc = _accumulate(acc, tl.where(own, _weights(q, k_own, alpha, DOTS, FAST), 0.0), v_own, DOTS)
    return acc


@triton.jit
def _stream_tiles(q_offsets, hist_lens, new_lens, bsz, m_blocks, heads,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BSZ_PAD: tl.constexpr, M_PAD: tl.constexpr):
    """Work units of every tile, tiles in order (user, head, query block): a live tile's key blocks,
    at least 1 (a candidate with no history still sees itself); 0 for a tile past its user's queries.
    Returns ``units [BSZ_PAD, M_PAD]`` (per head), their running sum along each row, each user's
    first unit and the total."""
    bi = tl.arange(0, BSZ_PAD)
    mi = tl.arange(0, M_PAD)
    b_ok = bi < bsz
    q_len = (tl.load(q_offsets + bi + 1, mask=b_ok, other=0) - tl.load(q_offsets + bi, mask=b_ok, other=0))
    q_len = q_len.to(tl.int32)[:, None]
    hist = tl.load(hist_lens + bi, mask=b_ok, other=0).to(tl.int32)[:, None]
    new = tl.load(new_lens + bi, mask=b_ok, other=0).to(tl.int32)[:, None]
    m0 = (mi * BLOCK_M)[None, :]
    live = b_ok[:, None] & (mi < m_blocks)[None, :] & (m0 < q_len)
    units = tl.where(live, tl.maximum(_block_count(q_len, hist, new, m0, BLOCK_M, BLOCK_N), 1), 0)
    per_user = tl.sum(units, axis=1) * heads
    user_end = tl.cumsum(per_user, axis=0)
    return units, tl.cumsum(units, axis=1), user_end - per_user, tl.sum(per_user, axis=0)


@triton.jit
def _hstu_fwd(
    Q, K, V, Out, KV, KVD, kv_indices, kv_indptr, layer_pages, q_offsets, hist_lens, new_lens, Part, Done,
    bsz, m_blocks, heads, splits,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_os, stride_ot, stride_oh,
    stride_pp, stride_pkv, stride_pt, stride_ph,
    alpha, inv_norm,
    PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOTS: tl.constexpr, FAST: tl.constexpr,
    TMA: tl.constexpr, WS: tl.constexpr, STREAM: tl.constexpr, BSZ_PAD: tl.constexpr, M_PAD: tl.constexpr,
    REVERSED: tl.constexpr,
):
    d = tl.arange(0, HEAD_DIM)
    if not STREAM:
        # one (query block, key split) per program, grid (m_blocks * splits, bsz, heads). With
        # splits > 1 each split's part goes to its own fp32 slice of Out (split stride ``stride_os``),
        # summed by `_sum_parts` (or by the norm's pass, `layer_norm._sum_ln_mul`, given a norm_gate).
        pid_m = tl.program_id(0) // splits
        split = tl.program_id(0) % splits
        b = tl.program_id(1)
        h = tl.program_id(2)
        m0 = pid_m * BLOCK_M
        # NOTE: the user's first page's place in kv_indices is loaded here with its lengths, not in
        # `_tile` after them and the early return: the first key block's page index waits on it. Its
        # effect was not measured apart (docs/BENCHMARKS.md, the timeline probe).
        page_base = tl.load(kv_indptr + b).to(tl.int64) if PAGED else 0
        q_len, nb = _key_blocks(q_offsets, hist_lens, new_lens, b, m0, BLOCK_M, BLOCK_N)
        if m0 >= q_len:
            return
        # NOTE: split 0 also adds the candidates' own keys (`_tile`), about 1.5 key blocks' time at bs 1
        # on the H200, and the floor split gives it the smallest share of key blocks. Giving it one
        # block fewer was measured (docs/BENCHMARKS.md): no gain at bs 1, 4% slower at head_dim 256, bs 2.
        acc = _tile(Q, K, V, KV, KVD, kv_indices, page_base, layer_pages, q_offsets, hist_lens, new_lens, b, h, m0,
                    nb * split // splits, nb * (split + 1) // splits, split == 0,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                    stride_pp, stride_pkv, stride_pt, stride_ph, alpha,
                    PAGE_SIZE, PAGED, HEAD_DIM, BLOCK_M, BLOCK_N, DOTS, FAST, TMA, WS)
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < q_len
        q_rows = tl.load(q_offsets + b).to(tl.int64) + rows
        out_ptrs = Out + split.to(tl.int64) * stride_os + q_rows[:, None] * stride_ot + h * stride_oh + d[None, :]
        tl.store(out_ptrs, (acc * inv_norm).to(Out.dtype.element_ty), mask=row_ok[:, None])
    else:
        # NOTE: stream-K. The tiles' key blocks, laid end to end, are cut into one equal range per
        # program (a persistent grid of about one program per SM), so a batch with fewer tiles than
        # SMs still fills the GPU and no program waits on a longer one. A tile cut between programs
        # is finished by the last of them to arrive (a per-tile counter of the units done): it adds
        # every part in program order, so the result does not depend on the order of arrival.
        npg = tl.num_programs(0)
        # NOTE: REVERSED (tests): programs take the ranges in reverse, so that under the interpreter,
        # which runs programs one after another, a tile's fix-up is done by its first contributor
        # rather than its last; on a GPU the order of arrival is arbitrary either way.
        pid = npg - 1 - tl.program_id(0) if REVERSED else tl.program_id(0)
        units, run, user_start, total = _stream_tiles(q_offsets, hist_lens, new_lens, bsz, m_blocks, heads,
                                                      BLOCK_M, BLOCK_N, BSZ_PAD, M_PAD)
        bi = tl.arange(0, BSZ_PAD)
        mi = tl.arange(0, M_PAD)
        total64 = total.to(tl.int64)
        u_lo = (pid * total64 // npg).to(tl.int32)
        u_hi = ((pid + 1) * total64 // npg).to(tl.int32)
        r = tl.arange(0, BLOCK_M)
        u = u_lo
        while u < u_hi:
            # the tile holding unit u: its user, head and query block
            b = tl.sum(((user_start <= u) & (bi < bsz)).to(tl.int32), axis=0) - 1
            us = tl.sum(tl.where(bi == b, user_start, 0), axis=0)
            row_units = tl.sum(tl.where((bi == b)[:, None], units, 0), axis=0)
            row_run = tl.sum(tl.where((bi == b)[:, None], run, 0), axis=0)
            per_head = tl.sum(row_units, axis=0)
            h = (u - us) // per_head
            w = u - us - h * per_head
            m = tl.sum((row_run <= w).to(tl.int32), axis=0)
            n_units = tl.sum(tl.where(mi == m, row_units, 0), axis=0)
            ts = us + h * per_head + tl.sum(tl.where(mi == m, row_run, 0), axis=0) - n_units
            te = ts + n_units
            e = tl.minimum(u_hi, te)
            page_base = tl.load(kv_indptr + b).to(tl.int64) if PAGED else 0
            acc = _tile(Q, K, V, KV, KVD, kv_indices, page_base, layer_pages, q_offsets, hist_lens, new_lens, b, h,
                        m * BLOCK_M, u - ts, e - ts, u == ts,
                        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                        stride_pp, stride_pkv, stride_pt, stride_ph, alpha,
                        PAGE_SIZE, PAGED, HEAD_DIM, BLOCK_M, BLOCK_N, DOTS, FAST, TMA, WS)
            q_start = tl.load(q_offsets + b).to(tl.int64)
            rows = m * BLOCK_M + tl.arange(0, BLOCK_M)
            row_ok = rows < (tl.load(q_offsets + b + 1) - q_start).to(tl.int32)
            q_rows = q_start + rows
            out_ptrs = Out + q_rows[:, None] * stride_ot + h * stride_oh + d[None, :]
            if (u == ts) & (e == te):  # the whole tile is this program's
                tl.store(out_ptrs, (acc * inv_norm).to(Out.dtype.element_ty), mask=row_ok[:, None])
            else:
                # a program's part of its first tile goes to its slot 0, of its last tile to slot 1
                slot = (u != u_lo).to(tl.int32)
                tl.store(Part + ((pid * 2 + slot) * BLOCK_M + r)[:, None] * HEAD_DIM + d[None, :], acc)
                tl.debug_barrier()
                tile = (b * heads + h) * m_blocks + m
                done = tl.atomic_add(Done + tile, e - u, sem="acq_rel", scope="gpu") + (e - u)
                if done == n_units:
                    tl.debug_barrier()
                    out = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
                    p_lo = tl.maximum(ts.to(tl.int64) * npg // total64 - 1, 0).to(tl.int32)
                    p_hi = tl.minimum(te.to(tl.int64) * npg // total64 + 2, npg).to(tl.int32)
                    for p in range(p_lo, p_hi):
                        pl = (p * total64 // npg).to(tl.int32)
                        ph = ((p + 1) * total64 // npg).to(tl.int32)
                        if (pl < te) & (ph > ts) & (ph > pl):
                            ps = (pl < ts).to(tl.int32)
                            out += tl.load(Part + ((p * 2 + ps) * BLOCK_M + r)[:, None] * HEAD_DIM + d[None, :],
                                           cache_modifier=".cg")
                    tl.store(out_ptrs, (out * inv_norm).to(Out.dtype.element_ty), mask=row_ok[:, None])
            u = e


@triton.jit
def _sum_parts(Part, Out, q_offsets, bsz, n_part, row_elems, splits, BLOCK: tl.constexpr):
    """``Out = sum over splits of Part[split]`` in split order, fp32, rounded once; rows past the
    last user's (trailing rows no user owns, which no program writes) are 0."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = (offs < tl.load(q_offsets + bsz).to(tl.int64) * row_elems) & (offs < n_part)
    acc = sum_splits(Part + offs, live, splits, n_part)
    tl.store(Out + offs, acc.to(Out.dtype.element_ty), mask=offs < n_part)


SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
# The dots of fp32 inputs (Triton's ``input_precision``); 16-bit inputs run theirs on tensor cores as they are.
# NOTE: "tf32x3" (three TF32 tensor-core products a dot: the operands' high and low parts) is the default:
# measured on the H200 (`scripts/gpu/probe_fp32_dots.py`, docs/BENCHMARKS.md, "fp32 dots on tf32x3") its
# error against fp64 is at or below "ieee"'s (FMA dots, operands in registers; forward 9.6e-6 against
# 1.0-1.7e-5 at head_dim 128) and the forward 2.2-2.6x faster at head_dim 128 (1.1-3.4x over 16-256); plain
# "tf32" had 3.3-3.9x (forward) and 2.6-3.5x (backward) the error of cuBLAS's TF32 and failed the error rule.
# GR_PLUGIN_FP32_DOTS (read at import) or a launch's ``fp32_dots`` names another. A CUDA graph, an Inductor
# trace or an AOTInductor package keeps the precision it was made with.
FP32_DOT_CHOICES = ("tf32x3", "ieee", "tf32")
FP32_DOTS = os.environ.get("GR_PLUGIN_FP32_DOTS") or "tf32x3"  # (set but empty: the default)


def dot_precision(dtype: torch.dtype, fp32_dots: str | None = None) -> str:
    """The kernels' ``input_precision`` for inputs of ``dtype``: ``fp32_dots`` (None: `FP32_DOTS`) for
    fp32, Triton's default ("tf32", which 16-bit operands do not use) otherwise."""
    choice = FP32_DOTS if fp32_dots is None else fp32_dots
    if choice not in FP32_DOT_CHOICES:
        name = "fp32_dots" if fp32_dots is not None else "GR_PLUGIN_FP32_DOTS"
        raise ValueError(f"{name} must be one of {FP32_DOT_CHOICES}, got {choice!r}")
    return choice if dtype == torch.float32 else "tf32"


# NOTE: on by default since the kernel's GPU tests (tests/ops/test_triton_attention.py, the bf16 error
# rule, both settings) passed on the H200; GR_PLUGIN_FAST_SILU=0 turns it off.
FAST_SILU = os.environ.get("GR_PLUGIN_FAST_SILU", "1") == "1"
# GR_PLUGIN_ATTENTION_SCHEDULE=split|stream: the grid (`_launch`, default split); GR_PLUGIN_ATTENTION_TMA=0:
# plain pointer loads everywhere (the Triton kernel only: a launch naming kernel="gluon" keeps its TMA loads).
SCHEDULE = os.environ.get("GR_PLUGIN_ATTENTION_SCHEDULE", "split")
TMA = os.environ.get("GR_PLUGIN_ATTENTION_TMA", "1") == "1"
# GR_PLUGIN_ATTENTION_GLUON=0: the Triton kernel for graphed launches too (`_gluon_tiles`; GR_PLUGIN_ATTENTION_TMA=0,
# which the Gluon kernel's loads need, turns it off as well).
GLUON = os.environ.get("GR_PLUGIN_ATTENTION_GLUON", "1") == "1"
# GR_PLUGIN_ATTENTION_GLUON_FULL=0: the full pass's graphed launches keep the Triton kernel (the paged ones still
# take the Gluon kernel); the block bench's recompute baseline side by side with both kernels.
GLUON_FULL = os.environ.get("GR_PLUGIN_ATTENTION_GLUON_FULL", "1") == "1"
# NOTE: the Gluon kernel's tiles (`hstu_gluon`) per head_dim, and its split rule's makespan constants
# (`_makespan`'s model: µs per history key of a program's query tile, µs per program). Measured on the
# H200 (`scripts/gpu/gluon_attention.py time` and `grid`, graphed, the norm gate included;
# docs/BENCHMARKS.md): head_dim 128 on 3 stages, 256 on 4 (149.5 vs 164.4 µs at bs 8); the constants
# fitted by `scripts/fit_makespan.py` over histories 1024 / 4096 / 16384 and bs 1-32 (mean relative error
# 13% and 4.4%), whose count was the measured best in 31 of 36 cases, at most 14.5% slower in the others.
# Keyed by (head_dim, tiles): other tiles (``kernel="gluon"`` naming them) take the one-wave rule.
GLUON_TILES = {128: (64, 64, 4, 3), 256: (64, 32, 4, 4)}
GLUON_MAKESPAN = {(128, (64, 64, 4, 3)): (0.01172, 7.62), (256, (64, 32, 4, 4)): (0.01983, 8.14)}
# NOTE: the Gluon kernel's tiles for the full pass (keys and values read from the step's own k / v, the query
# tiles heaviest first), per head_dim; their split count is the one-wave rule's (`_plan`). Measured on the H200
# (`scripts/gpu/gluon_attention.py full`, graphed, 4096 history + 256 candidates; docs/BENCHMARKS.md): the
# fastest of the tiles tried at head_dim 128 (bs 8: 324 µs, Triton 398) and at head_dim 256 bs 1 and 2; at
# 256 / bs 8 the 128-row tiles took 719 µs ((128, 64, 8, 2) in order) and 731 ((128, 32, 8, 3)) against these
# tiles' 798, but 10-20% longer at bs 1 and 2 (not taken: a rule by size).
GLUON_FULL_TILES = {128: (64, 64, 4, 3), 256: (64, 32, 4, 4)}


def _blocks(head_dim: int, dtype: torch.dtype, paged: bool, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) by head size, element size, form and device.

    NOTE: measured on the H200 (`scripts/gpu/tune_attention.py`, every split count per config,
    docs/BENCHMARKS.md): the paged form at head_dim 128 in bf16 runs fastest with 128x128 tiles and
    8 warps (0.103 ms vs 0.112 ms for 64x64 at bs 8); the jagged form prefers 64x64. Those tiles
    take ~160 KB of shared memory, so only devices with about 200 KB per block (Hopper) get them.

    fp32 takes its own, smaller tiles, measured first for ``input_precision="ieee"`` (FMA dots whose
    operands sit in registers) and kept for "tf32x3" (`FP32_DOTS`). NOTE: measured on the H200
    (`scripts/gpu/tune_fp32_attention.py`, docs/BENCHMARKS.md, "The fp32 kernel's tiles"): at
    head_dim 128, bs 8, the 64x64 tiles on 3 stages it had before ran
    the jagged form (512-event histories + 64 candidates) in 5.94 ms and the paged one (1024-token
    histories, 16 of them new) in 1.90 ms (register spills, presumably; not profiled); 32x64 tiles
    on 1 stage in 0.369 and 0.218 ms (the torch reference: 2.0 and 2.15 ms). At head_dim 256 the
    64x32 tiles took 17.5 ms, 16x32 1.02 ms; at 64, 64x64 2.49 ms, 32x64 0.193 ms. Head sizes 16
    and 32 (same sweep, 2026-12-02 from 11:19): 64x64 on 3 stages stays the best or within 2% at 32
    (jagged 0.095 ms, paged 0.063; 32x32: 0.109 and 0.068) and for the jagged form at 16 (0.069 vs
    32x32's 0.068); the paged form at 16 takes 32x32 on 1 stage (0.059 ms vs 0.125). On tf32x3 dots
    (same script, ``--dots tf32x3 ieee``, 2026-12-02 from 15:05) these tiles were the fastest tried or
    within 10% (the same tiles timed twice differed by 8%) at head_dim 128 (jagged 0.141 ms against 0.368
    on IEEE dots; paged 0.101 / 0.219) and everywhere 1.1-3.4x faster than IEEE, except for the jagged
    form at 64, where 32x32 took 0.095 ms against these 0.130 (not taken: the rule would depend on the
    precision for one case); at 128 and 256 the larger tiles tried (64x64 / 64x32 on 2-3 stages, 128x32)
    were slower or out of shared memory, and 32x64 on 8 warps at 128 slower (jagged 0.168 against 0.140)."""
    if dtype.itemsize == 4 and head_dim >= 64:
        return (16, 32, 4, 1) if head_dim >= 256 else (32, 64, 4, 1)
    if dtype.itemsize == 4 and head_dim <= 16 and paged:
        return 32, 32, 4, 1
    if head_dim >= 256:
        return 64, 32, 4, 2
    if head_dim >= 128 and paged and dtype.itemsize == 2 and _large_tiles_fit(device):
        return 128, 128, 8, 2
    return 64, 64, 4, 3


def _large_tiles_fit(device: torch.device) -> bool:
    """Whether a block may use ~200 KB of shared memory (Hopper), which the ~160 KB tiles need."""
    return _shared_memory(device) >= 200 * 1024


# Query tiles (128 rows) x heads at or below which the paged form's split grid takes `_FEW_TILE_BLOCKS`.
FEW_TILES = {128: 36, 256: 20}
_FEW_TILE_BLOCKS = {128: (64, 64, 4, 2), 256: (64, 64, 8, 2)}


def _launch_blocks(nq: int, bsz: int, heads: int, max_q_len: int, max_kv_len: int | None, head_dim: int,
                   dtype: torch.dtype, paged: bool, device: torch.device) -> tuple[int, int, int, int]:
    """The blocks of a split-grid launch whose caller named none: `_blocks`, except for a paged launch
    with few query tiles (at most ``FEW_TILES[head_dim]`` of 128 rows, counted as the split rule
    counts them, `_query_tiles`, times the heads) in bf16/fp16 on a device where the large tiles fit
    (`_large_tiles_fit`), which takes `_FEW_TILE_BLOCKS`: 64x64 tiles (head_dim 128: 64-row tiles
    instead of 128; head_dim 256: 64-key blocks and 8 warps instead of 32 and 4). With more tiles
    such a launch takes whichever of the two the makespan model expects to finish first, where
    ``max_kv_len`` bounds the histories tightly (None: it does not, and `_blocks` serves).

    NOTE: measured on the H200 (`scripts/gpu/tune_attention.py small`, history 4096, 128 new + 256
    candidates, graphed, every config with every split count; docs/BENCHMARKS.md): head_dim 128 at
    bs 1 0.0176 ms with 64x64 tiles (4 warps, 2 stages, 11 splits) vs 0.0193 with 128x128, at bs 2
    0.0232 vs 0.0264; head_dim 256 at bs 1 0.0415 ms with 64x64 tiles (8 warps, 5 splits) vs 0.0491
    with 64x32, but at bs 2 the 64x32 tiles stay best (0.0664). bs 1 and 2 count 12 and 24 tiles
    (bs 1 and 2 graph buckets, a padding user included: 20 and 32), bs 4 counts 48. At the edge
    (`small 3 4`): bs 3, 36 tiles, 0.0333 ms with 64x64 tiles vs 0.0364 with 128x128; bs 4 0.0511
    vs 0.0524, within the spread. Not measured: the split count the bs-1 bucket takes with these
    tiles (7), fp16."""
    blocks = _blocks(head_dim, dtype, paged, device)
    few = _FEW_TILE_BLOCKS.get(head_dim)
    if not paged or few is None or dtype.itemsize != 2 or not _large_tiles_fit(device):
        return blocks
    tiles = _programs(nq, bsz, heads, max_q_len, 128)
    if tiles <= FEW_TILES[head_dim] or max_kv_len is None:  # (None: no tight bound on the histories)
        return few if tiles <= FEW_TILES[head_dim] else blocks
    # NOTE: past the few tiles, whichever of the two the makespan model (`_makespan`) expects to
    # finish first with its best split count; a tie keeps `_blocks`. On the H200 (`tune_attention.py
    # grid`, docs/BENCHMARKS.md) head_dim 128 at bs 4 and 8 with a 4096 history ran fastest on the
    # 64x64 tiles with 5 and 4 splits, at bs 8 with a 16384 history on the 128x128 ones with 4.
    times = []
    for bl in (blocks, few):
        est = _makespan(_programs(nq, bsz, heads, max_q_len, bl[0]), max_kv_len, bl, head_dim, device)
        if est is None:
            return blocks
        times.append(est[0])
    return few if times[1] < times[0] else blocks


def _cdiv(a: int, b: int) -> int:
    """Ceil division of host ints (``triton.cdiv`` is a constexpr function: microseconds a call)."""
    return -(-a // b)


_SMS: dict[int, int] = {}


_SMEM: dict[int, int] = {}


def _shared_memory(device: torch.device) -> int:
    """Shared memory a block may opt into, in bytes (0 off CUDA, or where torch does not say)."""
    if device.type != "cuda":
        return 0
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMEM:
        try:  # Triton's own query (what its compiler checks a kernel's shared memory against)
            _SMEM[idx] = int(triton.runtime.driver.active.utils.get_device_properties(idx)["max_shared_mem"])
        except Exception:
            _SMEM[idx] = int(getattr(torch.cuda.get_device_properties(idx), "shared_memory_per_block_optin", 0))
    return _SMEM[idx]


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


_SUM_BLOCK = 1024
MIN_SPLIT_BLOCKS = 2  # key blocks per split program, at least
_MAX_SPLITS = 1024  # a bound on the fp32 parts' buffer (splits x the output); the rule picks at most 32
_STREAM_TILES = 4096  # users x query blocks (powers of two) that stream-K's table may hold


def _pad(n: int) -> int:
    return triton.next_power_of_2(max(n, 1))


def _resident(blocks: tuple[int, int, int, int], dim: int, itemsize: int, device: torch.device) -> int:
    """Programs of this config one SM holds at once, estimated from its tiles: shared memory for the
    query tile and ``stages`` key/value tiles (or the candidates' own keys and values, ``BLOCK_M``
    rows each, where more: `_tile`), and registers at up to 128 a thread; 1 where the device does
    not say its shared memory (off CUDA). NOTE: at most 2, the most measured (head_dim 256's 64x32
    tiles on the H200): a count above what really fits would make a split grid of more than one
    wave, which measured 30-50% slower."""
    block_m, block_n, warps, stages = blocks
    smem = _shared_memory(device)
    if smem == 0:
        return 1
    tiles = (block_m + 2 * max(stages * block_n, block_m)) * dim * itemsize
    return max(1, min(smem // tiles, 65536 // (warps * 32 * 128), 2))


def _query_tiles(nq: int, bsz: int, m_blocks: int, block_m: int) -> int:
    """At most how many (user, query block) tiles hold query rows: the grid has ``m_blocks`` per
    user, but ``nq`` rows over ``bsz`` users fill at most ``k + (nq - k) // block_m`` of them, k =
    min(bsz, nq) (k users of l rows hold ``1 + (l - 1) // block_m`` each, a sum largest with the
    most users holding rows). The split rule counts these, not the grid: a launch whose
    ``max_q_len`` is loose (a CUDA graph bucket's bound on its users' rows, which vary between
    replays) would otherwise count every user as holding that many (bs 1 with its padding user and
    ``max_q_len`` = all 512 rows: 8 tiles of 128 rows counted for at most 5, so 4 splits, not 6)."""
    users = min(bsz, nq)
    return max(1, min(m_blocks * bsz, users + (nq - users) // block_m))


def _programs(nq: int, bsz: int, heads: int, max_q_len: int, block_m: int) -> int:
    """The split rule's programs before splitting: the query tiles of ``block_m`` rows that can hold
    rows (`_query_tiles`), times the heads."""
    return _query_tiles(nq, bsz, _cdiv(max(max_q_len, 1), block_m), block_m) * heads


def _default_splits(nq: int, bsz: int, heads: int, max_q_len: int, max_kv_len: int,
                    blocks: tuple[int, int, int, int], dim: int, itemsize: int, device: torch.device,
                    model: bool = True) -> int:
    """The split grid's key splits where the caller names none: `_splits` of the programs of the
    query tiles that can hold rows (`_query_tiles`); ``model`` as there."""
    return _splits(_programs(nq, bsz, heads, max_q_len, blocks[0]), max_kv_len, blocks, dim, itemsize, device,
                   model)


# NOTE: the makespan model's constants (`_makespan`) per (head_dim, paged tiles, bf16): microseconds per
# history key of one program's query tile, and per program of a split (its start, its fp32 part's store
# and its share of the sum in the norm's pass). Fitted by least squares on relative error to the H200's
# graphed times of every split count, norm gate included (`scripts/gpu/tune_attention.py grid`, 132
# SMs, histories 1024 / 4096 / 16384, bs 4-32; docs/BENCHMARKS.md): mean error 4.3-7.3%. Not measured:
# fp16, other GPUs (the model serves only where `_large_tiles_fit`, Hopper-sized shared memory), other
# tiles (head_dim 256's few-tile 64x64 ones were timed at one history only: the one-wave rule counts them).
MAKESPAN = {(128, (128, 128, 8, 2)): (0.01892, 8.91), (128, (64, 64, 4, 2)): (0.01964, 6.15),
            (256, (64, 32, 4, 2)): (0.03798, 14.04)}


def _makespan(n_programs: int, max_kv_len: int, blocks: tuple[int, int, int, int], dim: int,
              device: torch.device) -> tuple[float, int] | None:
    """``(µs, splits)``: the paged split grid's best key split count for ``n_programs`` query tiles x
    heads over histories of up to ``max_kv_len`` keys, by the time the model expects,
    ``ceil(n_programs * s / wave) * (per_key * max_kv_len / s + per_program)`` (whole waves of
    `_resident` programs per SM, each split a program with its own fixed cost); None where
    `MAKESPAN` has no constants for these tiles or the device is not one they were fitted on (off
    CUDA, or less shared memory than Hopper's: `_large_tiles_fit`). Counts run from 1 to 32, each
    split at least `MIN_SPLIT_BLOCKS` key blocks; a tie keeps the fewer splits."""
    consts = MAKESPAN.get((dim, tuple(blocks)))
    if consts is None or not _large_tiles_fit(device):
        return None
    wave = _num_sms(device) * _resident(blocks, dim, 2, device)
    return _best_count(max(n_programs, 1), max(max_kv_len, 1), blocks[1], wave, *consts)


@functools.lru_cache(maxsize=4096)
def _best_count(n: int, keys: int, block_n: int, wave: int, per_key: float, per_program: float) -> tuple[float, int]:
    """`_makespan`'s minimum over split counts (remembered: an eager launch asks it per layer)."""
    top = max(1, min(_cdiv(keys, block_n) // MIN_SPLIT_BLOCKS, 32))
    return min((_cdiv(n * s, wave) * (per_key * keys / s + per_program), s) for s in range(1, top + 1))


def _splits(n_programs: int, max_kv_len: int, blocks: tuple[int, int, int, int], dim: int, itemsize: int,
            device: torch.device, model: bool = True) -> int:
    """Key splits per query block for the split grid: with few query blocks (small batches, short
    queries) most SMs would sit idle while each program walks the whole history, so the keys are
    cut into more programs, each with at least `MIN_SPLIT_BLOCKS` key blocks. Each split writes its
    own fp32 part, summed by `_sum_parts` or the norm gate's pass. With ``model`` (the caller's: a
    paged launch whose ``max_kv_len`` bounds the histories tightly), a bf16/fp16 launch on tiles
    `MAKESPAN` has constants for takes the makespan model's count (`_makespan`); any other launch
    (the jagged form, fp32, other tiles or devices, a loose bound) cuts the keys into up to one wave
    of programs (`_resident` per SM).

    NOTE: measured on the H200 (docs/BENCHMARKS.md):
    - the count is a runtime argument of the kernel, so any count fills the SMs (Triton compiles
      at most three variants: a count of 1, a multiple of 16, any other): bs 1, head_dim 128 took
      11 splits of 12 tiles of 128 rows (132 programs, at most 3 of the 32 key blocks each): 0.019
      ms, vs 0.021 ms at 8 (a power of two, 96 programs); with the 64-row tiles it takes now
      (`_launch_blocks`), 11 splits of 24 tiles, two programs per SM: 0.0176 ms;
    - a part-full wave costs, and so does each split (`tune_attention.py splits`): bs 8 / 4096
      history / head_dim 128 on 128x128 tiles (one per SM), 0.090 ms unsplit, 0.102 at 2 splits;
    - the one-wave cap, the rule before the model, cost past bs 4 when a count filled the last
      wave better (`tune_attention.py grid`, the norm gate included): bs 8 with a 16384 history
      0.316 ms at 1 split, 0.263 at 4 (2.9 waves); bs 16 with 4096, 0.177 at 1 (1.45 waves),
      0.151 at 2. With `_launch_blocks`' choice of tiles, the model's launches were the sweep's
      best in 11 of its 14 cases; in the other three it was 15% (bs 16, 1024) and 2.4% (bs 16,
      4096) slower than the 64x32 tiles, which `MAKESPAN` lacks, and 4.7% slower than 128x128
      tiles with 5 splits (bs 4, 16384). It was at most 0.1% slower than the one-wave rule's
      launch in any (the fit is in-sample; held-out checks in docs/BENCHMARKS.md)."""
    if model and itemsize == 2:
        best = _makespan(n_programs, max_kv_len, blocks, dim, device)
        if best is not None:
            return best[1]
    kv_blocks = _cdiv(max(max_kv_len, 1), blocks[1])
    wave = _num_sms(device) * _resident(blocks, dim, itemsize, device)
    return max(1, min(wave // max(n_programs, 1), kv_blocks // MIN_SPLIT_BLOCKS, 32))


def paged_launch(nq: int, bsz: int, heads: int, max_q_len: int, max_kv_len: int, dim: int, dtype: torch.dtype,
                 device: torch.device, page_size: int | None = None) -> tuple:
    """What a paged launch naming neither its tiles nor its split count takes (`_plan`, which
    `_launch` asks): ``(blocks, splits)`` of the split grid, or ``("stream",)`` when
    ``SCHEDULE`` runs stream-K (which does not depend on ``max_kv_len``; past `_STREAM_TILES` it
    falls back to the split grid on `_blocks`' tiles); given the table's ``page_size``, ``("gluon",
    blocks, splits)`` where a captured launch takes the Gluon kernel (`_gluon_tiles`). A CUDA graph
    bucket keys on it, so histories whose bounds give the same launch share one graph."""
    tiles = None if page_size is None or SCHEDULE == "stream" else _gluon_tiles(dim, dtype, page_size, device)
    if tiles is not None:
        return "gluon", tiles, _gluon_splits(nq, bsz, heads, max_q_len, max_kv_len, tiles, dim, device, True)
    blocks, stream, splits = _plan(nq, bsz, heads, dim, dtype, device, max_q_len, max_kv_len, True, None, None,
                                   None, True)
    return ("stream",) if stream else (blocks, splits)


def _use_tma(kv: torch.Tensor | None, q: torch.Tensor | None = None) -> bool:
    """Whether a paged launch may read the table ``kv`` through a TMA descriptor: Hopper or newer, a
    table one descriptor covers (`tma_covers`), and a launch being captured into a CUDA graph; the
    Triton kernel also needs its key blocks within one page (`_launch`), the Gluon one more
    (`_gluon_choice`). ``kv`` None: whether a full-pass launch of ``q`` may (the Gluon kernel's loads;
    `hstu_gluon.supported` checks its keys and values). NOTE: measured on the H200 (docs/BENCHMARKS.md):
    graphed, the TMA loads take the paged kernel from 0.094 to 0.092 ms at bs 8 / head_dim 128 and from
    0.201 to 0.179 ms at head_dim 256; but building the descriptor costs the host ~30 us per eager
    launch, more than the kernel gains, so eager launches keep plain pointers. A traced kernel
    (Inductor) keeps them too."""
    t = kv if kv is not None else q
    if not (t.is_cuda and type(t) is torch.Tensor and TMA):
        return False
    if torch.compiler.is_compiling() or not torch.cuda.is_current_stream_capturing():
        return False
    return (kv is None or tma_covers(kv)) and torch.cuda.get_device_capability(t.device)[0] >= 9


def _gluon_tiles(dim: int, dtype: torch.dtype, page_size: int | None, device: torch.device) -> tuple | None:
    """The static part of the choice of the Gluon kernel, which `paged_launch` (a graph bucket's key)
    can ask without tensors: its tiles (`GLUON_TILES`) where ``GLUON``, ``TMA`` and ``FAST_SILU`` are
    on, the dtype is bf16, the device Hopper (its warpgroup MMA), the head size one it has tiles for and
    the pages a multiple of their key block; else None. ``page_size`` None: the full pass's tiles
    (`GLUON_FULL_TILES`, ``GLUON_FULL`` on too). `_gluon_choice` adds the launch's part (`_use_tma`,
    `hstu_gluon.supported`, the caller's options)."""
    tiles = GLUON_TILES.get(dim) if page_size is not None else (GLUON_FULL_TILES.get(dim) if GLUON_FULL else None)
    if not (GLUON and TMA and FAST_SILU and tiles and dtype == torch.bfloat16 and device.type == "cuda"
            and (page_size is None or page_size % tiles[1] == 0)):
        return None
    return tiles if torch.cuda.get_device_capability(device)[0] == 9 else None


def _gluon_splits(nq: int, bsz: int, heads: int, max_q_len: int, kv_len: int, tiles: tuple, dim: int,
                  device: torch.device, tight_kv_len: bool) -> int:
    """The Gluon kernel's split count: `_makespan`'s model with `GLUON_MAKESPAN`'s constants for these
    tiles where ``kv_len`` bounds the histories tightly, else the one-wave rule (`_splits`)."""
    n = _programs(nq, bsz, heads, max_q_len, tiles[0])
    consts = GLUON_MAKESPAN.get((dim, tuple(tiles)))
    if tight_kv_len and consts is not None:
        wave = _num_sms(device) * _resident(tiles, dim, 2, device)
        return _best_count(n, max(kv_len, 1), tiles[1], wave, *consts)[1]
    return _splits(n, kv_len, tiles, dim, 2, device, model=False)


def _gluon_choice(kernel, q, k, v, kv, paged, blocks, tma, warp_specialize, fast, exact_silu, schedule,
                  tma_ok) -> tuple | None:
    """The Gluon kernel's tiles where this launch (`_launch`'s arguments, paged or the full pass) takes it,
    else None (the Triton kernel). ``kernel="gluon"`` forces it, with ``blocks`` or `GLUON_TILES`' (the
    full pass: `GLUON_FULL_TILES`') tiles, and is an error naming why where it cannot run: not the split
    grid, ``tma=False`` or warp specialisation asked (it has neither form), the exact SiLU asked, or
    tensors `hstu_gluon.supported` refuses. ``kernel=None`` takes it where the launch names no tiles,
    TMA setting, stream-K, warp specialisation or exact SiLU, ``tma_ok`` (`_launch`'s `_use_tma`:
    captured into a CUDA graph, a table one descriptor covers), `_gluon_tiles` has tiles for it and
    `hstu_gluon.supported` takes the tensors (else Triton: e.g. a bf16 ``q`` on an fp16 table)."""
    if kernel == "triton":
        return None
    if kernel is None:
        if blocks is not None or tma is not None or warp_specialize or not fast or schedule == "stream" \
                or (schedule is None and SCHEDULE != "split" and paged) or not tma_ok:
            return None
        tiles = _gluon_tiles(q.shape[2], q.dtype, kv.shape[-3] if paged else None, q.device)
        if tiles is None:
            return None
    from gr_plugin.ops.triton import hstu_gluon

    if kernel is None:  # (``kv`` is None for the full pass)
        return tiles if hstu_gluon.supported(q, kv, tiles, k, v) is None else None
    tiles = blocks if blocks is not None else (GLUON_TILES if paged else GLUON_FULL_TILES).get(q.shape[2],
                                                                                             (64, 64, 4, 3))
    why = ("the split grid only" if schedule == "stream" else
           "it has no form without TMA loads or with warp specialisation (tma=False / warp_specialize asked)"
           if tma is False or warp_specialize else
           hstu_gluon.supported(q, kv, tiles, k, v) or ("its SiLU is the fast one (the exact one asked)"
                                                        if exact_silu else None))
    if why is not None:
        raise ValueError(f"the Gluon attention kernel cannot take this launch: {why}")
    return tiles


def _plan(nq, bsz, heads, dim, dtype, device, max_q_len, max_kv_len, paged, num_splits, blocks, schedule,
          tight_kv_len, gluon=False):
    """``(blocks, stream, num_splits)`` of a launch (`_launch`'s arguments): the tiles where the
    caller names none (`_launch_blocks` where the split rule picks the count, else `_blocks`), the
    schedule (``schedule``, or ``SCHEDULE`` where none is named: stream-K while its tiles' table
    fits, else the split grid) and the split count (1 for stream-K; `_default_splits` where none is
    named, `_gluon_splits` for a ``gluon`` launch, whose tiles ``blocks`` names)."""
    want_stream = schedule == "stream" or (schedule is None and SCHEDULE == "stream" and paged and num_splits is None)
    kv_len = max_kv_len if max_kv_len is not None else max_q_len
    if blocks is None:  # the few-tile blocks only where the split rule picks the count
        blocks = (_launch_blocks(nq, bsz, heads, max_q_len, kv_len if tight_kv_len else None, dim, dtype, paged,
                                 device)
                  if num_splits is None and not want_stream else _blocks(dim, dtype, paged, device))
    m_blocks = _cdiv(max(max_q_len, 1), blocks[0])
    if schedule is None:  # (the tiles' table of `_stream_tiles` lives in registers: bounded)
        schedule = "stream" if want_stream and _pad(bsz) * _pad(m_blocks) <= _STREAM_TILES else "split"
    stream = schedule == "stream"
    if stream and _pad(bsz) * _pad(m_blocks) > _STREAM_TILES:
        raise ValueError(f"stream-K holds the tiles' table in registers: {bsz} users x {m_blocks} query blocks "
                         f"(padded to powers of two) exceed {_STREAM_TILES}; use schedule='split'")
    if stream:
        num_splits = 1
    elif num_splits is None and gluon:
        num_splits = _gluon_splits(nq, bsz, heads, max_q_len, kv_len, blocks, dim, device, tight_kv_len and paged)
    elif num_splits is None:
        num_splits = _default_splits(nq, bsz, heads, max_q_len, kv_len, blocks, dim, dtype.itemsize, device,
                                     model=paged and tight_kv_len)
    return blocks, stream, num_splits


def _launch(q, k, v, kv, kv_indices, kv_indptr, q_offsets, hist_lens, new_lens, alpha, n_norm, max_q_len, paged,
            max_kv_len=None, num_splits=None, blocks=None, fast=None, layer=None, schedule=None, programs=None,
            tma=None, warp_specialize=False, reversed_programs=False, norm_gate=None, tight_kv_len=True, kernel=None,
            silu_gate=False, fp32_dots=None):
    """Launch the kernel. ``schedule``: ``"split"`` (a program per query block and key split) or
    ``"stream"`` (stream-K over ``programs`` persistent programs, default one per SM); None:
    ``SCHEDULE`` (split unless set). ``tma``: None decides by `_use_tma`. ``norm_gate``: None, or
    ``(weight, bias, eps, u)``, which returns ``LayerNorm(out.flatten(1)) * u`` ``[Nq, H*D]`` instead
    (the HSTU layer's norm and gate; a split launch adds its parts inside the norm's pass).
    ``tight_kv_len``: whether ``max_kv_len`` is near the longest history, so that the split rule may
    weigh a program's work by it (`_makespan`); False where it is only a cap (the custom op's eager
    kernel passes the table's capacity): the tiles are `_launch_blocks`' without the model and the
    count the one-wave rule's. ``kernel``: ``"gluon"`` (the Hopper kernel of `hstu_gluon`; ``blocks``
    then names its tiles; a launch it cannot take is an error), ``"triton"``, or None: see
    `_gluon_choice`. ``silu_gate``: the norm gate's ``u`` is the layer's projection before its SiLU,
    which the norm's pass applies as it loads it (`layer_norm`'s ``silu_u``). ``fp32_dots``: the
    dots' precision for fp32 inputs (`dot_precision`; None: `FP32_DOTS`)."""
    nq, heads, dim = q.shape
    if dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"triton HSTU attention supports head_dim in {SUPPORTED_HEAD_DIMS}, got {dim}")
    if norm_gate is not None:
        _check_norm_gate(norm_gate, q)
    elif silu_gate:
        raise ValueError("silu_gate=True names the SiLU of norm_gate's u, and norm_gate is None")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")
    if schedule not in (None, "split", "stream"):
        raise ValueError(f"schedule must be None, 'split' or 'stream', got {schedule!r}")
    if schedule is None and SCHEDULE not in ("split", "stream"):
        raise ValueError(f"GR_PLUGIN_ATTENTION_SCHEDULE must be split or stream, got {SCHEDULE!r}")
    if schedule == "stream" and num_splits is not None:
        raise ValueError(f"num_splits applies to the split schedule, got num_splits={num_splits} with 'stream'")
    if kernel not in (None, "triton", "gluon"):
        raise ValueError(f"kernel must be None, 'triton' or 'gluon', got {kernel!r}")
    dots = dot_precision(q.dtype, fp32_dots)
    bsz = q_offsets.numel() - 1
    exact_silu = fast is False or (fast is None and not FAST_SILU)  # (asked for: the Gluon kernel has none)
    if fast is None:
        fast = FAST_SILU and q.is_cuda and q.dtype == torch.bfloat16
    # (whether a captured launch may read the table through TMA: asked once, each kernel adds its own terms)
    if tma and not paged and kernel != "gluon":
        raise ValueError("tma=True applies to the paged form (the Triton kernel reads the full pass through "
                         "pointers; the Gluon one, kernel='gluon', always by TMA)")
    tma_ok = tma is None and _use_tma(kv, q)  # (``kv`` is None for the full pass)
    gluon = _gluon_choice(kernel, q, k, v, kv, paged, blocks, tma, warp_specialize, fast, exact_silu, schedule,
                          tma_ok)
    if gluon is not None:
        blocks, schedule = gluon, "split"
    # NOTE: stream-K measured slower than the split grid on the H200 (docs/BENCHMARKS.md: bs 8, head_dim
    # 128, graphed 0.104 vs 0.092 ms; even one program per tile, nothing cut, 0.103), so it runs only
    # where asked for. Sizes are taken apart only where the split rule or stream-K's bound needs them
    # (`_plan`: `_launch_blocks`, `_default_splits`): a traced launch names num_splits=1 and may hold
    # symbolic ones.
    blocks, stream, num_splits = _plan(nq, bsz, heads, dim, q.dtype, q.device, max_q_len, max_kv_len, paged,
                                       num_splits, blocks, schedule, tight_kv_len, gluon=gluon is not None)
    block_m, block_n, warps, stages = blocks
    m_blocks = _cdiv(max(max_q_len, 1), block_m)
    if stream:
        programs = programs or _num_sms(q.device)
    if type(num_splits) is not int or not 1 <= num_splits <= _MAX_SPLITS:
        raise ValueError(f"num_splits must be an int in [1, {_MAX_SPLITS}], got {num_splits!r}")
    if nq == 0 or bsz == 0:
        return _gated(torch.zeros(q.shape, dtype=q.dtype, device=q.device), norm_gate, silu_gate)
    if num_splits == 1:
        out = target = torch.empty_like(q)
    else:
        # NOTE: one fp32 slice per split, summed in split order (`_sum_parts`, or `_sum_ln_mul` given a
        # norm_gate): no zero fill, no atomics, the same bits every run. Measured on the H200 against
        # fp32 atomic adds into a zeroed output (docs/BENCHMARKS.md, commit a3ffa4b): bs 1 / 4096
        # history / head_dim 128 0.019 vs 0.027 ms, bs 2 0.027 vs 0.035, head_dim 256 bs 2 0.066 vs 0.089.
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        target = torch.empty((num_splits, *q.shape), dtype=torch.float32, device=q.device)
    split_stride = target.stride(0) if target.dim() == 4 else 0
    if paged:
        page_size = kv.shape[-3]
        if kv.stride(-1) != 1:
            raise ValueError(f"kv_layer must have a contiguous last dimension, got strides {kv.stride()}")
        layer_pages, strides = table_layout(kv, layer)
        kv_arg, idx, ptr = kv, kv_indices, kv_indptr
    else:
        page_size, kv_arg, idx, ptr, layer_pages, strides = 1, k, q_offsets, q_offsets, 0, (0, 0, 0, 0)
    if tma is None:
        tma = paged and tma_ok and gluon is None and page_size % block_n == 0
    desc = None
    if tma and gluon is None:
        from triton.tools.tensor_descriptor import TensorDescriptor

        desc = TensorDescriptor.from_tensor(kv.view(-1, kv.stride(-3)), [block_n, dim])
    if stream:
        part = torch.empty(programs, 2, block_m, dim, dtype=torch.float32, device=q.device)
        done = torch.zeros(bsz * heads * m_blocks, dtype=torch.int32, device=q.device)
        grid, sizes, pads = (programs, 1, 1), (bsz, m_blocks, heads, 1), (_pad(bsz), _pad(m_blocks))
    else:  # the stream-K arguments are unused: no new buffers, no sizes taken apart
        part, done = target, q_offsets
        grid, sizes, pads = (m_blocks * num_splits, bsz, heads), (0, 0, 0, num_splits), (1, 1)
    if gluon is not None:
        from gr_plugin.ops.triton import hstu_gluon

        hstu_gluon.launch(grid, q, k, v, target, kv, idx, ptr, layer_pages, q_offsets, hist_lens, new_lens, num_splits,
                          split_stride, strides, alpha, 1.0 / float(n_norm), blocks)
    else:
        _hstu_fwd[grid](
            q, k, v, target, kv_arg, desc, idx, ptr, layer_pages, q_offsets, hist_lens, new_lens, part, done, *sizes,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), split_stride,
            target.stride(-3), target.stride(-2),
            *strides, float(alpha), 1.0 / float(n_norm),
            PAGE_SIZE=page_size, PAGED=paged, HEAD_DIM=dim, BLOCK_M=block_m, BLOCK_N=block_n,
            DOTS=dots, FAST=bool(fast), TMA=bool(tma),
            WS=bool(warp_specialize), STREAM=stream, BSZ_PAD=pads[0], M_PAD=pads[1],
            REVERSED=bool(reversed_programs) and stream,
            num_warps=warps, num_stages=stages,
        )
    if num_splits > 1:
        if norm_gate is not None:
            weight, bias, eps, u = norm_gate
            return layer_norm.sum_layer_norm_mul(target, q_offsets, bsz, weight, bias, eps, u, q.dtype, silu_gate)
        n = out.numel()
        _sum_parts[(_cdiv(n, _SUM_BLOCK),)](target, out, q_offsets, bsz, n, heads * dim, num_splits,
                                            BLOCK=_SUM_BLOCK)
    return _gated(out, norm_gate, silu_gate)


def _check_norm_gate(norm_gate, q: torch.Tensor) -> None:
    """``(weight, bias, eps, u)`` for the ``[Nq, H, D]`` queries ``q``: ``u [Nq, H*D]`` of ``q``'s dtype
    and device with contiguous columns, ``weight`` and ``bias [H*D]``."""
    weight, bias, _, u = norm_gate
    nq, n = q.shape[0], q.shape[1] * q.shape[2]
    if u.shape != (nq, n) or u.dtype != q.dtype or u.device != q.device or u.stride(-1) != 1:
        raise ValueError(f"norm_gate's u must be [{nq}, {n}] {q.dtype} on {q.device} with contiguous columns, got "
                         f"{tuple(u.shape)} {u.dtype} on {u.device}, strides {u.stride()}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t.shape != (n,) or t.device != q.device:
            raise ValueError(f"norm_gate's {name} must be [{n}] on {q.device}, got {tuple(t.shape)} on {t.device}")


def _gated(out: torch.Tensor, norm_gate, silu_u: bool) -> torch.Tensor:
    if norm_gate is None:
        return out
    weight, bias, eps, u = norm_gate
    return layer_norm.layer_norm_mul(out.flatten(1), weight, bias, eps, u, silu_u)


def hstu_attention_jagged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_offsets: torch.Tensor,
                          num_candidates: torch.Tensor, *, alpha: float, n_norm: float,
                          max_seq_len: int, num_splits: int | None = None, **launch) -> torch.Tensor:
    """Full-sequence HSTU attention ``[T, H, D]`` (history then candidates per sequence)."""
    lengths = seq_offsets[1:] - seq_offsets[:-1]
    hist = lengths - num_candidates
    return _launch(q, k, v, None, None, None, seq_offsets, hist, hist, alpha, n_norm, max_seq_len, paged=False,
                   max_kv_len=max_seq_len, num_splits=num_splits, **launch)


def paged_hstu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
                         kv_indices: torch.Tensor, kv_indptr: torch.Tensor, history_lengths: torch.Tensor,
                         q_offsets: torch.Tensor, new_lengths: torch.Tensor, *, alpha: float, n_norm: float,
                         max_q_len: int, max_history_len: int, num_history_tokens: int,
                         num_splits: int | None = None, layer: int | None = None, **launch) -> torch.Tensor:
    """Cached-step HSTU attention over paged history K/V ``kv_layer [num_pages, 2, P, H, D]``, or
    layer ``layer`` of the whole table ``[L, num_pages, 2, P, H, D]`` (`table_layout`)."""
    return _launch(q, k, v, kv_layer, kv_indices, kv_indptr, q_offsets, history_lengths, new_lengths, alpha, n_norm,
                   max_q_len, paged=True, max_kv_len=max_history_len, num_splits=num_splits, layer=layer,
                   **launch)
