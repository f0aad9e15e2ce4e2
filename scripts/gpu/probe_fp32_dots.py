"""Error of the fp32 attention kernels' dots against fp64, next to torch's reference (one device call).

    python3 scripts/gpu/probe_fp32_dots.py
    TRITON_F32_DEFAULT=tf32x3 python3 scripts/gpu/probe_fp32_dots.py

Per head_dim (128 / page 128, 64 / page 16; 4 users, histories to 700 with 0, half, all of them cached): the
jagged and paged forward and the jagged backward (dq, dk, dv) in fp32, max abs error against the fp64 reference,
under ``torch.set_float32_matmul_precision("highest")`` ("ieee" columns) and ``"high"`` ("tf32" columns), for
the Triton kernel and the torch reference (cuBLAS). The kernels take the TF32 setting only in a tree whose
fp32 launches pass ``IEEE=False`` under it (commit 52bc1d8, reverted in 2334c22: at HEAD the kernel columns
are IEEE both ways); their non-IEEE dots then use Triton's default fp32 precision, ``TRITON_F32_DEFAULT``
(``tf32``, or ``tf32x3``: three TF32 products, about fp32's accuracy). Results: docs/BENCHMARKS.md, "The fp32
kernel's tiles".
"""

import os

import torch

from tests.ops import test_triton_attention_bwd as bwd_tests
from tests.ops.test_triton_attention import build, ref, run, tri


def err(a: torch.Tensor, exact: torch.Tensor) -> float:
    return (a.double() - exact).abs().max().item()


def main() -> None:
    print("TRITON_F32_DEFAULT", os.environ.get("TRITON_F32_DEFAULT"))
    for dim, page in ((128, 128), (64, 16)):
        g = torch.Generator().manual_seed(dim)
        hist = torch.randint(0, 700, (4,), generator=g).tolist()
        cand = torch.randint(1, 70, (4,), generator=g).tolist()
        jag, paged = build(hist, cand, [0, hist[1] // 2, hist[2], hist[3]], page, 4, dim, torch.float32, "cuda",
                           dim)
        for which, args in (("jagged", jag), ("paged", paged)):
            exact = run(ref, which, args, torch.float64)
            kernel_ieee, torch_ieee = run(tri, which, args), run(ref, which, args)
            torch.set_float32_matmul_precision("high")
            kernel_tf32, torch_tf32 = run(tri, which, args), run(ref, which, args)
            torch.set_float32_matmul_precision("highest")
            print(which, dim, "kernel_tf32", err(kernel_tf32, exact), "torch_tf32", err(torch_tf32, exact),
                  "kernel_ieee", err(kernel_ieee, exact), "torch_ieee", err(torch_ieee, exact), "scale",
                  exact.abs().max().item(), flush=True)
        jag, dout = bwd_tests._inputs(hist, cand, 4, dim, torch.float32, "cuda", dim)
        exact = bwd_tests._reference_grads(jag, dout, torch.float64)
        kernel_ieee = bwd_tests._kernel_grads(jag, dout, torch.float32)
        torch.set_float32_matmul_precision("high")
        torch_tf32 = bwd_tests._reference_grads(jag, dout, torch.float32)
        kernel_tf32 = bwd_tests._kernel_grads(jag, dout, torch.float32)
        torch.set_float32_matmul_precision("highest")
        for name, k, t, x, i in zip("qkv", kernel_tf32, torch_tf32, exact, kernel_ieee):
            print("bwd", dim, name, "kernel_tf32", err(k, x), "torch_tf32", err(t, x), "kernel_ieee", err(i, x),
                  "scale", x.abs().max().item(), flush=True)


if __name__ == "__main__":
    main()
