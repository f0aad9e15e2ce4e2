"""The split attention's fp32 parts, summed where they are read (`hstu_attention._sum_parts`,
`layer_norm._sum_ln_mul`)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def sum_splits(ptrs, mask, splits, stride):
    """``sum(ptrs[s * stride] for s in range(splits))`` (``splits`` ≥ 1), fp32, added in split order
    with four loads in flight at a time, instead of one at a time, where each would wait a load's
    full latency."""
    step = stride.to(tl.int64)
    acc = tl.load(ptrs, mask=mask, other=0.0)
    for s in range(1, splits, 4):
        p = ptrs + s * step
        a = tl.load(p, mask=mask, other=0.0)
        b = tl.load(p + step, mask=mask & (s + 1 < splits), other=0.0)
        c = tl.load(p + 2 * step, mask=mask & (s + 2 < splits), other=0.0)
        d = tl.load(p + 3 * step, mask=mask & (s + 3 < splits), other=0.0)
        acc += a
        acc += b  # (a split past the last adds 0.0: the same value)
        acc += c
        acc += d
    return acc
