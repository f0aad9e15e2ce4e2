"""Where the cached end-to-end step spends its time on the GPU (one call of the device tool).

python3 scripts/gpu/profile_e2e.py [batch_size ...] -> per batch size: wall ms per step (cached with
graphs / full), the Python functions with the most cumulative time (cProfile), and the CUDA
kernels with the most GPU time (torch.profiler), over a warm stretch of the e2e stream.
"""

import cProfile
import pstats
import sys
import time

import torch

from gr_plugin.bench import e2e
from gr_plugin.inference import RankingEngine
from gr_plugin.modules import KVCacheModule


def main(batch_sizes):
    torch.manual_seed(0)
    model = e2e.stream_model(torch.device("cuda"))
    for bs in batch_sizes:
        batches = e2e.stream(bs, 16, 256, 4096, 128, 256)
        kv = e2e.stream_cache_config(torch.device("cuda"), 16)
        cache = KVCacheModule(kv, "gpu")
        cached = RankingEngine(model, cache, "cuda", cuda_graphs=True)
        full = RankingEngine(model, None, "cuda")
        half = len(batches) // 2
        for b in batches[:half]:  # warm: captures, first visits
            cached.score(b)
            full.score(b)
        torch.cuda.synchronize()
        warm = batches[half:]
        for name, eng in (("cached+graphs", cached), ("full", full)):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for b in warm:
                eng.score(b)
            torch.cuda.synchronize()
            print(f"bs{bs} {name}: {1e3 * (time.perf_counter() - t0) / len(warm):.2f} ms/step over {len(warm)} steps")
        prof = cProfile.Profile()
        prof.enable()
        for b in warm:
            cached.score(b)
        torch.cuda.synchronize()
        prof.disable()
        print(f"--- bs{bs} cached+graphs, cProfile (cumulative) ---")
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as p:
            for b in warm[:8]:
                cached.score(b)
            torch.cuda.synchronize()
        print(f"--- bs{bs} cached+graphs, torch.profiler (8 steps) ---")
        print(p.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
        cache.manager.close()


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1, 8])
