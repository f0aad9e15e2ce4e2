"""A Gluon (Triton's tile-level dialect) version of the paged HSTU attention for Hopper, side by side
with the package's Triton kernel (`gr_plugin.ops.triton.hstu_attention`).

python3 scripts/gpu/gluon_attention.py [check|time|offline] -> correctness against an fp32 reference and
the package's kernel (``check``), graphed µs of both at the block's shapes (``time``), or the registers
and local memory of its launches compiled for sm_90 on any machine (``offline``, no GPU needed).

Why: the Triton kernel's bs-1 launch compiles near the register limit with its query tile in registers
(docs/BENCHMARKS.md, "the attention kernel's register budget"). Here the query tile lives in shared
memory (the first operand of both warpgroup MMAs comes from shared memory or, for the weights, from
registers), full key blocks arrive by TMA into a ring of ``STAGES`` buffers tracked by mbarriers, and
the next block's ``q k^T`` is issued before this block's ``p v`` so that the SiLU of one overlaps the
other's MMA. Same grid and outputs as the Triton kernel's split form (a program per query tile and key
split; fp32 parts summed by the package's passes), same mask and SiLU (``tanh.approx``, as its FAST).

Scope: bf16, page size a multiple of BLOCK_N, head_dim 64-256. Not wired into the package.
"""

from __future__ import annotations

import sys

import torch
import triton
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

from gr_plugin.ops.triton import hstu_attention as tri
from gr_plugin.ops.triton import layer_norm, table_layout


@gluon.jit
def _silu(s, alpha):
    """``SiLU(alpha s)`` as the Triton kernel's FAST form: ``h (1 + tanh(h))``, ``h = alpha s / 2``."""
    h = s * (0.5 * alpha)
    t = gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [h], dtype=gl.float32, is_pure=True, pack=1)
    return h + h * t


@gluon.jit
def _issue(KVD, kv_indices, page_base, layer_pages, n0, col, rows_pp, rows_kv, bar, k_dst, v_dst,
           PAGE_SIZE: gl.constexpr):
    """TMA loads of the key and value block at history position ``n0`` (one page) into ``k_dst`` /
    ``v_dst``, completing on ``bar``."""
    page = gl.load(kv_indices + page_base + n0 // PAGE_SIZE).to(gl.int64) + layer_pages
    row = (page * rows_pp + n0 % PAGE_SIZE).to(gl.int32)
    mbarrier.expect(bar, 2 * KVD.block_type.nbytes)
    tma.async_copy_global_to_shared(KVD, [row, col], bar, k_dst)
    tma.async_copy_global_to_shared(KVD, [row + rows_kv, col], bar, v_dst)


@gluon.jit
def _paged_fwd(Q, K, V, Out, KV, KVD, kv_indices, kv_indptr, layer_pages, q_offsets, hist_lens, new_lens, splits,
               stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_os, stride_ot, stride_oh,
               stride_pp, stride_pkv, stride_pt, stride_ph, alpha, inv_norm,
               PAGE_SIZE: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               STAGES: gl.constexpr, TC: gl.constexpr, num_warps: gl.constexpr):
    dt: gl.constexpr = Q.dtype.element_ty
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TC, TC], [num_warps, 1], [1, 0])
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dt)
    kv_sl: gl.constexpr = KVD.layout

    pid = gl.program_id(0)
    pid_m = pid // splits
    split = pid % splits
    b = gl.program_id(1)
    h = gl.program_id(2)
    m0 = pid_m * BLOCK_M
    page_base = gl.load(kv_indptr + b).to(gl.int64)
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

    rows_pp = stride_pp // stride_pt
    rows_kv = (stride_pkv // stride_pt).to(gl.int32)
    col = (h * stride_ph).to(gl.int32)
    for i in gl.static_range(STAGES):
        if i < n_full:
            _issue(KVD, kv_indices, page_base, layer_pages, kv_lo + i * BLOCK_N, col, rows_pp, rows_kv,
                   bars.index(i), k_bufs.index(i), v_bufs.index(i), PAGE_SIZE)

    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    if n_full > 0:
        mbarrier.wait(bars.index(0), 0)
        s = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), s_zero, use_acc=False)
        p = gl.convert_layout(_silu(s, alpha).to(dt), p_layout)
        for j in range(0, n_full - 1):
            st = (j + 1) % STAGES
            mbarrier.wait(bars.index(st), ((j + 1) // STAGES) & 1)
            # the next block's q k^T, then this block's p v; the SiLU of the next runs during the p v
            s = warpgroup_mma(q_smem, k_bufs.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            acc = warpgroup_mma(p, v_bufs.index(j % STAGES), acc, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s, ))
            p = gl.convert_layout(_silu(s, alpha).to(dt), p_layout)
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            if j + STAGES < n_full:
                gl.thread_barrier()  # every warpgroup is done with the stage before TMA overwrites it
                _issue(KVD, kv_indices, page_base, layer_pages, kv_lo + (j + STAGES) * BLOCK_N, col, rows_pp,
                       rows_kv, bars.index(j % STAGES), k_bufs.index(j % STAGES), v_bufs.index(j % STAGES),
                       PAGE_SIZE)
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
            page = gl.load(kv_indices + page_base + cols_ld // PAGE_SIZE, mask=ok, other=0).to(gl.int64) + layer_pages
            base = page * stride_pp + (cols_ld % PAGE_SIZE).to(gl.int64) * stride_pt + h * stride_ph
            kt = gl.load(KV + base[:, None] + d_ld[None, :], mask=ok[:, None], other=0.0)
            vt = gl.load(KV + stride_pkv + base[:, None] + d_ld[None, :], mask=ok[:, None], other=0.0)
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

    # a candidate also sees itself, added by the tile's first split: its diagonal weight, rounded as a
    # block's weights are, times its own value
    if (split == 0) & (last >= new):
        # q.k per row in column chunks of 64 (what registers hold beside the accumulator), then the
        # weighted value added in the accumulator's own layout
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
        w = gl.where(cand_c, _silu(w, alpha).to(dt).to(gl.float32), 0.0)
        w_o = gl.convert_layout(w, gl.SliceLayout(1, o_layout))
        rows_v = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
        d_v = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        cand_v = (rows_v < q_len) & (rows_v >= new)
        vo = gl.load(V + ((q_start + rows_v) * stride_vt + h * stride_vh)[:, None] + d_v[None, :],
                     mask=cand_v[:, None], other=0.0)
        acc = acc + w_o[:, None] * vo.to(gl.float32)

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    rows_o = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    d_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    out_rows = q_start + rows_o
    out_ptrs = Out + split.to(gl.int64) * stride_os + out_rows[:, None] * stride_ot + h * stride_oh + d_o[None, :]
    gl.store(out_ptrs, (acc * inv_norm).to(Out.dtype.element_ty), mask=(rows_o < q_len)[:, None])


_DESC: dict = {}


def _descriptor(kv: torch.Tensor, block_n: int, dim: int) -> TensorDescriptor:
    """The table seen as rows of ``H * D`` elements, in blocks of ``[block_n, dim]`` (remembered per
    table and block: the table does not move)."""
    key = (kv.data_ptr(), tuple(kv.shape), block_n, dim)
    if key not in _DESC:
        view = kv.view(-1, kv.stride(-3))
        layout = gl.NVMMASharedLayout.get_default_for([block_n, dim], gl.bfloat16)
        _DESC[key] = TensorDescriptor.from_tensor(view, [block_n, dim], layout)
    return _DESC[key]


def launch(q, k, v, kv, kv_indices, kv_indptr, q_offsets, hist_lens, new_lens, alpha, n_norm, max_q_len,
           max_kv_len, num_splits=None, blocks=(64, 64, 4, 2), layer=None, norm_gate=None):
    """The paged attention (``tri._launch``'s arguments, split grid) with this file's kernel; ``blocks``:
    (BLOCK_M, BLOCK_N, warps, stages); ``num_splits`` None: the package's rule for these tiles."""
    nq, heads, dim = q.shape
    bsz = q_offsets.numel() - 1
    block_m, block_n, warps, stages = blocks
    page_size = kv.shape[-3]
    if q.dtype != torch.bfloat16 or page_size % block_n or block_m != 16 * warps:
        raise ValueError(f"bf16, pages a multiple of BLOCK_N and 16 rows a warp only: {q.dtype}, page {page_size}, "
                         f"blocks {blocks}")
    if num_splits is None:
        num_splits = tri._default_splits(nq, bsz, heads, max_q_len, max_kv_len, blocks, dim, 2, q.device)
    m_blocks = tri._cdiv(max(max_q_len, 1), block_m)
    out = torch.empty_like(q)
    target = out if num_splits == 1 else torch.empty((num_splits, *q.shape), dtype=torch.float32, device=q.device)
    split_stride = target.stride(0) if num_splits > 1 else 0
    layer_pages, strides = table_layout(kv, layer)
    _paged_fwd[(m_blocks * num_splits, bsz, heads)](
        q, k, v, target, kv, _descriptor(kv, block_n, dim), kv_indices, kv_indptr, layer_pages, q_offsets,
        hist_lens, new_lens, num_splits, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), split_stride, target.stride(-3), target.stride(-2), *strides, float(alpha),
        1.0 / float(n_norm), PAGE_SIZE=page_size, HEAD_DIM=dim, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages,
        TC=min(32, dim // 8), num_warps=warps)
    if num_splits > 1:
        if norm_gate is not None:
            weight, bias, eps, u = norm_gate
            return layer_norm.sum_layer_norm_mul(target, q_offsets, bsz, weight, bias, eps, u, q.dtype)
        n = out.numel()
        tri._sum_parts[(tri._cdiv(n, tri._SUM_BLOCK),)](target, out, q_offsets, bsz, n, heads * dim, num_splits,
                                                        BLOCK=tri._SUM_BLOCK)
    return tri._gated(out, norm_gate)


# (head_dim, page): the Gluon tiles tried (BLOCK_M, BLOCK_N, warps, stages)
TILES = {128: [(64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 4, 4), (128, 64, 8, 2), (128, 64, 8, 3), (64, 128, 4, 2)],
         256: [(64, 32, 4, 2), (64, 32, 4, 3), (64, 32, 4, 4), (64, 64, 4, 2), (128, 32, 8, 2)]}
SPLITS = (1, 2, 3, 4, 5, 6, 8, 11, 16)


def offline() -> None:
    """Registers / local memory of every tile at the block's shapes, compiled for sm_90 (no GPU)."""
    import os

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from kernel_resources import TARGET, resources
    from triton.compiler import make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import create_function_from_signature

    for dim, page in ((128, 128), (256, 32)):
        for bl in TILES[dim]:
            block_m, block_n, warps, stages = bl
            kv = torch.zeros(8, 2, page, 4, dim, dtype=torch.bfloat16)
            q = torch.zeros(384, 4, dim, dtype=torch.bfloat16)
            i64 = torch.zeros(4, dtype=torch.int64)
            layout = gl.NVMMASharedLayout.get_default_for([block_n, dim], gl.bfloat16)
            desc = TensorDescriptor.from_tensor(kv.view(-1, kv.stride(-3)), [block_n, dim], layout)
            strides = (kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3))
            args = (q, q, q, torch.zeros(2, 384, 4, dim), kv, desc, i64, i64, 0, i64, i64, i64, 11,
                    q.stride(0), q.stride(1), q.stride(0), q.stride(1), q.stride(0), q.stride(1), 384 * 4 * dim,
                    4 * dim, dim, *strides, 0.1, 1 / 4096)
            kwargs = dict(PAGE_SIZE=page, HEAD_DIM=dim, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages,
                          TC=min(32, dim // 8), num_warps=warps)
            backend = make_backend(TARGET)
            fn = _paged_fwd
            binder = create_function_from_signature(fn.signature, fn.params, backend)
            bound, specialization, options = binder(*args, **kwargs)
            options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
            kernel = triton.compile(GluonASTSource(fn, signature, constexprs, attrs), target=TARGET,
                                    options=options.__dict__)
            regs, stack = resources(kernel)
            print(f"head_dim {dim} page {page} tiles {bl}: {regs} registers, {stack} bytes local, "
                  f"{kernel.metadata.shared} bytes shared")


def _case(bs, hist, dim, page, nan_tail=False):
    from tune_attention import case

    args, max_q, max_kv = case(bs, hist, 128, 256, 4, dim, page)
    if nan_tail:  # every slot past each user's history NaN: a masked read that is not zeroed would show
        kv, idx, indptr = args[3], args[4], args[5]
        pages = -(-hist // page)
        for b in range(bs):
            last = idx[indptr[b] + pages - 1]
            kv[last, :, hist - (pages - 1) * page:] = float("nan")
        spare = torch.ones(kv.shape[0], dtype=torch.bool, device=kv.device)
        spare[idx] = False
        kv[spare] = float("nan")
    return args, max_q, max_kv


def check() -> None:
    """Every tile against an fp32 reference (the package's pure-torch op) and the Triton kernel."""
    from gr_plugin.ops.pytorch import hstu_attention as ref_ops

    torch.manual_seed(0)
    for dim, page, bs, hist in ((128, 128, 1, 4096), (128, 128, 2, 4000), (128, 128, 8, 4096), (256, 32, 1, 4096),
                                (256, 32, 2, 1000), (128, 128, 3, 300)):
        args, max_q, max_kv = _case(bs, hist, dim, page, nan_tail=hist % page != 0)
        q, k, v, kv, idx, indptr, q_off, hl, nl = args
        ref = ref_ops.paged_hstu_attention(q.float(), k.float(), v.float(), kv.float(), idx, indptr, hl, q_off, nl,
                                           alpha=0.1, n_norm=4096.0, max_q_len=max_q, max_history_len=max_kv,
                                           num_history_tokens=int(hl.sum()))
        triton_out = tri._launch(*args, 0.1, 4096.0, max_q, paged=True, max_kv_len=max_kv)
        tri_err = (triton_out.float() - ref).abs().max().item()
        for bl in TILES[dim]:
            if page % bl[1]:
                continue
            for sp in (None, 1, 3):
                out = launch(*args, 0.1, 4096.0, max_q, max_kv, num_splits=sp, blocks=bl)
                err = (out.float() - ref).abs().max().item()
                ok = err <= 2 * tri_err + 1e-6 and torch.isfinite(out).all().item()
                print(f"check d{dim} p{page} bs{bs} hist{hist} {bl} splits={sp}: gluon err {err:.2e}, triton err "
                      f"{tri_err:.2e} {'ok' if ok else 'FAIL'}")


def time_all(rounds: int = 2) -> None:
    """Graphed µs, min over interleaved rounds: the package's launch (its tiles and split rule), and each
    Gluon tile with the rule's split count and its neighbours; the norm gate as the layer runs it."""
    for dim, page, bs in ((128, 128, 1), (128, 128, 2), (128, 128, 8), (256, 32, 1), (256, 32, 8)):
        args, max_q, max_kv = _case(bs, 4096, dim, page)
        width = 4 * dim
        gate = (torch.ones(width, device="cuda", dtype=torch.bfloat16),
                torch.zeros(width, device="cuda", dtype=torch.bfloat16), 1e-5,
                torch.randn(args[0].shape[0], width, device="cuda", dtype=torch.bfloat16))
        fns = {"triton": lambda: tri._launch(*args, 0.1, 4096.0, max_q, paged=True, max_kv_len=max_kv, norm_gate=gate)}
        ref = fns["triton"]()
        for bl in TILES[dim]:
            rule = tri._default_splits(args[0].shape[0], bs, 4, max_q, max_kv, bl, dim, 2, args[0].device)
            for sp in sorted({rule, *SPLITS}):
                if bs * 4 * -(-max_q // bl[0]) * sp > 6 * 132 or sp * 2 > -(-max_kv // bl[1]):
                    continue
                fns[f"gluon {bl} splits={sp}"] = (lambda bl=bl, sp=sp: launch(*args, 0.1, 4096.0, max_q, max_kv,
                                                                              num_splits=sp, blocks=bl, norm_gate=gate))
        best = {}
        for _ in range(rounds):
            for label, fn in fns.items():
                try:
                    ms = triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
                except Exception as e:  # a tile that does not compile is reported
                    print(f"  {label}: {type(e).__name__}: {str(e)[:200]}")
                    fns[label] = None
                    continue
                best[label] = min(best.get(label, float("inf")), ms)
            fns = {k: f for k, f in fns.items() if f is not None}
        print(f"time d{dim} p{page} bs{bs} (graphed µs, with the norm gate, min of {rounds} rounds):")
        for label, ms in sorted(best.items(), key=lambda kv: kv[1])[:14]:
            diff = (fns[label]().float() - ref.float()).abs().max().item()
            print(f"   {ms * 1000:8.2f}  {label}  (max diff vs triton {diff:.2e})")


def grid(rounds: int = 2) -> None:
    """Graphed ms (min of ``rounds``) of the given tiles at every split count, norm gate included, over
    batch sizes and histories: one JSON line each in $OUT/gluon_grid.jsonl, to fit the split rule's
    constants to (``tri.MAKESPAN``)."""
    import json
    import os

    sink = open(os.path.join(os.environ.get("OUT", "/tmp"), "gluon_grid.jsonl"), "a")
    for dim, page, bl in ((128, 128, (64, 64, 4, 3)), (256, 32, (64, 32, 4, 4))):
        for hist in (1024, 4096, 16384):
            for bs in (1, 2, 4, 8, 16, 32):
                args, max_q, max_kv = _case(bs, hist, dim, page)
                width = 4 * dim
                gate = (torch.ones(width, device="cuda", dtype=torch.bfloat16),
                        torch.zeros(width, device="cuda", dtype=torch.bfloat16), 1e-5,
                        torch.randn(args[0].shape[0], width, device="cuda", dtype=torch.bfloat16))
                tiles = bs * 4 * -(-max_q // bl[0])
                for sp in SPLITS:
                    if tiles * sp > 6 * 132 or sp * 2 > -(-max_kv // bl[1]):
                        continue
                    def fn(sp=sp, args=args, gate=gate):
                        return launch(*args, 0.1, 4096.0, max_q, max_kv, num_splits=sp, blocks=bl, norm_gate=gate)

                    ms = min(triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median")
                             for _ in range(rounds))
                    row = dict(dim=dim, hist=hist, bs=bs, blocks=bl, splits=sp, ms=ms, programs=tiles * sp)
                    sink.write(json.dumps(row) + "\n")
                    print(row)
                del args, gate
                torch.cuda.empty_cache()
    sink.close()


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "check"
    if mode == "offline":
        offline()
    else:
        import os

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        {"check": check, "time": time_all, "grid": grid}[mode]()
