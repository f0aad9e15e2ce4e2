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

The device policy (page pool, user directory, LRU, prefix matching, eviction, plans, metadata) is
the C++ core (``gr_plugin/csrc/core``, ``torch.classes.gr_kv_core.CacheCore``); this class keeps
what touches Python objects: the lower tiers, the copies, counters and the lock.
Thread-safe: one re-entrant lock guards all state; copies run on the transfer engine.
This module does not compute K/V or attention and does not know what a token means.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from gr_plugin.cache import paged_ops
from gr_plugin.cache.backend import KVBackend, TierReadError
from gr_plugin.cache.config import KVCacheConfig, check_namespace
from gr_plugin.cache.hashing import as_int64, from_pairs, namespace_seed, page_digests, prefix_hash, to_pairs
from gr_plugin.cache.metadata import metadata_from_host
from gr_plugin.cache.page_pool import PagePool, load_core
from gr_plugin.cache.plan import BatchPlan, Key, LookupResult
from gr_plugin.cache.request import CacheRequest
from gr_plugin.cache.stats import KVCacheStats
from gr_plugin.cache.transfer import CopyHandle, DoneHandle, TransferEngine, make_transfer_engine

logger = logging.getLogger(__name__)

AppendFn = Callable[..., None]  # (kv_layer, k, v, slots[, rows]) -> None


def _config_dtypes() -> dict[str, torch.dtype]:
    from gr_plugin.cache.config import DTYPES

    return DTYPES


class UserInFlightError(RuntimeError):
    """A user is already part of a step that has not been committed or aborted."""


# Statuses of CacheCore.allocate (kv_core.h AllocStatus).
_OK, _IN_FLIGHT, _CHANGED, _NO_FIT, _TOO_BIG = range(5)


@dataclasses.dataclass(frozen=True)
class _DeviceEntry:
    """A snapshot of one user's device entry in the core (introspection and tests only)."""

    num_tokens: int
    in_plan: bool
    offloads: int
    version: int
    pages: list[int]
    page_hashes: list[int]

    @property
    def evictable(self) -> bool:
        return not self.in_plan and self.offloads == 0


class _Entries:
    """Read-only mapping ``(namespace, user) -> _DeviceEntry`` over the core's directory."""

    def __init__(self, manager: KVCacheManager) -> None:
        self._m = manager

    def get(self, key: Key, default: _DeviceEntry | None = None) -> _DeviceEntry | None:
        m = self._m
        with m._lock:  # NOTE: the core is not thread-safe; every call into it holds the manager's lock
            ns = m._ns_ids.get(key[0])
            if ns is None:
                return default
            info, pages, hashes = m._core.entry(ns, key[1])
        if info[0] < 0:
            return default
        return _DeviceEntry(info[0], bool(info[1]), info[2], info[3], pages.tolist(), from_pairs(hashes))

    def __getitem__(self, key: Key) -> _DeviceEntry:
        entry = self.get(key)
        if entry is None:
            raise KeyError(key)
        return entry

    def __contains__(self, key: object) -> bool:
        return isinstance(key, tuple) and self.get(key) is not None

    def __len__(self) -> int:
        with self._m._lock:
            return self._m._core.num_entries()

    def __iter__(self) -> Iterator[Key]:
        m = self._m
        with m._lock:
            return iter([(name, u) for name, ns in m._ns_ids.items() for u in m._core.lru_order(ns)])


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
            try:
                kv_table = paged_ops.new_kv_table(
                    *shape[:2], *shape[3:], dtype=config.torch_dtype, device=self.device
                )
            except (RuntimeError, MemoryError) as exc:  # (torch.OutOfMemoryError is a RuntimeError)
                need = config.num_pages * config.page_bytes
                raise ValueError(f"num_pages={config.num_pages} device pages need {need / 2**30:.2f} GiB on "
                                 f"{self.device} ({config.page_bytes} bytes a page), which could not be "
                                 f"allocated: {str(exc).splitlines()[0][:200]}") from exc
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
        load_core()
        self._core = torch.classes.gr_kv_core.CacheCore(config.num_pages, config.page_size)
        self._pool = PagePool.wrap(self._core.pool())
        # NOTE: bound once: looking a method up on a ScriptObject costs ~2 µs per call.
        core = self._core
        self._core_lookup, self._core_allocate = core.lookup_rows, core.allocate
        self._core_commit, self._core_abort = core.commit_rows, core.abort
        # NOTE: without libxxhash in the core, digests are computed here (python-xxhash, the same
        # function) and passed in; tests set this to exercise that path too.
        self._caller_digests = not torch.ops.gr_kv_core.hashing_available()
        self._ns_ids: dict[str, int] = {}
        self._entries = _Entries(self)
        self._plans: dict[int, BatchPlan] = {}
        self._epoch = 0  # `rebind`s so far
        self._jobs: deque[_CopyJob] = deque()
        self._stats = KVCacheStats()
        self.set_namespace(config.namespace)

    def rebind(self, kv_table: torch.Tensor) -> None:
        """Adopt a moved or cast copy of the device table (``nn.Module.to()`` made it).

        A new device keeps the cached contents; a new dtype clears the device tier and this
        process's lower tiers (values cast to another precision are not what the model would compute
        in it). A shared remote tier keeps its pages for the other processes; here those of the old
        dtype stay there for the replicas of that dtype (the lower tiers file pages under the dtype).
        Refused while a step is in flight, and, changing nothing, when the backend cannot take the new
        table (e.g. a host tier smaller than one page of the new dtype); waits for lower-tier reads
        in flight. A lookup made before is looked up again by `allocate`.
        """
        with self._lock:
            if self._plans:
                raise ValueError(
                    f"{len(self._plans)} steps are in flight; commit or abort them before moving the cache")
            if tuple(kv_table.shape) != tuple(self.kv_table.shape):
                raise ValueError(f"kv_table shape {tuple(kv_table.shape)} != {tuple(self.kv_table.shape)}")
            dtype_names = {v: k for k, v in _config_dtypes().items()}
            if kv_table.dtype not in dtype_names:
                raise ValueError(f"kv_table dtype {kv_table.dtype} is not a cache dtype")
            new_cfg = dataclasses.replace(self.config, device=str(kv_table.device),
                                          dtype=dtype_names[kv_table.dtype])
            moved = kv_table.device != self.kv_table.device
            recast = kv_table.dtype != self.kv_table.dtype
            if self.backend is not None and (recast or moved):
                self.backend.check_bind(new_cfg)  # (e.g. no host slot at the new page size: nothing changed)
            self._drain()
            if self.backend is not None and recast:
                self.backend.settle()  # (a read task's reservation would make the clear refuse, half done)
            # NOTE: lookups made before this call hold versions of the replaced tiers (a new host core
            # counts versions from 0 again): `allocate` looks them up again.
            self._epoch += 1
            self.kv_table = kv_table
            self.config = new_cfg
            self.device = kv_table.device
            if recast:
                self._count_evicted(self._core.evict_all())
            if self.backend is not None and (recast or moved):
                if recast:
                    self.backend.clear()  # (no namespace: a shared remote tier keeps its pages)
                self.backend.rebind(new_cfg)
            if moved:
                self.transfer.close()
                self.transfer = make_transfer_engine(self.device)

    # ------------------------------------------------------------------ identity
    def set_namespace(self, namespace: str) -> None:
        """Switch the model/version salt: entries of other namespaces are never matched again."""
        check_namespace(namespace)
        with self._lock:
            self.namespace = namespace
            self._seed = namespace_seed(namespace)
            self._ns_id = self._ns_ids[namespace] = self._core.set_namespace(namespace, as_int64(self._seed))

    # ------------------------------------------------------------------ lookup
    def _digests(self, req: CacheRequest, tail_tokens: list[int], seed: int) -> tuple:
        """Caller digests for the core (when it cannot hash): every full page of every history,
        and each history's first ``tail_tokens[b]`` rows (-1: none)."""
        P, tokens = self.config.page_size, req.tokens
        pages, tails = [], []
        for b, n in enumerate(tail_tokens):
            start, length = req.history_offsets[b], req.history_lengths[b]
            pages.extend(page_digests(tokens, start, length, P, seed))
            tails.append(prefix_hash(tokens, start, n, seed) if n >= 0 else 0)
        return to_pairs(pages), to_pairs(tails), tail_tokens

    def _device_match(self, req: CacheRequest) -> tuple[list[int], list[int]]:
        """(device tokens, entry versions) per user, from the core (one call for the batch)."""
        if self._caller_digests:
            cached = self._core.cached_tokens(self._ns_id, req.user_ids)
            tails = [n if 0 < n <= length else -1 for n, length in zip(cached, req.history_lengths)]
            digests = self._digests(req, tails, self._seed)
            return self._core.lookup(req.user_ids, req.history_offsets, req.tokens, *digests)
        return self._core_lookup(req.user_ids, req.history_offsets, req.tokens)

    def _match_tiers(self, keys: list[Key], req: CacheRequest, batch: list[int],
                     dev: list[int]) -> tuple[list[dict[str, int]], list[int]]:
        """(tier pages, backend version) of users ``batch`` of ``req`` with ``dev`` device tokens each
        (`KVBackend.match_many`: one call for the batch)."""
        offsets, sub = req.history_offsets, [0]
        rows = []
        for b in batch:
            rows.append(req.tokens[offsets[b] : offsets[b + 1]])
            sub.append(sub[-1] + offsets[b + 1] - offsets[b])
        tokens = req.tokens if len(batch) == len(keys) else torch.cat(rows)
        offs = offsets if len(batch) == len(keys) else sub
        return self.backend.match_many([keys[b] for b in batch], tokens, offs, self._seed, dev,
                                       self.config.page_size)

    def _rematch(self, keys: list[Key], req: CacheRequest, batch: list[int], dev: list[int],
                 host_pages: list[int]) -> None:
        """Host-tier pages of users ``batch`` again (their entries changed since the lookup)."""
        if batch:
            tiers, _ = self._match_tiers(keys, req, batch, [dev[b] for b in batch])
            for b, t in zip(batch, tiers):
                host_pages[b] = t.get(self.backend.tier_names[0], 0)

    def lookup(self, request: CacheRequest) -> LookupResult:
        """Reusable history tokens per user and tier. Changes no state (not even LRU order).

        Raises `TierReadError`, with nothing changed, when a fail-closed backend cannot ask a lower
        tier (an unreachable remote tier)."""
        if not isinstance(request, CacheRequest):
            raise ValueError(f"lookup expects a CacheRequest, got {type(request).__name__}")
        with self._lock:
            ns, epoch = self.namespace, self._epoch
            keys = [(ns, u) for u in request.user_ids]
            names = self.backend.tier_names if self.backend is not None else ()
            dev_tokens, entry_versions = self._device_match(request)
            tier_pages: dict[str, list[int]] = {t: [] for t in names}
            fetch = []
            versions = [(v, -1) for v in entry_versions] if self.backend is None else []
            all_tiers, bvers = (self._match_tiers(keys, request, list(range(len(keys))), dev_tokens)
                                if self.backend is not None else ([], []))
            for b, key in enumerate(keys if self.backend is not None else ()):
                tiers, bver = all_tiers[b], bvers[b]
                versions.append((entry_versions[b], bver))
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
        return LookupResult(request, ns, keys, dev_tokens, tier_tokens, cached, tier_pages, versions, task, epoch)

    # ------------------------------------------------------------------ allocate
    def _count_evicted(self, evicted: Sequence[int]) -> None:
        self._stats.evicted_users += evicted[0]
        self._stats.evicted_pages += evicted[1]

    def _make_room(self, demand: int, exclude: list[int]) -> bool:
        """Free ``demand`` pages, evicting LRU users but not ``exclude`` (current namespace);
        reaps, then drains, finished copies first when that is the only way."""
        ok, users, pages = self._core.make_room(demand, exclude)
        if not ok:
            self._reap()
            if not self._core.fits(demand, exclude) and self._jobs:
                self._drain()
            ok, users, pages = self._core.make_room(demand, exclude)
        self._count_evicted((users, pages))
        return bool(ok)

    def allocate(self, lookup: LookupResult) -> BatchPlan | None:
        """Reserve pages for ``lookup``'s request and build its metadata.

        Evicts least-recently-used users (never those in flight) to make room. Returns ``None``
        and changes nothing when the batch cannot fit even after evicting everything evictable.
        Raises `UserInFlightError` (nothing changed) if a user is already in an in-flight step, and
        `TierReadError` (no pages reserved) when a fail-closed backend's read did not end ready or a
        lower tier it must ask again cannot be asked.
        """
        if not isinstance(lookup, LookupResult):
            raise ValueError(f"allocate expects a LookupResult, got {type(lookup).__name__}")
        req = lookup.request
        users, totals = req.user_ids, req.history_lengths
        with self._lock:
            if lookup.namespace != self.namespace or lookup.epoch != self._epoch:
                if lookup.prefetch_task is not None and self.backend is not None:
                    self.backend.cancel(lookup.prefetch_task)  # (its pages are of the old namespace or tiers)
                lookup = self.lookup(req)
            keys, backend, core, core_allocate = lookup.keys, self.backend, self._core, self._core_allocate
            fetched = {}
            if lookup.prefetch_task is not None:
                state = backend.wait(lookup.prefetch_task)
                fetched = backend.take_fetched(lookup.prefetch_task)
                lookup.prefetch_task = None
                if state != "ready" and not backend.fail_open:
                    raise TierReadError(f"lower-tier read for users {[k[1] for k in keys]} ended {state!r}")
            dev = lookup.device_tokens
            seen = [v[0] for v in lookup.versions]
            host_pages = [0] * len(keys)
            if backend is not None:
                host_pages = list(lookup.tier_pages[backend.tier_names[0]])
                # NOTE: another step changed these users' host pages since the lookup; match again.
                now_b = backend.versions(keys)
                self._rematch(keys, req, [b for b in range(len(keys)) if now_b[b] != lookup.versions[b][1]], dev,
                              host_pages)
            # The core decides (changing nothing on a refusal), evicts and reserves in one call.
            args = (users, totals, dev, seen, host_pages)
            status, value, buffer, info = core_allocate(*args)
            if status == _CHANGED:
                # NOTE: another step changed a user's device entry since the lookup; match again.
                dev, now = self._device_match(req)
                if backend is not None:
                    self._rematch(keys, req, [b for b in range(len(keys)) if now[b] != seen[b]], dev, host_pages)
                args = (users, totals, dev, now, host_pages)
                status, value, buffer, info = core_allocate(*args)
            if status == _NO_FIT:
                # NOTE: finished copies may unpin users: reap them, drain if that is not enough.
                self._reap()
                if not core.fits(info[0], users) and self._jobs:
                    self._drain()
                status, value, buffer, info = core_allocate(*args)
            if status == _IN_FLIGHT:
                raise UserInFlightError(f"user {users[value]} is already in an in-flight step")
            if status != _OK:
                self._stats.alloc_failures += 1
                logger.debug("allocate: %d pages needed, cannot fit", info[0])
                return None
            B = len(keys)
            demand, ev_users, ev_pages, n_new, n_total, n_pages, max_new, max_total = info[:8]
            keep, onboard = info[8 : 8 + B], info[8 + B : 8 + 2 * B]
            cached, device_tokens = info[8 + 2 * B : 8 + 3 * B], info[8 + 3 * B : 8 + 4 * B]
            self._count_evicted((ev_users, ev_pages))
            self._stats.pages_allocated += demand
            onboard_src = []
            for b, key in enumerate(keys):
                if onboard[b]:
                    slots = backend.acquire(key, keep[b], onboard[b])
                    assert slots is not None, f"host pages of {key} vanished under the lock"
                    onboard_src.append((b, keep[b], slots))
            meta = metadata_from_host(
                buffer, page_size=self.config.page_size, batch_size=B, num_new_tokens=n_new,
                num_total_tokens=n_total, num_batch_pages=n_pages, max_new_len=max_new, max_total_len=max_total,
                device=self.device,
            )
            plan = BatchPlan(
                plan_id=value, request=req, keys=keys, metadata=meta, device_tokens=device_tokens,
                onboard_tokens=[c - d for c, d in zip(cached, device_tokens)], cached_lengths=cached,
                new_lengths=[t - c for t, c in zip(totals, cached)],
                host_metadata=buffer, keep_pages=keep, onboard_src=onboard_src,
            )
            if fetched:
                plan.lower_tier_tokens = self._lower_tier_tokens(keys, keep, onboard, fetched)
            self._plans[plan.plan_id] = plan
            self._stats.plans += 1
            return plan

    def _lower_tier_tokens(self, keys: list[Key], keep: list[int], onboard: list[int],
                           fetched: dict[Key, tuple[int, list[str]]]) -> dict[str, int]:
        """Tokens per lower tier among the pages this step onboards that its own read fetched."""
        out: dict[str, int] = {}
        for b, key in enumerate(keys):
            first, tiers = fetched.get(key, (0, []))
            for page in range(max(first, keep[b]), min(first + len(tiers), keep[b] + onboard[b])):
                tier = tiers[page - first]
                out[tier] = out.get(tier, 0) + self.config.page_size
        return out

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
            # NOTE: this runs before the first layer's copy is launched, so its host time delays the
            # step: no concatenation for one user (the engine only reads the page lists), numpy reads
            # of the host buffer (~1 µs less than tensor indexing for one user).
            host, offsets = plan.host_metadata.numpy(), plan.metadata.field_offsets
            indptr, indices = offsets["kv_indptr"][0], offsets["kv_indices"][0]
            src, dst = [], []
            for b, first, slots in plan.onboard_src:
                at = indices + int(host[indptr + b]) + first
                src.append(slots)
                dst.append(torch.from_numpy(host[at : at + slots.numel()]))
            src_t = src[0] if len(src) == 1 else torch.cat(src)
            dst_t = dst[0] if len(dst) == 1 else torch.cat(dst)
            handle = self.transfer.copy(self.backend.host_table, src_t, self.kv_table, dst_t)
            plan.onboard_handle = handle
            items = [(plan.keys[b], None) for b, _, _ in plan.onboard_src]
            self._jobs.append(_CopyJob(handle, "onboard", items, []))
            self._stats.onboard_pages += dst_t.numel()
            self._stats.onboard_bytes += dst_t.numel() * self.config.page_bytes
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
        self.check_append(layer, k, v, plan, rows)
        meta = plan.metadata
        if rows is None:
            self.append_fn(self.kv_table[layer], k, v, meta.new_token_slots)
        else:
            self.append_fn(self.kv_table[layer], k, v, meta.new_token_slots, rows)

    def check_append(self, layer: int, k: torch.Tensor, v: torch.Tensor, plan: BatchPlan,
                     rows: torch.Tensor | None = None) -> None:
        """`append`'s checks without the write: the plan in flight, the layer in range, ``k``/``v``
        of the table's dtype and device in `append`'s shapes. For a caller that writes the plan's
        slots (``plan.metadata.new_token_slots``) itself, in a pass of its own."""
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
        with self._lock:
            self._check_live(plan)
            if plan.onboard_src and plan.onboard_handle is None:
                # NOTE: its host-tier pages were never copied: the step read, and the entry would
                # keep, pages that hold nothing of this user. Refused; abort the plan.
                raise ValueError(f"plan {plan.plan_id} has host-tier pages that were never onboarded "
                                 "(onboard_launch before the step); abort it")
            handle = plan.onboard_handle
            if handle is not None and handle.num_layers:
                # NOTE: a step waits for every layer it reads; a layer it never waited for must still
                # land before the entry is published: launched now (a lazy handle) and the caller's
                # stream ordered after it, so later readers of the pages see it.
                handle.wait_layer(handle.num_layers - 1)
            req = plan.request
            # NOTE: the core frees stale pages (zombies while a copy reads them), hashes the new
            # full pages with the entry's stream hasher and publishes the entries.
            if self._caller_digests:
                digests = self._digests(req, list(req.history_lengths), namespace_seed(plan.keys[0][0]))
                self._core.commit(plan.plan_id, req.history_offsets, req.tokens, *digests)
            else:
                self._core_commit(plan.plan_id, req.history_offsets, req.tokens)
            for b, total in enumerate(req.history_lengths):
                self._stats.tokens_requested += total
                self._stats.tokens_reused_device += plan.device_tokens[b]
                self._stats.tokens_reused_host += plan.onboard_tokens[b]
                self._stats.tokens_computed += plan.new_lengths[b]
            self._stats.tokens_reused_ssd += plan.lower_tier_tokens.get("ssd", 0)
            self._stats.tokens_reused_remote += plan.lower_tier_tokens.get("remote", 0)
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
            if plan.onboard_handle is not None:
                # NOTE: the copy may still write into pages we are about to free.
                try:
                    if not plan.onboard_handle.done():
                        self._stats.host_blocking_waits += 1
                        plan.onboard_handle.wait()
                except Exception:
                    logger.warning("onboard copy of aborted plan %d failed", plan.plan_id)
            elif plan.onboard_handle is None:
                for b, _, _ in plan.onboard_src:
                    self.backend.release(plan.keys[b])
            self._core_abort(plan.plan_id)
            plan.state = "aborted"
            del self._plans[plan.plan_id]
            self._stats.aborts += 1
            self._reap()

    # ------------------------------------------------------------------ offload
    def _offload(self, keys: Sequence[Key]) -> None:
        """Write newly completed full pages of ``keys`` (one namespace) through to the backend (one copy)."""
        if not keys:
            return
        ns = self._ns_ids[keys[0][0]]
        # NOTE: which pages, and the reservations (all before any publish), are the C++ host tier's
        # policy (HostCore.reserve_write_through), the one the C++ runner runs too.
        reserved, failed = self.backend.reserve_write_through(self._core, ns, list(keys))
        self._stats.offload_skipped += failed
        if not reserved:
            return
        src = torch.cat([pages for _, _, pages, _ in reserved])
        items: list[tuple[Key, torch.Tensor | None]] = []
        for key, _, _, slots in reserved:
            items.append((key, slots))
            self._core.add_offload(ns, key[1])
        src_list = src.tolist()
        self._pool.add_readers(src_list)
        handle = self.transfer.copy(self.kv_table, src, self.backend.host_table, torch.cat([s for *_, s in reserved]))
        self._jobs.append(_CopyJob(handle, "offload", items, src_list))
        self._stats.offload_pages += len(src_list)
        self._stats.offload_bytes += len(src_list) * self.config.page_bytes

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
            self._core.offload_done(self._ns_ids[key[0]], key[1])

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
            users = list(user_ids)
            # raises ValueError (nothing changed) for a user in an in-flight step
            blocked = self._core.evict_blockers(self._ns_id, users)
            if all_tiers and self.backend is not None:
                # NOTE: the host tier refuses to drop a user being read or written (an onboard copy not yet
                # reaped, a read task of a lookup whose step never came): quiesce them before changing
                # anything, or some users would be gone from every tier when the call raised.
                self._drain()
                self.backend.settle([(self.namespace, u) for u in users])
            elif blocked:
                self._drain()
            evicted = self._core.evict(self._ns_id, users)
            self._count_evicted(evicted)
            if all_tiers and self.backend is not None:
                for u in users:
                    self.backend.evict((self.namespace, u))
            return evicted[0]

    def evict_all(self, *, all_tiers: bool = False) -> None:
        """Drop every device entry; with ``all_tiers`` also every page of this process's host and SSD
        tiers and this namespace's pages in a shared remote tier (every replica loses those; other
        namespaces keep theirs)."""
        with self._lock:
            if self._plans:
                raise ValueError(f"{len(self._plans)} steps are in flight; commit or abort them first")
            self._drain()
            if all_tiers and self.backend is not None:
                self.backend.settle()  # (a read task's reservation would make the clear refuse, half done)
            self._count_evicted(self._core.evict_all())
            if all_tiers and self.backend is not None:
                self.backend.clear(namespace=self.namespace)

    def reserve_scratch_pages(self, n: int) -> list[int]:
        """Take ``n`` pages out of circulation for good (e.g. where padded tokens of a CUDA-graph
        bucket write their K/V); they never hold a user's tokens. Evicts LRU users if needed."""
        with self._lock:
            if n <= 0:
                return []
            if not self._make_room(n, []):
                raise ValueError(f"cannot reserve {n} scratch pages: the cache has {self.config.num_pages} pages")
            return self._core.reserve_scratch(n)

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, Any]:
        with self._lock:
            out = self._stats.as_dict()
            out.update(
                device_users=self._core.num_entries(),
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
            return self._core.lru_order(self._ns_id)

    def cached_length(self, user_id: int) -> int:
        with self._lock:
            return self._core.cached_tokens(self._ns_id, [user_id])[0]

    def pages_of(self, user_id: int) -> list[int]:
        with self._lock:
            return self._core.entry(self._ns_id, user_id)[1].tolist()

    def check(self) -> None:
        """Assert the accounting invariants (see the module docstring)."""
        with self._lock:
            problem = self._core.check()
            assert not problem, problem
            assert sorted(self._plans) == self._core.plan_ids(), "plans disagree with the core's"
            if self.backend is not None:
                self.backend.check()

    def close(self) -> None:
        with self._lock:
            self._drain()
        self.transfer.close()
        if self.backend is not None:
            self.backend.close()
