"""Soak: a long request stream from a Zipf population through small tiers; memory must stay flat.

Owns the soak run (``python -m recipes.bench suite=soak``, and a slow test): requests of returning
users drawn from a Zipf law over a churning population go through lookup / allocate / onboard /
append / commit of a `KVCacheManager` with the ``flexkv`` backend (small device, host and SSD
tiers, optionally Redis), so every tier transition happens many times. K/V are a deterministic
function of the history prefix; every ``verify_every``-th step reads every token back and compares.
It records RSS and the host tier's pinned bytes at checkpoints and checks the accounting at the end.
"""

from __future__ import annotations

import logging
import resource
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from gr_plugin.cache import CacheRequest, KVCacheConfig, KVCacheManager, TieredBackend, paged_ops
from gr_plugin.cache.tiers.flexkv_config import TierConfig

logger = logging.getLogger(__name__)


def _rss_mb() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _kv(tokens: torch.Tensor, layer: int, heads: int, dim: int) -> torch.Tensor:
    """``[L, H, D]`` values that depend on the whole prefix (exact in fp32)."""
    mixed = torch.cumsum(tokens * torch.arange(1, tokens.numel() + 1), 0) % 65521
    return (mixed.float() + layer * 7).view(-1, 1, 1).expand(-1, heads, dim).contiguous()


def run(num_requests: int = 100_000, num_users: int = 2000, zipf_s: float = 1.1, max_history: int = 256,
        page_size: int = 16, num_pages: int = 256, host_pages: int = 512, ssd_pages: int = 4096,
        redis_url: str | None = None, verify_every: int = 50, checkpoints: int = 10, seed: int = 0,
        ssd_dir: str | None = None) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    cfg0 = KVCacheConfig(num_layers=2, num_heads=1, head_dim=8, page_size=page_size, num_pages=num_pages)
    tmp = tempfile.TemporaryDirectory(prefix="gr-soak-") if ssd_dir is None else None
    ssd = Path(ssd_dir or tmp.name) / "ssd"
    tiers = TierConfig(cpu_cache_gb=host_pages * cfg0.page_bytes / 2**30,
                       ssd_cache_gb=ssd_pages * cfg0.page_bytes * 1.3 / 2**30, ssd_cache_dir=str(ssd),
                       enable_3rd_remote=redis_url is not None, remote_url=redis_url or "redis://127.0.0.1:1/0",
                       remote_ttl_s=3600)
    cfg = KVCacheConfig(num_layers=2, num_heads=1, head_dim=8, page_size=page_size, num_pages=num_pages,
                        host_cache_bytes=host_pages * cfg0.page_bytes, namespace=f"soak-{uuid.uuid4().hex[:12]}")
    m = KVCacheManager(cfg, TieredBackend(tiers))
    ranks = torch.arange(1, num_users + 1, dtype=torch.float64)
    probs = ranks.pow(-zipf_s)
    probs /= probs.sum()
    histories: dict[int, torch.Tensor] = {}
    generation = dict.fromkeys(range(num_users), 0)
    rows, t0, verified = [], time.perf_counter(), 0
    draws = torch.multinomial(probs, num_requests, replacement=True, generator=g).tolist()
    grow = torch.randint(1, 3 * page_size // 2, (num_requests,), generator=g).tolist()
    for i, slot in enumerate(draws):
        uid = slot * 1_000_000 + generation[slot]
        h = histories.get(uid, torch.zeros(0, dtype=torch.int64))
        if h.numel() + grow[i] > max_history:  # the user leaves; a new one takes the slot
            histories.pop(uid, None)
            generation[slot] += 1
            uid = slot * 1_000_000 + generation[slot]
            h = torch.zeros(0, dtype=torch.int64)
        h = torch.cat([h, torch.randint(1, 1 << 30, (grow[i],), generator=g)])
        histories[uid] = h
        plan = m.allocate(m.lookup(CacheRequest([uid], [h.numel()], h)))
        if plan is None:
            continue
        handle = m.onboard_launch(plan)
        c = plan.cached_lengths[0]
        check = i % verify_every == 0
        for layer in range(cfg.num_layers):
            handle.wait_layer(layer)
            kv = _kv(h, layer, cfg.num_heads, cfg.head_dim)
            m.append(layer, kv[c:], -kv[c:], plan)
            if check:
                meta = plan.metadata
                slots = paged_ops.sequence_slots(meta.kv_indices, meta.kv_indptr, meta.total_lengths,
                                                 meta.total_offsets, page_size, meta.num_total_tokens)
                k, v = paged_ops.gather_kv(m.kv_table[layer], slots)
                if not (torch.equal(k, kv) and torch.equal(v, -kv)):
                    raise AssertionError(f"request {i}: user {uid} read back wrong K/V at layer {layer}")
        verified += check
        m.commit(plan)
        if (i + 1) % max(1, num_requests // checkpoints) == 0 or i + 1 == num_requests:
            m.offload_try_wait()
            s = m.stats()
            rows.append({"requests": i + 1, "seconds": round(time.perf_counter() - t0, 1),
                         "rss_mb": round(_rss_mb(), 1), "pinned_mb": round(m.backend.host_table.nbytes / 2**20, 2),
                         "hit_rate": round(s["hit_rate"], 4),
                         "device_users": s["device_users"], "host_users": s["host_users"],
                         "ssd_pages": s.get("ssd_pages_stored", s.get("ssd_num_pages", "")),
                         "ssd_fetched": s["ssd_pages_fetched"], "evicted_users": s["evicted_users"],
                         "tasks_in_flight": s["tasks_in_flight"], "verified_steps": verified})
            logger.info("soak %s", rows[-1])
    m.offload_flush()
    m.backend.flush_writes()
    m.check()
    m.evict_all(all_tiers=True)  # (this run's namespace only: a shared Redis keeps everything else)
    m.close()
    if tmp is not None:
        tmp.cleanup()
    return rows


COLUMNS = ["requests", "seconds", "rss_mb", "pinned_mb", "hit_rate", "device_users", "host_users", "ssd_fetched",
           "evicted_users", "tasks_in_flight", "verified_steps"]
