"""A module-level switch of the package A/B'd in the block's graphed cached step, on the GPU.

python3 scripts/gpu/ab_step.py MODULE:ATTR [DIM,PAGE,BS ...]

For each case (default: head_dim 128 / page 128 and 256 / page 32, bs 1 and 8; a 4096 history, 3968
cached, 128 new + 256 candidates per user), two `gr_plugin.bench.block.StaticStep` are captured on one
block, the first with ``MODULE.ATTR = False``, the second with ``True`` (the switch is read when a launch
is captured). Prints whether the two give the same bits (the last layer's output from the same input),
each one's wall ms (median of 20 replays, the two in 5 interleaved rounds, the median round), and the
device time per step of each kernel whose time differs by more than 0.5 µs (torch.profiler).
"""

from __future__ import annotations

import collections
import importlib
import sys

import torch

from gr_plugin.bench.block import Block, StaticStep, _time_ms, kernel_times

CASES = ((128, 128, 1), (128, 128, 8), (256, 32, 1), (256, 32, 8))
HIST, CACHED, CANDIDATES = 4096, 3968, 256


def main() -> None:
    name, _, attr = sys.argv[1].partition(":")
    mod = importlib.import_module(name)
    cases = [tuple(int(x) for x in c.split(",")) for c in sys.argv[2:]] or CASES
    saved = getattr(mod, attr)
    for dim, page, bs in cases:
        blk = Block(dim, page, num_pages=bs * (HIST // page + 2) + 8)
        users = list(range(bs))
        blk.fill(users, CACHED)
        plan = blk.plan(users, HIST)
        steps = {}
        with torch.no_grad():
            for flag in (False, True):
                setattr(mod, attr, flag)
                steps[flag] = StaticStep(blk, plan, bs, HIST - CACHED, CANDIDATES)
            setattr(mod, attr, saved)
            steps[True].x.copy_(steps[False].x)
            outs = {}
            for flag, step in steps.items():
                step.run()
                torch.cuda.synchronize()
                outs[flag] = step.ys[-1].clone()
            same = torch.equal(outs[False], outs[True])
            diff = (outs[False].float() - outs[True].float()).abs().max().item()
            rounds = collections.defaultdict(list)
            for _ in range(5):
                for flag, step in steps.items():
                    rounds[flag].append(_time_ms(step.run, 20))
            walls = {flag: sorted(v)[len(v) // 2] for flag, v in rounds.items()}
            kernels = {flag: kernel_times(step.run)[0] for flag, step in steps.items()}
        print(f"=== head_dim {dim} page {page} bs {bs}: {attr}=False vs True: same bits {same} "
              f"(max abs diff {diff:.3g}); "
              f"wall {walls[False]:.4f} vs {walls[True]:.4f} ms", flush=True)
        for k in sorted(set(kernels[False]) | set(kernels[True])):
            a, b = kernels[False][k], kernels[True][k]
            if abs(a - b) > 0.5:
                print(f"  {a:8.1f} vs {b:8.1f} us/step  {k[:100]}", flush=True)


if __name__ == "__main__":
    main()
