"""Lower-tier benchmarks (``python -m recipes.bench suite=tiers``), each measured side by side:

- ``ssd_read``: `SSDPageStore.get_many` of N pages next to a raw sequential read of the same slab
  bytes from the same file with the same I/O mode (O_DIRECT where the filesystem allows);
- ``tier_hit``: one returning user's cached step (``hstu_small`` shape, CPU) when its history is on
  the device, in the host tier, on SSD or in Redis, next to a full recomputation;
- ``launch``: bringing 8 users' pages up from SSD as one batched task vs one task per user.
"""

from __future__ import annotations

import logging
import mmap
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from gr_plugin.cache import CacheRequest, HostTier, KVCacheConfig, KVCacheManager, TieredBackend
from gr_plugin.cache.tiers import PageKey, SSDPageStore, aligned_empty
from gr_plugin.cache.tiers.flexkv_config import TierConfig

logger = logging.getLogger(__name__)

_BENCH_TTL_S = 3600  # a benchmark's Redis pages expire within the hour even if its cleanup never runs


def _row(measure: str, case: str, value: float, unit: str, reference: float | None = None,
         ref_case: str = "") -> dict[str, Any]:
    out = {"measure": measure, "case": case, "value": round(value, 3), "unit": unit, "reference": ref_case,
           "reference_value": None if reference is None else round(reference, 3)}
    out["ratio"] = None if reference in (None, 0) else round(value / reference, 3)
    return out


def ssd_read(directory: Path, total_mb: int = 512, page_kb: int = 256, repeats: int = 3) -> list[dict[str, Any]]:
    page_bytes = page_kb * 1024
    n = total_mb * 1024 // page_kb
    store = SSDPageStore(directory / "ssd-bench", capacity_bytes=(n + 8) * (page_bytes + 8192), page_bytes=page_bytes,
                         num_threads=4)
    elems = page_bytes // 2
    pages = torch.randint(-1000, 1000, (n, elems), dtype=torch.int16).view(torch.bfloat16).view(n, 1, 2, 1, 1, -1)
    keys = [PageKey("bench", u, i, i + 1) for u in range(8) for i in range(n // 8)]
    for u in range(8):
        chunk = slice(u * (n // 8), (u + 1) * (n // 8))
        assert all(store.put_many(keys[chunk], pages[chunk].contiguous()))
    out = aligned_empty(tuple(pages.shape), pages.dtype)  # page-aligned, as a caller using O_DIRECT should
    store_t, raw_t = [], []
    slab_files = sorted((directory / "ssd-bench").glob("slab-*.bin"))
    used = n * store.slot_bytes
    flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if store.io_mode == "o_direct" else 0)
    buf = mmap.mmap(-1, 8 << 20)  # page-aligned, as O_DIRECT needs
    for _ in range(repeats):
        t0 = time.perf_counter()
        got = store.get_many(keys, out)
        store_t.append(time.perf_counter() - t0)
        assert all(got) and torch.equal(out.view(torch.int16), pages.view(torch.int16))
        t0 = time.perf_counter()
        left = used
        for path in slab_files:
            fd = os.open(path, flags)
            try:
                off = 0
                while left > 0:
                    k = os.preadv(fd, [buf], off)
                    if k <= 0:
                        break
                    off += k
                    left -= k
            finally:
                os.close(fd)
        raw_t.append(time.perf_counter() - t0)
    store.close()
    payload = n * page_bytes / 1e9
    s_gbs, r_gbs = payload / min(store_t), (used / 1e9) / min(raw_t)
    return [_row("ssd_read", f"get_many {n} x {page_kb} KiB ({store.io_mode}, 4 threads)", s_gbs, "GB/s", r_gbs,
                 "raw sequential read of the slab bytes")]


def _tiny_request(uid: int, hist: int, g: torch.Generator):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from gr_plugin.modules import cache_token_keys

    items = torch.randint(1, 3707, (hist,), generator=g)
    actions = torch.randint(1, 6, (hist,), generator=g)
    times = torch.randint(0, 32, (hist,), generator=g)
    cand = torch.randint(1, 3707, (64,), generator=g)
    history = KeyedJaggedTensor(keys=["item", "action", "time"], values=torch.cat([items, actions, times]),
                                lengths=torch.tensor([hist] * 3))
    candidates = KeyedJaggedTensor(keys=["item"], values=cand, lengths=torch.tensor([64]))
    return history, candidates, cache_token_keys(items, actions, times)


def tier_hit(directory: Path, history_lens=(1024, 2048), new_events: int = 8, repeats: int = 5,
             redis_url: str | None = None) -> list[dict[str, Any]]:
    from gr_plugin.modules import HSTUConfig, HSTURanker, KVCacheModule

    torch.manual_seed(0)
    model = HSTURanker(HSTUConfig(num_items=3706, num_time_buckets=32, embedding_dim=64, num_layers=2, num_heads=2,
                                  head_dim=32, n_norm=512.0)).eval()
    rows = []
    for hist in history_lens:
        g = torch.Generator().manual_seed(hist)
        full_h, full_c, keys = _tiny_request(1, hist + new_events, g)
        old = hist
        # A namespace of this run's own: clearing the tiers between repeats deletes only its Redis pages
        # (a shared server's other pages stay), and a TTL lets them go if the run dies before its cleanup.
        base = KVCacheConfig(num_layers=2, num_heads=2, head_dim=32, page_size=32, num_pages=4 * hist // 32,
                             namespace=f"bench-tiers-{uuid.uuid4().hex[:12]}")
        tiers = TierConfig(cpu_cache_gb=8 * hist // 32 * base.page_bytes / 2**30,
                           ssd_cache_gb=16 * hist // 32 * base.page_bytes / 2**30,
                           ssd_cache_dir=str(directory / f"tier-hit-{hist}"), enable_3rd_remote=redis_url is not None,
                           remote_url=redis_url or "redis://127.0.0.1:1/0", remote_ttl_s=_BENCH_TTL_S)
        base.host_cache_bytes = int(tiers.cpu_cache_gb * 2**30)
        cache = KVCacheModule(base, "flexkv", tiers=tiers)
        m = cache.manager
        prefix_h, prefix_c, prefix_keys = _prefix(full_h, full_c, keys, old)
        times: dict[str, list[float]] = {k: [] for k in ("device", "host", "ssd", "remote", "full")}

        def step(h, c, k, n, record=None, cache=cache, times=times):
            t0 = time.perf_counter()
            plan = cache.begin([1], [n], k)
            with torch.no_grad():
                model.forward_cached(h, c, cache, plan)
            cache.commit(plan)
            if record is not None:
                times[record].append((time.perf_counter() - t0) * 1e3)
            cache.manager.offload_flush()
            cache.manager.backend.flush_writes()
            return plan

        for _ in range(repeats):
            m.evict_all(all_tiers=True)
            step(prefix_h, prefix_c, prefix_keys, old)  # history cached everywhere (write-through)
            step(full_h, full_c, keys, old + new_events, "device")
            for tier in ("host", "ssd"):
                m.evict_all(all_tiers=True)
                step(prefix_h, prefix_c, prefix_keys, old)
                m.evict([1])
                if tier == "ssd":
                    HostTier.evict(m.backend, (m.namespace, 1))  # the host tier only: SSD keeps it
                plan = step(full_h, full_c, keys, old + new_events, tier)
                assert plan.cached_lengths == [old // 32 * 32], (tier, plan.cached_lengths)
            t0 = time.perf_counter()
            with torch.no_grad():
                model(full_h, full_c)
            times["full"].append((time.perf_counter() - t0) * 1e3)
        if redis_url is not None:
            replica = KVCacheModule(base, "flexkv", tiers=TierConfig(**{**tiers.to_dict(), "ssd_cache_gb": 0.0}))
            for _ in range(repeats):
                m.evict_all(all_tiers=True)
                step(prefix_h, prefix_c, prefix_keys, old)
                replica.manager.evict_all()
                HostTier.clear(replica.manager.backend)
                step(full_h, full_c, keys, old + new_events, "remote", cache=replica)
            replica.manager.close()
        full = statistics.median(times["full"])
        for tier in ("device", "host", "ssd", "remote"):
            if times[tier]:
                rows.append(_row("tier_hit", f"history {old}+{new_events}, hit in {tier}",
                                 statistics.median(times[tier]), "ms", full, "full recompute"))
        m.evict_all(all_tiers=True)  # (this run's namespace only)
        m.close()
    return rows


def _prefix(h, c, keys, n):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    vals = h.values().view(3, -1)[:, :n].reshape(-1)
    return (KeyedJaggedTensor(keys=["item", "action", "time"], values=vals, lengths=torch.tensor([n] * 3)), c,
            keys[:n].contiguous())


def launch(directory: Path, num_users: int = 8, hist: int = 1024, repeats: int = 5) -> list[dict[str, Any]]:
    cfg = KVCacheConfig(num_layers=2, num_heads=2, head_dim=32, page_size=32, num_pages=num_users * hist // 16,
                        namespace="launch")
    tiers = TierConfig(cpu_cache_gb=num_users * hist // 16 * cfg.page_bytes / 2**30,
                       ssd_cache_gb=num_users * hist // 8 * cfg.page_bytes / 2**30,
                       ssd_cache_dir=str(directory / "launch"))
    cfg.host_cache_bytes = int(tiers.cpu_cache_gb * 2**30)
    m = KVCacheManager(cfg, TieredBackend(tiers))
    g = torch.Generator().manual_seed(0)
    hists = {u: torch.randint(0, 1 << 40, (hist,), generator=g) for u in range(num_users)}
    req_all = CacheRequest(list(hists), [hist] * num_users, torch.cat(list(hists.values())))
    m.commit(m.allocate(m.lookup(req_all)))
    m.offload_flush()
    m.backend.flush_writes()
    batched, per_user = [], []
    for _ in range(repeats):
        for mode, out in (("batched", batched), ("per_user", per_user)):
            m.evict(list(hists))
            for u in hists:
                HostTier.evict(m.backend, (m.namespace, u))
            t0 = time.perf_counter()
            if mode == "batched":
                plans = [m.allocate(m.lookup(req_all))]
            else:
                plans = [m.allocate(m.lookup(CacheRequest([u], [hist], h))) for u, h in hists.items()]
            for p in plans:
                m.onboard_launch(p)
                m.onboard_wait(p)
            out.append((time.perf_counter() - t0) * 1e3)
            assert all(sum(p.cached_lengths) == hist * p.batch_size for p in plans)
            for p in plans:
                m.abort(p)
    m.close()
    b, p = statistics.median(batched), statistics.median(per_user)
    return [_row("launch", f"{num_users} users x {hist} events from SSD: one batched task", b, "ms", p,
                 "one task per user")]


def run(parts=("ssd_read", "tier_hit", "launch"), directory: str | None = None, redis_url: str | None = None,
        ssd_total_mb: int = 512) -> list[dict[str, Any]]:
    if isinstance(parts, str):  # (tiers.parts=launch: one part, not its letters)
        parts = (parts,)
    unknown = sorted(set(parts) - {"ssd_read", "tier_hit", "launch"})
    if unknown:
        raise ValueError(f"tiers.parts: unknown part(s) {unknown}; the parts are ssd_read, tier_hit, launch")
    if directory is not None and not os.path.isdir(directory):
        raise ValueError(f"tiers.directory={directory!r} is not a directory (the SSD files go in a temporary "
                         "directory inside it)")
    tmp = tempfile.TemporaryDirectory(prefix="gr-tiers-", dir=directory)
    root = Path(tmp.name)
    rows: list[dict[str, Any]] = []
    try:
        if "ssd_read" in parts:
            rows += ssd_read(root, total_mb=ssd_total_mb)
        if "tier_hit" in parts:
            rows += tier_hit(root, redis_url=redis_url)
        if "launch" in parts:
            rows += launch(root)
    finally:
        tmp.cleanup()
    for r in rows:
        logger.info("tiers %s", r)
    return rows


COLUMNS = ["measure", "case", "value", "unit", "reference", "reference_value", "ratio"]
