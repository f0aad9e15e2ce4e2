"""The cached layer's SiLU and page append in one launch (`gr_plugin.ops.silu_append_kv`) vs the two it
replaces, on the GPU.

python3 scripts/gpu/tune_silu_append.py

At the block's shapes (hidden 1024, 4 heads of 128 / page 128 and of 256 / page 32; 128 new tokens
and 256 candidates per user at bs 1, 2, 8), graphed (CUDA graph replays, min of 3 interleaved
rounds of ``triton.testing.do_bench_cudagraph``) µs of: ``F.silu`` of the whole projection then the
Triton append of its new K/V (the step before dc902f6), each alone, and the package's launch with
torch's SiLU (``EXACT_SILU``, libdevice's exp and a correctly rounded division) and with the
approximate one. The package's launch activates ``q, k, v`` only: ``u``'s SiLU is the norm gate's
(not timed here). Checks that the exact form gives ``F.silu``'s bits (the activated ``q, k, v`` and the
whole table) and prints how far the approximate one is, in bf16 rounding steps.
An earlier fused kernel of this script (a34a46d, tiled, all four parts) is in its history.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

import gr_plugin.ops.triton as tri_ops
from gr_plugin.ops.triton.append_kv import append_kv, silu_append_kv

CASES = ((128, 128, 1), (128, 128, 2), (128, 128, 8), (256, 32, 1), (256, 32, 8))  # head_dim, page, bs
HEADS, NEW, CANDIDATES = 4, 128, 256


def graphed_us(fn) -> float:
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")


def steps_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    """The most bf16 rounding steps between ``a`` and ``b`` (bf16 bit patterns of one sign)."""
    return int((a.view(torch.int16).int() - b.view(torch.int16).int()).abs().max())


def with_exact(exact: bool, fn):
    def run():
        saved, tri_ops.EXACT_SILU = tri_ops.EXACT_SILU, exact
        try:
            return fn()
        finally:
            tri_ops.EXACT_SILU = saved
    return run


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    for dim, page, bs in CASES:
        width = HEADS * dim
        n = bs * (NEW + CANDIDATES)
        x = (torch.randn(n, 4 * width, device="cuda", generator=g) * 2).to(torch.bfloat16)
        _, v, q, k = (t.view(n, HEADS, dim) for t in x.chunk(4, dim=-1))
        pages = 4 * bs * NEW // page + 16
        table = torch.zeros(pages, 2, page, HEADS, dim, dtype=torch.bfloat16, device="cuda")
        rows = torch.cat([torch.arange(b * (NEW + CANDIDATES), b * (NEW + CANDIDATES) + NEW) for b in range(bs)]).cuda()
        slots = torch.randperm(pages * page, device="cuda", generator=g)[: bs * NEW]
        ref_table, exact_table, approx_table = table.clone(), table.clone(), table.clone()

        def pair():
            y = F.silu(x)
            _, yv, _, yk = y.chunk(4, dim=-1)
            append_kv(ref_table, yk.view(n, HEADS, dim), yv.view(n, HEADS, dim), slots, rows)
            return y

        exact = with_exact(True, lambda: silu_append_kv(exact_table, q, k, v, slots, rows))
        approx = with_exact(False, lambda: silu_append_kv(approx_table, q, k, v, slots, rows))
        y = pair()
        want = [t.view(n, HEADS, dim) for t in (y.chunk(4, dim=-1)[i] for i in (2, 3, 1))]
        got_exact, got_approx = exact(), approx()
        same = all(torch.equal(a, b) for a, b in zip(got_exact, want)) and torch.equal(exact_table, ref_table)
        apart = max(max(steps_apart(a, b) for a, b in zip(got_approx, want)), steps_apart(approx_table, ref_table))
        fns = {"F.silu + append": pair, "silu_append_kv exact": exact, "silu_append_kv approximate": approx,
               "F.silu alone": lambda: F.silu(x),
               "append alone": lambda: append_kv(ref_table, want[1], want[2], slots, rows)}
        best = dict.fromkeys(fns, float("inf"))
        for _ in range(3):
            for label, fn in fns.items():
                best[label] = min(best[label], graphed_us(fn))
        print(f"head_dim {dim} page {page} bs {bs} ({n} rows, {bs * NEW} new): exact = F.silu's bits {same}, "
              f"approximate at most {apart} rounding steps apart; "
              + ", ".join(f"{label} {us:.2f} us" for label, us in best.items()))


if __name__ == "__main__":
    main()
