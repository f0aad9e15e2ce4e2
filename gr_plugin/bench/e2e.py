"""End to end on a GPU (``python -m recipes.bench suite=e2e``): request streams through the whole
model (embeddings, token layout, 8 HSTU layers, head) with and without the KV cache.

Synthetic users with histories of 256 -> 4096 events return in visits of ``stride`` new events and
ask to score ``num_candidates`` items; each batch is scored by the cached engine and then, in the
same loop, by the full recomputation. Reports throughput (requests/s), latency and the largest score
difference between the two.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

import torch

from gr_plugin.cache import KVCacheConfig
from gr_plugin.data import RecDataModule
from gr_plugin.inference import RankingEngine
from gr_plugin.modules import HSTUConfig, HSTURanker, KVCacheModule

logger = logging.getLogger(__name__)


def run(batch_sizes=(1, 2, 4, 8), num_users: int = 64, min_len: int = 256, max_len: int = 4096, stride: int = 128,
        num_candidates: int = 256, hidden: int = 1024, layers: int = 8, heads: int = 4, head_dim: int = 128,
        page_size: int = 128, warmup_batches: int = 2, graphs: bool = True) -> list[dict[str, Any]]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    cfg = HSTUConfig(num_items=50_000, num_time_buckets=32, max_positions=8192, embedding_dim=hidden,
                     num_layers=layers, num_heads=heads, head_dim=head_dim, n_norm=4096.0)
    model = HSTURanker(cfg).to(device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    model.eval()
    rows = []
    for bs in batch_sizes:
        dm = RecDataModule("synthetic", source_kwargs=dict(num_users=num_users, min_len=min_len, max_len=max_len,
                                                            num_items=50_000), batch_size=bs,
                           num_candidates=num_candidates, max_next=8, stride=stride, num_val_visits=2,
                           num_test_visits=2, interleave_users=max(bs, 8))
        dm.setup("predict")
        batches = list(dm.predict_dataloader())
        kv = KVCacheConfig(num_layers=layers, num_heads=heads, head_dim=head_dim, page_size=page_size,
                           num_pages=num_users * (-(-(max_len + 4 * stride) // page_size) + 2),
                           dtype="bfloat16" if device.type == "cuda" else "float32", device=str(device))
        cache = KVCacheModule(kv, "gpu")
        cached_engine = RankingEngine(model, cache, device, cuda_graphs=graphs and device.type == "cuda")
        full_engine = RankingEngine(model, None, device)
        t_cached, t_full, diff, hits = [], [], 0.0, []
        for i, batch in enumerate(batches):
            for engine, times in ((cached_engine, t_cached), (full_engine, t_full)):
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                res = engine.score(batch)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if i >= warmup_batches:
                    times.append(time.perf_counter() - t0)
                if engine is cached_engine:
                    logits = res.logits
                    hits.append(res.cached_tokens / max(1, res.cached_tokens + res.computed_tokens))
                else:
                    diff = max(diff, (logits.float() - res.logits.float()).abs().max().item())
        n_req = sum(b.batch_size for b in batches[warmup_batches:])
        row = {"batch": bs, "requests": n_req, "cached_req_s": n_req / sum(t_cached), "full_req_s": n_req / sum(t_full),
               "cached_ms_p50": 1e3 * statistics.median(t_cached), "full_ms_p50": 1e3 * statistics.median(t_full),
               "hit_rate": statistics.fmean(hits), "max_abs_diff": diff, "cuda_graphs": graphs,
               "graph_replays": getattr(cached_engine.graphs, "replays", 0)}
        row["throughput_x"] = row["cached_req_s"] / row["full_req_s"]
        rows.append(row)
        logger.info("e2e %s", row)
        cache.manager.close()
    return rows


COLUMNS = ["batch", "requests", "cuda_graphs", "graph_replays", "cached_req_s", "full_req_s", "throughput_x",
           "cached_ms_p50", "full_ms_p50", "hit_rate", "max_abs_diff"]
