"""Bounds and ownership checks of the C++ cache core (found by review): bad input raises ValueError
and leaves the core unchanged; nothing outside the core frees its pages; the lock covers every call."""

from __future__ import annotations

import threading

import pytest
import torch

from gr_plugin.cache import KVCacheManager
from gr_plugin.csrc.core.build import load as load_core
from tests.cache.helpers import history_tokens, run_step, tiny_config
from tests.crash import run_in_child

load_core()
_M = 2**63 - 1


def _core(num_pages=8, page_size=4):
    c = torch.classes.gr_kv_core.CacheCore(num_pages, page_size)
    c.set_namespace("a", None)
    return c


def test_hash_rows_overflowing_range_is_rejected():
    # start + num_rows wraps to a negative number and passes `<= tokens.size(0)`; the hash then
    # reads (2**63 - 1) * 8 bytes past the tensor.
    outcome = run_in_child(lambda: torch.ops.gr_kv_core.hash_rows(torch.arange(8), 1, _M, 0))
    assert outcome[0] == "value_error", outcome


def test_allocate_rejects_host_pages_whose_token_count_overflows():
    # hp * P would wrap to 4 (<= L = 8): 2**62 + 1 host pages must not "fit" an 8-token history.
    c = _core()
    with pytest.raises(ValueError, match="host pages 4611686018427387905 do not fit a history of 8 tokens"):
        c.allocate([1], [8], [0], [-1], [2**62 + 1])
    assert c.check() == "" and c.num_free() == 8 and c.num_entries() == 0


def test_allocate_length_overflow_leaves_the_core_unchanged():
    # The fresh page counts sum (int64) to 2**64 + 2 -> 2: the fit check passes, pass 2 starts
    # (entries marked in_plan, 2 pages taken), then std::length_error escapes: user 1 is left
    # in_plan without a plan (forever "in flight", never evictable) and 2 pages leak.
    c = _core(page_size=1)
    try:
        c.allocate([1, 2, 3], [_M, _M, 4], [0, 0, 0], [-1, -1, -1], [0, 0, 0])
    except ValueError:
        pass
    except RuntimeError as e:
        raise AssertionError(f"not a ValueError: {e}") from None
    assert c.check() == "", c.check()
    assert c.num_free() == 8 and c.num_entries() == 0


def test_core_pool_handle_cannot_free_a_users_pages():
    # CacheCore.pool() hands out the core's own pool, mutable: free() accepts any page in use,
    # including pages a user owns, which are then free while still owned.
    c = _core()
    _, plan_id, _, _ = c.allocate([1], [8], [0], [-1], [0])
    c.commit_rows(plan_id, [0, 8], torch.arange(8))
    owned = c.entry(0, 1)[1].tolist()
    try:
        c.pool().free(owned)
    except (ValueError, RuntimeError, AttributeError):
        pass
    assert c.check() == "", c.check()


def test_entries_view_calls_the_core_under_the_manager_lock():
    # The core is not thread-safe; `_Entries.get/__len__/__iter__` call it without the lock.
    m = KVCacheManager(tiny_config())
    run_step(m, [3], [history_tokens(3, 10)])
    held, release = threading.Event(), threading.Event()

    def hold():
        with m._lock:
            held.set()
            release.wait(5)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(5)
    finished = threading.Event()

    def read():
        m._entries.get(("test", 3))
        len(m._entries)
        finished.set()

    reader = threading.Thread(target=read)
    reader.start()
    try:
        ran_without_lock = finished.wait(0.3)
    finally:
        release.set()
        holder.join()
        reader.join()
    assert not ran_without_lock, "core.entry()/num_entries() ran while another thread held the manager lock"


def test_namespace_ids_past_int32_are_rejected_not_aliased():
    c = _core()
    _, plan_id, _, _ = c.allocate([1], [8], [0], [-1], [0])
    c.commit_rows(plan_id, [0, 8], torch.arange(8))
    with pytest.raises(ValueError, match="namespace id 4294967296 is out of range"):
        c.entry(2**32, 1)
    with pytest.raises(ValueError, match="namespace id -1 is out of range"):
        c.evict(-1, [1])
    assert c.num_entries() == 1 and c.check() == ""
