"""Where the block's time goes on the GPU: kernel time per kernel name, per step (one device call).

python3 scripts/gpu/profile_block.py [head_dim] [page] [bs] -> for the cached step (4096 history, 3968 cached,
128 new, 256 candidates per user) and the full recomputation, the device time of each kernel (summed over the
8 layers, averaged over the profiled steps), its share, and the step's wall time as CUDA graphs. The cached
step also as it ran before its consumers took the projection's SiLU (``silu_pass``: a SiLU pass of its own)
and with the other form of the kernels' SiLU (`gr_plugin.ops.triton.EXACT_SILU` flipped), their wall times
taken in turns with the engine's form.
"""

import collections
import sys

import torch

import gr_plugin.ops.triton as tri_ops
from gr_plugin.bench.block import Block, StaticStep, _graph, _time_ms, kernel_times

dim, page, bs = (int(a) for a in (sys.argv[1:] + ["128", "128", "8"][len(sys.argv) - 1:])[:3])
hist, cached, cands = 4096, 3968, 256
blk = Block(dim, page, num_pages=bs * (hist // page + 2) + 8)
users = list(range(bs))
blk.fill(users, cached)
plan = blk.plan(users, hist)

with torch.no_grad():
    cached_fn, _ = blk.cached_fn(plan, bs, hist - cached, cands)
    full_fn, _ = blk.full_fn(bs, hist, cands)
    step = StaticStep(blk, plan, bs, hist - cached, cands)
    step_pass = StaticStep(blk, plan, bs, hist - cached, cands, silu_pass=True)
    tri_ops.EXACT_SILU = not tri_ops.EXACT_SILU  # (the other SiLU form, captured into this step's graphs)
    step_other = StaticStep(blk, plan, bs, hist - cached, cands)
    tri_ops.EXACT_SILU = not tri_ops.EXACT_SILU
    other = f"cached (graph, {'approximate' if tri_ops.EXACT_SILU else 'exact'} SiLU)"
    full_graph = _graph(full_fn)
    rounds = collections.defaultdict(list)
    for _ in range(5):  # in turns, so that a drift of the machine's speed touches both forms alike
        rounds["cached (graph)"].append(_time_ms(step.run, 20))
        rounds["cached (graph, SiLU pass)"].append(_time_ms(step_pass.run, 20))
        rounds[other].append(_time_ms(step_other.run, 20))
    walls = {k: sorted(v)[len(v) // 2] for k, v in rounds.items()}
    walls["full (graph)"] = _time_ms(full_graph, 10)
for name, fn in (("cached (graphs)", step.run), ("cached (graphs, SiLU pass)", step_pass.run),
                 ("cached (eager)", cached_fn), ("full (graph)", full_graph)):
    times, counts = kernel_times(fn)
    total = sum(times.values())
    print(f"=== {name}: bs {bs} head_dim {dim} page {page}: kernel time {total / 1e3:.3f} ms per step")
    for k, t in times.most_common(25):
        print(f"  {t / 1e3:8.4f} ms {100 * t / total:5.1f}%  x{counts[k]:4.0f}  {k[:110]}")
for k, v in walls.items():
    print(f"wall {k}: {v:.3f} ms" + (f" ({walls['full (graph)'] / v:.2f}x)" if k.startswith("cached") else ""))
