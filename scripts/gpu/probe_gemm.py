"""The cached step's two matmuls (the uvqk projection and the output projection) on cuBLAS vs a plain
Triton GEMM at each of a few tile configs, on the GPU: whether a tile choice the library does not make
pays at the step's row counts.

python3 scripts/gpu/probe_gemm.py

At the block's shapes (hidden 1024, 4 heads of head_dim 128 / 256; 384 rows a user, bs 1 and 8), graphed µs
(median of ``triton.testing.do_bench_cudagraph``, min of 3 interleaved rounds) of ``F.linear`` (what the
step runs) and of `_gemm` (``y = x W^T + b``, optionally ``+ residual`` in its epilogue) at each config
of `CONFIGS`, with each output's largest difference from ``F.linear`` in bf16 rounding steps of the
result's scale (and, for the output projection, each config with the residual added in its epilogue,
checked against ``F.linear + residual``). Prints one line per form for each shape, fastest first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

HIDDEN, HEADS, ROWS = 1024, 4, 384
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
CONFIGS = ((128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4), (64, 256, 64, 4, 4),
           (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (64, 64, 64, 4, 5), (256, 128, 64, 8, 3),
           (128, 128, 128, 8, 3), (64, 128, 128, 4, 3))


@triton.jit
def _gemm(X, W, B, R, Y, M, N, K, stride_xm, stride_wn, stride_rm, stride_ym, RESIDUAL: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * grid_n
    first_m = (pid // group) * GROUP_M
    size_m = min(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = X + rm[:, None].to(tl.int64) * stride_xm + rk[None, :]
    w_ptrs = W + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(x_ptrs, mask=(rm[:, None] < M) & (rk[None, :] + k0 < K), other=0.0)
        b = tl.load(w_ptrs, mask=(rn[None, :] < N) & (rk[:, None] + k0 < K), other=0.0)
        acc = tl.dot(a, b, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc += tl.load(B + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    ok = (rm[:, None] < M) & (rn[None, :] < N)
    if RESIDUAL:
        acc += tl.load(R + rm[:, None].to(tl.int64) * stride_rm + rn[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + rm[:, None].to(tl.int64) * stride_ym + rn[None, :], acc.to(Y.dtype.element_ty), mask=ok)


def gemm(x, w, b, cfg, residual=None, out=None):
    bm, bn, bk, warps, stages = cfg
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    r = y if residual is None else residual
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _gemm[grid](x, w, b, r, y, m, n, k, x.stride(0), w.stride(0), r.stride(0), y.stride(0),
                RESIDUAL=residual is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                num_warps=warps, num_stages=stages)
    return y


def graphed_us(fn) -> float:
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")


def main() -> None:
    torch.manual_seed(0)
    for dim in (128, 256):
        width = HEADS * dim
        for bs in (1, 8):
            m = bs * ROWS
            for name, k, n in (("uvqk", HIDDEN, 4 * width), ("output", width, HIDDEN)):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16)
                b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
                res = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
                want = F.linear(x, w, b)
                scale = want.float().abs().max().item()
                fns = {"F.linear": lambda: F.linear(x, w, b),
                       "F.linear + residual add": lambda: torch.add(res, F.linear(x, w, b))}
                for cfg in CONFIGS:
                    try:
                        got = gemm(x, w, b, cfg)
                    except Exception as e:  # (a config whose shared memory does not fit)
                        print(f"  {name} {cfg}: {type(e).__name__}", flush=True)
                        continue
                    err = (got.float() - want.float()).abs().max().item() / (scale * 2 ** -8)
                    fns[f"triton {cfg} (err {err:.2f} steps)"] = lambda cfg=cfg: gemm(x, w, b, cfg)
                    if name == "output":
                        got = gemm(x, w, b, cfg, residual=res)
                        want_r = (res.float() + want.float()).to(res.dtype).float()
                        err = (got.float() - want_r).abs().max().item() / (want_r.abs().max().item() * 2 ** -8)
                        fns[f"triton {cfg} + residual (err {err:.2f} steps)"] = (
                            lambda cfg=cfg: gemm(x, w, b, cfg, residual=res))
                best = dict.fromkeys(fns, float("inf"))
                for _ in range(3):
                    for label, fn in fns.items():
                        best[label] = min(best[label], graphed_us(fn))
                flops = 2 * m * k * n
                print(f"=== head_dim {dim} bs {bs} {name}: [{m}, {k}] x [{k}, {n}]", flush=True)
                for label, us in sorted(best.items(), key=lambda kv: kv[1]):
                    print(f"  {us:7.2f} us {flops / us / 1e6:6.0f} TFLOP/s  {label}", flush=True)


if __name__ == "__main__":
    main()
