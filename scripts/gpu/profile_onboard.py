"""Where does the host time of ``KVCacheManager.onboard_launch`` go? (the tiers rows' launch_us)

python3 scripts/gpu/profile_onboard.py [tokens]   (default 2048)

The tiers bench's bs-1 setup (head_dim 128, page 128, 8 layers, every cached page in the host tier):
50 onboard launches under cProfile (each after an evict + plan, followed by a sync, abort and
flush, which are not profiled), then the top functions by own time and by cumulative time; then
50 launches without the profiler, with checkpoints (perf_counter at the entry and exit of the
transfer engine's copy, its fence and each raw cudaMemcpyAsync / cudaMemcpy2DAsync): the median µs from the call
to each checkpoint, so the host time before the first copy is queued reads directly.
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import sys
import time

import torch

from gr_plugin.bench.block import Block, host_hit_block
from gr_plugin.cache import cudart


def main(tokens: int) -> None:
    page, new = 128, 128
    blk = host_hit_block(tokens, 128, page, new)
    m = blk.cache
    prof, times = cProfile.Profile(), []
    for i in range(60):
        m.evict([1])
        plan = blk.plan([1], tokens)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if i >= 10:
            prof.enable()
        m.onboard_launch(plan)
        if i >= 10:
            prof.disable()
        times.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        m.abort(plan)
        m.offload_flush()
    print(f"onboard_launch us: median unprofiled (first 10) {sorted(times[:10])[5]:.1f}, profiled "
          f"{sorted(times[10:])[25]:.1f}")
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(18)
    stats.sort_stats("cumulative").print_stats(18)
    checkpoints(blk, tokens)
    m.close()


def checkpoints(blk: Block, tokens: int, runs: int = 50) -> None:
    m, rt = blk.cache, cudart.runtime()
    marks: list[tuple[str, float]] = []

    def wrap(obj, name: str, label: str) -> None:
        fn = getattr(obj, name)

        def timed(*a, **k):
            marks.append((f"{label} in", time.perf_counter()))
            try:
                return fn(*a, **k)
            finally:
                marks.append((f"{label} out", time.perf_counter()))
        setattr(obj, name, timed)

    wrap(m.transfer, "copy", "engine.copy")
    wrap(m.transfer, "_fence", "fence")
    wrap(rt, "memcpy_async", "memcpy")
    wrap(rt, "memcpy2d_async", "memcpy2d")  # (a pair of layers' run: `layer_spans`)
    rows: dict[str, list[float]] = {}
    for i in range(runs + 5):
        m.evict([1])
        plan = blk.plan([1], tokens)
        torch.cuda.synchronize()
        marks.clear()
        t0 = time.perf_counter()
        m.onboard_launch(plan)
        marks.append(("return", time.perf_counter()))
        torch.cuda.synchronize()
        m.abort(plan)
        m.offload_flush()
        if i >= 5:
            seen: dict[str, int] = {}
            for label, t in marks:
                seen[label] = seen.get(label, 0) + 1
                rows.setdefault(f"{label} #{seen[label]}", []).append((t - t0) * 1e6)
    print("checkpoints: median us from the call (unprofiled)")
    for label, ts in sorted(rows.items(), key=lambda kv: statistics.median(kv[1])):
        print(f"  {statistics.median(ts):7.1f}  {label}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2048)
