"""Error of the fp32 attention kernels' dots against fp64 per dot precision, beside torch's (one device call).

    python3 scripts/gpu/probe_fp32_dots.py [--dots tf32x3 ieee tf32]

Per head_dim (128 / page 128, 64 / page 16; 4 users, histories to 700 with 0, half, all of them cached): the
jagged and paged forward and the jagged backward (dq, dk, dv) in fp32, max abs error against the fp64 reference,
for the Triton kernel at each fp32 dot precision (`hstu_attention.FP32_DOTS`, set for the call) and for the torch
reference (cuBLAS) under ``torch.set_float32_matmul_precision("highest")`` ("torch_ieee") and ``"high"``
("torch_tf32"). The kernel's error rule (tests/ops) holds it to 2x the same-precision reference's. Results:
docs/BENCHMARKS.md, "The fp32 kernel's tiles".
"""

import argparse

import torch

from gr_plugin.ops.triton import hstu_attention as tri_module
from tests.ops import test_triton_attention_bwd as bwd_tests
from tests.ops.test_triton_attention import build, ref, run, tri


def err(a: torch.Tensor, exact: torch.Tensor) -> float:
    return (a.double() - exact).abs().max().item()


def torch_both(fn):
    """``fn()`` under the "highest" and the "high" fp32 matmul precision."""
    highest = fn()
    torch.set_float32_matmul_precision("high")
    try:
        return highest, fn()
    finally:
        torch.set_float32_matmul_precision("highest")


def kernel_each(fn, precisions):
    """``{precision: fn()}`` with the kernels' fp32 dots at each precision."""
    default, out = tri_module.FP32_DOTS, {}
    try:
        for p in precisions:
            tri_module.FP32_DOTS = p
            out[p] = fn()
    finally:
        tri_module.FP32_DOTS = default
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dots", nargs="+", default=list(tri_module.FP32_DOT_CHOICES))
    args = ap.parse_args()
    for dim, page in ((128, 128), (64, 16)):
        g = torch.Generator().manual_seed(dim)
        hist = torch.randint(0, 700, (4,), generator=g).tolist()
        cand = torch.randint(1, 70, (4,), generator=g).tolist()
        jag, paged = build(hist, cand, [0, hist[1] // 2, hist[2], hist[3]], page, 4, dim, torch.float32, "cuda",
                           dim)
        for which, args_ in (("jagged", jag), ("paged", paged)):
            exact = run(ref, which, args_, torch.float64)
            torch_ieee, torch_tf32 = torch_both(lambda: run(ref, which, args_))
            kernels = kernel_each(lambda: run(tri, which, args_), args.dots)
            row = {f"kernel_{p}": err(out, exact) for p, out in kernels.items()}
            print(which, dim, row, "torch_ieee", err(torch_ieee, exact), "torch_tf32", err(torch_tf32, exact),
                  "scale", exact.abs().max().item(), flush=True)
        jag, dout = bwd_tests._inputs(hist, cand, 4, dim, torch.float32, "cuda", dim)
        exact = bwd_tests._reference_grads(jag, dout, torch.float64)
        torch_ieee, torch_tf32 = torch_both(lambda: bwd_tests._reference_grads(jag, dout, torch.float32))
        kernels = kernel_each(lambda: bwd_tests._kernel_grads(jag, dout, torch.float32), args.dots)
        for i, name in enumerate("qkv"):
            row = {f"kernel_{p}": err(grads[i], exact[i]) for p, grads in kernels.items()}
            print("bwd", dim, "d" + name, row, "torch_ieee", err(torch_ieee[i], exact[i]), "torch_tf32",
                  err(torch_tf32[i], exact[i]), "scale", exact[i].abs().max().item(), flush=True)


if __name__ == "__main__":
    main()
