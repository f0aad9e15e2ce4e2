"""Fit the split rule's makespan constants (``gr_plugin.ops.triton.hstu_attention.MAKESPAN``) to graphed
times of every split count, and say how the rule's pick compares with the best measured count.

python scripts/fit_makespan.py GRID.jsonl [--sms 132] -> per (head_dim, tiles): ``(µs per history key of a
program's query tile, µs per program)`` and, per (history, batch), the rule's count against the best.

Each JSON line: ``dim, hist, bs, blocks, splits, ms, programs`` (``programs``: query tiles x heads x
splits), as `scripts/gpu/gluon_attention.py grid` writes them. The model is `_makespan`'s,
``ceil(programs / wave) * (per_key * hist / splits + per_program)`` with ``wave`` = SMs x `_resident`,
fitted by least squares on relative error (it is linear in the two constants).
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict

import torch

from gr_plugin.ops.triton import hstu_attention as tri


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("grid")
    parser.add_argument("--sms", type=int, default=132)
    parser.add_argument("--shared", type=int, default=232448, help="shared memory a block may opt into (bytes)")
    a = parser.parse_args()
    rows = [json.loads(line) for line in open(a.grid)]
    groups = defaultdict(list)
    for r in rows:
        groups[(r["dim"], tuple(r["blocks"]))].append(r)
    tri._SMEM[0] = a.shared  # `_resident` as on that device
    device = torch.device("cuda", 0)
    for (dim, blocks), rs in sorted(groups.items()):
        wave = a.sms * tri._resident(blocks, dim, 2, device)
        xs = torch.tensor([[math.ceil(r["programs"] / wave) * r["hist"] / r["splits"] / (r["ms"] * 1e3),
                            math.ceil(r["programs"] / wave) / (r["ms"] * 1e3)] for r in rs], dtype=torch.float64)
        per_key, per_program = torch.linalg.lstsq(xs, torch.ones(len(rs), 1, dtype=torch.float64)).solution[:, 0]
        err = (xs @ torch.tensor([per_key, per_program], dtype=torch.float64) - 1).abs()
        print(f"head_dim {dim} tiles {blocks} ({wave} programs a wave): per_key {per_key:.5f} µs, per_program "
              f"{per_program:.2f} µs; relative error mean {err.mean():.3f}, max {err.max():.3f}")
        cases = defaultdict(dict)
        for r in rs:
            cases[(r["hist"], r["bs"])][r["splits"]] = (r["ms"], r["programs"] // r["splits"])
        for (hist, bs), by_split in sorted(cases.items()):
            n = next(iter(by_split.values()))[1]
            _, pick = tri._best_count(n, hist, blocks[1], wave, float(per_key), float(per_program))
            best = min(by_split, key=lambda s: by_split[s][0])
            got = by_split.get(pick, (float("nan"),))[0]
            print(f"   hist {hist:5d} bs {bs:2d}: rule {pick:2d} splits {got * 1e3:8.1f} µs, best {best:2d} splits "
                  f"{by_split[best][0] * 1e3:8.1f} µs ({got / by_split[best][0] - 1:+.1%})")


if __name__ == "__main__":
    main()
