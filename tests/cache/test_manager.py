"""Exact behaviour of KVCacheManager: page ids, hits, eviction order, rollback, bad input."""

import pytest
import torch

from gr_plugin.cache import CacheRequest, HostTier, KVCacheManager, UserInFlightError

from .helpers import finish_step, history_tokens, run_step, tiny_config


def make(num_pages=16, host_pages=0, **kw):
    cfg = tiny_config(num_pages=num_pages, host_cache_bytes=host_pages * tiny_config().page_bytes, **kw)
    return KVCacheManager(cfg, HostTier() if host_pages else None)


def test_first_visit_misses_then_returning_user_hits_with_exact_pages():
    m = make()
    lk, plan = run_step(m, [7], [history_tokens(7, 10)])
    assert lk.cached_tokens == [0] and plan.new_lengths == [10]
    assert m.pages_of(7) == [0, 1, 2]  # the lowest free run: deterministic ids
    lk, plan = run_step(m, [7], [history_tokens(7, 13)])
    assert lk.device_tokens == [10] and plan.cached_lengths == [10] and plan.new_lengths == [3]
    # the partial tail page 2 is reused in place; one new page
    assert plan.metadata.new_token_slots.tolist() == [2 * 4 + 2, 2 * 4 + 3, 3 * 4 + 0]
    assert m.pages_of(7) == [0, 1, 2, 3]
    assert m.cached_length(7) == 13
    m.check()


def test_same_history_again_is_a_full_hit_with_nothing_to_compute():
    m = make()
    run_step(m, [1], [history_tokens(1, 8)])
    _lk, plan = run_step(m, [1], [history_tokens(1, 8)])
    assert plan.cached_lengths == [8] and plan.metadata.num_new_tokens == 0
    assert m.counters.tokens_computed == 8 and m.counters.tokens_reused_device == 8


def test_edited_history_is_a_partial_hit_never_a_false_one():
    m = make()
    run_step(m, [1], [history_tokens(1, 14)])
    edited = history_tokens(1, 16, edit_at=9)  # page 2 (tokens 8..11) differs
    lk, plan = run_step(m, [1], [edited])  # run_step checks every value read back
    assert lk.device_tokens == [8] and plan.new_lengths == [8]
    m.check()
    # the old pages after the edit were released at commit
    assert len(m.pages_of(1)) == 4


def test_shorter_history_reuses_whole_pages_only():
    m = make()
    run_step(m, [1], [history_tokens(1, 14)])
    lk, plan = run_step(m, [1], [history_tokens(1, 10)])
    assert lk.device_tokens == [8] and plan.new_lengths == [2]
    assert m.cached_length(1) == 10


def test_namespace_change_never_reads_other_namespace():
    m = make()
    run_step(m, [1], [history_tokens(1, 8)])
    m.set_namespace("v2")
    lk, _ = run_step(m, [1], [history_tokens(1, 8)])
    assert lk.cached_tokens == [0]
    m.set_namespace("test")
    lk, _ = run_step(m, [1], [history_tokens(1, 8)], outcome="none")
    assert lk.cached_tokens == [8]


def test_lru_eviction_order_is_exact_and_skips_batch_users():
    m = make(num_pages=8)
    for u in (1, 2, 3):
        run_step(m, [u], [history_tokens(u, 8)])  # 2 pages each
    run_step(m, [1], [history_tokens(1, 8)])  # touch 1: order 2, 3, 1
    assert m.lru_order() == [2, 3, 1]
    # user 4 needs 4 pages, 2 free: evicts 2 (LRU) only
    run_step(m, [4], [history_tokens(4, 16)])
    assert m.lru_order() == [3, 1, 4]
    assert m.counters.evicted_users == 1
    # user 3 (LRU) grows by 4 pages: 0 free, evicting 3 itself is not allowed -> 1 then 4 go
    run_step(m, [3], [history_tokens(3, 24)])
    assert m.lru_order() == [3]
    m.check()


def test_pinned_users_are_never_evicted_and_too_big_returns_none_unchanged():
    m = make(num_pages=6)
    run_step(m, [1], [history_tokens(1, 8)])
    _, held = run_step(m, [2], [history_tokens(2, 8)], outcome="none")  # in flight: pinned
    # needs 4 pages: 2 free + user 1's 2 evictable = 4 -> fits by evicting 1
    _, plan = run_step(m, [3], [history_tokens(3, 16)], outcome="none")
    assert plan is not None and m.lru_order() == [2, 3]
    m.abort(plan)
    # now 4 free + nothing evictable (2 is pinned): 5 pages do not fit -> None, nothing changed
    before = (m.lru_order(), m.stats()["device_pages_free"])
    _lk, plan = run_step(m, [4], [history_tokens(4, 20)])
    assert plan is None and m.counters.alloc_failures == 1
    assert (m.lru_order(), m.stats()["device_pages_free"]) == before
    # more pages than exist at all -> None
    assert run_step(m, [5], [history_tokens(5, 4 * 7)])[1] is None
    m.commit(held)
    m.check()


def test_abort_rolls_back_pages_and_entries():
    m = make()
    run_step(m, [1], [history_tokens(1, 6)])
    free_before, pages_before = m.stats()["device_pages_free"], m.pages_of(1)
    run_step(m, [1, 2], [history_tokens(1, 13), history_tokens(2, 5)], outcome="abort")
    assert m.stats()["device_pages_free"] == free_before
    assert m.pages_of(1) == pages_before and m.cached_length(1) == 6
    assert m.cached_length(2) == 0 and 2 not in m.lru_order()
    # the tail slots written by the aborted step are not visible: values still read back exactly
    lk, _ = run_step(m, [1], [history_tokens(1, 9)])
    assert lk.device_tokens == [6]
    m.check()


def test_user_in_two_steps_at_once_is_refused_without_changes():
    m = make()
    _, plan = run_step(m, [1], [history_tokens(1, 4)], outcome="none")
    req = CacheRequest([2, 1], [4, 4], torch.cat([history_tokens(2, 4), history_tokens(1, 4)]))
    free = m.stats()["device_pages_free"]
    with pytest.raises(UserInFlightError, match="user 1"):
        m.allocate(m.lookup(req))
    assert m.stats()["device_pages_free"] == free and m.lru_order() == [1]
    with pytest.raises(ValueError, match="in-flight"):
        m.evict([1])
    m.commit(plan)
    with pytest.raises(ValueError, match="not in flight"):
        m.commit(plan)
    m.check()


def test_evict_and_evict_all():
    m = make(host_pages=8)
    run_step(m, [1, 2], [history_tokens(1, 8), history_tokens(2, 8)])
    assert m.evict([1, 99]) == 1
    assert m.lru_order() == [2]
    lk, _ = run_step(m, [1], [history_tokens(1, 8)], outcome="none")
    assert lk.device_tokens == [0] and lk.cached_tokens == [8]  # still in the host tier
    m.abort(_)
    m.evict([1], all_tiers=True)
    assert m.lookup(CacheRequest([1], [8], history_tokens(1, 8))).cached_tokens == [0]
    m.evict_all(all_tiers=True)
    assert m.lru_order() == [] and m.stats()["device_pages_free"] == 16
    assert m.stats()["host_slots_used"] == 0
    m.check()


def test_host_tier_round_trip_onboards_exact_bytes_layerwise():
    m = make(num_pages=8, host_pages=16)
    run_step(m, [1], [history_tokens(1, 15)])  # 3 full pages written through
    m.offload_flush()
    assert m.counters.offload_pages == 3
    m.evict([1])
    lk, plan = run_step(m, [1], [history_tokens(1, 18)])  # values checked after each layer's wait
    assert lk.device_tokens == [0] and lk.tier_tokens["host"] == [12]
    assert plan.onboard_tokens == [12] and plan.new_lengths == [6]
    assert m.counters.onboard_pages == 3 and m.counters.tokens_reused_host == 12
    m.offload_flush()
    m.check()


def test_a_plan_whose_host_pages_were_never_onboarded_cannot_be_committed():
    m = make(num_pages=8, host_pages=16)
    run_step(m, [1], [history_tokens(1, 15)])
    m.offload_flush()
    m.evict([1])
    plan = m.allocate(m.lookup(CacheRequest([1], [18], history_tokens(1, 18))))
    assert plan.onboard_tokens == [12]
    with pytest.raises(ValueError, match=f"plan {plan.plan_id} has host-tier pages that were never onboarded"):
        m.commit(plan)
    m.abort(plan)  # still live: the refusal changed nothing; the abort gives the host pages back
    assert m.cached_length(1) == 0 and m.backend.num_free_slots == 16 - 3
    m.backend.evict(("test", 1))  # not pinned any more
    m.check()


def test_host_tier_with_device_prefix_onboards_only_the_missing_pages():
    m = make(num_pages=8, host_pages=16)
    run_step(m, [1], [history_tokens(1, 16)])
    m.offload_flush()
    m.evict([1])
    # re-seed the device with just the first page, then ask for more: pages 1..3 come from host
    run_step(m, [1], [history_tokens(1, 4)])
    m.offload_flush()
    lk, plan = run_step(m, [1], [history_tokens(1, 17)])
    assert lk.device_tokens == [4] and lk.cached_tokens == [16]
    assert plan.device_tokens == [4] and plan.onboard_tokens == [12]
    m.check()


@pytest.mark.parametrize(
    ("users", "lengths", "rows", "match"),
    [
        ([], [], 0, "empty batch"),
        ([1, 1], [2, 2], 4, "more than once"),
        ([1, 2], [2], 2, "history_lengths has 1"),
        ([1], [-1], 0, "negative history length -1"),
        ([1], [3], 4, "4 rows"),
    ],
)
def test_bad_requests_raise_and_change_nothing(users, lengths, rows, match):
    m = make()
    run_step(m, [5], [history_tokens(5, 6)])
    snapshot = (m.lru_order(), m.stats())
    with pytest.raises(ValueError, match=match):
        CacheRequest(users, lengths, torch.zeros(rows, dtype=torch.int64))
    assert (m.lru_order(), m.stats()) == snapshot


def test_bad_tokens_and_offsets():
    with pytest.raises(ValueError, match="int64"):
        CacheRequest([1], [2], torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="float"):
        CacheRequest(torch.tensor([1.0]), [2], torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="decrease at index 2: 5 -> 3"):
        CacheRequest.from_offsets([1, 2], [0, 5, 3], torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="shape"):
        CacheRequest([1], [2], torch.zeros(2, 2, 2, dtype=torch.int64))
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="CPU"):
            CacheRequest([1], [2], torch.zeros(2, dtype=torch.int64, device="cuda"))


def test_bad_append_raises_and_leaves_pages_untouched():
    m = make()
    _, plan = run_step(m, [1], [history_tokens(1, 5)], outcome="none", check_values=True)
    table = m.kv_table.clone()
    n = plan.metadata.num_new_tokens
    good = torch.zeros(n, 2, 4)
    with pytest.raises(ValueError, match="shape"):
        m.append(0, torch.zeros(n + 1, 2, 4), good, plan)
    with pytest.raises(ValueError, match=r"torch\.float32"):
        m.append(0, good.double(), good, plan)
    with pytest.raises(ValueError, match="layer 5"):
        m.append(5, good, good, plan)
    with pytest.raises(ValueError, match=r"rows must lie in \[0, 2\), got \[-1, 1\]"):  # (it wrapped around)
        m.append(0, torch.zeros(2, 2, 4), torch.zeros(2, 2, 4), plan, rows=torch.tensor([0, 1, -1, 1, 0])[:n])
    assert torch.equal(m.kv_table, table)
    m.abort(plan)
    with pytest.raises(ValueError, match="not in flight"):
        m.append(0, good, good, plan)


def test_scratch_pages_leave_circulation_and_stay_accounted():
    m = make(num_pages=6)
    run_step(m, [1], [history_tokens(1, 16)])  # 4 pages
    scratch = m.reserve_scratch_pages(2)
    assert scratch == [4, 5] and m.stats()["device_pages_free"] == 0
    m.check()
    _, plan = run_step(m, [2], [history_tokens(2, 8)])  # 2 pages: user 1 must be evicted
    assert plan is not None and m.lru_order() == [2] and not set(m.pages_of(2)) & set(scratch)
    with pytest.raises(ValueError, match="cannot reserve 9 scratch pages"):
        m.reserve_scratch_pages(9)
    m.check()


def test_kv_table_shape_is_checked():
    cfg = tiny_config()
    with pytest.raises(ValueError, match="kv_table"):
        KVCacheManager(cfg, kv_table=torch.zeros(1, 2, 3))


def test_a_device_table_too_large_to_allocate_names_num_pages():
    """torch's allocator error (``DefaultCPUAllocator: can't allocate memory ...``) said neither which option
    nor how much: the manager names ``num_pages`` and the size it asked for."""
    with pytest.raises(ValueError, match=r"num_pages=1000000000000 device pages need .* GiB on cpu .*could not be "
                                         r"allocated"):
        KVCacheManager(tiny_config(num_pages=10**12))


def test_a_lookup_held_across_a_rebind_is_looked_up_again():
    """A lookup made before a dtype `rebind` held the old host core's versions; the new core counted
    from 0 again, so an edited history stored after the rebind reached the same version and `allocate`
    took the held lookup's host pages: the edited history's K/V served for the original one. Now
    `allocate` looks such a lookup up again (the step below checks every layer's values)."""
    m = KVCacheManager(tiny_config(host_cache_bytes=8 * tiny_config().page_bytes), HostTier())
    run_step(m, [1], [history_tokens(1, 16)])
    m.offload_flush()
    m.evict([1])
    held = m.lookup(CacheRequest([1], [17], history_tokens(1, 17)))
    assert held.tier_tokens["host"] == [16]
    m.rebind(m.kv_table.to(torch.bfloat16))
    run_step(m, [1], [history_tokens(1, 16, edit_at=0)])  # another history of user 1, in the new tiers
    m.offload_flush()
    m.evict([1])
    _, plan = finish_step(m, held, [history_tokens(1, 17)])
    assert plan.cached_lengths == [0]  # (the host's pages hold the edited history: a miss)
    m.offload_flush()
    m.check()


def test_a_rebind_the_host_tier_cannot_take_changes_nothing():
    """A new dtype whose page is larger than the whole host tier: refused before anything changed (it
    used to empty the device tier and switch the manager's dtype, leaving the host table in the old one,
    so every later write-through failed)."""
    page = tiny_config(dtype="bfloat16").page_bytes
    m = KVCacheManager(tiny_config(dtype="bfloat16", host_cache_bytes=page), HostTier())
    run_step(m, [1], [history_tokens(1, 6)])
    m.offload_flush()
    before, table = m.stats(), m.kv_table
    with pytest.raises(ValueError, match=f"host_cache_bytes >= one page \\({2 * page} bytes\\), got {page}"):
        m.rebind(m.kv_table.to(torch.float32))
    assert m.stats() == before and m.kv_table is table and m.config.dtype == "bfloat16"
    assert m.backend.host_table.dtype == torch.bfloat16
    lk, _ = run_step(m, [1], [history_tokens(1, 7)])
    assert lk.device_tokens == [6]
    m.offload_flush()
    m.check()


def test_evicting_from_every_tier_waits_for_an_onboard_not_yet_reaped():
    """An onboard copy that is done but not yet reaped still pins the user's host pages (a CUDA event
    that has not been queried complete); `evict(all_tiers=True)` dropped the device entry, then the host
    tier refused the pinned user and the call raised half done. It now reaps first."""
    from gr_plugin.cache.transfer import CopyHandle, ThreadTransferEngine

    class Lagging(CopyHandle):
        def __init__(self, inner):
            self.inner, self.num_layers, self.num_pages = inner, inner.num_layers, inner.num_pages

        def wait_layer(self, layer):
            self.inner.wait_layer(layer)

        def wait(self):
            self.inner.wait()

        def done(self):
            return False  # (until waited for)

        def check(self):
            self.inner.check()

    class Engine(ThreadTransferEngine):
        def copy(self, *args):
            return Lagging(super().copy(*args))

    m = KVCacheManager(tiny_config(host_cache_bytes=8 * tiny_config().page_bytes), HostTier(), transfer=Engine())
    run_step(m, [1], [history_tokens(1, 8)])
    m.offload_flush()
    m.evict([1])
    run_step(m, [1], [history_tokens(1, 9)])  # onboards 8 tokens from the host tier
    assert m.stats()["copies_in_flight"] >= 1
    m.evict([1], all_tiers=True)
    s = m.stats()
    assert s["device_users"] == 0 and s["host_users"] == 0 and s["copies_in_flight"] == 0
    m.check()


def test_a_move_the_host_tier_cannot_take_while_holding_users_changes_nothing():
    """A move whose host storage must be replaced (here to the meta device; CPU -> CUDA needs pinned
    memory the same way) while the host tier holds users: refused before anything changed (the manager
    used to take the new device and table, then the host tier raised)."""
    m = KVCacheManager(tiny_config(host_cache_bytes=8 * tiny_config().page_bytes), HostTier())
    run_step(m, [1], [history_tokens(1, 8)])
    m.offload_flush()
    table, transfer = m.kv_table, m.transfer
    with pytest.raises(ValueError, match=r"new storage for device 'meta'.*evict_all"):
        m.rebind(m.kv_table.to("meta"))
    assert m.kv_table is table and m.transfer is transfer and m.device == torch.device("cpu")
    assert m.config.device == "cpu" and m.stats()["host_users"] == 1
    lk, _ = run_step(m, [1], [history_tokens(1, 9)])
    assert lk.device_tokens == [8]
    m.check()


def test_a_namespace_too_long_for_a_page_header_is_refused():
    """The lower tiers file pages under the namespace and ``:<dtype>``, in a header of at most 512 bytes:
    a namespace over 500 bytes is refused up front, not at the first write-down."""
    with pytest.raises(ValueError, match=r"KVCacheConfig\.namespace must be at most 500 utf-8 bytes, got 501"):
        tiny_config(namespace="n" * 501)
    m = make()
    with pytest.raises(ValueError, match="namespace must be at most 500 utf-8 bytes, got 502"):
        m.set_namespace("ü" * 251)
    assert m.namespace == "test"
    m.set_namespace("n" * 500)
