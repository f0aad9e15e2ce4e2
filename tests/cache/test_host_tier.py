"""The pinned host tier's Python layer over the C++ ``HostCore`` (its policy is exercised end to end
by test_manager / test_properties / test_tiered): hooks, bounds, counters across a rebind."""

import pytest
import torch

from gr_plugin.cache import HostTier, KVCacheConfig
from gr_plugin.cache.hashing import to_pairs


def _tier(slots: int = 4, cls=HostTier) -> HostTier:
    cfg = KVCacheConfig(num_layers=1, num_heads=1, head_dim=4, page_size=2, num_pages=8, device="cpu")
    cfg.host_cache_bytes = slots * cfg.page_bytes
    tier = cls(pin_memory=False)
    tier.bind(cfg)
    return tier


def _store(tier: HostTier, user: int, hashes: list[int]) -> torch.Tensor:
    slots = tier.reserve(("ns", user), 0, hashes)
    tier.publish(("ns", user), slots, True)
    return slots


def test_a_failing_drop_hook_keeps_the_reservation_and_the_accounting():
    class Spilling(HostTier):
        def _on_drop(self, key, slots, hashes):
            raise OSError("disk full")

    tier = _tier(4, Spilling)
    _store(tier, 1, [11, 12, 13])
    slots = tier.reserve(("ns", 2), 0, [21, 22])  # drops user 1 (LRU); its spill fails
    assert slots is not None and tier.pages_of(("ns", 1)) == []
    tier.publish(("ns", 2), slots, True)
    tier.check()
    assert tier.pages_of(("ns", 2)) == slots.tolist() and tier.stats()["host_evicted_users"] == 1
    tier.evict(("ns", 2))  # not stuck busy
    assert tier.num_free_slots == 4


def test_unknown_keys_read_as_empty_and_register_nothing():
    tier = _tier()
    tokens = torch.arange(8, dtype=torch.int64)
    key = ("other", 5)
    assert tier.match(key, tokens, 0, 8, 7) == {"host": 0} and tier.version(key) == -1
    assert tier.pages_of(key) == [] and tier.stored_pages(key, [1, 2]) == 0
    tier.evict(key)
    assert tier._ns_ids == {}


def test_acquire_out_of_range_is_a_miss_not_a_pin():
    tier = _tier()
    _store(tier, 1, [11, 12])
    assert tier.acquire(("ns", 1), 2**62, 2**62) is None and tier.acquire(("ns", 1), 1, 2) is None
    assert tier.stats()["host_pages_read"] == 0
    tier.evict(("ns", 1))  # no pin was taken


def test_counters_survive_a_rebind_that_replaces_storage():
    tier = _tier(4)
    _store(tier, 1, [11, 12])
    tier.evict(("ns", 1))
    written = tier.stats()["host_pages_written"]
    cfg = KVCacheConfig(num_layers=1, num_heads=1, head_dim=4, page_size=2, num_pages=8, device="cpu")
    cfg.host_cache_bytes = 6 * cfg.page_bytes
    tier.bind(cfg)  # a new table and core (it was empty)
    assert tier.stats()["host_pages_written"] == written == 2 and tier.stats()["host_slots"] == 6


def test_core_rejects_bad_hash_shapes():
    tier = _tier()
    with pytest.raises(ValueError, match=r"hashes must have shape \[n, 2\]"):
        tier._core.reserve(0, 1, 0, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="must be a contiguous int64 CPU tensor"):
        tier._core.stored_pages(0, 1, to_pairs([1, 2]).float())
    assert tier.stats()["host_reserve_failed"] == 0 and tier.num_free_slots == 4


def test_match_many_equals_per_user_matching_with_and_without_caller_digests():
    tier = _tier(8)
    tokens = torch.arange(20, dtype=torch.int64).view(10, 2)  # users 1 and 2, 5 rows each (page 2)
    from gr_plugin.cache.hashing import page_digests

    seed = 7
    for user, start in ((1, 0), (2, 5)):
        hashes = page_digests(tokens, start, 5, 2, seed)  # 2 full pages
        slots = tier.reserve(("ns", user), 0, hashes[:1] if user == 2 else hashes)
        tier.publish(("ns", user), slots, True)
    keys, offsets = [("ns", 1), ("ns", 2), ("ns", 3)], [0, 5, 10, 10]
    expect = ([{"host": 2}, {"host": 1}, {}], [tier.version(k) for k in keys])
    for device_tokens, want in (([0, 0, 0], expect), ([4, 0, 0], ([{}, {"host": 1}, {}], expect[1]))):
        got = tier.match_many(keys, tokens, offsets, seed, device_tokens, 2)
        generic = HostTier.__mro__[1].match_many(tier, keys, tokens, offsets, seed, device_tokens, 2)
        assert got == generic == want
        tier._caller_digests = True  # the path of a core built without libxxhash
        assert tier.match_many(keys, tokens, offsets, seed, device_tokens, 2) == want
        tier._caller_digests = False
    assert tier.versions(keys) == expect[1] and expect[1][2] == -1


def test_every_reservation_bumps_the_generations_of_the_slots_it_takes():
    tier = _tier(4)
    s1 = _store(tier, 1, [11, 12, 13]).tolist()
    assert tier.slot_generations(s1) == [1, 1, 1]
    before = tier.slot_generations(range(4))
    assert tier.reserve(("ns", 3), 0, [31, 32, 33, 34, 35]) is None  # more than the tier: refused...
    assert tier.slot_generations(range(4)) == before  # ...and nothing bumped
    s2 = tier.reserve(("ns", 2), 0, [21, 22, 23]).tolist()  # drops user 1 (LRU) and takes its slots
    assert set(s2) & set(s1)
    assert tier.slot_generations(s2) == [before[i] + 1 for i in s2]


def test_the_write_through_reservation_bumps_the_generations_too():
    from gr_plugin.cache import KVCacheManager

    from .helpers import history_tokens, run_step, tiny_config

    cfg = tiny_config(num_pages=12, host_cache_bytes=6 * tiny_config().page_bytes)
    m = KVCacheManager(cfg, HostTier(pin_memory=False))
    run_step(m, [1], [history_tokens(1, 16)])  # commit: 4 full pages written through to 4 host slots
    m.offload_flush()
    slots = m.backend.pages_of(("test", 1))
    assert len(slots) == 4 and m.backend.slot_generations(slots) == [1] * 4
