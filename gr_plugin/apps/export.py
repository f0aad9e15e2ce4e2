"""``recipes.export``: export the whole cached step (embeddings, layer stack, head) to an AOTInductor
package, reload it, and check it.

Owns the export run: load the model (as ``recipes.infer`` does), take the first request batch as the
example, write the package, reload it with ``aoti_load_package``, then replay the request stream
twice on fresh caches — eager cached inference and the package — comparing both with a full
recomputation and timing them side by side; with ``stream`` (CPU), also write the request stream
with the eager cached scores next to the package (`gr_plugin.export.stream`) for the C++ runner.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from contextlib import closing
from pathlib import Path
from typing import Any

import torch

from gr_plugin.apps.common import make_cache, make_datamodule, pick_device
from gr_plugin.apps.infer import _load_or_train, check_options
from gr_plugin.cache.tiers.flexkv_config import TierConfig
from gr_plugin.configs.kvcache import KVCacheOptions
from gr_plugin.configs.schema import ExportConfig
from gr_plugin.export.runner import PackagedCachedRanker, export_package
from gr_plugin.export.stream import StreamBatch, record_stream
from gr_plugin.inference import batch_cache_keys, batch_to_kjts

logger = logging.getLogger(__name__)


def run(cfg: ExportConfig, out_dir: Path, package: str | None = None) -> dict[str, Any]:
    if cfg.kvcache is not None and cfg.kvcache.backend == "none":
        # (it used to fail after loading the weights: 'NoneType' object has no attribute 'close')
        raise ValueError("recipes.export exports the cached model, and +kvcache=none has no cache: choose "
                         "+kvcache=gpu, native or flexkv (or no +kvcache: gpu)")
    check_options(cfg)
    device = pick_device(cfg.device)
    dm = make_datamodule(cfg.data)
    module, weights = _load_or_train(cfg)
    model = module.model.to(device).eval()
    dtype = next(model.parameters()).dtype
    opts = cfg.kvcache or KVCacheOptions(backend="gpu", host_cache_gb=0.0)
    dm.setup("predict")
    batches = list(dm.predict_dataloader())
    if cfg.max_batches is not None:
        batches = batches[: cfg.max_batches]

    def begin(cache, batch):
        host = batch
        plan = cache.begin(host.user_ids.tolist(), host.history_lengths.tolist(), batch_cache_keys(host))
        history, candidates = batch_to_kjts(batch.to(device))
        return plan, history, candidates

    out_dir.mkdir(parents=True, exist_ok=True)
    path = package or str(out_dir / "cached_model.pt2")
    # NOTE: each phase's cache is closed before the next one is made: a flexkv cache holds its SSD
    # directory's lock until closed, and every phase uses the same directory.
    with closing(make_cache(opts, cfg.model, device, dtype)) as cache:
        plan, history, candidates = begin(cache, batches[0])
        t0 = time.perf_counter()
        export_package(model, cache, history, candidates, plan, path)
        export_s = time.perf_counter() - t0
        cache.abort(plan)
    results: dict[str, dict[str, Any]] = {}
    for mode in ("eager", "package"):
        with closing(make_cache(opts, cfg.model, device, dtype)) as cache:
            packaged = PackagedCachedRanker(model, cache, path) if mode == "package" else None
            times, diffs, reused = [], [], 0
            for batch in batches:
                plan, history, candidates = begin(cache, batch)
                with torch.no_grad():
                    full = model(history, candidates)
                    t = time.perf_counter()
                    got = (packaged.score(history, candidates, plan) if packaged is not None
                           else model.forward_cached(history, candidates, cache, plan))
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    times.append((time.perf_counter() - t) * 1e3)
                reused += sum(plan.cached_lengths)
                cache.commit(plan)
                diffs.append((got.float() - full.float()).abs().max().item())
        results[mode] = {"ms_p50": statistics.median(times), "max_abs_diff_vs_full": max(diffs),
                         "tokens_reused": reused}
    stream = None
    if cfg.stream:
        if device.type == "cpu":
            # NOTE: a fresh device-only cache: the C++ runner keeps device pages only, so this run's
            # cached lengths are what the runner's must be.
            device_only = dataclasses.replace(opts, backend="gpu", host_cache_gb=0.0, tiers=TierConfig(),
                                              tier_config=None)
            with closing(make_cache(device_only, cfg.model, device, dtype)) as cache:
                stream = str(record_stream(model, cache, (StreamBatch(b.user_ids.tolist(), *batch_to_kjts(b))
                                                          for b in batches), out_dir / "stream"))
        else:
            logger.warning("stream: streams are recorded on the CPU; not written for device %s", device)
    summary = {"weights": weights, "device": str(device), "package": path, "stream": stream, "export_s": export_s,
               "batches": len(batches), **{f"{m}_{k}": v for m, r in results.items() for k, v in r.items()}}
    summary["equal"] = max(results["eager"]["max_abs_diff_vs_full"],
                           results["package"]["max_abs_diff_vs_full"]) <= cfg.tolerance
    return summary
