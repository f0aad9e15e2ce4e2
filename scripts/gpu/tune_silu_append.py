"""The cached layer's SiLU and page append as one launch (`silu_append`) vs the two it replaces.

python3 scripts/gpu/tune_silu_append.py

At the block's shapes (hidden 1024, 4 heads of 128 / page 128 and of 256 / page 32; 128 new tokens
and 256 candidates per user at bs 1, 2, 8), graphed (CUDA graph replays, min of 3 interleaved
rounds of ``triton.testing.do_bench_cudagraph``): ``F.silu`` of the projection then the Triton
append of its new K/V (what the cached step runs), each alone, and `silu_append`. Checks that the
fused launch writes the same bits as the pair (its output and the whole table).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from gr_plugin.ops.triton.append_kv import append_kv, silu_append

CASES = ((128, 128, 1), (128, 128, 2), (128, 128, 8), (256, 32, 1), (256, 32, 8))  # head_dim, page, bs
HEADS, NEW, CANDIDATES = 4, 128, 256


def graphed_us(fn) -> float:
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    for dim, page, bs in CASES:
        width = HEADS * dim
        n = bs * (NEW + CANDIDATES)
        x = (torch.randn(n, 4 * width, device="cuda", generator=g) * 2).to(torch.bfloat16)
        pages = 4 * bs * NEW // page + 16
        table = torch.zeros(pages, 2, page, HEADS, dim, dtype=torch.bfloat16, device="cuda")
        rows = torch.cat([torch.arange(b * (NEW + CANDIDATES), b * (NEW + CANDIDATES) + NEW) for b in range(bs)]).cuda()
        slots = torch.randperm(pages * page, device="cuda", generator=g)[: bs * NEW]
        ref_table = table.clone()

        def pair():
            y = F.silu(x)
            _, v, _, k = y.chunk(4, dim=-1)
            append_kv(ref_table, k.view(n, HEADS, dim), v.view(n, HEADS, dim), slots, rows)
            return y

        def fused():
            return silu_append(table, x, slots, rows)

        y_ref, y = pair(), fused()
        same = torch.equal(y, y_ref) and torch.equal(table, ref_table)
        _, v_ref, _, k_ref = (t.view(n, HEADS, dim) for t in y_ref.chunk(4, dim=-1))
        fns = {"F.silu + append": pair, "silu_append": fused, "F.silu alone": lambda: F.silu(x),
               "append alone": lambda: append_kv(ref_table, k_ref, v_ref, slots, rows)}
        best = dict.fromkeys(fns, float("inf"))
        for _ in range(3):
            for label, fn in fns.items():
                best[label] = min(best[label], graphed_us(fn))
        print(f"head_dim {dim} page {page} bs {bs} ({n} rows, {bs * NEW} new): same bits {same}; "
              + ", ".join(f"{label} {us:.2f} us" for label, us in best.items()))


if __name__ == "__main__":
    main()
