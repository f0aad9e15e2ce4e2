"""Host overhead of the cache's request path: lookup + allocate (+ commit) per batch.

Owns the "host overhead" benchmark: returning users whose history is all cached except the
newest ``new_tokens`` events, the shape of a steady serving stream. Each timed iteration runs
``CacheRequest`` validation + ``lookup`` + ``allocate`` and is then rolled back with ``abort``, so
every iteration sees the same cache state; ``commit`` (hashing of new pages) is timed on its own.
With ``host_tier``: the pinned host tier below (the ``native`` option) and the users' cached pages
only there (evicted from the device), so lookup + allocate match and pin them in the host tier, and
``commit`` includes the write-through's reservations and the copy's launch (the copies themselves
finish, untimed, before the next iteration). K/V dims are tiny: the host path does not depend on
them. Device syncs are counted with
``torch.cuda.set_sync_debug_mode`` where CUDA is present.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from gr_plugin.bench.common import count_device_syncs, summarize
from gr_plugin.cache import CacheRequest, HostTier, KVCacheConfig, KVCacheManager

logger = logging.getLogger(__name__)


def _history(user: int, length: int) -> torch.Tensor:
    """Token keys ``[length]``: item id, action and time bucket packed into one int64 per token,
    as the model's cache key does."""
    item = torch.arange(length, dtype=torch.int64) * 131 + user * 1_000_003
    return (item << 24) | ((item % 5) << 16) | (item % 97)


def measure(bs: int, hist: int, page_size: int, new_tokens: int, repeats: int, device: str,
            host_tier: bool = False) -> dict[str, Any]:
    """One row: ``bs`` returning users with ``hist - new_tokens`` of ``hist`` events cached."""
    pages_needed = bs * (-(-hist // page_size) + 2) * 2
    cfg = KVCacheConfig(num_layers=1, num_heads=1, head_dim=1, page_size=page_size,
                        num_pages=pages_needed, device=device)
    if host_tier:
        cfg.host_cache_bytes = 2 * pages_needed * cfg.page_bytes
    m = KVCacheManager(cfg, HostTier() if host_tier else None)
    users = list(range(bs))
    hists = [_history(u, hist) for u in users]
    cached = hist - new_tokens
    warm = CacheRequest(users, [cached] * bs, torch.cat([h[:cached] for h in hists]))
    rows, lengths = torch.cat(hists), [hist] * bs

    def warm_up() -> None:  # the warm state: cached on the device, or (host tier) only in the host tier
        m.commit(m.allocate(m.lookup(warm)))
        if host_tier:
            m.offload_flush()
            m.evict(users)

    warm_up()

    def step():
        return m.allocate(m.lookup(CacheRequest(users, lengths, rows)))

    for _ in range(10):
        m.abort(step())
    with count_device_syncs() as syncs:
        plan = step()
    m.abort(plan)
    totals, lookups, commits = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        lk = m.lookup(CacheRequest(users, lengths, rows))
        t1 = time.perf_counter()
        plan = m.allocate(lk)
        t2 = time.perf_counter()
        assert plan.cached_lengths == [cached // page_size * page_size if host_tier else cached] * bs
        m.abort(plan)
        lookups.append((t1 - t0) * 1e6)
        totals.append((t2 - t0) * 1e6)
    for _ in range(min(repeats, 50)):
        plan = step()
        m.onboard_launch(plan)
        m.onboard_wait(plan)
        t0 = time.perf_counter()
        m.commit(plan)
        commits.append((time.perf_counter() - t0) * 1e6)
        m.offload_flush()
        m.evict(users)  # back to the warm state
        if host_tier:
            for u in users:
                m.backend.evict((m.namespace, u))
        warm_up()
    m.close()
    total, look, com = summarize(totals), summarize(lookups), summarize(commits)
    return {
        "batch": bs, "history": hist, "cached": cached, "page_size": page_size, "device": device,
        "host_tier": host_tier,
        "lookup_us_p50": look["p50"], "lookup_allocate_us_p50": total["p50"],
        "lookup_allocate_us_p90": total["p90"], "commit_us_p50": com["p50"], "device_syncs": syncs[0],
    }


def run(batch_sizes=(1, 8), history_lens=(1024, 4096), page_size: int = 32, new_tokens: int = 128,
        repeats: int = 200, device: str = "cpu", host_tier: bool = False) -> list[dict[str, Any]]:
    rows = []
    for hist in history_lens:
        for bs in batch_sizes:
            rows.append(measure(bs, hist, page_size, new_tokens, repeats, device, host_tier))
            logger.info("host overhead %s", rows[-1])
    return rows


COLUMNS = ["batch", "history", "cached", "page_size", "device", "host_tier", "lookup_us_p50", "lookup_allocate_us_p50",
           "lookup_allocate_us_p90", "commit_us_p50", "device_syncs"]
