"""Host time of a ranking step (``python -m recipes.bench suite=step_host``).

Owns the "step host path" benchmark: `RankingEngine.prepare` (request validation, KJTs, cache keys,
lookup + begin, the token layout built on the host and moved to the device) and the abort that
rolls it back, for returning users whose history is cached except the newest ``new_tokens``
events. This is the part of a cached step that runs on the CPU whatever the accelerator; the
layers are not run (their time is the block suite's). Each row times the same state, since the
abort restores it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from gr_plugin.bench.common import summarize
from gr_plugin.bench.e2e import stream
from gr_plugin.cache import KVCacheConfig
from gr_plugin.inference import RankingEngine
from gr_plugin.modules import HSTUConfig, HSTURanker, KVCacheModule

logger = logging.getLogger(__name__)


def measure(bs: int, hist: int, new_tokens: int, num_candidates: int, page_size: int, repeats: int,
            device: torch.device) -> dict[str, Any]:
    torch.manual_seed(0)
    cfg = HSTUConfig(num_items=50_000, num_time_buckets=32, max_positions=8192, embedding_dim=8, num_layers=1,
                     num_heads=1, head_dim=8, n_norm=4096.0)
    model = HSTURanker(cfg).to(device).eval()
    batches = stream(bs, bs, hist - new_tokens, hist, new_tokens, num_candidates)
    warm, timed = batches[0], batches[1]
    kv = KVCacheConfig(num_layers=1, num_heads=1, head_dim=8, page_size=page_size,
                       num_pages=bs * (-(-(hist + new_tokens) // page_size) + 2), device=str(device))
    engine = RankingEngine(model, KVCacheModule(kv, "gpu", device=device), device)
    engine.score(warm)  # the users' histories are now cached
    for _ in range(5):
        engine.discard(engine.prepare(timed))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step = engine.prepare(timed)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
        assert step.plan is not None and sum(step.plan.cached_lengths) == bs * (hist - new_tokens)
        engine.discard(step)
    engine.cache.manager.close()
    t = summarize(times)
    return {"batch": bs, "history": hist, "new": new_tokens, "candidates": num_candidates, "device": device.type,
            "prepare_us_p50": t["p50"], "prepare_us_p90": t["p90"]}


def run(batch_sizes=(1, 8), history_lens=(1024, 4096), new_tokens: int = 128, num_candidates: int = 256,
        page_size: int = 128, repeats: int = 100, device: str = "auto") -> list[dict[str, Any]]:
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    rows = []
    for hist in history_lens:
        for bs in batch_sizes:
            rows.append(measure(bs, hist, new_tokens, num_candidates, page_size, repeats, dev))
            logger.info("step host path %s", rows[-1])
    return rows


COLUMNS = ["batch", "history", "new", "candidates", "device", "prepare_us_p50", "prepare_us_p90"]
