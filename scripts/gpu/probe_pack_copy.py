"""Host µs of a graphed cached step's input packing (`CachedStackGraphs._load`) and of its parts.

python3 scripts/gpu/probe_pack_copy.py [batch_size ...]

For a returning step of the e2e stream (`gr_plugin.bench.e2e`, graphed engine, warmed), p50 over
300 calls each, timed with ``perf_counter`` (the GPU idle, every copy done before the next call):
- ``_load``: the whole packing as the engine runs it (the fills: numpy up to commit b4ae06d, the core's
  ``pack_cached_step`` since; one copy: ``Tensor.copy_`` up to commit dd92054, the runtime's
  ``cudaMemcpyAsync`` since; an event);
- its fills alone (the copy and the event left out);
- the copy alone: ``Tensor.copy_`` (pinned host -> device, non-blocking) and ``cudaMemcpyAsync``
  through ctypes (`gr_plugin.cache.cudart`) of the whole packed buffer (the engine sends only the
  fields up to the batch's pages);
The parts are timed one by one in tight loops, so they need not add up to ``_load``.
- ``Event.record``, ``Event.synchronize`` of a completed event, and the step's other small host
  calls: ``logits[:n].clone()`` and ``with torch.cuda.device(...)``.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from gr_plugin.bench import e2e
from gr_plugin.cache import cudart
from gr_plugin.inference import RankingEngine
from gr_plugin.modules import KVCacheModule


def p50_us(fn, n: int = 300) -> float:
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def main(batch_sizes) -> None:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = e2e.stream_model(dev)
    for bs in batch_sizes:
        batches = e2e.stream(bs, 24, 256, 4096, 128, 256)
        cache = KVCacheModule(e2e.stream_cache_config(dev, 24), "gpu")
        eng = RankingEngine(model, cache, dev, cuda_graphs=True)
        for b in e2e.other_users(batches, 1 << 20):
            eng.score(b)
        for b in batches[: len(batches) // 2]:
            eng.score(b)
        torch.cuda.synchronize()
        step = eng.prepare(batches[len(batches) // 2])
        graphs = eng.graphs
        key, _ = graphs._key(step.plan.metadata.batch_size, step.layout.num_query_tokens,
                             step.plan.metadata.num_new_tokens, step.layout.max_q_len,
                             step.plan.metadata.max_total_len, cache.kv_table)
        bucket = graphs._buckets[key]
        p = bucket.inputs
        n = p.ints.numel()
        rt = cudart.runtime()
        stream = torch.cuda.current_stream()
        ev = torch.cuda.Event()
        ev.record()
        logits = torch.zeros(4096, 1, device=dev)
        rows = {
            "_load (as the engine runs it)": lambda: graphs._load(bucket, step.layout, step.plan),
        }
        send = p.send
        p.send = lambda end=None: None
        rows["fills alone"] = lambda: graphs._load(bucket, step.layout, step.plan)
        times = {name: p50_us(fn) for name, fn in rows.items()}
        p.send = send
        staging = p._staging[0]
        times["Tensor.copy_ (pinned -> device, non-blocking)"] = p50_us(
            lambda: p.ints[:n].copy_(staging[:n], non_blocking=True))
        if rt is not None:
            times["cudaMemcpyAsync through ctypes"] = p50_us(
                lambda: rt.memcpy_async(p.ints.data_ptr(), staging.data_ptr(), 8 * n, cudart.H2D, stream))
        times["Event.record"] = p50_us(ev.record)
        times["Event.synchronize (completed)"] = p50_us(ev.synchronize)
        times["logits[:n].clone()"] = p50_us(lambda: logits[: 256 * bs].clone())

        def device_context():
            with torch.cuda.device(dev):
                pass

        times["with torch.cuda.device(...)"] = p50_us(device_context)
        cache.abort(step.plan)
        print(f"bs {bs}: {n} packed ints ({8 * n} bytes)")
        print("| part | µs p50 |\n|---|---|")
        for name, us in times.items():
            print(f"| {name} | {us:.1f} |")
        cache.manager.close()


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1, 8])
