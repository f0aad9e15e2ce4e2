"""`KVCacheManager`: the facade over device pages, identity, LRU and the lower tiers.

Owns the device KV table, which user holds which pages, the LRU over users, in-flight steps and
in-flight copies. The verbs, in the order a serving step calls them:

    lookup(request)      -> LookupResult   reusable tokens per user and tier; changes nothing
    allocate(lookup)     -> BatchPlan|None pages for the new tokens (+ pages to onboard), CSR
                                           metadata; None when the batch cannot fit (caller
                                           recomputes or splits), with nothing changed
    onboard_launch(plan) -> CopyHandle     async host->device copy; handle.wait_layer(l) per layer
    append(l, k, v, plan)                  write new tokens' K/V of layer l into their pages
    commit(plan) / abort(plan)             publish the step's pages / roll back
    offload_try_wait() / offload_flush()   reap / drain write-through copies to the host tier
    evict(user_ids) / evict_all() / stats() / check()

Invariants (``check()``): every device page is free, a zombie awaiting an in-flight reader, owned
by exactly one user, or reserved by exactly one in-flight plan; users in an in-flight plan or with
pages being read are never evicted; a user's pages are published only by `commit`.
Thread-safe: one re-entrant lock guards all state; copies run on the transfer engine.
This module does not compute K/V or attention and does not know what a token means.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gr_plugin.cache import paged_ops
from gr_plugin.cache.backend import KVBackend
from gr_plugin.cache.config import KVCacheConfig
from gr_plugin.cache.hashing import StreamHasher, longest_matching_prefix, namespace_seed, prefix_hash
from gr_plugin.cache.metadata import build_metadata
from gr_plugin.cache.page_pool import PagePool
from gr_plugin.cache.plan import BatchPlan, Key, LookupResult
from gr_plugin.cache.request import CacheRequest
from gr_plugin.cache.stats import KVCacheStats
from gr_plugin.cache.transfer import CopyHandle, DoneHandle, TransferEngine, make_transfer_engine

logger = logging.getLogger(__name__)

AppendFn = Callable[..., None]  # (kv_layer, k, v, slots[, rows]) -> None


def _config_dtypes() -> dict[str, torch.dtype]:
    from gr_plugin.cache.config import _DTYPES

    return _DTYPES


class TierReadError(RuntimeError):
    """A lower-tier read failed or timed out and the backend is fail-closed."""


class UserInFlightError(RuntimeError):
    """A user is already part of a step that has not been committed or aborted."""


@dataclasses.dataclass
class _DeviceEntry:
    pages: array = dataclasses.field(default_factory=lambda: array("q"))
    num_tokens: int = 0
    page_hashes: list[int] = dataclasses.field(default_factory=list)
    digest: int = 0
    hasher: StreamHasher | None = None
    in_plan: bool = False
    offloads: int = 0
    version: int = 0

    @property
    def evictable(self) -> bool:
        return not self.in_plan and self.offloads == 0


@dataclasses.dataclass
class _CopyJob:
    handle: CopyHandle
    kind: str  # "offload" | "onboard"
    items: list[tuple[Key, torch.Tensor | None]]
    pages: list[int]


class KVCacheManager:
    def __init__(
        self,
        config: KVCacheConfig,
        backend: KVBackend | None = None,
        *,
        kv_table: torch.Tensor | None = None,
        transfer: TransferEngine | None = None,
        append_fn: AppendFn | None = None,
        write_through: bool = True,
    ) -> None:
        self.config = config
        self.device = config.torch_device
        shape = (config.num_layers, config.num_pages, 2, config.page_size, config.num_heads, config.head_dim)
        if kv_table is None:
            kv_table = paged_ops.new_kv_table(
                *shape[:2], *shape[3:], dtype=config.torch_dtype, device=self.device
            )
        elif tuple(kv_table.shape) != shape or kv_table.dtype != config.torch_dtype:
            raise ValueError(f"kv_table must be {shape} {config.torch_dtype}, got "
                             f"{tuple(kv_table.shape)} {kv_table.dtype}")
        self.kv_table = kv_table
        self.backend = backend
        if backend is not None:
            backend.bind(config)
        self.transfer = transfer if transfer is not None else make_transfer_engine(self.device)
        self.append_fn: AppendFn = append_fn or paged_ops.append_kv
        self.write_through = write_through and backend is not None
        self._lock = threading.RLock()
        self._pool = PagePool(config.num_pages)
        self._entries: OrderedDict[Key, _DeviceEntry] = OrderedDict()
        self._plans: dict[int, BatchPlan] = {}
        self._jobs: deque[_CopyJob] = deque()
        self._plan_ids = itertools.count()
        self._clock = 0
        self._stats = KVCacheStats()
        self._scratch: list[int] = []
        self.set_namespace(config.namespace)

    def rebind(self, kv_table: torch.Tensor) -> None:
        """Adopt a moved or cast copy of the device table (``nn.Module.to()`` made it).

        A new device keeps the cached contents; a new dtype clears every tier (values cast to
        another precision are not what the model would compute in it). Refused while a step is in
        flight.
        """
        with self._lock:
            if self._plans:
                raise ValueError(
                    f"{len(self._plans)} steps are in flight; commit or abort them before moving the cache")
            self._drain()
            if tuple(kv_table.shape) != tuple(self.kv_table.shape):
                raise ValueError(f"kv_table shape {tuple(kv_table.shape)} != {tuple(self.kv_table.shape)}")
            dtype_names = {v: k for k, v in _config_dtypes().items()}
            if kv_table.dtype not in dtype_names:
                raise ValueError(f"kv_table dtype {kv_table.dtype} is not a cache dtype")
            new_cfg = dataclasses.replace(self.config, device=str(kv_table.device),
                                          dtype=dtype_names[kv_table.dtype])
            moved = kv_table.device != self.kv_table.device
            recast = kv_table.dtype != self.kv_table.dtype
            self.kv_table = kv_table
            self.config = new_cfg
            self.device = kv_table.device
            if recast:
                for key in list(self._entries):
                    self._drop(key, self._entries[key])
            if self.backend is not None and (recast or moved):
                if recast:
                    self.backend.clear()
                self.backend.rebind(new_cfg)
            if moved:
                self.transfer.close()
                self.transfer = make_transfer_engine(self.device)

    # ------------------------------------------------------------------ identity
    def set_namespace(self, namespace: str) -> None:
        """Switch the model/version salt: entries of other namespaces are never matched again."""
        if not isinstance(namespace, str) or not namespace:
            raise ValueError(f"namespace must be a non-empty str, got {namespace!r}")
        with self._lock:
            self.namespace = namespace
            self._seed = namespace_seed(namespace)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # ------------------------------------------------------------------ lookup
    def _match(self, key: Key, req: CacheRequest, b: int) -> tuple[int, dict[str, int], tuple[int, int]]:
        """(device tokens, tier pages, versions) for user ``b`` of ``req``."""
        P = self.config.page_size
        start, length, tokens = req.history_offsets[b], req.history_lengths[b], req.tokens
        entry = self._entries.get(key)
        dev = 0
        if entry is not None and entry.num_tokens:
            n = entry.num_tokens
            # NOTE: only the entry's own partial tail may be reused mid-page; a shorter or edited
            # history reuses whole pages, so a page that may be in flight to a lower tier is
            # never appended to.
            if length >= n and prefix_hash(tokens, start, n, self._seed) == entry.digest:
                dev = n
            else:
                dev = longest_matching_prefix(entry.page_hashes, tokens, start, length, P, self._seed) * P
        tiers: dict[str, int] = {}
        bver = -1
        if self.backend is not None:
            bver = self.backend.version(key)
            if bver != -1 and length // P > dev // P:
                tiers = self.backend.match(key, tokens, start, length, self._seed, min_pages=dev // P)
        return dev, tiers, (-1 if entry is None else entry.version, bver)

    def lookup(self, request: CacheRequest) -> LookupResult:
        """Reusable history tokens per user and tier. Changes no state (not even LRU order)."""
        if not isinstance(request, CacheRequest):
            raise ValueError(f"lookup expects a CacheRequest, got {type(request).__name__}")
        with self._lock:
            ns = self.namespace
            keys = [(ns, u) for u in request.user_ids]
            names = self.backend.tier_names if self.backend is not None else ()
            dev_tokens, versions = [], []
            tier_pages: dict[str, list[int]] = {t: [] for t in names}
            fetch = []
            for b, key in enumerate(keys):
                dev, tiers, ver = self._match(key, request, b)
                dev_tokens.append(dev)
                versions.append(ver)
                for t in names:
                    tier_pages[t].append(tiers.get(t, 0))
                if tiers and max(tiers.values()) > tiers.get(names[0], 0):
                    fetch.append((key, request.tokens, request.history_offsets[b], request.history_lengths[b],
                                  self._seed, tiers))
            # NOTE: lower-tier pages start moving into host slots now; allocate waits for them, so
            # the read overlaps whatever the caller does in between.
            task = self.backend.prefetch(fetch) if fetch else None
            self._stats.lookups += 1
            self._stats.lookup_users += len(keys)
        P = self.config.page_size
        tier_tokens = {t: [max(d, p * P) for d, p in zip(dev_tokens, tier_pages[t])] for t in names}
        cached = list(dev_tokens)
        for t in names:
            cached = [max(c, x) for c, x in zip(cached, tier_tokens[t])]
        return LookupResult(request, ns, keys, dev_tokens, tier_tokens, cached, tier_pages, versions, task)

    # ------------------------------------------------------------------ allocate
    def _evictable_pages(self, exclude: set[Key]) -> int:
        return sum(len(e.pages) for k, e in self._entries.items() if e.evictable and k not in exclude)

    def _make_room(self, demand: int, exclude: set[Key]) -> bool:
        if self._pool.num_free >= demand:
            return True
        if self._pool.num_free + self._evictable_pages(exclude) < demand:
            self._reap()
            if self._pool.num_free + self._evictable_pages(exclude) < demand and self._jobs:
                self._drain()
            if self._pool.num_free + self._evictable_pages(exclude) < demand:
                return False
        for key in list(self._entries):
            if self._pool.num_free >= demand:
                break
            entry = self._entries[key]
            if entry.evictable and key not in exclude:
                self._drop(key, entry)
        return True

    def _drop(self, key: Key, entry: _DeviceEntry) -> None:
        self._stats.evicted_users += 1
        self._stats.evicted_pages += len(entry.pages)
        self._pool.free(entry.pages)
        del self._entries[key]

    def allocate(self, lookup: LookupResult) -> BatchPlan | None:
        """Reserve pages for ``lookup``'s request and build its metadata.

        Evicts least-recently-used users (never those in flight) to make room. Returns ``None``
        and changes nothing when the batch cannot fit even after evicting everything evictable.
        Raises `UserInFlightError` (nothing changed) if a user is already in an in-flight step.
        """
        if not isinstance(lookup, LookupResult):
            raise ValueError(f"allocate expects a LookupResult, got {type(lookup).__name__}")
        P = self.config.page_size
        req = lookup.request
        totals = req.history_lengths
        with self._lock:
            if lookup.namespace != self.namespace:
                lookup = self.lookup(req)
            keys, entries, backend = lookup.keys, self._entries, self.backend
            if lookup.prefetch_task is not None:
                state = backend.wait(lookup.prefetch_task)
                lookup.prefetch_task = None
                if state != "ready" and not backend.fail_open:
                    raise TierReadError(f"lower-tier read for users {[k[1] for k in keys]} ended {state!r}")
            host_seen = lookup.tier_pages[backend.tier_names[0]] if backend is not None else None
            # Pass 1 decides, changing nothing (so a refusal leaves the cache as it was).
            keep, onboard, fresh_counts, cached, device_tokens = [], [], [], [], []
            for b, key in enumerate(keys):
                entry = entries.get(key)
                if entry is not None and entry.in_plan:
                    raise UserInFlightError(f"user {key[1]} is already in an in-flight step")
                ver = (-1 if entry is None else entry.version,
                       -1 if backend is None else backend.version(key))
                if ver == lookup.versions[b]:
                    d, hp = lookup.device_tokens[b], host_seen[b] if backend is not None else 0
                else:
                    # NOTE: another step changed this user since the lookup; match again.
                    d, tiers, _ = self._match(key, req, b)
                    hp = tiers.get(backend.tier_names[0], 0) if backend is not None else 0
                if hp * P > d:  # onboard host pages [d // P, hp); a device partial tail is dropped
                    k, o, c, dv = d // P, hp - d // P, hp * P, (d // P) * P
                else:
                    k, o, c, dv = -(-d // P), 0, d, d
                keep.append(k)
                onboard.append(o)
                cached.append(c)
                device_tokens.append(dv)
                fresh_counts.append(-(-totals[b] // P) - k)
            demand = sum(fresh_counts)
            if demand > self.config.num_pages or not self._make_room(demand, set(keys)):
                self._stats.alloc_failures += 1
                logger.debug("allocate: %d pages needed, cannot fit", demand)
                return None

            # Pass 2 commits to the decisions.
            fresh_all = self._pool.allocate(demand)
            assert fresh_all is not None
            self._stats.pages_allocated += demand
            page_lists, fresh, onboard_src = [], [], []
            pos = 0
            for b, key in enumerate(keys):
                entry = entries.get(key)
                if entry is None:
                    entry = entries[key] = _DeviceEntry(version=self._tick())
                else:
                    entries.move_to_end(key)
                entry.in_plan = True
                mine = fresh_all[pos : pos + fresh_counts[b]]
                pos += fresh_counts[b]
                pages = entry.pages[: keep[b]]
                pages.extend(mine)
                page_lists.append(pages)
                fresh.append(mine)
                if onboard[b]:
                    slots = backend.acquire(key, keep[b], onboard[b])
                    assert slots is not None, f"host pages of {key} vanished under the lock"
                    onboard_src.append((b, keep[b], slots))
            meta = build_metadata(page_lists, cached, totals, P, self.device)
            plan = BatchPlan(
                plan_id=next(self._plan_ids), request=req, keys=keys, metadata=meta,
                device_tokens=device_tokens,
                onboard_tokens=[c - d for c, d in zip(cached, device_tokens)], cached_lengths=cached,
                new_lengths=[t - c for t, c in zip(totals, cached)],
                page_lists=page_lists, keep_pages=keep, fresh_pages=fresh, onboard_src=onboard_src,
            )
            self._plans[plan.plan_id] = plan
            self._stats.plans += 1
            return plan

    def prepare(self, request: CacheRequest) -> BatchPlan | None:
        """``lookup`` + ``allocate`` + ``onboard_launch`` in one call."""
        plan = self.allocate(self.lookup(request))
        if plan is not None:
            self.onboard_launch(plan)
        return plan

    # ------------------------------------------------------------------ onboard
    def onboard_launch(self, plan: BatchPlan) -> CopyHandle:
        """Start copying the plan's host-tier pages to their device pages (one batched copy)."""
        with self._lock:
            self._check_live(plan)
            if plan.onboard_handle is not None:
                return plan.onboard_handle
            if not plan.onboard_src:
                plan.onboard_handle = DoneHandle(self.config.num_layers)
                return plan.onboard_handle
            src = torch.cat([s for _, _, s in plan.onboard_src])
            dst = []
            for b, first, slots in plan.onboard_src:
                dst.extend(plan.page_lists[b][first : first + slots.numel()])
            dst_t = torch.tensor(dst, dtype=torch.int64)
            handle = self.transfer.copy(self.backend.host_table, src, self.kv_table, dst_t)
            plan.onboard_handle = handle
            items = [(plan.keys[b], None) for b, _, _ in plan.onboard_src]
            self._jobs.append(_CopyJob(handle, "onboard", items, []))
            self._stats.onboard_pages += len(dst)
            self._stats.onboard_bytes += len(dst) * self.config.page_bytes
            return handle

    def onboard_wait(self, plan: BatchPlan) -> None:
        """Block until every layer of the plan's onboard copy is on the device."""
        handle = plan.onboard_handle
        if handle is not None:
            handle.wait()

    def wait_layer(self, plan: BatchPlan, layer: int) -> None:
        """Make layer ``layer``'s reads wait for its onboarded pages (per-layer wait handle)."""
        if plan.onboard_handle is not None:
            plan.onboard_handle.wait_layer(layer)

    # ------------------------------------------------------------------ append
    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, plan: BatchPlan,
               rows: torch.Tensor | None = None) -> None:
        """Write the new tokens' K and V of ``layer`` into the plan's pages: ``k``/``v`` are
        ``[N, H, D]``, or ``[M, H, D]`` with ``rows [N]`` naming each new token's row."""
        self._check_live(plan)
        cfg, meta = self.config, plan.metadata
        if not 0 <= layer < cfg.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {cfg.num_layers})")
        if rows is not None and rows.numel() != meta.num_new_tokens:
            raise ValueError(f"rows has {rows.numel()} entries, the plan has {meta.num_new_tokens} new tokens")
        want = (meta.num_new_tokens if rows is None else k.shape[0], cfg.num_heads, cfg.head_dim)
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != want:
                raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
            if t.dtype != self.kv_table.dtype:
                raise ValueError(f"{name} must be {self.kv_table.dtype}, got {t.dtype}")
            if t.device != self.kv_table.device:
                raise ValueError(f"{name} must be on {self.kv_table.device}, got {t.device}")
        if rows is None:
            self.append_fn(self.kv_table[layer], k, v, meta.new_token_slots)
        else:
            self.append_fn(self.kv_table[layer], k, v, meta.new_token_slots, rows)

    # ------------------------------------------------------------------ commit / abort
    def _check_live(self, plan: BatchPlan) -> None:
        if not isinstance(plan, BatchPlan):
            raise ValueError(f"expected a BatchPlan, got {type(plan).__name__}")
        if self._plans.get(plan.plan_id) is not plan:
            raise ValueError(f"plan {plan.plan_id} is not in flight (state {plan.state!r})")

    def commit(self, plan: BatchPlan) -> None:
        """Publish the step: each user's entry becomes its request history, pages included.

        Only call after every append of the step was issued. Starts the write-through offload
        of newly completed full pages when a backend is present.
        """
        P = self.config.page_size
        with self._lock:
            self._check_live(plan)
            req = plan.request
            for b, key in enumerate(plan.keys):
                entry = self._entries[key]
                start, total = req.history_offsets[b], req.history_lengths[b]
                stale = entry.pages[plan.keep_pages[b] :]
                self._pool.free(stale)
                # Hashes of the kept full pages stay valid; hash the rest once, incrementally.
                valid = min(len(entry.page_hashes), plan.device_tokens[b] // P)
                hasher = entry.hasher
                if hasher is None or valid != len(entry.page_hashes) or hasher.num_tokens != valid * P:
                    hasher = StreamHasher(self._seed)
                    hasher.update(req.tokens, start, start + valid * P)
                hashes = entry.page_hashes[:valid]
                for i in range(valid, total // P):
                    hasher.update(req.tokens, start + i * P, start + (i + 1) * P)
                    hashes.append(hasher.digest())
                entry.pages = plan.page_lists[b]
                entry.page_hashes = hashes
                entry.hasher = hasher
                entry.num_tokens = total
                entry.digest = hasher.digest_with(req.tokens, start + (total // P) * P, start + total)
                entry.version = self._tick()
                entry.in_plan = False
                if total == 0 and entry.offloads == 0:
                    del self._entries[key]
                self._stats.tokens_requested += total
                self._stats.tokens_reused_device += plan.device_tokens[b]
                self._stats.tokens_reused_host += plan.onboard_tokens[b]
                self._stats.tokens_computed += plan.new_lengths[b]
            plan.state = "committed"
            del self._plans[plan.plan_id]
            self._stats.commits += 1
            # NOTE: reap first: a finished onboard still pins the host pages it read, and the
            # write-through below may need to replace them (an edited history).
            self._reap()
            if self.write_through:
                self._offload(plan.keys)

    def abort(self, plan: BatchPlan) -> None:
        """Roll the step back: its pages are freed, every entry is as before `allocate`."""
        with self._lock:
            self._check_live(plan)
            if plan.onboard_handle is not None and not plan.onboard_handle.done():
                # NOTE: the copy still writes into pages we are about to free.
                self._stats.host_blocking_waits += 1
                try:
                    plan.onboard_handle.wait()
                except Exception:
                    logger.warning("onboard copy of aborted plan %d failed", plan.plan_id)
            elif plan.onboard_handle is None:
                for b, _, _ in plan.onboard_src:
                    self.backend.release(plan.keys[b])
            for b, key in enumerate(plan.keys):
                entry = self._entries[key]
                self._pool.free(plan.fresh_pages[b])
                entry.in_plan = False
                if entry.num_tokens == 0 and not entry.pages and entry.offloads == 0:
                    del self._entries[key]
            plan.state = "aborted"
            del self._plans[plan.plan_id]
            self._stats.aborts += 1
            self._reap()

    # ------------------------------------------------------------------ offload
    def _offload(self, keys: Sequence[Key]) -> None:
        """Write newly completed full pages of ``keys`` through to the backend (one copy)."""
        P = self.config.page_size
        src: list[int] = []
        slots_all: list[torch.Tensor] = []
        items: list[tuple[Key, torch.Tensor | None]] = []
        for key in keys:
            entry = self._entries.get(key)
            if entry is None:
                continue
            full = entry.num_tokens // P
            have = self.backend.stored_pages(key, entry.page_hashes[:full])
            if have >= full:
                continue
            slots = self.backend.reserve(key, have, entry.page_hashes[have:full])
            if slots is None:
                self._stats.offload_skipped += 1
                continue
            pages = entry.pages[have:full].tolist()
            src.extend(pages)
            slots_all.append(slots)
            items.append((key, slots))
            entry.offloads += 1
        if not items:
            return
        self._pool.add_readers(src)
        handle = self.transfer.copy(self.kv_table, torch.tensor(src, dtype=torch.int64),
                                    self.backend.host_table, torch.cat(slots_all))
        self._jobs.append(_CopyJob(handle, "offload", items, src))
        self._stats.offload_pages += len(src)
        self._stats.offload_bytes += len(src) * self.config.page_bytes

    def offload_launch(self, user_ids: Sequence[int]) -> None:
        """Write the committed full pages of these users through to the backend now."""
        if self.backend is None:
            raise ValueError("offload_launch needs a backend (kvcache option 'native' or 'flexkv')")
        with self._lock:
            self._offload([(self.namespace, u) for u in user_ids])

    def _finish(self, job: _CopyJob, ok: bool) -> None:
        if job.kind == "onboard":
            for key, _ in job.items:
                self.backend.release(key)
            return
        self._pool.remove_readers(job.pages)
        if not ok:
            self._stats.offload_failed += 1
        for key, slots in job.items:
            self.backend.publish(key, slots, ok)
            entry = self._entries.get(key)
            if entry is not None:
                entry.offloads -= 1

    def _reap(self) -> int:
        if self.backend is not None:
            self.backend.poll()
        while self._jobs:
            job = self._jobs[0]
            try:
                if not job.handle.done():
                    break
                job.handle.check()  # a failed copy raises; never blocks (no device sync)
                ok = True
            except Exception:
                logger.warning("%s copy failed; its pages are not published", job.kind, exc_info=True)
                ok = False
            self._jobs.popleft()
            self._finish(job, ok)
        return len(self._jobs)

    def _drain(self) -> None:
        self._stats.host_blocking_waits += 1
        while self._jobs:
            job = self._jobs.popleft()
            try:
                job.handle.wait()
                ok = True
            except Exception:
                logger.warning("%s copy failed; its pages are not published", job.kind, exc_info=True)
                ok = False
            self._finish(job, ok)

    def offload_try_wait(self) -> int:
        """Publish every finished copy without blocking; returns how many are still in flight."""
        with self._lock:
            return self._reap()

    def offload_flush(self) -> None:
        """Block until every in-flight copy is finished and published."""
        with self._lock:
            self._drain()

    # ------------------------------------------------------------------ eviction
    def evict(self, user_ids: Sequence[int], *, all_tiers: bool = False) -> int:
        """Drop these users' device pages (and lower-tier pages with ``all_tiers``).

        Raises ValueError, changing nothing, if one of them is in an in-flight step.
        Returns the number of device entries dropped.
        """
        with self._lock:
            keys = [(self.namespace, u) for u in user_ids]
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None and entry.in_plan:
                    raise ValueError(f"user {key[1]} is in an in-flight step; commit or abort it first")
            if any(key in self._entries and self._entries[key].offloads for key in keys):
                self._drain()
            dropped = 0
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None:
                    self._drop(key, entry)
                    dropped += 1
                if all_tiers and self.backend is not None:
                    self.backend.evict(key)
            return dropped

    def evict_all(self, *, all_tiers: bool = False) -> None:
        """Drop every device entry (and every lower-tier page with ``all_tiers``)."""
        with self._lock:
            if self._plans:
                raise ValueError(f"{len(self._plans)} steps are in flight; commit or abort them first")
            self._drain()
            for key in list(self._entries):
                self._drop(key, self._entries[key])
            if all_tiers and self.backend is not None:
                self.backend.clear()

    def reserve_scratch_pages(self, n: int) -> list[int]:
        """Take ``n`` pages out of circulation for good (e.g. where padded tokens of a CUDA-graph
        bucket write their K/V); they never hold a user's tokens. Evicts LRU users if needed."""
        with self._lock:
            if n <= 0:
                return []
            if not self._make_room(n, set()):
                raise ValueError(f"cannot reserve {n} scratch pages: the cache has {self.config.num_pages} pages")
            pages = self._pool.allocate(n)
            self._scratch.extend(pages)
            return pages

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, Any]:
        with self._lock:
            out = self._stats.as_dict()
            out.update(
                device_users=len(self._entries),
                device_pages_free=self._pool.num_free,
                device_pages_used=self.config.num_pages - self._pool.num_free,
                plans_in_flight=len(self._plans),
                copies_in_flight=len(self._jobs),
            )
            if self.backend is not None:
                out.update(self.backend.stats())
            return out

    @property
    def counters(self) -> KVCacheStats:
        return self._stats

    def lru_order(self) -> list[int]:
        """User ids on the device, least recently used first (current namespace only)."""
        with self._lock:
            return [k[1] for k in self._entries if k[0] == self.namespace]

    def cached_length(self, user_id: int) -> int:
        with self._lock:
            entry = self._entries.get((self.namespace, user_id))
            return 0 if entry is None else entry.num_tokens

    def pages_of(self, user_id: int) -> list[int]:
        with self._lock:
            entry = self._entries.get((self.namespace, user_id))
            return [] if entry is None else entry.pages.tolist()

    def check(self) -> None:
        """Assert the accounting invariants (see the module docstring)."""
        with self._lock:
            owned: list[int] = []
            P = self.config.page_size
            for key, e in self._entries.items():
                assert len(e.pages) == -(-e.num_tokens // P) or e.in_plan, (
                    f"user {key}: {len(e.pages)} pages for {e.num_tokens} tokens")
                assert len(e.page_hashes) == e.num_tokens // P, f"user {key}: hash count"
                assert e.offloads >= 0
                owned.extend(e.pages)
            for plan in self._plans.values():
                for b, key in enumerate(plan.keys):
                    assert self._entries[key].in_plan, f"user {key} of plan {plan.plan_id} not marked"
                    owned.extend(plan.fresh_pages[b])
            assert sum(e.in_plan for e in self._entries.values()) == sum(
                p.batch_size for p in self._plans.values()), "in_plan marks disagree with plans"
            owned.extend(self._scratch)
            self._pool.check(owned)
            if self.backend is not None:
                self.backend.check()

    def close(self) -> None:
        with self._lock:
            self._drain()
        self.transfer.close()
        if self.backend is not None:
            self.backend.close()
