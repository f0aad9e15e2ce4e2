"""Triton kernels of the HSTU layer's norms, each one pass over a row per program.

Owns the GPU kernels behind `gr_plugin.ops.norm` (the references are the torch forms there) and the
norm-gate epilogue the split attention launch calls (`hstu_attention._launch`):
- ``layer_norm_mul``: ``LayerNorm(a) * u``, the attention output's norm and gate. The row of ``a``
  is read once, normalised in fp32, scaled and shifted, multiplied by the row of ``u`` and rounded
  once (torch rounds the norm's output before the product; the difference is within the output's
  rounding).
- ``sum_layer_norm_mul``: ``layer_norm_mul`` of the sum of a split attention's fp32 parts, added
  in split order and rounded to the output's dtype as the attention's own sum rounds them, without
  the attention's output written and read back. The same math as that sum followed by
  ``layer_norm_mul``, not always the same bits: the compiler may order the norm's fp32 sums over a
  row of fp32 parts differently from a row of 16-bit values (seen on the H200: at rows of 1024 a few
  outputs land one rounding step apart; rows of 512 and 256 gave equal bits, not a guarantee).
- both gate forms take ``silu_u``: ``u`` is the layer's pre-SiLU projection, whose SiLU
  (`gr_plugin.ops.triton.silu`, torch's bits with `EXACT_SILU`, rounded to ``u``'s dtype as torch's
  SiLU rounds it) the pass applies where it loads the row, so the cached step needs no SiLU pass of its own;
- ``add_layer_norm``: the residual add ``y = x + o`` (rounded to the stream's dtype, as torch's add)
  and the next layer's input norm of ``y``, which then need not be read back.
All three run under ``TRITON_INTERPRET=1`` on CPU tensors, which the CPU tests use.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gr_plugin.ops.triton import exact_silu, silu
from gr_plugin.ops.triton.parts import sum_splits


@triton.jit
def _layer_norm_row(x, ok, W, B, c, eps, N: tl.constexpr):
    """``LayerNorm`` of one fp32 row ``x`` (``ok`` masks the columns past ``N``), in fp32."""
    mean = tl.sum(x, axis=0) / N
    diff = tl.where(ok, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(diff * diff, axis=0) / N + eps)
    w = tl.load(W + c, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(B + c, mask=ok, other=0.0).to(tl.float32)
    return diff * rstd * w + b


@triton.jit
def _gate_row(U, c, ok, SILU_U: tl.constexpr, EXACT: tl.constexpr):
    """The row of ``U`` at ``U + c`` in fp32, its SiLU (rounded to ``U``'s dtype) with ``SILU_U``."""
    u = tl.load(U + c, mask=ok, other=0.0)
    if SILU_U:
        u = silu(u, EXACT).to(U.dtype.element_ty)
    return u.to(tl.float32)


@triton.jit
def _ln_mul(A, U, W, B, Out, stride_a, stride_u, stride_o, eps, N: tl.constexpr, BLOCK: tl.constexpr,
            SILU_U: tl.constexpr, EXACT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    ok = c < N
    a = tl.load(A + row * stride_a + c, mask=ok, other=0.0).to(tl.float32)
    u = _gate_row(U + row * stride_u, c, ok, SILU_U, EXACT)
    y = _layer_norm_row(a, ok, W, B, c, eps, N) * u
    tl.store(Out + row * stride_o + c, y.to(Out.dtype.element_ty), mask=ok)


def layer_norm_mul(a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                   u: torch.Tensor, silu_u: bool = False) -> torch.Tensor:
    """``LayerNorm(a; weight, bias, eps) * u`` (``* SiLU(u)`` with ``silu_u``) for ``a, u [M, N]``
    (rows may be strided, columns contiguous); a new contiguous ``[M, N]`` tensor of ``a``'s dtype."""
    m, n = a.shape
    out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    if m == 0:
        return out
    block = triton.next_power_of_2(n)
    _ln_mul[(m,)](a, u, weight, bias, out, a.stride(0), u.stride(0), out.stride(0), float(eps), N=n, BLOCK=block,
                  SILU_U=bool(silu_u), EXACT=exact_silu(u),
                  num_warps=4 if block <= 1024 else 8)
    return out


@triton.jit
def _sum_ln_mul(Part, U, W, B, Out, q_offsets, bsz, n_part, splits, stride_u, stride_o, eps, N: tl.constexpr,
                BLOCK: tl.constexpr, SILU_U: tl.constexpr, EXACT: tl.constexpr):
    """One row: the parts' sum in split order (`sum_splits`), rounded to ``Out``'s dtype, its norm
    times the row of ``U`` (its SiLU with ``SILU_U``, `_gate_row`)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    ok = c < N
    # rows past the last user's are no program's (`_sum_parts`): their sum is 0
    live = ok & (row < tl.load(q_offsets + bsz).to(tl.int64))
    acc = sum_splits(Part + row * N + c, live, splits, n_part)
    a = acc.to(Out.dtype.element_ty).to(tl.float32)  # rounded as the attention's output is
    u = _gate_row(U + row * stride_u, c, ok, SILU_U, EXACT)
    y = _layer_norm_row(a, ok, W, B, c, eps, N) * u
    tl.store(Out + row * stride_o + c, y.to(Out.dtype.element_ty), mask=ok)


def sum_layer_norm_mul(parts: torch.Tensor, q_offsets: torch.Tensor, bsz: int, weight: torch.Tensor,
                       bias: torch.Tensor, eps: float, u: torch.Tensor, dtype: torch.dtype,
                       silu_u: bool = False) -> torch.Tensor:
    """``LayerNorm(a; weight, bias, eps) * u`` (``* SiLU(u)`` with ``silu_u``) with ``a`` = the sum
    over splits of ``parts [S, M, ...]`` (fp32, contiguous, each row ``N`` = ``u``'s columns; rows at
    or past ``q_offsets[bsz]`` count as 0) rounded to ``dtype``; a new contiguous ``[M, N]`` tensor
    of ``dtype``."""
    splits, m = parts.shape[0], parts.shape[1]
    n = u.shape[1]
    out = torch.empty((m, n), dtype=dtype, device=u.device)
    if m == 0:
        return out
    block = triton.next_power_of_2(n)
    _sum_ln_mul[(m,)](parts, u, weight, bias, out, q_offsets, bsz, parts[0].numel(), splits, u.stride(0),
                      out.stride(0), float(eps), N=n, BLOCK=block, SILU_U=bool(silu_u), EXACT=exact_silu(u),
                      num_warps=4 if block <= 1024 else 8)
    return out


@triton.jit
def _add_ln(X, O, Y, Z, W, B, stride_x, stride_o, stride_y, stride_z, eps, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    ok = c < N
    x = tl.load(X + row * stride_x + c, mask=ok, other=0.0).to(tl.float32)
    o = tl.load(O + row * stride_o + c, mask=ok, other=0.0).to(tl.float32)
    y = (x + o).to(Y.dtype.element_ty)  # the residual stream, rounded as torch's add rounds it
    tl.store(Y + row * stride_y + c, y, mask=ok)
    z = _layer_norm_row(y.to(tl.float32), ok, W, B, c, eps, N)
    tl.store(Z + row * stride_z + c, z.to(Z.dtype.element_ty), mask=ok)


def add_layer_norm(x: torch.Tensor, o: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                   out: torch.Tensor | None = None,
                   normed_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``y = x + o`` and ``LayerNorm(y; weight, bias, eps)`` (into ``out`` / ``normed_out`` when
    given) for ``x, o [M, N]`` (columns contiguous), in one pass."""
    m, n = x.shape
    y = torch.empty((m, n), dtype=x.dtype, device=x.device) if out is None else out
    z = torch.empty((m, n), dtype=x.dtype, device=x.device) if normed_out is None else normed_out
    if m == 0:
        return y, z
    block = triton.next_power_of_2(n)
    _add_ln[(m,)](x, o, y, z, weight, bias, x.stride(0), o.stride(0), y.stride(0), z.stride(0), float(eps), N=n,
                  BLOCK=block, num_warps=4 if block <= 1024 else 8)
    return y, z
