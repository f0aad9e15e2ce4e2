"""The pinned host tier: the ``native`` backend.

Owns the pinned host table of page slots (``host_cache_bytes // page_bytes`` of them) that users'
full pages sit in, and the Python face of the host tier's policy, which lives in the C++ core
(``torch.classes.gr_kv_core.HostCore``, ``gr_plugin/csrc/core/host_core.cpp``, shared with a C++
runtime): free slots kept as runs (a user's pages written together land in consecutive slots, so
their copy is one transfer per layer), per user a contiguous prefix of published pages with their
prefix hashes, reservations published in the order they were reserved (whatever order they
complete in), pins of readers, and the LRU
over users that frees slots. It does not move bytes itself and knows nothing about device pages.
Each slot has a generation, bumped whenever a reservation takes the slot (before any byte is written
into it): a reader off the manager's thread (the write-down to a lower tier) reads a published slot's
bytes, then checks its generation; unchanged, the bytes it read are the published ones.
Prefix hashes cross into the core as int64 ``[n, 2]`` (low, high) pairs (`hashing.to_pairs`).
"""

from __future__ import annotations

import logging
from array import array
from typing import Any

import torch

from gr_plugin.cache.backend import Key, KVBackend
from gr_plugin.cache.config import KVCacheConfig
from gr_plugin.cache.hashing import as_int64, from_pairs, page_digests, to_pairs
from gr_plugin.csrc.core.build import load as load_core

logger = logging.getLogger(__name__)

_COUNTERS = ("host_evicted_users", "host_evicted_pages", "host_reserve_failed", "host_pages_written",
             "host_pages_read")  # HostCore.counters() order


class HostTier(KVBackend):
    """Pinned host memory with LRU over users (the ``native`` backend)."""

    tier_names = ("host",)

    def __init__(self, pin_memory: bool | None = None) -> None:
        self._pin = pin_memory
        self._table: torch.Tensor | None = None
        self._core: torch.ScriptObject | None = None
        self._num_slots = 0
        self._counter_base = [0] * len(_COUNTERS)  # counters of cores replaced by bind()
        self._ns_ids: dict[str, int] = {}
        self._ns_names: list[str] = []
        self._caller_digests = False
        self._slot_gen = array("q")  # per slot: reservations that took it

    # ----------------------------------------------------------------- setup
    def _storage_fits(self, config: KVCacheConfig) -> bool:
        """The host table can stay as it is for ``config`` (shape, dtype, pinning, meta or not)."""
        device, old = config.torch_device, self._table
        pin = self._pin if self._pin is not None else device.type == "cuda"
        shape = (config.num_layers, config.num_host_slots, 2, config.page_size, config.num_heads, config.head_dim)
        return old is not None and old.shape == shape and old.dtype == config.torch_dtype and (
            old.is_pinned() or not pin) and (old.device.type == "meta") == (device.type == "meta")

    @staticmethod
    def _check_slots(config: KVCacheConfig) -> None:
        if config.num_host_slots <= 0:
            raise ValueError(
                f"host tier needs host_cache_bytes >= one page ({config.page_bytes} bytes), "
                f"got {config.host_cache_bytes}"
            )

    def check_bind(self, config: KVCacheConfig) -> None:
        self._check_slots(config)
        old = getattr(self, "config", None)
        if old is not None and config.dtype == old.dtype and not self._storage_fits(config) \
                and self._core is not None and self._core.num_users():
            # (a new dtype empties the tier first: `KVCacheManager.rebind`)
            raise ValueError(f"the host tier needs new storage for device {config.device!r} (pinned or not, "
                             "meta or not), which it can only take while empty: evict_all(all_tiers=True) first")

    def bind(self, config: KVCacheConfig) -> None:
        self._check_slots(config)
        self.config = config
        num_slots = config.num_host_slots
        device = config.torch_device
        pin = self._pin if self._pin is not None else device.type == "cuda"
        shape = (config.num_layers, num_slots, 2, config.page_size, config.num_heads, config.head_dim)
        if self._storage_fits(config):
            return  # storage fits as it is: keep what it holds
        if self._core is not None and self._core.num_users():
            raise ValueError("host tier storage can only be replaced while it is empty")
        # NOTE: empty, not zeros: only published slots are ever read, and zeroing GBs of pinned
        # memory would stall start-up. A cache built on the meta device holds no host memory.
        if device.type == "meta":
            self._table = torch.empty(shape, dtype=config.torch_dtype, device="meta")
        else:
            self._table = torch.empty(shape, dtype=config.torch_dtype, pin_memory=pin)
        load_core()
        if self._core is not None:
            self._counter_base = [a + b for a, b in zip(self._counter_base, self._core.counters())]
        self._core = torch.classes.gr_kv_core.HostCore(num_slots, config.page_size)
        self._caller_digests = not torch.ops.gr_kv_core.hashing_available()
        self._num_slots = num_slots
        self._slot_gen = array("q", bytes(8 * num_slots))

    @property
    def host_table(self) -> torch.Tensor:
        assert self._table is not None, "HostTier.bind() was not called"
        return self._table

    @property
    def num_free_slots(self) -> int:
        return 0 if self._core is None else self._core.num_free()

    def _ns(self, key: Key) -> int:
        """The core's id of ``key``'s namespace, registered on first write."""
        ns = self._ns_ids.get(key[0])
        if ns is None:
            ns = self._ns_ids[key[0]] = len(self._ns_names)
            self._ns_names.append(key[0])
        return ns

    # ----------------------------------------------------------------- reading
    def match(
        self, key: Key, tokens: torch.Tensor, start: int, length: int, seed: int, min_pages: int = 0
    ) -> dict[str, int]:
        ns = self._ns_ids.get(key[0])
        if ns is None:
            return {"host": 0}
        digests = None
        if self._caller_digests:
            if len(self._core.slots_of(ns, key[1])) <= min_pages:
                return {"host": 0}  # (the core's own early exit, before hashing the history here)
            digests = to_pairs(page_digests(tokens, start, length, self.config.page_size, seed))
        pages = self._core.match(ns, key[1], tokens, start, length, as_int64(seed), min_pages, digests)
        return {"host": pages}

    def version(self, key: Key) -> int:
        ns = self._ns_ids.get(key[0])
        return -1 if ns is None else self._core.version(ns, key[1])

    def _batched(self) -> bool:
        # NOTE: a subclass with its own match/version (TieredBackend: lower tiers) keeps the generic loop.
        cls = type(self)
        return cls.match is HostTier.match and cls.version is HostTier.version

    def versions(self, keys: list[Key]) -> list[int]:
        if not keys or not self._batched():
            return super().versions(keys)
        ns = self._ns_ids.get(keys[0][0])
        if ns is None or any(k[0] != keys[0][0] for k in keys):
            return super().versions(keys)
        return self._core.versions(ns, [k[1] for k in keys])

    def match_many(self, keys: list[Key], tokens: torch.Tensor, offsets: list[int], seed: int,
                   device_tokens: list[int], page_size: int) -> tuple[list[dict[str, int]], list[int]]:
        """`KVBackend.match_many` in one call into the C++ core (``HostCore::match_beyond``)."""
        if not keys or not self._batched() or any(k[0] != keys[0][0] for k in keys):
            return super().match_many(keys, tokens, offsets, seed, device_tokens, page_size)
        ns = self._ns_ids.get(keys[0][0])
        if ns is None:
            return [{} for _ in keys], [-1] * len(keys)
        digests = None
        if self._caller_digests:
            digests = to_pairs([d for b in range(len(keys)) for d in page_digests(
                tokens, offsets[b], offsets[b + 1] - offsets[b], self.config.page_size, seed)])
        pages, versions = self._core.match_many(ns, [k[1] for k in keys], list(offsets), tokens, as_int64(seed),
                                                list(device_tokens), digests)
        return [{"host": p} if p >= 0 else {} for p in pages], versions  # -1: the tier was not asked

    def acquire(self, key: Key, first_page: int, num_pages: int) -> torch.Tensor | None:
        ok, slots = self._core.acquire(self._ns(key), key[1], first_page, num_pages)
        return slots if ok else None

    def release(self, key: Key) -> None:
        self._core.release(self._ns(key), key[1])

    # ----------------------------------------------------------------- writing
    def stored_pages(self, key: Key, page_hashes: list[int]) -> int:
        ns = self._ns_ids.get(key[0])
        return 0 if ns is None else self._core.stored_pages(ns, key[1], to_pairs(page_hashes))

    def reserve(self, key: Key, first_page: int, page_hashes: list[int]) -> torch.Tensor | None:
        ok, slots, dropped, dropped_slots, dropped_hashes = self._core.reserve(
            self._ns(key), key[1], first_page, to_pairs(page_hashes))
        if ok:
            self._taken(slots)
        self._dropped(dropped, dropped_slots, dropped_hashes)
        return slots if ok else None

    def _taken(self, slots: torch.Tensor) -> None:
        """Slots a reservation took: their bytes are about to change (`slot_generations`)."""
        # NOTE: a Python loop over a stdlib array, not torch indexing: this runs on the commit's path.
        # With the torch form (and the staging moved to the workers) the write-through launch took
        # 0.5-0.8 ms longer on the H200 (docs/BENCHMARKS.md); a guess, not measured: each torch op lets
        # the tier's workers take the GIL.
        gen = self._slot_gen
        for i in slots.tolist():
            gen[i] += 1

    def slot_generations(self, slots: list[int], generations: array | None = None) -> list[int]:
        """The slots' generations (of ``generations``, default the table's now): bumped by each
        reservation that takes a slot, before the slot is written. Equal before and after reading
        published slots = the read is the published bytes. A reader keeps the array it started
        with: `bind` starts a new one with a new table."""
        gen = self._slot_gen if generations is None else generations
        return [gen[i] for i in slots]

    def reserve_write_through(self, core: torch.ScriptObject, core_ns: int,
                              keys: list[Key]) -> tuple[list[tuple[Key, int, torch.Tensor, torch.Tensor]], int]:
        """Reservations for the full pages of these users' device entries (``core``, a C++
        ``CacheCore``; namespace id ``core_ns``; ``keys`` of one namespace) that this tier does not
        hold yet, every reservation before any publish (``HostCore.reserve_write_through``, the
        C++ runner's too). Returns ``(key, first page, device pages, slots)`` per reservation and
        how many could not be had."""
        if not keys:
            return [], 0
        name = keys[0][0]
        users, firsts, pages, slots, dropped, dropped_slots, dropped_hashes, failed = (
            self._core.reserve_write_through(self._ns(keys[0]), core, core_ns, [k[1] for k in keys]))
        for s in slots:
            self._taken(s)
        self._dropped(dropped, dropped_slots, dropped_hashes)
        return [((name, u), f, p, s) for u, f, p, s in zip(users, firsts, pages, slots)], failed

    def _dropped(self, dropped: list[int], dropped_slots: list[torch.Tensor],
                 dropped_hashes: list[torch.Tensor]) -> None:
        # NOTE: the dropped users' slots may already be in a new reservation; their bytes stay put
        # until the caller copies into it, so the hook reads them now. The drop and the reservation
        # have happened: a failing hook (a spill to a lower tier) is logged, never undoes them.
        for i, (slots_i, hashes_i) in enumerate(zip(dropped_slots, dropped_hashes)):
            dropped_key = (self._ns_names[dropped[2 * i]], dropped[2 * i + 1])
            try:
                self._on_drop(dropped_key, slots_i.tolist(), from_pairs(hashes_i))
            except Exception:
                logger.warning("spilling host pages of user %s failed; they are dropped", dropped_key[1],
                               exc_info=True)

    def publish(self, key: Key, slots: torch.Tensor, ok: bool, num_ok: int | None = None,
                *, from_lower_tier: bool = False) -> None:
        """Make the reservation readable: all of it (``ok``), its first ``num_ok`` pages, or none.

        ``from_lower_tier``: the pages were read from a tier below (no write-back to it).
        """
        want = 0 if not ok else (slots.numel() if num_ok is None else num_ok)
        # NOTE: a user's reservations become readable in the order they were made: a write-through
        # completed before an older lower-tier fetch of the user waits for it (and this call may apply
        # older completions that waited for this one), each with its own ``from_lower_tier``.
        for first, done_slots, hashes, tag in self._core.complete(self._ns(key), key[1], slots.tolist(), want,
                                                                   int(from_lower_tier)):
            self._on_published(key, first, done_slots.tolist(), from_pairs(hashes), bool(tag))

    def _on_published(self, key: Key, first_page: int, slots: list[int], hashes: list[int],
                      from_lower_tier: bool) -> None:
        """Hook: pages ``first_page..`` of ``key`` just became readable in ``slots``."""

    def _on_drop(self, key: Key, slots: list[int], hashes: list[int]) -> None:
        """Hook: a reservation took these pages of ``key`` (LRU eviction); their bytes are intact
        until the caller writes the new reservation."""

    # ----------------------------------------------------------------- eviction
    def evict(self, key: Key) -> None:
        ns = self._ns_ids.get(key[0])
        if ns is not None:
            self._core.evict(ns, key[1])

    def clear(self, namespace: str | None = None) -> None:
        self._core.clear()  # (this process's memory: every namespace)

    # ----------------------------------------------------------------- introspection
    def lru_order(self) -> list[Key]:
        ns, users = self._core.lru_order()
        return [(self._ns_names[n], u) for n, u in zip(ns, users)]

    def pages_of(self, key: Key) -> list[int]:
        ns = self._ns_ids.get(key[0])
        return [] if ns is None else self._core.slots_of(ns, key[1])

    def stats(self) -> dict[str, Any]:
        used = self._num_slots - self._core.num_free()
        counters = [a + b for a, b in zip(self._counter_base, self._core.counters())]
        return {**dict(zip(_COUNTERS, counters)), "host_users": self._core.num_users(),
                "host_slots": self._num_slots, "host_slots_used": used}

    def check(self) -> None:
        err = self._core.check()
        assert not err, err
