"""The tiered backend under the manager: device <-> host <-> SSD / Redis, faults, task semantics.

Every step goes through `run_step`, which reads back every token of every layer and compares it
with the K/V the history defines: a false hit or a corrupt page fails the test.
"""

import errno
import os
import threading
import time

import pytest
import torch

from gr_plugin.cache import CacheRequest, KVCacheManager, TieredBackend, TierReadError
from gr_plugin.cache.tiers import TierConfig

from .helpers import history_tokens, run_step, tiny_config

PAGE_BYTES = tiny_config().page_bytes


def make(tmp_path, *, num_pages=12, host_pages=6, ssd_pages=64, redis_url=None, ssd=True, **tier_kw):
    tiers = TierConfig(cpu_cache_gb=host_pages * PAGE_BYTES / 2**30,
                       ssd_cache_gb=(ssd_pages * 8 * PAGE_BYTES / 2**30) if ssd else 0.0,
                       ssd_cache_dir=str(tmp_path / "ssd"), enable_3rd_remote=redis_url is not None,
                       remote_url=redis_url or "redis://127.0.0.1:1/0", **tier_kw)
    cfg = tiny_config(num_pages=num_pages, host_cache_bytes=host_pages * PAGE_BYTES)
    return KVCacheManager(cfg, TieredBackend(tiers))


def settle(m):
    m.offload_flush()
    m.backend.flush_writes()


def test_round_trip_device_host_ssd_host_device(tmp_path):
    m = make(tmp_path, host_pages=6)
    run_step(m, [1], [history_tokens(1, 16)])  # 4 full pages -> host -> SSD (write-through)
    settle(m)
    assert m.stats()["ssd_pages_written"] == 4
    for u in (2, 3):  # push user 1 out of the host tier (6 slots) and the device
        run_step(m, [u], [history_tokens(u, 12)])
        settle(m)
    m.evict([1])
    lk = m.lookup(CacheRequest([1], [18], history_tokens(1, 18)))
    assert lk.device_tokens == [0] and lk.tier_tokens["host"] == [0] and lk.tier_tokens["ssd"] == [16]
    m.abort(m.allocate(lk))  # the fetched pages are published in the host tier by allocate
    lk, plan = run_step(m, [1], [history_tokens(1, 18)])  # values of every layer checked
    assert plan.onboard_tokens == [16] and plan.new_lengths == [2]
    s = m.stats()
    assert s["ssd_pages_fetched"] == 4 and s["tasks_ready"] == 1
    settle(m)
    m.check()


def test_fetch_is_one_batched_task_and_overlaps_until_allocate(tmp_path):
    m = make(tmp_path, host_pages=8)
    for u in (1, 2):
        run_step(m, [u], [history_tokens(u, 8)])
    settle(m)
    for u in (3, 4, 5, 6):
        run_step(m, [u], [history_tokens(u, 8)])
        settle(m)
    m.evict([1, 2])
    req = CacheRequest([1, 2], [9, 9], torch.cat([history_tokens(1, 9), history_tokens(2, 9)]))
    lk = m.lookup(req)
    assert lk.prefetch_task is not None and m.stats()["tasks_launched"] == 1
    plan = m.allocate(lk)
    assert plan.cached_lengths == [8, 8] and plan.onboard_tokens == [8, 8]
    m.abort(plan)
    settle(m)
    m.check()


def test_redis_round_trip_and_a_second_replica_hits(tmp_path, redis_url):
    a = make(tmp_path / "a", ssd=False, redis_url=redis_url)
    b = make(tmp_path / "b", ssd=False, redis_url=redis_url)
    run_step(a, [7], [history_tokens(7, 13)])  # 3 full pages -> host -> Redis
    settle(a)
    assert a.stats()["remote_pages_written"] == 3
    lk, plan = run_step(b, [7], [history_tokens(7, 15)])  # replica B has never seen user 7
    assert lk.tier_tokens["remote"] == [12] and plan.onboard_tokens == [12] and plan.new_lengths == [3]
    assert b.stats()["remote_pages_fetched"] == 3 and plan.lower_tier_tokens == {"remote": 12}
    assert b.stats()["tokens_reused_remote"] == b.stats()["tokens_reused_host"] == 12
    settle(b)
    b.check()


def test_evict_all_tiers_deletes_only_its_own_namespace_from_a_shared_redis(tmp_path, redis_url):
    import redis

    client = redis.Redis.from_url(redis_url)
    client.set("someone-else:key", b"theirs")  # another application's key on the same server
    other = make(tmp_path / "b", ssd=False, redis_url=redis_url)
    other.set_namespace("model-v2")
    a = make(tmp_path / "a", redis_url=redis_url)
    for m in (a, other):
        run_step(m, [7], [history_tokens(7, 13)])
        settle(m)
    assert len(list(client.scan_iter("*"))) == 7
    a.evict_all(all_tiers=True)
    assert a.stats()["host_users"] == 0 and a.backend._ssd.num_pages_stored == 0
    left = sorted(client.scan_iter("*"))
    assert len(left) == 4 and all(b"model-v2" in k for k in left[:3]) and left[3] == b"someone-else:key"
    fresh = make(tmp_path / "c", ssd=False, redis_url=redis_url)  # a new replica of model-v2 still hits
    fresh.set_namespace("model-v2")
    lk, _ = run_step(fresh, [7], [history_tokens(7, 13)])
    assert lk.tier_tokens["remote"] == [12]
    client.close()
    for m in (a, other, fresh):
        m.close()


def test_remote_ttl_s_reaches_the_redis_tier(tmp_path, redis_url):
    """``remote_ttl_s`` reaches the Redis tier: written pages carry the TTL (none without it), a replica's
    read renews it, and once they expire (forced here) a replica misses instead of reading them."""
    import redis

    client = redis.Redis.from_url(redis_url)  # (the fixture empties the database)
    managers = [make(tmp_path / n, ssd=False, redis_url=redis_url, remote_ttl_s=3600) for n in "abc"]
    a, b, c = managers
    run_step(a, [21], [history_tokens(21, 13)])
    settle(a)
    keys = list(client.scan_iter("*"))
    assert a.stats()["remote_pages_written"] == 3 and len(keys) == 3
    assert all(3500 < client.ttl(k) <= 3600 for k in keys)
    for k in keys:
        client.expire(k, 100)
    lk, _ = run_step(b, [21], [history_tokens(21, 14)])
    assert lk.tier_tokens["remote"] == [12]
    assert all(client.ttl(k) > 3500 for k in keys)  # the read renewed them
    for k in keys:
        client.pexpire(k, 1)
    time.sleep(0.05)
    lk, plan = run_step(c, [21], [history_tokens(21, 14)])
    assert lk.tier_tokens["remote"] == [0] and plan.new_lengths == [14]
    settle(c)
    client.flushall()
    plain = make(tmp_path / "d", ssd=False, redis_url=redis_url)
    managers.append(plain)
    run_step(plain, [22], [history_tokens(22, 9)])
    settle(plain)
    assert [client.ttl(k) for k in client.scan_iter("*")] == [-1, -1]  # no TTL: the pages stay
    for m in managers:
        m.close()


def test_remote_pages_of_a_user_served_from_its_replicas_own_tiers_are_renewed(tmp_path, redis_url, monkeypatch):
    """A replica serving a user from its device or host tier reads nothing from Redis; it renews the
    user's remote TTL instead, for the pages above the remote tier: all of them at most once a quarter of
    the TTL, and in between the pages a longer lookup finds beyond those the last renewal reached."""
    import redis

    from gr_plugin.cache import tiered

    clock = [1000.0]
    monkeypatch.setattr(tiered, "_now", lambda: clock[0])
    client = redis.Redis.from_url(redis_url)
    m = make(tmp_path, ssd=False, redis_url=redis_url, remote_ttl_s=3600)
    assert m.backend.renew_interval_s == 900
    run_step(m, [21], [history_tokens(21, 13)])  # (a new user: nothing to renew)
    settle(m)
    assert client.dbsize() == 3 and m.stats()["remote_renewals"] == 0

    def served_again(length):
        """{page: TTL} after a step of ``length`` history tokens, of the pages Redis held before it (each
        set to 100 s first), and the tokens the step onboarded from the host tier."""
        held = {int(k.split(b":")[-2]): k for k in client.scan_iter("*")}
        for k in held.values():
            client.expire(k, 100)
        _, plan = run_step(m, [21], [history_tokens(21, length)])
        settle(m)
        assert m.stats()["remote_hits"] == 0  # (nothing read from Redis)
        return {page: client.ttl(k) for page, k in held.items()}, plan.onboard_tokens

    def renewed():
        return m.stats()["remote_renewals"], m.stats()["remote_pages_renewed"]

    assert all(t > 3500 for t in served_again(14)[0].values())  # device hit, first sight: renewed
    assert renewed() == (1, 3)
    clock[0] += 899
    assert all(t <= 100 for t in served_again(15)[0].values())  # within the interval: not again
    clock[0] += 1
    assert all(t > 3500 for t in served_again(16)[0].values())  # (that step wrote page 3)
    assert renewed() == (2, 6) and client.dbsize() == 4
    ttls, _ = served_again(17)  # within the interval, but page 3 is found beyond the last renewal's 3
    assert ttls[3] > 3500 and all(ttls[p] <= 100 for p in (0, 1, 2)) and renewed() == (3, 7)
    m.evict([21])  # device pages gone: the next step's hit is the host tier's
    clock[0] += 900
    ttls, onboarded = served_again(18)
    assert onboarded == [16] and len(ttls) == 4 and all(t > 3500 for t in ttls.values())
    assert renewed() == (4, 11)
    m.close()

    plain = make(tmp_path / "plain", ssd=False, redis_url=redis_url)  # no TTL: nothing to renew
    assert plain.backend.renew_interval_s is None
    run_step(plain, [21], [history_tokens(21, 18)])
    run_step(plain, [21], [history_tokens(21, 19)])
    settle(plain)
    assert plain.stats()["remote_renewals"] == 0 and plain.stats()["remote_round_trips"] >= 1
    plain.close()


def test_remote_pages_of_a_user_served_from_the_ssd_are_renewed_and_an_evict_forgets_it(tmp_path, redis_url,
                                                                                          monkeypatch):
    import redis

    from gr_plugin.cache import HostTier, tiered

    clock = [1000.0]
    monkeypatch.setattr(tiered, "_now", lambda: clock[0])
    client = redis.Redis.from_url(redis_url)
    m = make(tmp_path, redis_url=redis_url, remote_ttl_s=3600)
    run_step(m, [21], [history_tokens(21, 13)])
    settle(m)
    m.evict([21])
    HostTier.evict(m.backend, (m.namespace, 21))  # the host tier only: SSD and Redis keep the 3 pages
    for k in client.scan_iter("*"):
        client.expire(k, 100)
    lk, _ = run_step(m, [21], [history_tokens(21, 14)])
    settle(m)
    assert lk.tier_tokens["ssd"] == [12] and m.stats()["remote_hits"] == 0
    assert [client.ttl(k) > 3500 for k in client.scan_iter("*")] == [True] * 3  # renewed from the SSD hit
    assert m.stats()["remote_pages_renewed"] == 3 and (m.namespace, 21) in m.backend._renewed
    m.backend.evict((m.namespace, 21))  # every tier: Redis loses the pages, the renewal forgets the user
    assert client.dbsize() == 0 and (m.namespace, 21) not in m.backend._renewed
    client.close()
    m.close()


def test_a_failed_renewal_is_retried_after_the_back_off_not_the_interval(tmp_path, redis_server, redis_url,
                                                                          monkeypatch):
    import redis

    from gr_plugin.cache import tiered

    clock = [1000.0]
    monkeypatch.setattr(tiered, "_now", lambda: clock[0])
    client = redis.Redis.from_url(redis_url)
    m = make(tmp_path, ssd=False, redis_url=redis_url, remote_ttl_s=3600)
    m.backend._remote.retry_after_s = 0.3  # (the store's back-off; the renewal's retry is 1 s)
    run_step(m, [21], [history_tokens(21, 13)])
    settle(m)
    saved = {k: client.dump(k) for k in client.scan_iter("*")}
    assert len(saved) == 3

    def step_ttls():
        run_step(m, [21], [history_tokens(21, 14)])  # a device hit: nothing read from Redis
        settle(m)
        return sorted(client.ttl(k) for k in saved)

    redis_server.kill()
    run_step(m, [21], [history_tokens(21, 14)])
    settle(m)
    assert m.stats()["remote_renew_failed"] == 3 and m.stats()["remote_pages_renewed"] == 0
    redis_server.restart()
    for k, v in saved.items():
        client.restore(k, 100_000, v)  # the pages are back, 100 s to live
    time.sleep(0.35)  # (the store's back-off ends)
    clock[0] += 0.5
    got = step_ttls()
    assert all(t <= 100 for t in got), got  # within the 1 s retry: not asked again
    clock[0] += 0.5
    assert all(t > 3500 for t in step_ttls())  # retried, every page (the interval is 900 s)
    assert m.stats()["remote_pages_renewed"] == 3 and m.stats()["renewals_in_flight"] == 0
    client.close()
    m.close()
    assert m.backend._renew_pool._shutdown
    before = list(m.backend._renewals)
    clock[0] += 3600  # (due) a lookup after close starts no renewal thread
    m.backend._renew_remote([(m.namespace, 21)], history_tokens(21, 16), [0, 16], 0, [16], [{}])
    assert m.backend._renewals == before


def test_a_step_counts_the_tokens_its_own_read_brought_up_from_the_ssd(tmp_path):
    m = make(tmp_path, host_pages=6)
    run_step(m, [1], [history_tokens(1, 16)])
    settle(m)
    _push_out_of_host(m, 1)
    _, plan = run_step(m, [1, 2], [history_tokens(1, 18), history_tokens(2, 5)])  # (user 2: all new)
    assert plan.onboard_tokens == [16, 0] and plan.lower_tier_tokens == {"ssd": 16}
    s = m.stats()
    assert s["tokens_reused_ssd"] == 16 and s["tokens_reused_remote"] == 0 and s["ssd_pages_fetched"] == 4
    host_before = s["tokens_reused_host"]
    m.evict([1])  # off the device again: the next visit finds the pages in the host tier
    _, plan = run_step(m, [1], [history_tokens(1, 19)])
    assert plan.onboard_tokens == [16] and plan.lower_tier_tokens == {}
    assert m.stats()["tokens_reused_ssd"] == 16 and m.stats()["tokens_reused_host"] == host_before + 16
    settle(m)
    m.check()


def test_a_step_counts_only_the_fetched_pages_it_onboards(tmp_path):
    from gr_plugin.cache import HostTier

    m = make(tmp_path, host_pages=6)
    run_step(m, [1], [history_tokens(1, 16)])  # 4 pages -> host -> SSD
    settle(m)
    _push_out_of_host(m, 1)
    run_step(m, [1], [history_tokens(1, 8)])  # 2 pages back from the SSD; the device holds 8 tokens
    settle(m)
    HostTier.evict(m.backend, (m.namespace, 1))  # the host tier only: the SSD keeps its 4 pages
    before = m.stats()
    _, plan = run_step(m, [1], [history_tokens(1, 18)])  # the read fetches pages 0-3, the step onboards 2-3
    s = m.stats()
    assert plan.device_tokens == [8] and plan.onboard_tokens == [8] and plan.lower_tier_tokens == {"ssd": 8}
    assert s["ssd_pages_fetched"] - before["ssd_pages_fetched"] == 4
    assert s["tokens_reused_ssd"] - before["tokens_reused_ssd"] == 8
    settle(m)
    m.check()


def _push_out_of_host(m, user, length=16):
    for u in (90, 91):
        run_step(m, [u], [history_tokens(u, 12)])
        settle(m)
    m.evict([user])


@pytest.mark.parametrize("fault", ["corrupt", "truncate"])
def test_corrupt_or_truncated_slab_is_a_miss_and_recomputed(tmp_path, fault):
    m = make(tmp_path, host_pages=6)
    run_step(m, [1], [history_tokens(1, 16)])
    settle(m)
    _push_out_of_host(m, 1)
    slab = next((tmp_path / "ssd").glob("slab-*.bin"))
    if fault == "corrupt":
        with open(slab, "r+b") as f:  # flip bytes everywhere in the slab: every stored page is hit
            data = bytearray(f.read())
            for i in range(64, len(data), 4096):
                data[i] ^= 0xFF
            f.seek(0)
            f.write(data)
    else:
        os.truncate(slab, 100)
    _, plan = run_step(m, [1], [history_tokens(1, 17)])  # exact values: the corrupt pages were not used
    assert plan.onboard_tokens == [0] and plan.new_lengths == [17]
    s = m.stats()
    assert s["fetch_pages_failed"] >= 1 and s["ssd_pages_fetched"] == 0
    settle(m)
    m.check()


def test_ssd_full_or_read_only_is_counted_never_fatal(tmp_path, monkeypatch):
    m = make(tmp_path, host_pages=6)

    def refuse(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", refuse)
    monkeypatch.setattr(os, "pwrite", refuse)
    run_step(m, [1], [history_tokens(1, 16)])
    settle(m)
    s = m.stats()
    assert s["ssd_pages_written"] == 0 and s["lower_writes_failed"] == 4
    lk, _ = run_step(m, [1], [history_tokens(1, 17)])  # the device and host tiers still serve
    assert lk.device_tokens == [16]
    m.check()


def test_redis_killed_mid_run_then_restarted(tmp_path, redis_server, redis_url):
    m = make(tmp_path, ssd=False, redis_url=redis_url)
    run_step(m, [1], [history_tokens(1, 8)])
    settle(m)
    redis_server.kill()
    run_step(m, [2], [history_tokens(2, 8)])  # write-through fails: counted, not fatal
    settle(m)
    m.evict([1])
    _push_out_of_host(m, 1)
    _, plan = run_step(m, [1], [history_tokens(1, 9)])  # remote unreachable: a miss, recomputed
    assert plan.new_lengths == [9]
    settle(m)
    assert m.stats()["lower_writes_failed"] > 0
    redis_server.start()
    time.sleep(1.1)  # the store waits retry_after_s (1 s) before it tries a failed server again
    before = m.stats()["remote_pages_written"]
    run_step(m, [3], [history_tokens(3, 8)])
    settle(m)
    assert m.stats()["remote_pages_written"] - before == 2  # writes work again after the restart
    m.check()


def test_a_renewal_the_server_refuses_is_not_retried_before_the_interval(tmp_path, redis_url, monkeypatch):
    """A server that refuses EXPIRE (an ACL, a read-only replica) gives the same answer a second later:
    such a user is due again after the interval, not after the 1 s retry of an unreachable server (that
    would send an EXPIRE per page and user every second, up to 900x the traffic at a 1 h TTL)."""
    import redis

    from gr_plugin.cache import tiered

    clock = [1000.0]
    monkeypatch.setattr(tiered, "_now", lambda: clock[0])
    client = redis.Redis.from_url(redis_url)
    client.acl_setuser("no-expire", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-expire"])
    try:
        m = make(tmp_path, ssd=False, redis_url=redis_url.replace("redis://", "redis://no-expire:pw@"),
                 remote_ttl_s=3600)
        run_step(m, [21], [history_tokens(21, 13)])
        settle(m)

        def step():
            run_step(m, [21], [history_tokens(21, 14)])  # a device hit: the lookup renews
            settle(m)
            return m.stats()["remote_renewals"], m.stats()["remote_renew_failed"]

        assert step() == (1, 3)  # refused
        clock[0] += 5
        assert step() == (1, 3)  # not asked again within the interval
        clock[0] += 900
        assert step() == (2, 6)
        m.close()
    finally:
        client.acl_deluser("no-expire")
        client.close()


@pytest.mark.parametrize("fail_open", [True, False])
def test_redis_unreachable_at_lookup_is_a_miss_or_an_error_that_changes_nothing(tmp_path, redis_server, redis_url,
                                                                                 fail_open):
    import redis

    client = redis.Redis.from_url(redis_url)
    m = make(tmp_path, ssd=False, redis_url=redis_url, fail_open=fail_open)
    store = m.backend._remote
    store.retry_after_s = 0.2  # (a short back-off: the step after the restart asks the server again soon)
    run_step(m, [1], [history_tokens(1, 8)])  # 2 full pages -> host -> Redis
    settle(m)
    saved = {k: client.dump(k) for k in client.scan_iter("*")}
    assert len(saved) == 2
    _push_out_of_host(m, 1)  # user 1's pages are now in Redis only
    settle(m)
    req = CacheRequest([1], [9], history_tokens(1, 9))

    store_keys = {f"remote_{k}" for k in store.stats()}  # (the store's own counters: errors are counted)

    def state():
        return ({k: v for k, v in m.stats().items() if k not in store_keys}, m.lru_order(),
                m.backend.lru_order(), dict(m.backend._renewed))

    before = state()
    redis_server.kill()
    if fail_open:
        lk = m.lookup(req)
        assert lk.tier_tokens["remote"] == [0] and lk.prefetch_task is None  # a miss
    else:
        with pytest.raises(TierReadError) as unreachable:
            m.lookup(req)
        msg = str(unreachable.value)
        assert "remote tier" in msg and "user 1 " in msg and "fail_open=False" in msg
        assert f"127.0.0.1:{redis_server.port}" in msg and "cannot be reached" in msg
        with pytest.raises(TierReadError, match="backing off"):
            run_step(m, [1], [history_tokens(1, 9)])
        assert state() == before  # nothing changed: not the lookup counters, LRU orders or tiers
        assert store.stats()["errors"] == 1 and store.stats()["skipped_while_down"] == 1
        m.check()
        run_step(m, [91], [history_tokens(91, 14)])  # all on the device: Redis is not asked, no error
    redis_server.restart()
    for k, v in saved.items():
        client.restore(k, 0, v)  # user 1's pages are back
    time.sleep(0.25)  # (the back-off)
    lk, plan = run_step(m, [1], [history_tokens(1, 9)])  # K/V of every layer checked
    assert lk.tier_tokens["remote"] == [8] and plan.onboard_tokens == [8] and plan.lower_tier_tokens == {"remote": 8}
    settle(m)
    m.check()
    client.close()
    m.close()


@pytest.mark.parametrize("fail_open", [True, False])
def test_redis_lost_between_lookup_and_read_is_a_miss_or_an_error(tmp_path, redis_server, redis_url, fail_open):
    """The lookup finds a user's pages in Redis; the server dies before the read task runs. Fail-open the
    step recomputes them; fail-closed (``fail_open=False``) allocate raises TierReadError (the read was
    a silent miss too), the task's host slots are released and a later step reads the pages."""
    import redis

    client = redis.Redis.from_url(redis_url)
    m = make(tmp_path, ssd=False, redis_url=redis_url, fail_open=fail_open)
    m.backend._remote.retry_after_s = 0.0
    run_step(m, [1], [history_tokens(1, 8)])
    settle(m)
    saved = {k: client.dump(k) for k in client.scan_iter("*")}
    _push_out_of_host(m, 1)  # user 1's 2 pages are in Redis only
    settle(m)
    release = _hold_writers(m)  # (the read task queues behind the held workers)
    lk = m.lookup(CacheRequest([1], [9], history_tokens(1, 9)))
    assert lk.tier_tokens["remote"] == [8] and lk.prefetch_task is not None
    redis_server.kill()
    release.set()
    if fail_open:
        plan = m.allocate(lk)
        assert plan.cached_lengths == [0]  # (recomputed)
        m.abort(plan)
    else:
        with pytest.raises(TierReadError, match="ended 'failed'"):
            m.allocate(lk)
        assert m.stats()["tasks_failed"] == 1
    m.check()
    assert (m.namespace, 1) not in m.backend.lru_order()  # (nothing of user 1 was published)
    redis_server.restart()
    for k, v in saved.items():
        client.restore(k, 0, v)
    lk, plan = run_step(m, [1], [history_tokens(1, 9)])  # K/V of every layer checked
    assert lk.tier_tokens["remote"] == [8] and plan.lower_tier_tokens == {"remote": 8}
    settle(m)
    m.check()
    client.close()
    m.close()


def _until_no_task(m, step=None, timeout_s=5.0):
    """Call ``step`` (default: a poll) until no read task is in flight (at most ``timeout_s``)."""
    deadline = time.time() + timeout_s
    while m.stats()["tasks_in_flight"] and time.time() < deadline:
        (step or m.offload_try_wait)()
        time.sleep(0.01)


class SlowStore:
    """The real SSD store, with reads held back until ``release`` is set."""

    def __init__(self, inner):
        self.inner = inner
        self.release = threading.Event()

    def get_many(self, keys, out):
        self.release.wait(timeout=10)
        return self.inner.get_many(keys, out)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("fail_open", [True, False])
def test_a_task_that_times_out_is_a_miss_or_an_error(tmp_path, fail_open):
    m = make(tmp_path, host_pages=6, task_timeout_s=0.05, fail_open=fail_open)
    run_step(m, [1], [history_tokens(1, 16)])
    settle(m)
    _push_out_of_host(m, 1)
    slow = SlowStore(m.backend._ssd)
    m.backend._ssd = slow
    if fail_open:
        lk, plan = run_step(m, [1], [history_tokens(1, 17)])
        assert lk.tier_tokens["ssd"] == [16] and plan.new_lengths == [17]
    else:
        lk = m.lookup(CacheRequest([1], [17], history_tokens(1, 17)))
        with pytest.raises(TierReadError, match="timed_out"):
            m.allocate(lk)
    assert m.stats()["tasks_timed_out"] == 1
    slow.release.set()
    _until_no_task(m)
    m.backend._ssd = slow.inner
    settle(m)
    m.check()  # the timed-out task's slots were released, nothing leaked
    assert m.stats()["host_slots_used"] <= 6


def test_a_write_through_that_finishes_before_an_older_fetch_of_the_user_waits_for_it(tmp_path):
    """A lookup's fetch of user 1's SSD pages 0-3 is in flight (held back) when another step of user 1
    commits page 4: its write-through reserves host slots behind the fetch's and its copy finishes first.
    It used to raise "host publishes out of order" and leak the reservation and the device entry's
    offload pin for good (`check` passed; `evict_all` then failed forever). Now it waits for the
    fetch: once that lands, pages 0-4 are readable in order and nothing is held."""
    m = make(tmp_path, host_pages=6)
    run_step(m, [1], [history_tokens(1, 16)])
    settle(m)
    _push_out_of_host(m, 1)
    slow = SlowStore(m.backend._ssd)
    m.backend._ssd = slow
    m.lookup(CacheRequest([1], [18], history_tokens(1, 18)))  # (a lookup whose step never comes)
    lk, plan = run_step(m, [1], [history_tokens(1, 22)])  # values of every layer checked
    assert plan.cached_lengths == [0]
    m.offload_flush()  # page 4's copy is done: it waits for the fetch, no error
    assert m.backend.pages_of((m.namespace, 1)) == []
    slow.release.set()
    _until_no_task(m)
    m.backend._ssd = slow.inner
    settle(m)
    assert len(m.backend.pages_of((m.namespace, 1))) == 5 and m.stats()["host_slots_used"] == 5
    assert m._entries[(m.namespace, 1)].offloads == 0
    m.check()
    m.evict([1])
    lk, plan = run_step(m, [1], [history_tokens(1, 23)])  # the host's 5 pages, checked layer by layer
    assert lk.tier_tokens["host"] == [20] and plan.onboard_tokens == [20]
    settle(m)
    m.evict_all(all_tiers=True)
    m.check()
    m.close()


def _fetch_pending(tmp_path):
    """User 1's 4 pages on SSD only, users 90 and 91 on the device, and a lookup of user 1 whose read of
    those pages is held back (its step never comes): the host tier holds a reservation for user 1."""
    m = make(tmp_path, host_pages=6)
    run_step(m, [1], [history_tokens(1, 16)])
    settle(m)
    _push_out_of_host(m, 1)
    slow = SlowStore(m.backend._ssd)
    m.backend._ssd = slow
    m.lookup(CacheRequest([1], [18], history_tokens(1, 18)))
    threading.Timer(0.2, slow.release.set).start()
    return m, slow


@pytest.mark.parametrize("call", ["evict", "evict_all", "rebind"])
def test_an_unfinished_read_task_does_not_leave_a_clear_half_done(tmp_path, call):
    """`evict(all_tiers=True)`, `evict_all(all_tiers=True)` and a dtype `rebind` while a lookup's read of
    user 1 is in flight: the host tier refused to drop the busy user after the device tier was already
    emptied (raised with users half evicted; a retried rebind then did nothing and the next step failed
    on the old-dtype host table). Now they wait for the read, then drop everything they name."""
    m, slow = _fetch_pending(tmp_path)
    if call == "evict":
        m.evict([90, 1], all_tiers=True)
        s = m.stats()
        assert s["device_users"] == 1 and (m.namespace, 1) not in m.backend.lru_order()
        assert m.backend._ssd.match(m.backend._store_ns((m.namespace, 1)), 1, [0]) == 0
    elif call == "evict_all":
        m.evict_all(all_tiers=True)
        s = m.stats()
        assert s["device_users"] == 0 and s["host_users"] == 0 and s["ssd_pages_stored"] == 0
    else:
        m.rebind(m.kv_table.to(torch.bfloat16))
        assert m.backend.host_table.dtype == torch.bfloat16 and m.stats()["host_users"] == 0
    assert m.stats()["tasks_in_flight"] == 0
    if m.backend._ssd is slow:  # (a rebind built a store for the new page size)
        m.backend._ssd = slow.inner
    m.check()
    _, plan = run_step(m, [1], [history_tokens(1, 18)])  # (values of every layer checked)
    assert plan.new_lengths == [18]  # (every tier dropped user 1: recomputed)
    settle(m)
    m.check()
    m.close()


class BrokenStore:
    """The real SSD store whose reads fail."""

    def __init__(self, inner):
        self.inner = inner

    def get_many(self, keys, out, **kw):
        raise OSError("disk gone")

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("between", ["offload_try_wait", "evict_other_user"])
def test_a_failed_read_finished_by_another_call_still_fails_a_fail_closed_allocate(tmp_path, between):
    """With fail_open=False, a lookup's read task that failed and was finished by another call before
    the lookup's `allocate` (a poll, or an evict's settle) answered "ready" to that allocate, which then
    recomputed the users instead of raising `TierReadError`."""
    m = make(tmp_path, host_pages=6, fail_open=False)
    run_step(m, [1, 2], [history_tokens(1, 8), history_tokens(2, 8)])
    settle(m)
    _push_out_of_host(m, 1)
    m.evict([2])
    m.backend._ssd = BrokenStore(m.backend._ssd)
    lk = m.lookup(CacheRequest([1, 2], [9, 9], torch.cat([history_tokens(1, 9), history_tokens(2, 9)])))
    assert lk.tier_tokens["ssd"] == [8, 8]
    _until_no_task(m, m.offload_try_wait if between == "offload_try_wait" else lambda: m.evict([2], all_tiers=True))
    assert m.stats()["tasks_failed"] == 1
    with pytest.raises(TierReadError, match="ended 'failed'"):
        m.allocate(lk)
    m.backend._ssd = m.backend._ssd.inner
    m.check()
    m.close()


def test_a_rebind_a_lower_tier_cannot_take_changes_nothing(tmp_path):
    """A new dtype whose page no longer fits the SSD tier: refused before anything changed (it emptied
    every tier, switched the manager's dtype, then raised, leaving no SSD store behind)."""
    page = tiny_config(dtype="bfloat16", head_dim=40).page_bytes  # (2560 bytes: one 4 KiB SSD slot, 8 KiB in fp32)
    tiers = TierConfig(cpu_cache_gb=8 * page / 2**30, ssd_cache_gb=4096 / 2**30, ssd_cache_dir=str(tmp_path / "ssd"))
    m = KVCacheManager(tiny_config(dtype="bfloat16", head_dim=40, host_cache_bytes=8 * page), TieredBackend(tiers))
    run_step(m, [1], [history_tokens(1, 8)])
    settle(m)
    ssd, before = m.backend._ssd, m.stats()
    with pytest.raises(ValueError, match="capacity_bytes=4096 holds no slot of 8192 bytes"):
        m.rebind(m.kv_table.to(torch.float32))
    assert m.backend._ssd is ssd and m.config.dtype == "bfloat16" and m.kv_table.dtype == torch.bfloat16
    assert {k: v for k, v in m.stats().items() if "latency" not in k} == {
        k: v for k, v in before.items() if "latency" not in k}
    lk, _ = run_step(m, [1], [history_tokens(1, 9)])
    assert lk.device_tokens == [8]
    settle(m)
    m.check()
    m.close()


def test_a_cancelled_task_releases_its_slots(tmp_path):
    m = make(tmp_path, host_pages=6)
    run_step(m, [1], [history_tokens(1, 16)])
    settle(m)
    _push_out_of_host(m, 1)
    slow = SlowStore(m.backend._ssd)
    m.backend._ssd = slow
    lk = m.lookup(CacheRequest([1], [17], history_tokens(1, 17)))
    used = m.stats()["host_slots_used"]
    m.backend.cancel(lk.prefetch_task)
    slow.release.set()
    m.backend._ssd = slow.inner
    plan = m.allocate(lk)  # the cancelled task publishes nothing: a miss
    assert plan.cached_lengths == [0]
    m.abort(plan)
    settle(m)
    assert m.stats()["tasks_cancelled"] == 1 and m.stats()["host_slots_used"] <= used
    m.check()


def _hold_writers(m):
    """Keep the tier's two workers busy until the returned event is set (write-downs queue behind)."""
    release, started = threading.Event(), threading.Barrier(3, timeout=10)

    def hold():
        started.wait()
        release.wait(timeout=30)

    for _ in range(2):
        m.backend._pool.submit(hold)
    started.wait()
    return release


def test_a_write_down_reads_host_slots_on_the_worker_and_skips_slots_taken_meanwhile(tmp_path):
    m = make(tmp_path, host_pages=6)
    release = _hold_writers(m)
    try:
        run_step(m, [1], [history_tokens(1, 16)])
        m.offload_flush()  # user 1's 4 pages published in the host tier; their SSD write queued, not run
        m.evict([1])  # off the device; then user 2's 6 pages push it out of the host tier and take its slots
        run_step(m, [2], [history_tokens(2, 24)])
        m.offload_flush()
    finally:
        release.set()
    m.backend.flush_writes()
    s = m.stats()
    # user 1's write read slots that user 2's bytes now fill: not written (else the SSD would serve
    # user 2's K/V under user 1's page hashes); user 2's own write read its published bytes
    assert s["lower_writes_skipped"] == 4 and s["ssd_pages_written"] == 6
    lk, plan = run_step(m, [1], [history_tokens(1, 18)])  # values of every layer checked
    assert lk.tier_tokens["ssd"] == [0] and plan.cached_lengths == [0]
    settle(m)
    m.evict([1], all_tiers=True)  # (host slots free for user 2's read from the SSD)
    m.evict([2])
    lk = m.lookup(CacheRequest([2], [26], history_tokens(2, 26)))
    assert lk.tier_tokens["ssd"] == [24]
    m.abort(m.allocate(lk))  # the fetched pages are published in the host tier by allocate
    _, plan = run_step(m, [2], [history_tokens(2, 26)])  # user 2 from the SSD, values checked
    assert plan.onboard_tokens == [24]
    settle(m)
    m.check()


class HeldWrites:
    """The real SSD store, with writes held back until ``release`` is set."""

    def __init__(self, inner):
        self.inner = inner
        self.release, self.writing = threading.Event(), threading.Event()

    def put_many(self, keys, pages):
        self.writing.set()
        self.release.wait(timeout=10)
        return self.inner.put_many(keys, pages)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_evicting_a_user_from_every_tier_waits_for_its_write_down(tmp_path):
    m = make(tmp_path, host_pages=6)
    held = HeldWrites(m.backend._ssd)
    m.backend._ssd = held
    run_step(m, [1], [history_tokens(1, 16)])
    m.offload_flush()
    assert held.writing.wait(timeout=10)  # user 1's SSD write has started, and waits
    wait = m.backend._wait_writes

    def releasing_wait(key):  # the write is let go once the evict waits for it (never, without the wait)
        held.release.set()
        wait(key)

    m.backend._wait_writes = releasing_wait
    m.evict([1], all_tiers=True)  # (else the write lands after the SSD's evict: the user back on the SSD)
    m.backend.flush_writes()
    m.backend._ssd = held.inner
    assert m.stats()["ssd_pages_written"] == 4 and held.inner.stats()["pages_stored"] == 0
    m.check()


def _serve_in_another_process(redis_url: str, ssd_dir: str, user: int, length: int) -> None:
    m = make(__import__("pathlib").Path(ssd_dir), ssd=False, redis_url=redis_url)
    run_step(m, [user], [history_tokens(user, length)])
    settle(m)
    assert m.stats()["remote_pages_written"] == length // 4
    m.close()


def test_two_processes_share_one_redis(tmp_path, redis_url):
    import multiprocessing

    proc = multiprocessing.get_context("spawn").Process(
        target=_serve_in_another_process, args=(redis_url, str(tmp_path / "a"), 42, 17))
    proc.start()
    proc.join(timeout=120)
    assert proc.exitcode == 0
    b = make(tmp_path / "b", ssd=False, redis_url=redis_url)
    lk, plan = run_step(b, [42], [history_tokens(42, 19)])  # exact values, from process A's pages
    assert lk.tier_tokens["remote"] == [16] and plan.onboard_tokens == [16]
    b.check()


@pytest.mark.parametrize("fail_open", [True, False])
def test_a_new_dtype_rebuilds_the_stores_and_keeps_apart_from_the_old_dtypes_pages(tmp_path, redis_url, fail_open):
    """``rebind`` to another dtype: the SSD and Redis stores took the old page size (a read then failed
    with "out rows hold 256 bytes, the store's pages hold 512", an error with fail_open=False); they are
    rebuilt. The lower tiers file pages under the namespace and the dtype, so the old dtype's pages in
    Redis are neither found nor overwritten (before, both dtypes wrote the same keys and each read the
    other's as corrupt): replicas in either dtype hit their own."""
    import redis

    client = redis.Redis.from_url(redis_url)
    m = make(tmp_path / "a", redis_url=redis_url, fail_open=fail_open)
    run_step(m, [1], [history_tokens(1, 8)])
    settle(m)
    assert client.dbsize() == 2 and all(b"%3Afloat32:" in k for k in client.scan_iter("*"))
    m.rebind(m.kv_table.to(torch.bfloat16))
    assert m.backend._remote.page_bytes == m.config.page_bytes == PAGE_BYTES // 2
    assert m.backend._ssd.page_bytes == PAGE_BYTES // 2 and client.dbsize() == 2  # (kept for the others)
    lk, plan = run_step(m, [1], [history_tokens(1, 9)])  # (K/V of every layer checked, in bfloat16)
    assert lk.tier_tokens["remote"] == [0] and plan.cached_lengths == [0]  # not this dtype's: recomputed
    assert m.stats()["remote_corruptions"] == 0
    settle(m)
    assert client.dbsize() == 4 and len([k for k in client.scan_iter("*") if b"%3Abfloat16:" in k]) == 2
    for dtype, page_bytes in (("bfloat16", PAGE_BYTES // 2), ("float32", PAGE_BYTES)):
        b = KVCacheManager(tiny_config(num_pages=12, host_cache_bytes=6 * page_bytes, dtype=dtype),
                           TieredBackend(TierConfig(cpu_cache_gb=3 * page_bytes / 2**30, enable_3rd_remote=True,
                                                    remote_url=redis_url)))
        lk, plan = run_step(b, [1], [history_tokens(1, 9)])
        assert lk.tier_tokens["remote"] == [8] and plan.lower_tier_tokens == {"remote": 8}, dtype
        assert b.stats()["remote_corruptions"] == 0
        b.check()
        b.close()
    m.check()
    m.close()
    client.close()
