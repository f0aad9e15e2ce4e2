"""Pages being copied are never reused or published early (a copy held back by a gate)."""

import threading

import torch

from gr_plugin.cache import CacheRequest, HostTier, KVCacheManager
from gr_plugin.cache.transfer import ThreadTransferEngine, _ThreadHandle

from .helpers import history_tokens, run_step, tiny_config


class GatedEngine(ThreadTransferEngine):
    """The real worker-thread engine; each copy is queued behind a job that waits for ``gate``."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()

    def copy(self, src, src_pages, dst, dst_pages):
        self._queue.put((_ThreadHandle(1, 0), lambda layer: self.gate.wait(timeout=10)))
        return super().copy(src, src_pages, dst, dst_pages)


def make_gated(num_pages=8, host_pages=16):
    cfg = tiny_config(num_pages=num_pages, host_cache_bytes=host_pages * tiny_config().page_bytes)
    engine = GatedEngine()
    return KVCacheManager(cfg, HostTier(), transfer=engine), engine


def test_offload_in_flight_is_not_visible_and_pins_its_pages():
    m, engine = make_gated()
    run_step(m, [1], [history_tokens(1, 8)])  # offload of 2 pages launched, held by the gate
    assert m.offload_try_wait() == 1
    assert m.stats()["host_pages_written"] == 0
    m.evict([2])  # unrelated users can be evicted; user 1 has pages being read:
    # user 2 wants all 8 pages: user 1 is not evictable while its pages are read -> waits (drain)
    threading.Timer(0.2, engine.gate.set).start()
    _, plan = run_step(m, [2], [history_tokens(2, 32)])
    assert plan is not None  # after the copy finished, user 1 could be evicted
    assert m.stats()["host_pages_written"] == 2
    assert m.counters.host_blocking_waits == 1
    m.check()


def test_stale_pages_read_by_a_copy_become_zombies_until_it_finishes():
    m, engine = make_gated()
    run_step(m, [1], [history_tokens(1, 8)])  # pages 0, 1 being offloaded (gate closed)
    edited = history_tokens(1, 8, edit_at=0)
    run_step(m, [1], [edited])  # whole history differs: pages 0, 1 are stale but still read
    assert m._pool.num_zombies == 2
    free_ids = list(m._pool._free)
    assert 0 not in free_ids and 1 not in free_ids
    m.check()
    engine.gate.set()
    m.offload_flush()
    assert m._pool.num_zombies == 0 and {0, 1} <= set(m._pool._free)
    # the host got the *old* history's pages (as written), the device the new ones
    m.evict([1])
    lk = m.lookup(CacheRequest([1], [8], history_tokens(1, 8)))
    assert lk.cached_tokens == [8]
    m.check()


def test_failed_copy_publishes_nothing():
    cfg = tiny_config(num_pages=8, host_cache_bytes=16 * tiny_config().page_bytes)
    m = KVCacheManager(cfg, HostTier())
    bad = torch.zeros(1)  # wrong table: the worker's copy raises
    real = m.backend.host_table
    m.backend._table = bad
    run_step(m, [1], [history_tokens(1, 8)])
    m.offload_flush()
    m.backend._table = real
    assert m.counters.offload_failed == 1
    assert m.stats()["host_pages_written"] == 0 and m.stats()["host_slots_used"] == 0
    m.check()
