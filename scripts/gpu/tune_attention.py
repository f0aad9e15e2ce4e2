"""Time the paged HSTU attention kernel over block configs on the GPU (one call of the device tool).

python3 scripts/gpu/tune_attention.py  -> a table of ms per (case, BLOCK_M, BLOCK_N, warps, stages, splits)
"""

import itertools

import torch
import triton

from gr_plugin.ops.triton import hstu_attention as tri


def case(bs, hist, new, cands, heads, dim, page):
    g = torch.Generator(device="cuda").manual_seed(0)
    npg = bs * (-(-hist // page)) + 4
    kv = torch.randn(npg, 2, page, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    idx = torch.randperm(npg, device="cuda")[: bs * (-(-hist // page))].to(torch.int64)
    indptr = torch.arange(0, bs + 1, device="cuda", dtype=torch.int64) * (-(-hist // page))
    nq = bs * (new + cands)
    q, k, v = (torch.randn(nq, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    q_off = torch.arange(0, bs + 1, device="cuda", dtype=torch.int64) * (new + cands)
    hl = torch.full((bs,), hist, device="cuda", dtype=torch.int64)
    nl = torch.full((bs,), new, device="cuda", dtype=torch.int64)
    return (q, k, v, kv, idx, indptr, q_off, hl, nl), new + cands, hist


def bench(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


# NOTE: each config compiles once per case (seconds each); an earlier wider sweep (BLOCK_M 128, BLOCK_N 32..128,
# 8 warps, 2..4 stages) found nothing faster than these at head_dim 128 on the H200.
CONFIGS = [(64, 64, 4, 3), (64, 64, 4, 2), (128, 64, 8, 3), (64, 32, 4, 2), (64, 32, 4, 3)]

for name, (bs, hist, new, cands, heads, dim, page) in {
    "bs8 h4096 d128 p128": (8, 4096, 128, 256, 4, 128, 128),
    "bs1 h4096 d128 p128": (1, 4096, 128, 256, 4, 128, 128),
    "bs8 h4096 d256 p32": (8, 4096, 128, 256, 4, 256, 32),
}.items():
    args, max_q, max_kv = case(bs, hist, new, cands, heads, dim, page)
    flops = bs * heads * (new + cands) * hist * dim * 4
    results = []
    for (bm, bn, w, st), splits, fast in itertools.product(CONFIGS, (None,), (True, False)):
        if dim == 256 and (bn == 128 or (bm == 128 and bn >= 64)):
            continue
        if not fast and (splits == 1 or (bm, bn, w, st) != tri._blocks(dim, torch.bfloat16)):
            continue
        try:
            ms = bench(lambda: tri._launch(*args, 0.1, 4096.0, max_q, paged=True, max_kv_len=max_kv,
                                           num_splits=splits, blocks=(bm, bn, w, st), fast=fast))
        except Exception as e:  # a config that does not compile is reported, not fatal
            print(f"   BM={bm} BN={bn} warps={w} stages={st}: {type(e).__name__}")
            ms = float("nan")
        results.append((ms, bm, bn, w, st, splits, fast))
    results.sort(key=lambda r: (r[0] != r[0], r[0]))
    default = bench(lambda: tri._launch(*args, 0.1, 4096.0, max_q, paged=True, max_kv_len=max_kv))
    print(f"{name}: default {default:.3f} ms ({flops / default / 1e9:.0f} TFLOP/s); best:")
    for ms, bm, bn, w, st, sp, fast in results[:5]:
        print(f"   {ms:.3f} ms  {flops / ms / 1e9:.0f} TFLOP/s  BM={bm} BN={bn} warps={w} stages={st} splits={sp} "
              f"fast={fast}")
    slow = [r for r in results if not r[6]]
    if slow:
        print(f"   exact sigmoid, default blocks: {slow[0][0]:.3f} ms")
