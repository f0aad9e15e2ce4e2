"""The Redis page store against a real redis-server: round trips, match, tampering, a killed server."""

from __future__ import annotations

import logging
import math
import threading
import time

import pytest
import redis
import torch

from gr_plugin.cache.tiers import PageKey, PageStoreUnavailable, RedisPageStore
from gr_plugin.cache.tiers.flexkv_config import redact

from .helpers import PAGE_SHAPE, random_pages, same_bytes, user_keys


@pytest.fixture
def store(redis_url):
    s = RedisPageStore(redis_url, retry_after_s=0, max_batch=16)
    yield s
    s.close()


@pytest.fixture
def client(redis_url):
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


def hashes(keys: list[PageKey]) -> list[int]:
    return [k.page_hash for k in keys]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_byte_exact_and_pipelined(store, dtype):
    keys = [k for u in range(5) for k in user_keys(u, 20)]
    pages = random_pages(len(keys), dtype=dtype, seed=2)
    assert store.put_many(keys, pages) == [True] * 100
    assert store.stats()["round_trips"] == math.ceil(100 / 16)
    out = torch.zeros_like(pages)
    assert store.get_many(keys[::-1], out) == [True] * 100
    assert same_bytes(out, pages.flip(0))
    st = store.stats()
    assert (st["hits"], st["misses"], st["corruptions"], st["errors"]) == (100, 0, 0, 0)
    assert st["bytes_written"] == st["bytes_read"] > pages.nbytes
    assert st["round_trips"] == 2 * math.ceil(100 / 16)
    assert store.num_pages_stored == 100


def test_match_counts_the_leading_present_pages(store):
    keys = user_keys(1, 40)
    pages = random_pages(40)
    present = [i for i in range(40) if i != 35]
    assert store.put_many([keys[i] for i in present], pages[present]) == [True] * 39
    assert store.match("ns", 1, hashes(keys)) == 35  # stops at the hole, across batches of 16
    assert store.match("ns", 1, hashes(keys[:20])) == 20
    assert store.match("ns", 1, [keys[0].page_hash ^ 1, *hashes(keys[1:])]) == 0
    assert store.match("ns", 2, hashes(keys)) == 0
    assert store.match("other", 1, hashes(keys)) == 0
    assert store.match("ns", 1, []) == 0


def test_values_failing_verification_at_every_read_are_logged_once_per_interval(store, client, caplog):
    """A server holding damaged values fails verification at every read of them: one warning, then
    at most one more per 30 s with the count (a UAT run printed one line per batch)."""
    keys = user_keys(1, 2)
    store.put_many(keys, random_pages(2))
    client.set(store.key_name(keys[0]), b"not a page")
    out = torch.empty_like(random_pages(2))
    with caplog.at_level("WARNING", logger="gr_plugin.cache.tiers.remote"):
        for _ in range(20):
            assert store.get_many(keys, out) == [False, True]
    lines = [r.getMessage() for r in caplog.records if "failed verification" in r.getMessage()]
    assert len(lines) == 1 and "1 value(s) failed verification (read as misses); first" in lines[0]
    assert store.stats()["corruptions"] == 20


def test_tampered_values_miss_and_are_counted(store, client):
    keys = user_keys(1, 3)
    pages = random_pages(3)
    store.put_many(keys, pages)
    name = store.key_name(keys[1])
    value = bytearray(client.get(name))
    value[-7] ^= 0x01  # one payload bit
    client.set(name, bytes(value))
    client.set(store.key_name(keys[2]), client.get(store.key_name(keys[2]))[:-1])  # truncated
    out = torch.empty_like(pages)
    assert store.get_many(keys, out) == [True, False, False]
    assert same_bytes(out[0], pages[0])
    assert store.stats()["corruptions"] == 2


def test_a_value_stored_under_another_users_key_misses(store, client):
    theirs, mine = user_keys(1, 1), [PageKey("ns", 2, 0, user_keys(1, 1)[0].page_hash)]
    store.put_many(theirs, random_pages(1))
    client.set(store.key_name(mine[0]), client.get(store.key_name(theirs[0])))
    out = torch.empty(1, *PAGE_SHAPE)
    assert store.get_many(mine, out) == [False]
    assert store.get_many(theirs, out) == [True]
    assert store.stats()["corruptions"] == 1


def test_killed_server_fails_open_then_recovers(redis_server, redis_url, caplog):
    s = RedisPageStore(redis_url, retry_after_s=0, socket_timeout_s=0.5)
    keys = user_keys(1, 4)
    pages = random_pages(4)
    out = torch.empty_like(pages)
    assert s.put_many(keys[:2], pages[:2]) == [True, True]
    redis_server.kill()
    start = time.monotonic()
    with caplog.at_level(logging.INFO, logger="gr_plugin.cache.tiers.remote"):
        for _ in range(5):
            assert s.put_many(keys, pages) == [False] * 4
            assert s.get_many(keys, out) == [False] * 4
            assert s.match("ns", 1, hashes(keys)) == 0
            s.evict_user("ns", 1)
        assert time.monotonic() - start < 5, "a dead server must fail fast (connection refused)"
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        st = s.stats()
        assert st["errors"] == 20 and st["failing"]
        redis_server.restart()  # same port, empty: the client reconnects by itself
        assert s.put_many(keys, pages) == [True] * 4
        assert s.get_many(keys, out) == [True] * 4 and same_bytes(out, pages)
        assert s.match("ns", 1, hashes(keys)) == 4
    assert "working again after 20 errors" in caplog.text
    assert not s.stats()["failing"]
    s.close()


def test_after_an_error_the_store_backs_off(redis_server, redis_url):
    s = RedisPageStore(redis_url, retry_after_s=60)
    keys = user_keys(1, 2)
    redis_server.kill()
    assert s.put_many(keys, random_pages(2)) == [False, False]
    redis_server.restart()
    assert s.match("ns", 1, hashes(keys)) == 0  # not even tried: backing off
    assert s.stats()["skipped_while_down"] == 1 and s.stats()["errors"] == 1
    s.close()


def test_a_strict_match_on_a_killed_server_raises_naming_the_url_where_a_plain_one_misses(redis_server, redis_url):
    keys = user_keys(1, 4)
    plain = RedisPageStore(redis_url, retry_after_s=60)
    assert plain.put_many(keys, random_pages(4)) == [True] * 4
    assert plain.match("ns", 1, hashes(keys), strict=True) == 4  # a healthy server: the same answers
    assert plain.match("ns", 1, hashes(keys), 2, strict=True) == 4
    url = redis_url.replace("redis://", "redis://gr:hunter2@")  # (never connected while the server runs)
    s = RedisPageStore(url, retry_after_s=60)
    redis_server.kill()
    assert plain.match("ns", 1, hashes(keys)) == 0  # fail-open: a miss
    assert plain.stats()["errors"] == 1
    with pytest.raises(PageStoreUnavailable, match="backing off") as backing_off:
        plain.match("ns", 1, hashes(keys), strict=True)
    assert plain._safe_url() in str(backing_off.value) and "EXISTS: ConnectionError" in str(backing_off.value)
    st = plain.stats()
    assert (st["errors"], st["skipped_while_down"]) == (1, 1)  # counted as today: not even tried
    with pytest.raises(PageStoreUnavailable, match="cannot be reached") as unreachable:
        s.match("ns", 1, hashes(keys), strict=True)
    msg = str(unreachable.value)
    assert redact(url) in msg and f"127.0.0.1:{redis_server.port}" in msg and "hunter2" not in msg
    assert isinstance(unreachable.value.__cause__, redis.exceptions.ConnectionError)
    assert s.stats()["errors"] == 1
    assert s.match("ns", 1, hashes(keys), 1) == 1 and s.stats()["skipped_while_down"] == 1  # backing off as today
    redis_server.restart()
    for store in (plain, s):
        store.close()


def test_a_strict_match_refused_by_the_server_raises_without_backing_off(redis_url, client):
    owner = RedisPageStore(redis_url)
    keys = user_keys(1, 3)
    owner.put_many(keys, random_pages(3))
    client.acl_setuser("no-exists", enabled=True, passwords=["+s3cret-pw"], keys=["*"],
                       commands=["+@all", "-exists"])
    try:
        url = redis_url.replace("redis://", "redis://no-exists:s3cret-pw@")
        s = RedisPageStore(url, retry_after_s=60)
        assert s.match("ns", 1, hashes(keys)) == 0  # fail-open: NOPERM is a miss
        with pytest.raises(PageStoreUnavailable, match="refused EXISTS") as refused:
            s.match("ns", 1, hashes(keys), strict=True)
        assert redact(url) in str(refused.value) and "s3cret-pw" not in str(refused.value)
        st = s.stats()
        assert (st["errors"], st["skipped_while_down"], st["round_trips"]) == (2, 0, 2)  # no back-off
        s.close()
    finally:
        client.acl_deluser("no-exists")
    owner.close()


def test_a_strict_read_refused_by_the_server_raises_but_a_foreign_key_is_a_miss(redis_url, client):
    """Fail-closed, a server refusing reads (an ACL, READONLY after a failover) is an error like a refused
    EXISTS (it was a silent miss); a key of another type at a page's name (WRONGTYPE) stays a miss."""
    owner = RedisPageStore(redis_url)
    keys = user_keys(1, 3)
    pages = random_pages(3)
    owner.put_many(keys, pages)
    client.acl_setuser("no-get", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-get", "-getex"])
    try:
        s = RedisPageStore(redis_url.replace("redis://", "redis://no-get:pw@"), retry_after_s=60)
        out = torch.empty_like(pages)
        assert s.get_many(keys, out) == [False] * 3  # fail-open: misses
        with pytest.raises(PageStoreUnavailable, match="refused a read: GET: NoPermissionError"):
            s.get_many(keys, out, strict=True)
        assert s.stats()["skipped_while_down"] == 0 and s.stats()["misses"] == 6  # (no back-off; counted)
        s.close()
    finally:
        client.acl_deluser("no-get")
    client.delete(owner.key_name(keys[1]))
    client.rpush(owner.key_name(keys[1]), b"not a page")
    out = torch.empty_like(pages)
    assert owner.get_many(keys, out, strict=True) == [True, False, True]
    owner.close()


def test_two_replicas_share_pages(redis_url):
    a = RedisPageStore(redis_url, key_prefix="shared")
    b = RedisPageStore(redis_url, key_prefix="shared")
    keys = user_keys(3, 5)
    pages = random_pages(5)
    assert a.put_many(keys, pages) == [True] * 5
    assert b.put_many(keys[:2], pages[:2]) == [True] * 2  # same page, same key, same value
    out = torch.empty_like(pages)
    assert b.match("ns", 3, hashes(keys)) == 5
    assert b.get_many(keys, out) == [True] * 5 and same_bytes(out, pages)
    b.evict_user("ns", 3)
    assert a.match("ns", 3, hashes(keys)) == 0
    other = RedisPageStore(redis_url, key_prefix="elsewhere")
    assert other.match("ns", 3, hashes(keys)) == 0
    for s in (a, b, other):
        s.close()


def test_evict_user_touches_only_that_user(store):
    # ":" and glob characters in a namespace must not leak into another user's key pattern
    tricky = [PageKey("a:1", 2, 0, 5), PageKey("a", 1, 0, 5), PageKey("a*", 1, 0, 5), PageKey("a", 12, 0, 5)]
    store.put_many(tricky, random_pages(4))
    store.evict_user("a", 1)
    assert [store.match(k.namespace, k.user_id, [5]) for k in tricky] == [1, 0, 1, 1]
    store.clear()
    assert store.num_pages_stored == 0


def test_evict_namespace_touches_only_that_namespace(store):
    # a namespace that is another's prefix, or holds glob characters, must not match the other's keys
    keys = [PageKey("a", 1, 0, 5), PageKey("a", 2, 3, 6), PageKey("ab", 1, 0, 5), PageKey("a*", 1, 0, 5),
            PageKey("a:1", 1, 0, 5), PageKey("*", 1, 0, 5)]
    store.put_many(keys, random_pages(len(keys)))
    store.evict_namespace("a")
    assert [store.match(k.namespace, k.user_id, [k.page_hash]) for k in keys] == [0, 0, 1, 1, 1, 1]
    store.evict_namespace("*")
    assert [store.match(k.namespace, k.user_id, [k.page_hash]) for k in keys] == [0, 0, 1, 1, 1, 0]
    assert store.num_pages_stored == 3


def test_ttl_is_set_and_renewed(redis_url, client):
    s = RedisPageStore(redis_url, ttl_s=100)
    keys = user_keys(1, 1)
    s.put_many(keys, random_pages(1))
    name = s.key_name(keys[0])
    assert 0 < client.ttl(name) <= 100
    client.expire(name, 5)
    assert s.get_many(keys, torch.empty(1, *PAGE_SHAPE)) == [True]
    assert client.ttl(name) > 5  # the read renewed it
    s.close()


def test_renew_restarts_the_ttl_of_held_pages_only(redis_url, client):
    s = RedisPageStore(redis_url, ttl_s=100, max_batch=2)
    keys = user_keys(1, 3)
    s.put_many(keys[:2], random_pages(2))
    for k in keys[:2]:
        client.expire(s.key_name(k), 5)
    trips = s.stats()["round_trips"]
    assert s.renew(keys) == [True, True, False]  # (two round trips of two keys at most)
    assert s.stats()["round_trips"] == trips + 2
    assert [client.ttl(s.key_name(k)) for k in keys] == [100, 100, -2]  # the missing page is not created
    st = s.stats()
    assert (st["pages_renewed"], st["renew_failed"]) == (2, 0) and st["renew_latency_s"] > 0 and s.renew([]) == []
    plain = RedisPageStore(redis_url)  # no TTL: nothing is sent, nothing gets one
    trips = plain.stats()["round_trips"]
    assert plain.renew(keys) == [False] * 3 and plain.stats()["round_trips"] == trips
    plain.put_many(keys[2:], random_pages(1))
    assert plain.renew(keys[2:]) == [False] and client.ttl(s.key_name(keys[2])) == -1
    s.close()
    plain.close()


def test_renew_on_a_dead_server_is_unknown_and_backs_off(redis_server, redis_url):
    s = RedisPageStore(redis_url, ttl_s=100, retry_after_s=60)
    keys = user_keys(1, 2)
    redis_server.kill()
    assert s.renew(keys) == [None, None]
    assert s.stats()["renew_failed"] == 2 and s.stats()["errors"] == 1
    assert s.renew(keys) == [None, None] and s.stats()["skipped_while_down"] == 1  # not even tried
    assert s.stats()["renew_failed"] == 4  # (skipped: failed too)
    redis_server.restart()
    s.close()


def test_a_refused_renewal_is_unknown_without_backing_off_and_the_rest_is_still_sent(redis_url, client):
    owner = RedisPageStore(redis_url, ttl_s=100)
    keys = user_keys(1, 3)
    owner.put_many(keys, random_pages(3))
    client.acl_setuser("no-expire", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-expire"])
    try:
        s = RedisPageStore(redis_url.replace("redis://", "redis://no-expire:pw@"), ttl_s=100, retry_after_s=60,
                           max_batch=2)
        assert s.renew(keys) == [None, None, None]  # NOPERM for each key, both batches sent
        st = s.stats()
        assert (st["renew_failed"], st["errors"], st["skipped_while_down"], st["round_trips"]) == (3, 1, 0, 2)
        assert s.match("ns", 1, hashes(keys)) == 3  # the server answered: no back-off
        s.close()
    finally:
        client.acl_deluser("no-expire")
    owner.close()


@pytest.mark.parametrize("kwargs, bad", [
    ({"url": "http://localhost"}, "http://localhost"),
    ({"key_prefix": "a*b"}, "a\\*b"),
    ({"key_prefix": ""}, "key_prefix"),
    ({"max_batch": 0}, "max_batch"),
    ({"ttl_s": -1}, "ttl_s"),
    ({"socket_timeout_s": 0}, "socket_timeout_s"),
    ({"page_bytes": 0}, "page_bytes"),
])
def test_bad_construction_args(kwargs, bad):
    with pytest.raises(ValueError, match=bad):
        RedisPageStore(**kwargs)


def test_page_bytes_is_checked(redis_url):
    s = RedisPageStore(redis_url, page_bytes=8)
    with pytest.raises(ValueError, match="bytes"):
        s.put_many(user_keys(1, 1), random_pages(1))
    s.close()


def test_a_key_of_another_type_misses_without_backing_off(redis_url, client):
    s = RedisPageStore(redis_url, retry_after_s=60)
    keys = user_keys(1, 2)
    pages = random_pages(2)
    s.put_many(keys, pages)
    client.delete(s.key_name(keys[1]))
    client.rpush(s.key_name(keys[1]), b"not a page")  # GET answers WRONGTYPE for this key only
    out = torch.empty_like(pages)
    assert s.get_many(keys, out) == [True, False]
    assert s.get_many(keys[:1], out[:1]) == [True]  # the server is fine: no back-off
    assert s.stats()["errors"] == 1 and s.stats()["skipped_while_down"] == 0
    s.close()


def test_four_threads_share_one_store(store):
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def worker(tid: int) -> None:
        try:
            barrier.wait()
            for it in range(10):
                keys = user_keys(tid, 8, version=it)
                pages = random_pages(8, seed=tid * 100 + it)
                assert store.put_many(keys, pages) == [True] * 8
                out = torch.empty_like(pages)
                assert store.get_many(keys, out) == [True] * 8
                assert same_bytes(out, pages)
                assert store.match("ns", tid, hashes(keys)) == 8
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert store.stats()["hits"] == 4 * 10 * 8 and store.stats()["in_flight"] == 0
