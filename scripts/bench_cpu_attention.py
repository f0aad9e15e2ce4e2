"""Time the gr_kv C++ CPU attention ops (what CPU inference and an exported package run) on fixed batch shapes.

    python scripts/bench_cpu_attention.py [--repeats N]

Per case (users' history lengths; 64 candidates each; the paged form with 16 new events per user, page 32): the
jagged op (a full recomputation) and the paged op (a cached step), fp32, under ``inference_mode``, ms p50 over
``--repeats`` calls after a warm-up, with the process's intra-op threads (``torch.get_num_threads()``). To compare
two versions of the kernels, run each checkout's copy of this script, interleaved (each builds its own library).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gr_plugin.ops import library  # noqa: F401 - loads the gr_kv ops

CASES = {  # name: history lengths of the batch's users
    "mixed (ML-1M-like)": [1024, 300, 150, 80, 60, 500, 40, 200],
    "one long": [1024] + [32] * 7,
    "balanced": [256] * 8,
    "near even": [520, 500],
    "many short": [24] * 64,
    "bs 1": [1024],
}
CANDS, NEW, PAGE = 64, 16, 32


def inputs(hist: list[int], heads: int, dim: int, g: torch.Generator):
    lens = [h + CANDS for h in hist]
    off = torch.tensor([0, *torch.cumsum(torch.tensor(lens), 0).tolist()])
    q, k, v = (torch.randn(int(off[-1]), heads, dim, generator=g) for _ in range(3))
    jagged = (q, k, v, off, torch.full((len(hist),), CANDS))
    per = [-(-h // PAGE) for h in hist]
    table = torch.randn(sum(per) + 4, 2, PAGE, heads, dim, generator=g)
    idx = torch.randperm(sum(per) + 4, generator=g)[: sum(per)]
    indptr = torch.tensor([0, *torch.cumsum(torch.tensor(per), 0).tolist()])
    nq = len(hist) * (NEW + CANDS)
    qo = torch.arange(0, nq + 1, NEW + CANDS)
    qq, kk, vv = (torch.randn(nq, heads, dim, generator=g) for _ in range(3))
    paged = (qq, kk, vv, table, idx, indptr, torch.tensor(hist), qo, torch.full((len(hist),), NEW))
    return jagged, paged


def p50_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    ops = torch.ops.gr_kv
    g = torch.Generator().manual_seed(0)
    print(f"threads {torch.get_num_threads()}")
    print("| heads x dim | case | jagged ms p50 | paged ms p50 |")
    print("|---|---|---|---|")
    with torch.inference_mode():
        for heads, dim in ((2, 32), (4, 128)):
            for name, hist in CASES.items():
                jagged, paged = inputs(hist, heads, dim, g)
                j = p50_ms(lambda: ops.hstu_attention_jagged(*jagged, 0.2, 1024.0), args.repeats)
                p = p50_ms(lambda: ops.paged_hstu_attention(*paged, 0.2, 1024.0), args.repeats)
                print(f"| {heads} x {dim} | {name} | {j:.3f} | {p:.3f} |", flush=True)


if __name__ == "__main__":
    main()
