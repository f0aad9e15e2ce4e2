"""In-memory index of the SSD store: which slot holds which page, LRU over users, free slots.

Owns `SlotIndex`: per user the slots of a contiguous prefix of pages (published, readable) and of
the pages being written by one put in flight; the LRU order of users; the free slots (lowest first,
so a batch lands in adjacent slots and its I/O coalesces); read pins and "zombie" slots (freed
while a read still uses them, reused only once it is done). It does no I/O and no locking: the
store calls it under its lock. Counters name evictions; the store owns the I/O stats.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import OrderedDict
from typing import Any

from gr_plugin.cache.tiers.types import PageKey

UserKey = tuple[str, int]


@dataclasses.dataclass(eq=False)
class UserPages:
    """Pages of one user: ``slots[i]`` holds page ``i`` (prefix hash ``hashes[i]``); the pages
    after them are being written (``pending_*``) by the one put in flight."""

    slots: list[int] = dataclasses.field(default_factory=list)
    hashes: list[int] = dataclasses.field(default_factory=list)
    pending_slots: list[int] = dataclasses.field(default_factory=list)
    pending_hashes: list[int] = dataclasses.field(default_factory=list)
    readers: int = 0  # pins held by reads in flight on this user's pages
    writing: bool = False
    detached: bool = False  # evicted or cleared while written: the put in flight publishes nothing
    doomed: bool = False  # truncated while written: its pending pages would leave a hole

    @property
    def busy(self) -> bool:
        return self.readers > 0 or self.writing


@dataclasses.dataclass
class PutPlan:
    """What a put does: ``results[i]`` is final unless ``None`` (page ``i`` is written to its slot in
    ``writes``); ``finish_put`` fills the rest."""

    results: list[bool | None]
    writes: list[tuple[int, int]]  # (key position, slot), in no particular order
    users: list[tuple[UserKey, UserPages, list[int]]]  # per writing user: key positions in page order
    aliases: list[tuple[int, int]]  # (key position, position of the same page earlier in this call)


class SlotIndex:
    """Bookkeeping of ``num_slots`` page slots; not thread-safe (the store holds a lock)."""

    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"SlotIndex needs num_slots > 0, got {num_slots}")
        self.num_slots = num_slots
        self._users: OrderedDict[UserKey, UserPages] = OrderedDict()
        self._free = list(range(num_slots))  # a heap; sorted is a valid heap
        self._pins: dict[int, int] = {}
        self._zombies: set[int] = set()
        self._in_flight: set[int] = set()  # slots reserved by puts in flight (attached or not)
        self.counters = {"evicted_users": 0, "evicted_pages": 0, "dropped_pages": 0}

    # ----------------------------------------------------------------- slots
    def _free_slot(self, slot: int) -> None:
        if self._pins.get(slot):
            self._zombies.add(slot)  # NOTE: a read in flight still reads it; reuse after unpin
        else:
            heapq.heappush(self._free, slot)

    def _take_slot(self, keep: UserPages) -> int | None:
        while not self._free:
            if not self._evict_lru(keep):
                return None
        return heapq.heappop(self._free)

    def _evict_lru(self, keep: UserPages) -> bool:
        for user, entry in self._users.items():
            if entry is keep or entry.busy:
                continue
            self.counters["evicted_users"] += 1
            self.counters["evicted_pages"] += len(entry.slots)
            self._remove(user, entry)
            return True
        return False

    def _remove(self, user: UserKey, entry: UserPages) -> None:
        del self._users[user]
        self._truncate(entry, 0)
        if entry.writing:
            entry.detached = True

    def _truncate(self, entry: UserPages, num_pages: int) -> int:
        dropped = entry.slots[num_pages:]
        for slot in dropped:
            self._free_slot(slot)
        del entry.slots[num_pages:]
        del entry.hashes[num_pages:]
        if dropped and entry.writing:
            entry.doomed = True
        return len(dropped)

    # ----------------------------------------------------------------- writing
    def plan_put(self, keys: list[PageKey]) -> PutPlan:
        """Decide, for each key, whether it is already stored, rejected, or written to a new slot.

        Page ``i`` of a user is accepted only if pages ``0..i-1`` are stored or in this call; a
        stored page with another hash (an edited history) drops the stored pages from there on.
        A user with a put in flight accepts nothing new. Slots come from the free list, then from
        evicting least-recently-used users that no read or write is using.
        """
        plan = PutPlan([None] * len(keys), [], [], [])
        by_user: dict[UserKey, list[int]] = {}
        for pos, key in enumerate(keys):
            by_user.setdefault(key.user, []).append(pos)
        for user, positions in by_user.items():
            positions.sort(key=lambda p: keys[p].page_index)
            entry = self._users.get(user)
            if entry is None:
                entry = self._users[user] = UserPages()
            self._users.move_to_end(user)
            if entry.writing:
                for p in positions:
                    i = keys[p].page_index
                    plan.results[p] = i < len(entry.hashes) and entry.hashes[i] == keys[p].page_hash
                continue
            written: list[int] = []
            first_pos: dict[int, int] = {}
            rejected = False
            for p in positions:
                key = keys[p]
                i = key.page_index
                held = len(entry.hashes)
                if not rejected and i < held:
                    if entry.hashes[i] == key.page_hash:
                        plan.results[p] = True
                        continue
                    self._truncate(entry, i)  # NOTE: stale suffix of an edited history
                    held = i
                elif not rejected and i < held + len(entry.pending_hashes):
                    if entry.pending_hashes[i - held] == key.page_hash:
                        plan.aliases.append((p, first_pos[i]))
                        continue
                    rejected = True  # the same page twice in one call, with two hashes
                if rejected or i != held + len(entry.pending_hashes):
                    plan.results[p] = False
                    rejected = True
                    continue
                slot = self._take_slot(entry)
                if slot is None:
                    plan.results[p] = False
                    rejected = True
                    continue
                entry.pending_slots.append(slot)
                entry.pending_hashes.append(key.page_hash)
                self._in_flight.add(slot)
                first_pos[i] = p
                written.append(p)
                plan.writes.append((p, slot))
            if written:
                entry.writing = True
                plan.users.append((user, entry, written))
            elif not entry.slots:
                del self._users[user]
        return plan

    def finish_put(self, plan: PutPlan, written_ok: dict[int, bool]) -> list[bool]:
        """Publish the written pages of ``plan``: per user the leading ones whose write succeeded
        (``written_ok[key position]``); the rest give their slots back."""
        results = plan.results
        for user, entry, positions in plan.users:
            publish = 0
            if not (entry.detached or entry.doomed):
                while publish < len(positions) and written_ok.get(positions[publish], False):
                    publish += 1
            for j, p in enumerate(positions):
                results[p] = j < publish
            entry.slots.extend(entry.pending_slots[:publish])
            entry.hashes.extend(entry.pending_hashes[:publish])
            for slot in entry.pending_slots:
                self._in_flight.discard(slot)
            for slot in entry.pending_slots[publish:]:
                self._free_slot(slot)
            entry.pending_slots.clear()
            entry.pending_hashes.clear()
            entry.writing = entry.doomed = False
            if not entry.slots and not entry.detached and self._users.get(user) is entry:
                del self._users[user]
        for p, first in plan.aliases:
            results[p] = results[first]
        assert all(r is not None for r in results), "finish_put left a page undecided"
        return results  # type: ignore[return-value]

    # ----------------------------------------------------------------- reading
    def pin(self, keys: list[PageKey]) -> list[tuple[UserPages, int] | None]:
        """Slots of the keys that are stored (``None`` for the others), pinned until ``unpin``; a
        pinned user is not evicted and its freed slots are not reused while pinned."""
        found: list[tuple[UserPages, int] | None] = []
        touched: set[UserKey] = set()
        for key in keys:
            entry = self._users.get(key.user)
            i = key.page_index
            if entry is None or i >= len(entry.slots) or entry.hashes[i] != key.page_hash:
                found.append(None)
                continue
            slot = entry.slots[i]
            entry.readers += 1
            self._pins[slot] = self._pins.get(slot, 0) + 1
            found.append((entry, slot))
            if key.user not in touched:
                touched.add(key.user)
                self._users.move_to_end(key.user)
        return found

    def unpin(self, entry: UserPages, slot: int) -> None:
        entry.readers -= 1
        left = self._pins[slot] - 1
        if left:
            self._pins[slot] = left
            return
        del self._pins[slot]
        if slot in self._zombies:
            self._zombies.discard(slot)
            heapq.heappush(self._free, slot)

    def drop(self, key: PageKey, entry: UserPages, slot: int) -> int:
        """Forget a page that failed verification and the pages after it (the prefix stays
        contiguous); returns how many pages were dropped."""
        i = key.page_index
        if self._users.get(key.user) is not entry or i >= len(entry.slots) or entry.slots[i] != slot:
            return 0  # already replaced or dropped by someone else
        n = self._truncate(entry, i)
        self.counters["dropped_pages"] += n
        if not entry.slots and not entry.writing:
            del self._users[key.user]
        return n

    def match(self, user: UserKey, page_hashes: list[int]) -> int:
        entry = self._users.get(user)
        if entry is None:
            return 0
        n = 0
        for stored, wanted in zip(entry.hashes, page_hashes):
            if stored != wanted:
                break
            n += 1
        return n

    # ----------------------------------------------------------------- eviction
    def evict_user(self, user: UserKey) -> None:
        entry = self._users.get(user)
        if entry is not None:
            self._remove(user, entry)

    def clear(self) -> None:
        for user in list(self._users):
            self._remove(user, self._users[user])

    # ----------------------------------------------------------------- introspection
    def lru_order(self) -> list[UserKey]:
        """Users, least recently used first."""
        return list(self._users)

    def slot_of(self, key: PageKey) -> int | None:
        """The slot of a stored page, or ``None`` (no pin, no LRU touch)."""
        entry = self._users.get(key.user)
        i = key.page_index
        if entry is None or i >= len(entry.slots) or entry.hashes[i] != key.page_hash:
            return None
        return entry.slots[i]

    def slots_of(self, user: UserKey) -> list[int]:
        entry = self._users.get(user)
        return [] if entry is None else list(entry.slots)

    def stats(self) -> dict[str, Any]:
        return {
            **self.counters,
            "users": len(self._users),
            "pages_stored": sum(len(e.slots) for e in self._users.values()),
            "slots_total": self.num_slots,
            "slots_free": len(self._free),
            "slots_writing": len(self._in_flight),
            "slots_zombie": len(self._zombies),
        }

    def check(self) -> None:
        """Assert that every slot is exactly one of: free, zombie, stored, being written."""
        owned: set[int] = set()
        for user, e in self._users.items():
            assert len(e.slots) == len(e.hashes), f"ssd index {user}: slots/hashes differ"
            assert len(e.pending_slots) == len(e.pending_hashes), f"ssd index {user}: pending differ"
            assert e.readers >= 0 and not e.detached, f"ssd index {user}: bad state {e}"
            assert e.slots or e.writing or e.readers, f"ssd index {user}: empty entry kept"
            for s in e.slots:
                assert 0 <= s < self.num_slots and s not in owned, f"ssd slot {s} out of range or owned twice"
                owned.add(s)
        free = set(self._free)
        assert len(free) == len(self._free), "ssd free list has duplicates"
        parts = [free, self._zombies, owned, self._in_flight]
        assert sum(map(len, parts)) == self.num_slots == len(set().union(*parts)), (
            f"ssd slots leaked or shared: free {len(free)}, zombie {len(self._zombies)}, stored {len(owned)}, "
            f"writing {len(self._in_flight)}, total {self.num_slots}"
        )
        assert all(s in self._pins for s in self._zombies), "ssd zombie slot without a pin"
