"""Where ``recipes.infer``'s cached pass spends its host time, per stage (``perf_counter`` wrappers, no profiler).

    python3 scripts/gpu/profile_infer.py [--kernels] <kvcache option> [hydra overrides ...]

Runs ``recipes.infer`` (its config, ``+kvcache=<option>``, the overrides) with the engine's and the cache
manager's stages wrapped, then prints the run's latency lines and each stage's call count and p50 µs.
``prepare`` holds lookup and allocate; ``commit`` holds ``_reap`` (finished copies published to the host
tier, and the write-down to SSD / remote queued; its gather, ``_stage``, runs on the tier's worker) and
``_offload`` (the write-through launched).
``--kernels``: the whole run under ``torch.profiler`` too (give it ``max_batches=``), then the 25
kernels with the most device time (ops with the most CPU time on a CPU run).
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import gr_plugin.configs.schema  # noqa: F401 - registers the schemas
from gr_plugin.apps import infer
from gr_plugin.cache import host_tier, manager, tiered
from gr_plugin.inference import engine

TIMES: dict[str, list[float]] = defaultdict(list)
STAGES = [(engine.RankingEngine, "prepare"), (engine.RankingEngine, "forward"),
          (manager.KVCacheManager, "lookup"), (manager.KVCacheManager, "allocate"),
          (manager.KVCacheManager, "commit"), (manager.KVCacheManager, "_reap"),
          (manager.KVCacheManager, "_offload"), (host_tier.HostTier, "publish"),
          (tiered.TieredBackend, "_stage"), (tiered.TieredBackend, "_write_down"),
          (tiered.TieredBackend, "match")]


def _wrap(cls: type, name: str) -> None:
    fn = getattr(cls, name)

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            full = cls is engine.RankingEngine and args[0].cache is None
            TIMES[f"{cls.__name__}.{name}{' (full)' if full else ''}"].append((time.perf_counter() - t0) * 1e6)

    setattr(cls, name, timed)


def main() -> None:
    args = sys.argv[1:]
    kernels = args[:1] == ["--kernels"]
    option, overrides = args[kernels], args[kernels + 1:]
    for cls, name in STAGES:
        _wrap(cls, name)
    conf = Path(__file__).resolve().parents[2] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose(config_name="infer", overrides=[f"+kvcache={option}", *overrides])
    out = Path("outputs") / "profile_infer" / option
    if kernels:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            summary = infer.run(OmegaConf.to_object(cfg), out)
        on_gpu = torch.cuda.is_available() and cfg.device != "cpu"
        sort = "self_device_time_total" if on_gpu else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=70))
    else:
        summary = infer.run(OmegaConf.to_object(cfg), out)
    print(f"== {option} {' '.join(overrides)}")
    print(infer.format_table(summary))
    for key, values in TIMES.items():
        print(f"{key:32s} calls {len(values):6d}  p50 {statistics.median(values):9.1f} us")


if __name__ == "__main__":
    main()
