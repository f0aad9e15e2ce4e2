"""Host overhead of the cache's request path: lookup + allocate (+ commit) per batch.

Owns the "host overhead" benchmark: returning users whose history is all cached except the
newest ``new_tokens`` events, the shape of a steady serving stream. Each timed iteration runs
``CacheRequest`` validation + ``lookup`` + ``allocate`` and is then rolled back with ``abort``, so
every iteration sees the same cache state; ``commit`` (hashing of new pages) is timed on its own.
K/V dims are tiny: the host path does not depend on them. Device syncs are counted with
``torch.cuda.set_sync_debug_mode`` where CUDA is present.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from gr_plugin.bench.common import count_device_syncs, summarize, timed_us
from gr_plugin.cache import CacheRequest, KVCacheConfig, KVCacheManager

logger = logging.getLogger(__name__)


def _history(user: int, length: int) -> torch.Tensor:
    """Token keys ``[length]``: item id, action and time bucket packed into one int64 per token,
    as the model's cache key does."""
    item = torch.arange(length, dtype=torch.int64) * 131 + user * 1_000_003
    return (item << 24) | ((item % 5) << 16) | (item % 97)


def run(batch_sizes=(1, 8), history_lens=(1024, 4096), page_size: int = 32, new_tokens: int = 128,
        repeats: int = 200, device: str = "cpu") -> list[dict[str, Any]]:
    rows = []
    for hist in history_lens:
        for bs in batch_sizes:
            pages_needed = bs * (-(-hist // page_size) + 2) * 2
            cfg = KVCacheConfig(num_layers=1, num_heads=1, head_dim=1, page_size=page_size,
                                num_pages=pages_needed, device=device)
            m = KVCacheManager(cfg)
            users = list(range(bs))
            hists = [_history(u, hist) for u in users]
            # warm: every user has hist - new_tokens cached
            warm = CacheRequest(users, [hist - new_tokens] * bs, torch.cat([h[: hist - new_tokens] for h in hists]))
            m.commit(m.allocate(m.lookup(warm)))
            rows_all = torch.cat(hists)
            lengths = [hist] * bs

            def step():
                req = CacheRequest(users, lengths, rows_all)
                return m.allocate(m.lookup(req))

            for _ in range(10):
                m.abort(step())
            with count_device_syncs() as syncs:
                plan = step()
            m.abort(plan)
            times = []
            lookup_times = []
            for _ in range(repeats):
                t, lk = timed_us(lambda: m.lookup(CacheRequest(users, lengths, rows_all)), 1)
                lookup_times += t
                t2, plan = timed_us(lambda lk=lk: m.allocate(lk), 1)
                times.append(t[0] + t2[0])
                assert plan.cached_lengths == [hist - new_tokens] * bs
                m.abort(plan)
            # commit: each iteration commits the new tokens of a fresh copy of the cache state
            commit_times = []
            for _ in range(min(repeats, 50)):
                plan = step()
                t, _ = timed_us(lambda plan=plan: m.commit(plan), 1)
                commit_times += t
                m.evict(users)
                m.commit(m.allocate(m.lookup(warm)))
            total, look, com = summarize(times), summarize(lookup_times), summarize(commit_times)
            rows.append({
                "batch": bs, "history": hist, "cached": hist - new_tokens, "page_size": page_size,
                "device": device, "lookup_us_p50": look["p50"], "lookup_allocate_us_p50": total["p50"],
                "lookup_allocate_us_p90": total["p90"], "commit_us_p50": com["p50"],
                "device_syncs": syncs[0],
            })
            logger.info("host overhead %s", rows[-1])
            m.close()
    return rows


COLUMNS = ["batch", "history", "cached", "page_size", "device", "lookup_us_p50", "lookup_allocate_us_p50",
           "lookup_allocate_us_p90", "commit_us_p50", "device_syncs"]
