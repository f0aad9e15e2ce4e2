"""What programmatic dependent launch (PDL) saves per kernel boundary in a CUDA graph, on stand-ins.

python3 scripts/gpu/probe_pdl.py

A launch with PDL (Hopper on: ``launch_pdl=True``) may start while the kernel before it in the stream
is still running; the kernel waits (``griddepcontrol.wait``) before touching memory, and lets the
kernel after it start (``griddepcontrol.launch_dependents``) right away. What overlaps is the next
launch's start and its programs' placement on the SMs, not the work. This script times, graphed
(min of interleaved rounds of ``triton.testing.do_bench_cudagraph``), chains shaped like a cached HSTU
layer's kernels, each with PDL off and on:
- ``rows``: 56 one-row-per-program kernels (``y = x + 1`` over ``M`` rows of 1024 bf16) in a row,
  every one of them launched with PDL when on;
- ``layer``: 8 x (matmul, SiLU, a copy, row kernel, row kernel, matmul, row kernel): torch's kernels
  (no PDL: they neither wait nor trigger) around row kernels that do (24 of the 56 launches).
"Saved" is per launch that takes PDL.
Rows: 384 (one user's 128 new tokens and 256 candidates) and 3072 (eight users).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _plus_one(X, Y, N: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, N)
    tl.store(Y + row * N + c, (tl.load(X + row * N + c).to(tl.float32) + 1.0).to(Y.dtype.element_ty))


def plus_one(x: torch.Tensor, pdl: bool) -> torch.Tensor:
    y = torch.empty_like(x)
    kw = {"launch_pdl": True} if pdl else {}
    _plus_one[(x.shape[0],)](x, y, N=x.shape[1], PDL=pdl, num_warps=4, **kw)
    return y


def rows_chain(x: torch.Tensor, pdl: bool, n: int = 56) -> torch.Tensor:
    for _ in range(n):
        x = plus_one(x, pdl)
    return x


def layer_chain(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, pdl: bool) -> torch.Tensor:
    for _ in range(8):
        h = F.silu(F.linear(x, w1))[:, :1024].contiguous()
        h = plus_one(plus_one(h, pdl), pdl)
        x = plus_one(F.linear(h[:, :512], w2), pdl)
    return x


def main() -> None:
    from triton.testing import do_bench_cudagraph

    torch.manual_seed(0)
    dev = "cuda"
    w1 = torch.randn(2048, 1024, device=dev, dtype=torch.bfloat16) / 32
    w2 = torch.randn(1024, 512, device=dev, dtype=torch.bfloat16) / 32
    for m in (384, 3072):
        x = torch.randn(m, 1024, device=dev, dtype=torch.bfloat16)
        for name, fn in (("rows", lambda p: rows_chain(x, p)), ("layer", lambda p: layer_chain(x, w1, w2, p))):
            ref = fn(False)
            got = fn(True)
            assert torch.equal(ref, got), f"{name} m={m}: PDL changed the result"
            best = {False: float("inf"), True: float("inf")}
            for _ in range(3):
                for p in (False, True):
                    best[p] = min(best[p], do_bench_cudagraph(lambda p=p: fn(p), rep=50) * 1e3)
            n = 56 if name == "rows" else 24  # the launches that take PDL
            print(f"{name:5s} M={m:4d}: off {best[False]:8.1f} us, on {best[True]:8.1f} us, "
                  f"saved {(best[False] - best[True]) / n:5.2f} us per PDL launch ({n} of them), equal bits: True")


if __name__ == "__main__":
    main()
