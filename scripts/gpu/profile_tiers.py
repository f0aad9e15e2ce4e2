"""Where does a host hit + layerwise step spend its time? (the tiers rows of docs/BENCHMARKS.md)

python3 scripts/gpu/profile_tiers.py [tokens ...] [ahead=N]   (default 2048 4096; N: the onboard's
look-ahead in layers, default the transfer engine's)

For each history length: the bench's bs-1 block (head_dim 128, page 128, 128 new events, 256
candidates) with every cached page in the host tier, one layerwise host hit run under the
profiler. Prints the host time of each phase (plan, onboard launch, metadata load, the 8 layer
replays) and the GPU timeline (copies and kernels, per stream, from the event before the launch).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections import defaultdict

import torch

from gr_plugin.bench.block import StaticStep, host_hit_block


def one(tokens: int, new: int = 128, candidates: int = 256, page: int = 128, ahead: int | None = None) -> None:
    cached = tokens - new
    blk = host_hit_block(tokens, 128, page, new)
    m = blk.cache
    if ahead is not None:
        m.transfer.onboard_lookahead = ahead
    with torch.no_grad():
        plan = blk.plan([1], tokens)
        step = StaticStep(blk, plan, 1, tokens - plan.cached_lengths[0], candidates)
        m.abort(plan)

        def host_hit(marks: dict | None = None) -> None:
            m.evict([1])
            t0 = time.perf_counter()
            plan = blk.plan([1], tokens)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            handle = m.onboard_launch(plan)
            t2 = time.perf_counter()
            step.load(plan)
            t3 = time.perf_counter()
            step.run(wait=handle.wait_layer)
            t4 = time.perf_counter()
            b.record()
            b.synchronize()
            if marks is not None:
                marks.update(plan_us=(t1 - t0) * 1e6, onboard_launch_us=(t2 - t1) * 1e6, load_us=(t3 - t2) * 1e6,
                             replays_us=(t4 - t3) * 1e6, gpu_ms=a.elapsed_time(b))
            m.abort(plan)
            m.offload_flush()

        for _ in range(5):
            host_hit()
        marks: dict = {}
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            host_hit(marks)
        plain: dict = {}
        host_hit(plain)
    print(f"=== tokens {tokens} (cached {cached}), look-ahead {m.transfer.onboard_lookahead}: "
          "unprofiled host us / gpu ms "
          + ", ".join(f"{k} {v:.1f}" if k != "gpu_ms" else f"{k} {v:.3f}" for k, v in plain.items()))
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))
    gpu = [e for e in trace["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    gpu.sort(key=lambda e: e["ts"])
    if not gpu:
        print("no GPU events")
        return
    t0 = gpu[0]["ts"]
    per_stream = defaultdict(float)
    for e in gpu:
        per_stream[e["tid"]] += e["dur"]
    print("busy us per stream:", {k: round(v, 1) for k, v in per_stream.items()},
          f"span {gpu[-1]['ts'] + gpu[-1]['dur'] - t0:.1f} us")
    for e in gpu:
        print(f"  {e['ts'] - t0:8.1f} +{e['dur']:7.1f} s{e['tid']} {e['cat'][:6]} {e['name'][:70]}")
    launches = [e for e in trace["traceEvents"] if e.get("cat") == "cuda_runtime"]
    lt0 = min(e["ts"] for e in launches) if launches else 0
    print("host runtime calls (first 60):")
    for e in sorted(launches, key=lambda e: e["ts"])[:60]:
        print(f"  {e['ts'] - lt0:8.1f} +{e['dur']:6.1f} {e['name'][:50]}")
    m.close()


if __name__ == "__main__":
    opts = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
    for t in [int(a) for a in sys.argv[1:] if "=" not in a] or [2048, 4096]:
        one(t, ahead=int(opts["ahead"]) if "ahead" in opts else None)
