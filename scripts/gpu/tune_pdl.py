"""Programmatic dependent launch on and off, side by side in one run (one call of the device tool).

python3 scripts/gpu/tune_pdl.py [rounds] -> for the block's 4096/3968 rows (256 candidates, 8 layers,
hidden 1024, 4 heads) at head_dim 128 / page 128 and 256 / 32, bs 1, 2, 4 and 8: the cached step
and the full pass, each captured into a CUDA graph once with `gr_plugin.ops.triton.PDL` off and
once on, timed in interleaved rounds (ms: the best round's median of 20 replays), and whether the
two cached graphs' outputs are the same bits.
"""

import sys

import torch

import gr_plugin.ops.triton as tri_ops
from gr_plugin.bench.block import Block, _time_ms

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
hist, cached, cands = 4096, 3968, 256


def capture(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


print("head_dim page bs | cached off / on ms | full off / on ms | cached speedup off / on | same bits")
for dim, page in ((128, 128), (256, 32)):
    for bs in (1, 2, 4, 8):
        blk = Block(dim, page, num_pages=bs * (hist // page + 2) + 8)
        users = list(range(bs))
        blk.fill(users, cached)
        plan = blk.plan(users, hist)
        graphs = {}
        with torch.no_grad():
            cached_fn, _ = blk.cached_fn(plan, bs, hist - cached, cands)
            full_fn, _ = blk.full_fn(bs, hist, cands)
            for on in (False, True):
                tri_ops.PDL = on
                graphs[on] = capture(cached_fn), capture(full_fn)
        tri_ops.PDL = True
        best = {(on, i): float("inf") for on in (False, True) for i in (0, 1)}
        for _ in range(rounds):
            for on in (False, True):
                for i in (0, 1):
                    best[on, i] = min(best[on, i], _time_ms(graphs[on][i][0].replay, 20))
        outs = []
        for on in (False, True):
            graphs[on][0][0].replay()
            outs.append(graphs[on][0][1].clone())
        same = torch.equal(*outs)
        print(f"{dim} {page} {bs} | {best[False, 0]:.3f} / {best[True, 0]:.3f} | {best[False, 1]:.3f} / "
              f"{best[True, 1]:.3f} | {best[False, 1] / best[False, 0]:.2f}x / {best[True, 1] / best[True, 0]:.2f}x | "
              f"{same}", flush=True)
        blk.cache.abort(plan)
        blk.cache.close()
        del blk, graphs
        torch.cuda.empty_cache()
