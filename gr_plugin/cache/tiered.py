"""`TieredBackend`: the pinned host tier with an SSD tier and a shared remote tier below it.

Owns the policy between the tiers (what the ``flexkv`` option runs): which tier holds a prefix
(``match``), the batched, asynchronous reads that bring lower-tier pages into host slots
(``prefetch`` -> ``wait``/``try_wait``/``cancel``, FlexKV's task life), and the writes down:
write-through from host to SSD (or SSD on host eviction) and to the remote store. Data from SSD or
remote always lands in pinned host slots first; the manager onboards it to the device layer by
layer like any host hit. The byte formats and I/O belong to the stores (`tiers.ssd`,
`tiers.remote`); the host slots and LRU to `HostTier`.

Failure policy: a page that is missing or corrupt is a miss (recomputed). A lower-tier read task
that fails (a worker error; a remote tier that stops answering) or outlives ``task_timeout_s`` is a
miss (fail-open, the default: the tokens are recomputed) or an error (``fail_open=False``: allocate
raises `TierReadError`). So is a
remote tier that a lookup has to ask and cannot (unreachable, backing off after an error, or
refusing EXISTS): a miss, or with ``fail_open=False`` a `TierReadError` from ``match`` (the
manager's ``lookup`` raises it, changing nothing). A write that fails is counted and logged, never
fatal. A task that is cancelled, fails or times out releases every slot it reserved (slots a
worker may still be writing are released when it finishes); of a task that succeeds, only each
user's longest successfully read prefix is published.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import itertools
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from gr_plugin.cache.backend import Key, TierReadError
from gr_plugin.cache.config import KVCacheConfig
from gr_plugin.cache.hashing import StreamHasher
from gr_plugin.cache.host_tier import HostTier
from gr_plugin.cache.tiers.flexkv_config import TierConfig
from gr_plugin.cache.tiers.types import PageKey, PageStore, PageStoreUnavailable, aligned_empty

logger = logging.getLogger(__name__)

_FETCHED_KEPT = 256  # finished tasks whose published pages a step may still ask for (`take_fetched`)
_RENEWED_KEPT = 1 << 18  # users whose last remote renewal is remembered (one forgotten renews at once)
_now = time.monotonic  # (the renewal clock; a test moves it)


class TaskState(enum.Enum):
    LAUNCHED = "launched"
    READY = "ready"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"


@dataclasses.dataclass
class _FetchItem:
    key: Key
    first_page: int
    hashes: list[int]  # prefix hashes of pages first_page .. first_page + n
    sources: list[str]  # per page: "ssd" | "remote"
    slots: torch.Tensor  # reserved host slots
    ok_pages: int = 0  # leading pages read and verified (set by the worker)


@dataclasses.dataclass
class FetchTask:
    task_id: int
    items: list[_FetchItem]
    future: Future
    launched_at: float
    state: TaskState = TaskState.LAUNCHED
    finalized: bool = False
    doomed: bool = False  # cancelled or timed out: release, never publish

    def results(self) -> dict[Key, int]:
        """Pages per user that this task made readable in the host tier."""
        if self.state != TaskState.READY:
            return {it.key: 0 for it in self.items}
        return {it.key: it.ok_pages for it in self.items}


def request_page_hashes(tokens: torch.Tensor, start: int, num_pages: int, page_size: int, seed: int) -> list[int]:
    """Prefix hashes of the first ``num_pages`` pages of a history (one streaming pass)."""
    h = StreamHasher(seed)
    out = []
    for i in range(num_pages):
        h.update(tokens, start + i * page_size, start + (i + 1) * page_size)
        out.append(h.digest())
    return out


class TieredBackend(HostTier):
    """Host tier + optional SSD (`SSDPageStore`) and remote (`RedisPageStore`) tiers."""

    def __init__(self, tiers: TierConfig, *, pin_memory: bool | None = None, ssd: PageStore | None = None,
                 remote: PageStore | None = None, num_workers: int = 2) -> None:
        super().__init__(pin_memory)
        if tiers.write_policy not in ("write_through", "on_evict"):
            raise ValueError(f"write_policy must be 'write_through' or 'on_evict', got {tiers.write_policy!r}")
        self.tiers = tiers
        self._ssd, self._remote = ssd, remote
        self._built: set[str] = set()  # the stores this backend made (and remakes for a new page size)
        self._pool = ThreadPoolExecutor(max_workers=num_workers, thread_name_prefix="gr-kv-tier")
        self._tasks: dict[int, FetchTask] = {}
        self._fetching: dict[Key, int] = {}
        self._fetched: collections.OrderedDict[int, dict[Key, tuple[int, list[str]]]] = collections.OrderedDict()
        self._ended: collections.OrderedDict[int, TaskState] = collections.OrderedDict()  # finished, not ready
        self._writes: list[tuple[Key, Future]] = []  # write-downs in flight, per user
        self._write_lock = threading.Lock()
        self._task_ids = itertools.count(1)
        # per user: (when its remote pages were last renewed, how many from page 0 that renewal reached)
        self._renewed: collections.OrderedDict[Key, tuple[float, int]] = collections.OrderedDict()
        self._renew_lock = threading.Lock()
        self._renew_pool: ThreadPoolExecutor | None = None
        self._renewals: list[Future] = []  # renewal batches queued or running (not waited on by an evict)
        self._closed = False
        self._tier_counters = {
            "tasks_launched": 0, "tasks_ready": 0, "tasks_failed": 0, "tasks_timed_out": 0,
            "tasks_cancelled": 0, "task_latency_s_sum": 0.0, "task_latency_s_max": 0.0,
            "ssd_pages_fetched": 0, "remote_pages_fetched": 0, "fetch_pages_failed": 0,
            "ssd_pages_written": 0, "remote_pages_written": 0, "lower_writes_failed": 0,
            "lower_writes_skipped": 0, "remote_renewals": 0,
        }

    @property
    def tier_names(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("host", *(["ssd"] if self._ssd is not None or self.tiers.ssd_cache_gb > 0 else []),
                *(["remote"] if self._remote is not None or self.tiers.enable_3rd_remote else []))

    @property
    def fail_open(self) -> bool:
        return self.tiers.fail_open

    # ----------------------------------------------------------------- setup
    def check_bind(self, config: KVCacheConfig) -> None:
        super().check_bind(config)
        if config.torch_device.type != "meta" and self.tiers.ssd_cache_gb > 0 and (
                self._ssd is None or ("ssd" in self._built and self._ssd.page_bytes != config.page_bytes)):
            from gr_plugin.cache.tiers.ssd import slot_count

            slot_count(self.tiers.ssd_cache_bytes, config.page_bytes)

    def bind(self, config: KVCacheConfig) -> None:
        super().bind(config)
        if config.torch_device.type == "meta":
            return
        # NOTE: a new dtype (`KVCacheManager.rebind`, after `clear`) changes the page size: the stores
        # this backend built are rebuilt for it (an SSD store was emptied by the clear; the remote
        # tier's pages of the old dtype stay, for the other dtype's replicas, and are never found here:
        # they are filed under their dtype). A store passed in is the caller's to match.
        for name in sorted(self._built):
            store = getattr(self, f"_{name}")
            if store is not None and store.page_bytes != config.page_bytes:
                store.close()
                setattr(self, f"_{name}", None)
                self._built.discard(name)
        if self._ssd is None and self.tiers.ssd_cache_gb > 0:
            from gr_plugin.cache.tiers.ssd import SSDPageStore

            if not self.tiers.ssd_cache_dir:
                raise ValueError("ssd_cache_gb > 0 needs ssd_cache_dir")
            self._ssd = SSDPageStore(self.tiers.ssd_cache_dirs[0], self.tiers.ssd_cache_bytes, config.page_bytes,
                                     num_threads=self.tiers.ssd_num_threads, o_direct=self.tiers.ssd_o_direct)
            self._built.add("ssd")
        if self._remote is None and self.tiers.enable_3rd_remote:
            from gr_plugin.cache.tiers.remote import RedisPageStore

            self._remote = RedisPageStore(self.tiers.remote_url, page_bytes=config.page_bytes,
                                          ttl_s=self.tiers.remote_ttl_s)
            self._built.add("remote")

    def _store_ns(self, key: Key, dtype: str | None = None) -> str:
        """The namespace the SSD and remote tiers file ``key``'s pages under: the cache's, then the cache
        dtype. Replicas of one model at two precisions sharing a Redis (or, run after run, an SSD
        directory) keep apart instead of overwriting each other's pages (which each would read as misses:
        a page's header names its dtype)."""
        return f"{key[0]}:{dtype or self.config.dtype}"

    def _stores(self) -> list[tuple[str, PageStore]]:
        return [(n, s) for n, s in (("ssd", self._ssd), ("remote", self._remote)) if s is not None]

    # ----------------------------------------------------------------- reading
    def version(self, key: Key) -> int:
        v = super().version(key)
        # NOTE: 0, not -1, when the host holds nothing but a lower tier might: the manager then asks.
        return 0 if v == -1 and self._stores() else v

    def match(self, key: Key, tokens: torch.Tensor, start: int, length: int, seed: int,
              min_pages: int = 0) -> dict[str, int]:
        """`KVBackend.match` over host, SSD and remote. Raises `TierReadError` (``fail_open`` False)
        when the remote tier has to be asked and cannot answer (a strict `RedisPageStore.match`)."""
        host = super().match(key, tokens, start, length, seed, 0)["host"]
        out = {"host": host}
        full = length // self.config.page_size
        if full <= max(host, min_pages) or not self._stores():
            for name, _ in self._stores():
                out[name] = host
            return out
        hashes = request_page_hashes(tokens, start, full, self.config.page_size, seed)
        best = host
        for name, store in self._stores():
            if name == "remote":
                try:
                    got = store.match(self._store_ns(key), key[1], hashes, start=best, strict=not self.fail_open)
                except PageStoreUnavailable as exc:
                    raise TierReadError(f"the remote tier cannot be asked for user {key[1]} of namespace {key[0]!r} "
                                        f"and fail_open=False: {exc}") from exc
            else:
                got = store.match(self._store_ns(key), key[1], hashes)
            best = max(best, got)
            out[name] = best
        return out

    def match_many(self, keys: list[Key], tokens: torch.Tensor, offsets: list[int], seed: int,
                   device_tokens: list[int], page_size: int) -> tuple[list[dict[str, int]], list[int]]:
        tiers, versions = super().match_many(keys, tokens, offsets, seed, device_tokens, page_size)
        self._renew_remote(keys, tokens, offsets, seed, device_tokens, tiers)
        return tiers, versions

    @property
    def renew_interval_s(self) -> float | None:
        """How often a user's remote pages are renewed at most (a quarter of the remote TTL), or
        None: no remote tier, or its pages never expire."""
        ttl = getattr(self._remote, "ttl_s", None)
        return ttl / 4 if ttl else None

    def _renew_remote(self, keys: list[Key], tokens: torch.Tensor, offsets: list[int], seed: int,
                      device_tokens: list[int], tiers: list[dict[str, int]]) -> None:
        """Restart the remote TTL of the pages a lookup finds above the remote tier (on the device,
        host or SSD): a replica serving a user from its own tiers reads nothing from Redis, which
        would otherwise let the user's pages there expire while the user is active. Every page once a
        `renew_interval_s` per user, and in between the pages beyond those the last renewal reached
        (a longer history of the user, e.g. a later visit replayed); one pipelined batch per lookup,
        off the caller's thread. Pages the lookup will read from Redis are renewed by that read. So a
        page outlives the last lookup on any replica that found it by at least 3/4 of the TTL while
        the server is reachable; a user whose renewal failed because the server could not be reached
        is tried again, every page, by a lookup after the store's ``retry_after_s`` (at least 1 s, at
        most the interval); one the server refused (READONLY, NOPERM), after the interval."""
        interval = self.renew_interval_s
        if interval is None or self._closed:
            return
        P, now, due = self.config.page_size, _now(), []
        dtype = self.config.dtype  # NOTE: now: a renewal queued before a rebind renews the old dtype's keys
        with self._renew_lock:
            for b, key in enumerate(keys):
                full = (offsets[b + 1] - offsets[b]) // P
                t = tiers[b]
                upper = min(full, max(device_tokens[b] // P, t.get("host", 0), t.get("ssd", 0)))
                when, upto = self._renewed.get(key, (None, 0))
                if when is None or now - when >= interval:
                    first, when = 0, now  # (every page)
                elif upper > upto:
                    first = upto  # (pages the renewal at `when` did not reach: renewed now, later than `when`)
                else:
                    continue
                if upper == 0:
                    continue
                self._renewed[key] = (when, upper)
                self._renewed.move_to_end(key)
                due.append((key, tokens[offsets[b] : offsets[b] + upper * P].clone(), first, upper, (when, upper)))
            while len(self._renewed) > _RENEWED_KEPT:
                self._renewed.popitem(last=False)
        if not due:
            return
        remote = self._remote
        assert remote is not None
        retry = min(interval, max(1.0, float(getattr(remote, "retry_after_s", 1.0))))

        def run() -> None:
            page_keys, spans = [], []
            for key, rows, first, upper, _ in due:
                hashes = request_page_hashes(rows, 0, upper, P, seed)
                spans.append((len(page_keys), len(page_keys) + upper - first))
                page_keys += [PageKey(self._store_ns(key, dtype), key[1], i, hashes[i]) for i in range(first, upper)]
            try:
                done = remote.renew(page_keys)
            except Exception:  # (the store answers None for I/O errors; this is e.g. a store closed meanwhile)
                logger.warning("renewing the remote pages of %d users failed", len(due), exc_info=True)
                done = [None] * len(page_keys)
            failed_at = _now()
            # NOTE: unreachable (the store backs off): due again after `retry`, all its pages; refused (the
            # server answers, e.g. READONLY or NOPERM: asking again soon gets the same answer): after the
            # interval, as if renewed.
            again = retry if getattr(remote, "backing_off", True) else interval
            with self._renew_lock:
                for (key, *_, mark), (lo, hi) in zip(due, spans, strict=True):
                    if None in done[lo:hi] and self._renewed.get(key) == mark:
                        self._renewed[key] = (failed_at - interval + again, mark[1])
            with self._write_lock:
                self._tier_counters["remote_renewals"] += len(due)

        with self._write_lock:
            if self._renew_pool is None:
                # NOTE: its own thread: a renewal never queues ahead of a fetch a step waits for.
                self._renew_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gr-kv-renew")
            self._renewals = [f for f in self._renewals if not f.done()]
            self._renewals.append(self._renew_pool.submit(run))

    def prefetch(self, requests) -> int | None:
        """One batched task reading, for each request whose lower tiers hold more than the host,
        the missing pages into reserved host slots."""
        self.poll()
        P = self.config.page_size
        items = []
        for key, tokens, start, _length, seed, tiers in requests:
            if key in self._fetching:
                continue
            host = tiers.get("host", 0)
            upto = max(tiers.values())
            if upto <= host:
                continue
            hashes = request_page_hashes(tokens, start, upto, P, seed)
            slots = self.reserve(key, host, hashes[host:upto])
            if slots is None:
                continue
            ssd_upto = tiers.get("ssd", host)
            sources = ["ssd" if i < ssd_upto else "remote" for i in range(host, upto)]
            items.append(_FetchItem(key, host, hashes[host:upto], sources, slots))
        if not items:
            return None
        task = FetchTask(next(self._task_ids), items, Future(), time.perf_counter())
        task.future = self._pool.submit(self._run_fetch, items)
        self._tasks[task.task_id] = task
        for it in items:
            self._fetching[it.key] = task.task_id
        self._tier_counters["tasks_launched"] += 1
        return task.task_id

    def _run_fetch(self, items: list[_FetchItem]) -> None:
        """Worker: read every page of the task from its tier into staging, then into the reserved
        host slots (not readable until published on the manager's thread)."""
        cfg = self.config
        row = (cfg.num_layers, 2, cfg.page_size, cfg.num_heads, cfg.head_dim)
        ok: dict[tuple[int, int], bool] = {}
        for name, store in self._stores():
            where = [(i, j) for i, it in enumerate(items) for j, src in enumerate(it.sources) if src == name]
            if not where:
                continue
            keys = [PageKey(self._store_ns(items[i].key), items[i].key[1], items[i].first_page + j, items[i].hashes[j])
                    for i, j in where]
            staging = aligned_empty((len(keys), *row), cfg.torch_dtype)  # O_DIRECT reads land in place
            # NOTE: fail-closed, a remote tier that stops answering fails the task (allocate raises
            # TierReadError); a missing or corrupt page is a miss either way.
            strict = {"strict": True} if name == "remote" and not self.fail_open else {}
            got = store.get_many(keys, staging, **strict)
            good = [n for n, g in enumerate(got) if g]
            if good:
                idx = torch.tensor(good, dtype=torch.int64)
                slots = torch.stack([items[where[n][0]].slots[where[n][1]] for n in good])
                self.host_table.index_copy_(1, slots, staging.index_select(0, idx).transpose(0, 1))
            for n, (i, j) in enumerate(where):
                ok[(i, j)] = got[n]
        for i, it in enumerate(items):
            n = 0
            while n < len(it.sources) and ok.get((i, n), False):
                n += 1
            it.ok_pages = n

    def _finalize(self, task: FetchTask) -> None:
        """Publish (or release) a finished task's reservations; manager thread only, once."""
        if task.finalized:
            return
        task.finalized = True
        c = self._tier_counters
        if task.state == TaskState.LAUNCHED:  # (timed-out and cancelled tasks were counted then)
            error = None if task.future.cancelled() else task.future.exception()
            if error is not None:
                logger.warning("lower-tier read task %d failed: %r", task.task_id, error)
            task.state = TaskState.FAILED if error is not None else TaskState.READY
            c[f"tasks_{task.state.value}"] += 1
            latency = time.perf_counter() - task.launched_at
            c["task_latency_s_sum"] += latency
            c["task_latency_s_max"] = max(c["task_latency_s_max"], latency)
        for it in task.items:
            if self._fetching.get(it.key) == task.task_id:
                del self._fetching[it.key]
            good = it.ok_pages if task.state == TaskState.READY else 0
            for src in it.sources[:good]:
                c[f"{src}_pages_fetched"] += 1
            c["fetch_pages_failed"] += len(it.sources) - good
            self.publish(it.key, it.slots, good > 0, good, from_lower_tier=True)
        del self._tasks[task.task_id]
        if task.state != TaskState.READY:
            # NOTE: a task finished here (a `poll` or `settle` for another user) before its lookup's
            # `allocate` waits: `wait` still answers its state, so fail_open=False still raises.
            self._ended[task.task_id] = task.state
            while len(self._ended) > _FETCHED_KEPT:
                self._ended.popitem(last=False)
        if task.state == TaskState.READY:
            self._fetched[task.task_id] = {it.key: (it.first_page, it.sources[: it.ok_pages]) for it in task.items}
            while len(self._fetched) > _FETCHED_KEPT:  # (tasks whose step never asked)
                self._fetched.popitem(last=False)

    def take_fetched(self, task_id: int) -> dict[Key, tuple[int, list[str]]]:
        return self._fetched.pop(task_id, {})

    def _abandon(self, task: FetchTask, state: TaskState) -> None:
        """Stop waiting for a task: nothing of it will be published; its slots are released when
        its worker is done (now, if it never started)."""
        task.state = state
        self._tier_counters[f"tasks_{state.value}"] += 1
        task.future.cancel()
        for it in task.items:
            if self._fetching.get(it.key) == task.task_id:
                del self._fetching[it.key]
        if task.future.done():
            self._finalize(task)

    def try_wait(self, task_id: int) -> TaskState:
        """The task's state, finishing it if its worker is done; never blocks."""
        task = self._tasks.get(task_id)
        if task is None:
            return self._ended.get(task_id, TaskState.READY)
        if task.future.done():
            self._finalize(task)
        return task.state

    def wait(self, task_id: int, timeout: float | None = None) -> str:
        """Finish a task within ``timeout`` (default ``task_timeout_s``); returns its state."""
        task = self._tasks.get(task_id)
        if task is None:
            return self._ended.pop(task_id, TaskState.READY).value
        timeout = self.tiers.task_timeout_s if timeout is None else timeout
        try:
            task.future.result(timeout=timeout)
        except FutureTimeout:
            logger.warning("lower-tier read task %d timed out after %.3fs: those pages are a miss", task_id, timeout)
            self._abandon(task, TaskState.TIMED_OUT)
            return task.state.value
        except Exception:
            pass
        self._finalize(task)
        return task.state.value

    def settle(self, keys: list[Key] | None = None) -> None:
        wanted = None if keys is None else set(keys)
        for task in list(self._tasks.values()):
            if wanted is not None and wanted.isdisjoint(it.key for it in task.items):
                continue
            # NOTE: no timeout: a worker cannot be stopped, and its reservation stays until it ends (each
            # store call is bounded: Redis by its socket timeout, the SSD by its reads).
            try:
                task.future.result()
            except Exception:  # (cancelled before it ran, or failed: finalize releases its slots)
                pass
            self._finalize(task)

    def cancel(self, task_id: int) -> None:
        task = self._tasks.get(task_id)
        if task is not None and task.state == TaskState.LAUNCHED:
            self._abandon(task, TaskState.CANCELLED)

    def poll(self) -> None:
        for task in list(self._tasks.values()):
            if task.future.done():
                self._finalize(task)
        with self._write_lock:
            self._writes = [(k, f) for k, f in self._writes if not f.done()]

    # ----------------------------------------------------------------- writing down
    def _stage(self, slots: torch.Tensor, table: torch.Tensor | None = None) -> torch.Tensor:
        """Pages of these host slots as one contiguous ``[n, L, 2, P, H, D]`` CPU tensor (one gather)."""
        table = self.host_table if table is None else table
        return table.transpose(0, 1).index_select(0, slots)

    def _write_down(self, key: Key, first_page: int, hashes: list[int], pages: torch.Tensor | None,
                    targets: list[tuple[str, PageStore]], slots: list[int] | None = None) -> None:
        """Write pages to the lower tiers on a worker: ``pages`` staged already, or read from the
        published host ``slots`` there; if a reservation took any of them meanwhile (their
        generation moved), the read may be torn and nothing is written (counted, a later miss)."""
        keys = [PageKey(self._store_ns(key), key[1], first_page + i, h) for i, h in enumerate(hashes)]
        table, generations = self.host_table, self._slot_gen  # (what `bind` may replace meanwhile)
        gens = None if slots is None else self.slot_generations(slots, generations)

        def run() -> None:
            nonlocal pages
            if pages is None:
                pages = self._stage(torch.tensor(slots, dtype=torch.int64), table)
                # NOTE: read after the gather (the GIL orders the two for this thread); a reservation
                # bumps before its bytes are written, so equal generations = no write began during it.
                if self.slot_generations(slots, generations) != gens:
                    with self._write_lock:
                        self._tier_counters["lower_writes_skipped"] += len(keys)
                    return
            for name, store in targets:
                try:
                    done = store.put_many(keys, pages)
                except Exception:
                    logger.warning("%s write of user %s failed", name, key[1], exc_info=True)
                    done = [False] * len(keys)
                with self._write_lock:
                    self._tier_counters[f"{name}_pages_written"] += sum(done)
                    self._tier_counters["lower_writes_failed"] += len(done) - sum(done)

        with self._write_lock:
            self._writes.append((key, self._pool.submit(run)))

    def _write_targets(self, from_lower_tier: bool) -> list[tuple[str, PageStore]]:
        """The lower tiers that pages published in the host tier are written through to (none for
        pages that came up from a lower tier)."""
        targets: list[tuple[str, PageStore]] = []
        if self._ssd is not None and self.tiers.write_policy == "write_through" and not from_lower_tier:
            targets.append(("ssd", self._ssd))
        if self._remote is not None and self.tiers.remote_write_through and not from_lower_tier:
            targets.append(("remote", self._remote))
        return targets

    def _on_published(self, key: Key, first_page: int, slots: list[int], hashes: list[int],
                      from_lower_tier: bool) -> None:
        targets = self._write_targets(from_lower_tier)
        if targets:
            # NOTE: read on the worker, off the caller's thread (a gather of MBs per user at the
            # large models' page sizes): a reservation that takes the slots first voids the write.
            self._write_down(key, first_page, hashes, None, targets, slots=slots)

    def _on_drop(self, key: Key, slots: list[int], hashes: list[int]) -> None:
        if self._ssd is not None and self.tiers.write_policy == "on_evict":
            # NOTE: staged now: these slots are in a new reservation already, its bytes not yet written.
            self._write_down(key, 0, hashes, self._stage(torch.tensor(slots, dtype=torch.int64)),
                             [("ssd", self._ssd)])

    def _pending_writes(self, key: Key | None = None) -> list[Future]:
        """The write-downs queued or running (of ``key`` only, given one)."""
        with self._write_lock:
            return [f for k, f in self._writes if key is None or k == key]

    def flush_writes(self) -> None:
        """Block until every write to the lower tiers, remote renewals included, has finished."""
        for f in self._pending_writes():
            f.result()
        with self._write_lock:
            renewals = list(self._renewals)
        for f in renewals:
            if not f.cancelled():  # (close drops renewals not started)
                f.result()
        self.poll()

    def _wait_writes(self, key: Key) -> None:
        """Block until ``key``'s write-downs in flight have finished (a failed one is logged)."""
        for f in self._pending_writes(key):
            try:
                f.result()
            except Exception:
                logger.warning("a write-down of user %s failed", key[1], exc_info=True)

    # ----------------------------------------------------------------- eviction / lifecycle
    def evict(self, key: Key) -> None:
        super().evict(key)
        if self._stores():
            self._wait_writes(key)  # NOTE: a write-down still queued would put the user back after the evict
        with self._renew_lock:  # (a renewal in flight may run after the delete: EXPIRE creates nothing)
            self._renewed.pop(key, None)
        for _, store in self._stores():
            store.evict_user(self._store_ns(key), key[1])

    def clear(self, namespace: str | None = None) -> None:
        """Drop the host and SSD tiers' pages, and of the shared remote tier ``namespace``'s only (None:
        none): other processes, and other weights' namespaces, keep theirs."""
        super().clear()
        self.flush_writes()
        with self._renew_lock:
            self._renewed.clear()
        if self._ssd is not None:
            self._ssd.clear()
        if self._remote is not None and namespace is not None:
            self._remote.evict_namespace(self._store_ns((namespace, 0)))

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        out.update(self._tier_counters)
        out["tasks_in_flight"] = len(self._tasks)
        with self._write_lock:
            out["writes_in_flight"] = sum(not f.done() for _, f in self._writes)
            out["renewals_in_flight"] = sum(not f.done() for f in self._renewals)
        for name, store in self._stores():
            out.update({f"{name}_{k}": v for k, v in store.stats().items()})
        return out

    def check(self) -> None:
        super().check()
        if self._ssd is not None and hasattr(self._ssd, "check"):
            self._ssd.check()

    def close(self) -> None:
        for task in list(self._tasks.values()):
            if task.state == TaskState.LAUNCHED:
                self._abandon(task, TaskState.CANCELLED)
        self._closed = True
        self._pool.shutdown(wait=True)
        if self._renew_pool is not None:
            self._renew_pool.shutdown(wait=True, cancel_futures=True)  # (a renewal not started is dropped)
        for task in list(self._tasks.values()):
            self._finalize(task)
        for _, store in self._stores():
            store.close()
