"""The HSTU projection's SiLU, for kernels that read the projection before it (``silu_inputs``).

A cached layer's projection ``u, v, q, k`` is read by our own kernels only (the page append, the
paged attention, the norm gate), so they apply the SiLU as they load it and the step needs no
elementwise SiLU launch over the whole projection.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def silu(x, LIBDEVICE: tl.constexpr):
    """torch's ``F.silu`` of a loaded tensor, rounded back to its dtype: ``x / (1 + exp(-x))`` in
    fp32 with an accurate ``exp`` (libdevice's ``expf``, as torch's CUDA kernel calls; ``tl.exp``
    is the approximate one) and a correctly rounded division, so that the rounded result has
    torch's bits. ``LIBDEVICE`` False: ``tl.exp``, for the interpreter (numpy's exp), which has no
    libdevice."""
    y = x.to(tl.float32)
    if LIBDEVICE:
        e = libdevice.exp(-y)
    else:
        e = tl.exp(-y)
    return tl.math.div_rn(y, 1.0 + e).to(x.dtype)


@triton.jit
def silu_tanh(x):
    """``SiLU(x) = x/2 (1 + tanh(x/2))`` with the hardware ``tanh.approx`` (CUDA only), rounded back
    to ``x``'s dtype: one special-function op an element; relative error about 2^-11."""
    y = x.to(tl.float32) * 0.5
    t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [y], dtype=tl.float32, is_pure=True, pack=1)
    return (y + y * t).to(x.dtype)
