"""Triton ``LayerNorm(a) * u``: the HSTU layer's attention output norm and gate in one pass.

Owns the GPU kernel behind `gr_plugin.ops.norm.layer_norm_mul` (the reference is the torch form in
that module). One program per row: the row of ``a`` is read once, normalised in fp32, scaled and
shifted, multiplied by the row of ``u`` and rounded once to the output dtype (torch rounds the norm's
output before the product; the difference is within the output's rounding). Works under
``TRITON_INTERPRET=1`` on CPU tensors, which the CPU tests use.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _ln_mul(A, U, W, B, Out, stride_a, stride_u, stride_o, eps, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    ok = c < N
    a = tl.load(A + row * stride_a + c, mask=ok, other=0.0).to(tl.float32)
    mean = tl.sum(a, axis=0) / N
    diff = tl.where(ok, a - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(diff * diff, axis=0) / N + eps)
    w = tl.load(W + c, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(B + c, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + c, mask=ok, other=0.0).to(tl.float32)
    y = (diff * rstd * w + b) * u
    tl.store(Out + row * stride_o + c, y.to(Out.dtype.element_ty), mask=ok)


def layer_norm_mul(a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                   u: torch.Tensor) -> torch.Tensor:
    """``LayerNorm(a; weight, bias, eps) * u`` for ``a, u [M, N]`` (rows may be strided, columns
    contiguous); a new contiguous ``[M, N]`` tensor of ``a``'s dtype."""
    m, n = a.shape
    out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    if m == 0:
        return out
    block = triton.next_power_of_2(n)
    _ln_mul[(m,)](a, u, weight, bias, out, a.stride(0), u.stride(0), out.stride(0), float(eps), N=n, BLOCK=block,
                  num_warps=4 if block <= 1024 else 8)
    return out
