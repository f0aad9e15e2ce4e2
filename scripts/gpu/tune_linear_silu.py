"""Would the layer's projections as Triton matmuls (the SiLU as the first one's epilogue) beat cuBLAS?

python3 scripts/gpu/tune_linear_silu.py [M ...]   (default: the block's row counts, see ROWS)

`HSTULayer.project` runs ``F.silu(F.linear(x, W, b))``: a cuBLAS matmul, then an elementwise SiLU
kernel that reads and writes the whole projection again (docs/BENCHMARKS.md, the bs-1 profile: 17 µs
of SiLU per 8-layer step at bs 1, 60 µs at bs 8). This script times, graphed (CUDA graph replays,
min of 3 interleaved rounds), at the block's shapes (hidden 1024; 4 heads of 128 or 256: N = 2048
or 4096 columns of u, v, q, k):
- ``torch``: ``F.silu(F.linear(x, W, b))`` as the model runs it, and ``F.linear`` alone;
- ``triton``: a Triton matmul (tensor descriptors, fp32 accumulation) whose epilogue adds the
  bias and applies the SiLU before the one bf16 rounding, over a few tile configs; its SiLU is
  torch's formula (accurate ``expf``, correctly rounded division), but on the unrounded sum, so the
  bits differ from torch's two roundings: the script reports the largest difference and the share
  of equal elements.
Nothing here is used by the package; it is the measurement a fused projection would start from.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.tools.tensor_descriptor import TensorDescriptor

# rows of the projection: the cached step's 384 per user (128 new + 256 candidates) at bs 1, 2, 8,
# and the full pass's 4352 per user (4096 history + 256 candidates) at bs 1 and 8
ROWS = (384, 768, 3072, 4352, 34816)
CONFIGS = [  # BLOCK_M, BLOCK_N, BLOCK_K, stages, warps
    (64, 128, 64, 4, 4), (128, 128, 64, 4, 8), (128, 256, 64, 3, 8), (64, 64, 64, 4, 4), (128, 64, 64, 4, 4),
    (64, 64, 128, 3, 4), (64, 128, 128, 3, 4), (128, 64, 128, 3, 4), (128, 128, 128, 3, 8),
]
# (N, K, SiLU): the projection u, v, q, k (4 heads of 128 / 256) and the output projection back to
# hidden 1024 (a plain bias epilogue, against F.linear)
SHAPES = ((2048, 1024, True), (4096, 1024, True), (1024, 512, False), (1024, 1024, False))


@triton.jit
def _linear_silu(XD, WD, B, Y, M, N, K, stride_y, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SILU: tl.constexpr):
    """``Y = SiLU(X W^T + b)`` (``SILU`` False: ``X W^T + b``) for ``X [M, K]``, ``W [N, K]`` (an nn.Linear's
    weight), tile by tile,
    tiles grouped ``GROUP_M`` row blocks at a time (so a group's column tiles of W stay in L2)."""
    pid = tl.program_id(0)
    m_tiles, n_tiles = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * n_tiles)
    first_m = group * GROUP_M
    size_m = tl.minimum(m_tiles - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * n_tiles)) % size_m
    pid_n = (pid % (GROUP_M * n_tiles)) // size_m
    m0, n0 = pid_m * BLOCK_M, pid_n * BLOCK_N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K):
        x = XD.load([m0, k0])
        w = WD.load([n0, k0])
        acc = tl.dot(x, tl.trans(w), acc)
    cols = n0 + tl.arange(0, BLOCK_N)
    rows = m0 + tl.arange(0, BLOCK_M)
    z = acc + tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    y = tl.math.div_rn(z, 1.0 + libdevice.exp(-z)) if SILU else z
    ok = (rows < M)[:, None] & (cols < N)[None, :]
    tl.store(Y + rows.to(tl.int64)[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=ok)


def linear_silu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, config, silu: bool = True) -> torch.Tensor:
    bm, bn, bk, stages, warps = config
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    xd = TensorDescriptor.from_tensor(x, [bm, bk])
    wd = TensorDescriptor.from_tensor(w, [bn, bk])
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _linear_silu[grid](xd, wd, b, y, m, n, k, y.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, SILU=silu,
                       num_stages=stages, num_warps=warps)
    return y


def graphed_ms(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")


def main(rows) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    for n, k, silu in SHAPES:
        w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16)
        b = (torch.randn(n, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
        for m in rows:
            x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
            ref = F.silu(F.linear(x, w, b)) if silu else F.linear(x, w, b)
            fns = {"torch linear alone": lambda x=x: F.linear(x, w, b)}
            if silu:
                fns["torch linear + silu"] = lambda x=x: F.silu(F.linear(x, w, b))
            diffs = {}
            for cfg in CONFIGS:
                label = "triton BM={} BN={} BK={} stages={} warps={}".format(*cfg)
                def fn(x=x, cfg=cfg):
                    return linear_silu(x, w, b, cfg, silu)
                try:
                    got = fn()
                except Exception as e:  # a config that does not fit is reported, not fatal
                    print(f"   {label}: {type(e).__name__}: {str(e)[:120]}")
                    continue
                diffs[label] = ((got.float() - ref.float()).abs().max().item(), (got == ref).float().mean().item())
                fns[label] = fn
            best = dict.fromkeys(fns, float("inf"))
            for _ in range(3):
                for label, fn in fns.items():
                    best[label] = min(best[label], graphed_ms(fn))
            flops = 2 * m * n * k
            print(f"M={m} N={n} K={k} {'SiLU' if silu else 'bias'} epilogue:")
            for label, ms in sorted(best.items(), key=lambda kv: kv[1]):
                extra = (f"  (max diff vs torch {diffs[label][0]:.2e}, {100 * diffs[label][1]:.1f}% equal)"
                         if label in diffs else "")
                print(f"   {ms * 1e3:8.2f} us  {flops / ms / 1e9:6.0f} TFLOP/s  {label}{extra}")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or ROWS)
