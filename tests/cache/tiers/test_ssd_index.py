"""The SSD index alone: contiguous prefixes, exact LRU eviction order, pins, zombies, failed writes."""

from __future__ import annotations

import random

from gr_plugin.cache.tiers.ssd_index import SlotIndex

from .helpers import page_hash, user_keys


def put(index: SlotIndex, keys, ok=None) -> list[bool]:
    plan = index.plan_put(keys)
    written = {p: True if ok is None else ok(p) for p, _ in plan.writes}
    results = index.finish_put(plan, written)
    index.check()
    return results


def test_prefix_rule_and_divergence():
    index = SlotIndex(16)
    assert put(index, user_keys(1, 3, first=1)) == [False, False]  # no page 0: a hole
    assert index.lru_order() == []
    keys = user_keys(1, 4)
    assert put(index, keys[::-1]) == [True] * 4  # order within a call does not matter
    assert index.match(("ns", 1), [k.page_hash for k in keys] + [0]) == 4
    assert put(index, keys[:2]) == [True, True]  # already stored: no write
    assert index.stats()["slots_free"] == 12
    edited = user_keys(1, 3, first=2, version=1)  # page 2 onwards differs: drop the stale suffix
    assert put(index, edited) == [True]
    assert index.match(("ns", 1), [k.page_hash for k in keys]) == 2
    assert index.match(("ns", 1), [k.page_hash for k in keys[:2] + edited]) == 3
    assert index.stats()["slots_free"] == 13


def test_lru_eviction_order_is_exact():
    index = SlotIndex(6)
    for user in (1, 2, 3):
        assert put(index, user_keys(user, 2)) == [True, True]
    found = index.pin(user_keys(1, 1))  # a read makes user 1 the most recent
    for f in found:
        index.unpin(*f)
    assert index.lru_order() == [("ns", 2), ("ns", 3), ("ns", 1)]
    assert put(index, user_keys(4, 2)) == [True, True]
    assert index.lru_order() == [("ns", 3), ("ns", 1), ("ns", 4)]
    assert index.counters["evicted_users"] == 1
    assert put(index, user_keys(5, 4)) == [True] * 4  # evicts 3, then 1
    assert index.lru_order() == [("ns", 4), ("ns", 5)]
    assert index.counters == {"evicted_users": 3, "evicted_pages": 6, "dropped_pages": 0}
    # more pages than the store holds: the leading ones that fit are stored
    assert put(index, user_keys(6, 7)) == [True] * 6 + [False]
    assert index.lru_order() == [("ns", 6)]


def test_users_being_read_or_written_are_not_evicted():
    index = SlotIndex(4)
    put(index, user_keys(1, 2))
    put(index, user_keys(2, 2))
    pins = index.pin(user_keys(1, 2))  # user 1 is being read
    for f in index.pin(user_keys(2, 1)):  # ... and user 2 read since: user 1 is the least recent
        index.unpin(*f)
    assert index.lru_order() == [("ns", 1), ("ns", 2)]
    assert put(index, user_keys(3, 2)) == [True, True]  # evicts 2, not 1
    assert index.lru_order() == [("ns", 1), ("ns", 3)]
    plan = index.plan_put(user_keys(3, 4))  # user 3 being written: cannot be a victim either
    assert plan.results == [True, True, False, False]  # pages 2, 3: nothing evictable
    index.finish_put(plan, {})
    for f in pins:
        index.unpin(*f)
    index.check()


def test_slot_freed_while_read_is_reused_only_after_unpin():
    index = SlotIndex(2)
    put(index, user_keys(1, 2))
    pins = index.pin(user_keys(1, 2))
    index.evict_user(("ns", 1))
    assert index.stats()["slots_zombie"] == 2
    assert put(index, user_keys(2, 1)) == [False]  # no slot: both are still being read
    for f in pins:
        index.unpin(*f)
    assert index.stats()["slots_free"] == 2
    assert put(index, user_keys(2, 1)) == [True]


def test_failed_write_publishes_only_the_leading_pages():
    index = SlotIndex(8)
    keys = user_keys(1, 5)
    results = put(index, keys, ok=lambda p: p != 2)
    assert results == [True, True, False, False, False]
    assert index.match(("ns", 1), [k.page_hash for k in keys]) == 2
    assert index.stats()["slots_free"] == 6


def test_concurrent_put_for_a_writing_user_is_refused_and_evict_during_write_publishes_nothing():
    index = SlotIndex(8)
    put(index, user_keys(1, 1))
    plan = index.plan_put(user_keys(1, 3))
    assert plan.results == [True, None, None]
    assert index.plan_put(user_keys(1, 4)).results == [True, False, False, False]
    index.evict_user(("ns", 1))
    assert index.finish_put(plan, {p: True for p, _ in plan.writes}) == [True, False, False]
    assert index.lru_order() == []
    index.check()
    assert index.stats()["slots_free"] == 8


def test_dropping_a_page_drops_the_pages_after_it():
    index = SlotIndex(8)
    keys = user_keys(1, 4)
    put(index, keys)
    pins = index.pin(keys)
    entry, slot = pins[1]
    assert index.drop(keys[1], entry, slot) == 3
    assert index.drop(keys[1], entry, slot) == 0  # idempotent
    for f in pins:
        index.unpin(*f)
    index.check()
    assert index.match(("ns", 1), [k.page_hash for k in keys]) == 1
    assert index.stats()["slots_free"] == 7


def test_random_operations_keep_the_accounting():
    rng = random.Random(0)
    index = SlotIndex(20)
    pinned = []
    for _ in range(2000):
        op = rng.random()
        user = rng.randrange(8)
        if op < 0.5:
            n = rng.randrange(1, 7)
            keys = user_keys(user, n, version=rng.randrange(2))
            plan = index.plan_put(rng.sample(keys, len(keys)))
            index.finish_put(plan, {p: rng.random() < 0.9 for p, _ in plan.writes})
        elif op < 0.7:
            found = index.pin(user_keys(user, rng.randrange(1, 7)))
            pinned += [f for f in found if f is not None]
        elif op < 0.85 and pinned:
            index.unpin(*pinned.pop(rng.randrange(len(pinned))))
        elif op < 0.95:
            index.evict_user(("ns", user))
        else:
            index.match(("ns", user), [page_hash(user, i) for i in range(6)])
        index.check()
    for f in pinned:
        index.unpin(*f)
    index.clear()
    index.check()
    assert index.stats()["slots_free"] == 20
