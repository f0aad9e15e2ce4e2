"""Host time per stage of a pipelined, graphed cached step (one call of the device tool).

python3 scripts/gpu/profile_step_stages.py [batch_size ...] -> per batch size, the median µs per step
of each host stage of `RankingEngine.score` (validation, cache keys, lookup, begin, token layout,
the graph step's bucket key / input packing (its buffer wait, copy) / replay / logits
clone, commit) and of the e2e suite's pipelined loop (`gr_plugin.bench.e2e._pipelined`) around it,
over the e2e stream with one step in flight. ``PROFILE_TORCH_COPY=1``: the graph inputs' copy through
``Tensor.copy_`` instead of the runtime's ``cudaMemcpyAsync``. Stages are timed with ``perf_counter``
wrappers (no profiler: cProfile's per-call cost distorts the many small numpy calls); a stage nested
in another counts in both.
"""

import collections
import functools
import os
import statistics
import sys
import time
import types

import torch

from gr_plugin.bench import e2e
from gr_plugin.inference import RankingEngine
from gr_plugin.inference import engine as engine_mod
from gr_plugin.modules import KVCacheModule
from gr_plugin.modules import graphs as graphs_mod

STEP: dict[str, float] = collections.defaultdict(float)
PATCHED: list = []


def timed(owner, attr: str, name: str) -> None:
    fn = getattr(owner, attr)
    PATCHED.append((owner, attr, owner.__dict__.get(attr)))

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            STEP[name] += time.perf_counter() - t0

    setattr(owner, attr, wrapper)


def main(batch_sizes):
    if os.environ.get("PROFILE_TORCH_COPY") == "1":  # the graph inputs' copy through Tensor.copy_ (no raw runtime)
        graphs_mod.cudart = types.SimpleNamespace(runtime=lambda: None, H2D=1)
        print("graph inputs copied with Tensor.copy_")
    torch.manual_seed(0)
    model = e2e.stream_model(torch.device("cuda"))
    for bs in batch_sizes:
        batches = e2e.stream(bs, 24, 256, 4096, 128, 256)
        kv = e2e.stream_cache_config(torch.device("cuda"), 24)
        cache = KVCacheModule(kv, "gpu")
        eng = RankingEngine(model, cache, "cuda", cuda_graphs=True)
        for b in e2e.other_users(batches, 1 << 20):  # compiles and captures, as the suite's warm pass
            eng.score(b)
        torch.cuda.synchronize()
        cache.manager.evict_all()
        timed(eng, "prepare", "prepare")
        timed(eng, "run", "run")
        timed(model, "validate_ids", "prepare: validate_ids")
        timed(engine_mod, "batch_cache_keys", "prepare: cache keys")
        timed(cache, "lookup", "prepare: lookup")
        timed(cache, "begin", "prepare: begin")
        timed(engine_mod, "host_token_layout", "prepare: token layout")
        timed(eng.graphs, "step", "run: graphs.step")
        timed(graphs_mod, "bucket_key", "run: bucket key")
        timed(eng.graphs, "_load", "run: pack + copy inputs")
        timed(graphs_mod.PackedInputs, "begin", "run: pack: wait for the buffer")
        timed(graphs_mod.PackedInputs, "send", "run: pack: copy + event")
        timed(eng.graphs, "_key", "run: bucket key + launch")
        timed(torch.cuda.CUDAGraph, "replay", "run: replay")
        timed(cache, "commit", "run: commit")
        per_step = collections.defaultdict(list)
        pending, fetch = None, e2e.Fetcher(True)  # the suite's own output staging
        torch.cuda.synchronize()
        t_start = time.perf_counter()
        for b in batches:
            STEP.clear()
            t0 = time.perf_counter()
            logits = eng.score(b).logits
            t1 = time.perf_counter()
            _, done = fetch(logits)
            t2 = time.perf_counter()
            if pending is not None:
                pending.synchronize()
            t3 = time.perf_counter()
            pending = done
            STEP["score"] = t1 - t0
            STEP["loop: logits copy + event"] = t2 - t1
            STEP["loop: wait for the step before"] = t3 - t2
            for k, v in STEP.items():
                per_step[k].append(v)
        pending.synchronize()
        wall = time.perf_counter() - t_start
        torch.cuda.synchronize()
        print(f"bs {bs}: {len(batches)} steps, {1e3 * wall / len(batches):.3f} ms/step wall (one in flight); "
              f"graph replays {eng.graphs.replays}")
        print("| stage | µs p50 | µs mean |\n|---|---|---|")
        for k in sorted(per_step, key=lambda k: -statistics.mean(per_step[k])):
            v = per_step[k][2:]
            print(f"| {k} | {1e6 * statistics.median(v):.0f} | {1e6 * statistics.mean(v):.0f} |")
        cache.manager.close()
        while PATCHED:  # unwrap for the next batch size
            owner, attr, before = PATCHED.pop()
            if before is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, before)

if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1, 8])
