"""The pinned host tier: the ``native`` backend.

Owns a pinned host table of page slots (``host_cache_bytes // page_bytes`` of them), which users'
full pages sit in, and the LRU over users that frees them. A user's host pages are always a
contiguous prefix of their history; writes are reserved, copied by the manager, then published in
the order they were reserved. It does not move bytes itself and knows nothing about device pages.
"""

from __future__ import annotations

import dataclasses
import logging
from array import array
from collections import OrderedDict, deque
from typing import Any

import torch

from gr_plugin.cache.backend import Key, KVBackend
from gr_plugin.cache.config import KVCacheConfig
from gr_plugin.cache.extents import ExtentAllocator
from gr_plugin.cache.hashing import longest_matching_prefix

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Reservation:
    slots: torch.Tensor
    hashes: list[int]
    doomed: bool = False


@dataclasses.dataclass
class _HostEntry:
    slots: array = dataclasses.field(default_factory=lambda: array("q"))
    hashes: list[int] = dataclasses.field(default_factory=list)
    pending: deque = dataclasses.field(default_factory=deque)  # of _Reservation, in write order
    pins: int = 0
    version: int = 0

    @property
    def busy(self) -> bool:
        return self.pins > 0 or bool(self.pending)


class HostTier(KVBackend):
    """Pinned host memory with LRU over users (the ``native`` backend)."""

    tier_names = ("host",)

    def __init__(self, pin_memory: bool | None = None) -> None:
        self._pin = pin_memory
        self._table: torch.Tensor | None = None
        self._entries: OrderedDict[Key, _HostEntry] = OrderedDict()
        self._free = ExtentAllocator(0)
        self._clock = 0
        self._counters = {"host_evicted_users": 0, "host_evicted_pages": 0, "host_reserve_failed": 0,
                          "host_pages_written": 0, "host_pages_read": 0}

    # ----------------------------------------------------------------- setup
    def bind(self, config: KVCacheConfig) -> None:
        self.config = config
        num_slots = config.num_host_slots
        if num_slots <= 0:
            raise ValueError(
                f"host tier needs host_cache_bytes >= one page ({config.page_bytes} bytes), "
                f"got {config.host_cache_bytes}"
            )
        device = config.torch_device
        pin = self._pin if self._pin is not None else device.type == "cuda"
        shape = (config.num_layers, num_slots, 2, config.page_size, config.num_heads, config.head_dim)
        old = self._table
        if old is not None and old.shape == shape and old.dtype == config.torch_dtype and (
                old.is_pinned() or not pin) and (old.device.type == "meta") == (device.type == "meta"):
            return  # storage fits as it is: keep what it holds
        if self._entries:
            raise ValueError("host tier storage can only be replaced while it is empty")
        # NOTE: empty, not zeros: only published slots are ever read, and zeroing GBs of pinned
        # memory would stall start-up. A cache built on the meta device holds no host memory.
        if device.type == "meta":
            self._table = torch.empty(shape, dtype=config.torch_dtype, device="meta")
        else:
            self._table = torch.empty(shape, dtype=config.torch_dtype, pin_memory=pin)
        self._free = ExtentAllocator(num_slots)
        self._num_slots = num_slots

    @property
    def host_table(self) -> torch.Tensor:
        assert self._table is not None, "HostTier.bind() was not called"
        return self._table

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def _tick(self, entry: _HostEntry) -> None:
        self._clock += 1
        entry.version = self._clock

    # ----------------------------------------------------------------- reading
    def match(
        self, key: Key, tokens: torch.Tensor, start: int, length: int, seed: int, min_pages: int = 0
    ) -> dict[str, int]:
        entry = self._entries.get(key)
        if entry is None or len(entry.hashes) <= min_pages:
            return {"host": 0}
        pages = longest_matching_prefix(entry.hashes, tokens, start, length, self.config.page_size, seed)
        return {"host": pages}

    def version(self, key: Key) -> int:
        entry = self._entries.get(key)
        return -1 if entry is None else entry.version

    def acquire(self, key: Key, first_page: int, num_pages: int) -> torch.Tensor | None:
        entry = self._entries.get(key)
        if entry is None or first_page + num_pages > len(entry.slots):
            return None
        entry.pins += 1
        self._entries.move_to_end(key)
        self._counters["host_pages_read"] += num_pages
        return torch.frombuffer(entry.slots, dtype=torch.int64)[first_page : first_page + num_pages].clone()

    def release(self, key: Key) -> None:
        entry = self._entries[key]
        assert entry.pins > 0, f"release of unpinned host entry {key}"
        entry.pins -= 1

    # ----------------------------------------------------------------- writing
    def stored_pages(self, key: Key, page_hashes: list[int]) -> int:
        entry = self._entries.get(key)
        if entry is None:
            return 0
        held = entry.hashes + [h for r in entry.pending for h in r.hashes]
        n = 0
        for a, b in zip(held, page_hashes):
            if a != b:
                break
            n += 1
        return n

    def reserve(self, key: Key, first_page: int, page_hashes: list[int]) -> torch.Tensor | None:
        n = len(page_hashes)
        entry = self._entries.get(key)
        held = 0 if entry is None else len(entry.hashes) + sum(len(r.hashes) for r in entry.pending)
        # A stored prefix longer than first_page diverges from the device's (the history was
        # edited): its stale tail is dropped, unless someone is reading or writing it.
        stale = held - first_page
        # Feasibility first, so a failed reserve changes nothing.
        enough = len(self._free) + max(stale, 0) >= n
        evictable = 0 if enough else sum(len(e.slots) for k, e in self._entries.items() if k != key and not e.busy)
        if (stale < 0 or (stale > 0 and entry.busy) or n > self._num_slots
                or len(self._free) + stale + evictable < n):
            self._counters["host_reserve_failed"] += 1
            return None
        if stale:
            self._truncate(entry, first_page)
        for k in list(self._entries):
            if len(self._free) >= n:
                break
            e = self._entries[k]
            if k != key and not e.busy:
                self._drop(k, e)
        if entry is None:
            entry = self._entries[key] = _HostEntry()
            self._tick(entry)
        slots = torch.tensor(self._free.alloc(n), dtype=torch.int64)
        entry.pending.append(_Reservation(slots, list(page_hashes)))
        self._entries.move_to_end(key)
        return slots

    def publish(self, key: Key, slots: torch.Tensor, ok: bool, num_ok: int | None = None,
                *, from_lower_tier: bool = False) -> None:
        """Make the reservation readable: all of it (``ok``), its first ``num_ok`` pages, or none.

        ``from_lower_tier``: the pages were read from a tier below (no write-back to it).
        """
        entry = self._entries[key]
        res = entry.pending.popleft()
        assert res.slots is slots, f"host publishes out of order for {key}"
        n = len(res.hashes)
        good = 0 if (not ok or res.doomed) else (n if num_ok is None else max(0, min(num_ok, n)))
        if good:
            first = len(entry.hashes)
            entry.slots.extend(res.slots[:good].tolist())
            entry.hashes.extend(res.hashes[:good])
            self._counters["host_pages_written"] += good
            self._tick(entry)
            self._on_published(key, first, res.slots[:good], res.hashes[:good], from_lower_tier)
        if good == n:
            return
        # NOTE: later reservations of this user would leave a hole in the prefix: they fail too.
        for later in entry.pending:
            later.doomed = True
        self._free.free(res.slots[good:].tolist())
        if not entry.slots and not entry.pending and entry.pins == 0:
            del self._entries[key]

    def _on_published(self, key: Key, first_page: int, slots: torch.Tensor, hashes: list[int],
                      from_lower_tier: bool) -> None:
        """Hook: pages ``first_page..`` of ``key`` just became readable in ``slots``."""

    def _on_drop(self, key: Key, slots: list[int], hashes: list[int]) -> None:
        """Hook: the host tier is about to free these pages of ``key`` (eviction)."""

    # ----------------------------------------------------------------- eviction
    def _truncate(self, entry: _HostEntry, num_pages: int) -> None:
        self._free.free(entry.slots[num_pages:])
        del entry.slots[num_pages:]
        del entry.hashes[num_pages:]
        self._tick(entry)

    def _drop(self, key: Key, entry: _HostEntry, *, spill: bool = True) -> None:
        self._counters["host_evicted_users"] += 1
        self._counters["host_evicted_pages"] += len(entry.slots)
        if spill and entry.slots:
            self._on_drop(key, list(entry.slots), list(entry.hashes))
        self._free.free(entry.slots)
        del self._entries[key]

    def evict(self, key: Key) -> None:
        entry = self._entries.get(key)
        if entry is None:
            return
        if entry.busy:
            raise ValueError(f"user {key[1]} is being read or written in the host tier; cannot evict now")
        self._drop(key, entry, spill=False)

    def clear(self) -> None:
        busy = [k for k, e in self._entries.items() if e.busy]
        if busy:
            raise ValueError(f"host tier has in-flight users {[k[1] for k in busy]}; flush first")
        for k in list(self._entries):
            self._drop(k, self._entries[k], spill=False)

    # ----------------------------------------------------------------- introspection
    def lru_order(self) -> list[Key]:
        return list(self._entries)

    def pages_of(self, key: Key) -> list[int]:
        entry = self._entries.get(key)
        return [] if entry is None else list(entry.slots)

    def stats(self) -> dict[str, Any]:
        used = self._num_slots - len(self._free)
        return {**self._counters, "host_users": len(self._entries), "host_slots": self._num_slots,
                "host_slots_used": used}

    def check(self) -> None:
        seen: set[int] = set()
        for key, e in self._entries.items():
            assert len(e.slots) == len(e.hashes), f"host entry {key}: slots/hashes differ"
            owned = list(e.slots) + [s for r in e.pending for s in r.slots.tolist()]
            for s in owned:
                assert 0 <= s < self._num_slots, f"host slot {s} out of range"
                assert s not in seen, f"host slot {s} owned twice"
                seen.add(s)
            assert e.pins >= 0
        free_list = self._free.free_slots()
        free = set(free_list)
        assert len(free) == len(free_list) == self._free.num_free, "host free list has duplicates"
        assert not (free & seen), f"host slots both free and owned: {sorted(free & seen)[:8]}"
        assert len(free) + len(seen) == self._num_slots, (
            f"host slots leaked: {self._num_slots - len(free) - len(seen)}"
        )
