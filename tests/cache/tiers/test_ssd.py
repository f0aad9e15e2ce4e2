"""The SSD page store: byte-exact round trips, batching, LRU, and faults on disk."""

from __future__ import annotations

import errno
import logging
import os
import threading

import pytest
import torch

from gr_plugin.cache.tiers import PageKey, SSDPageStore

from .helpers import ALIGNED_PAGE_SHAPE, PAGE_SHAPE, page_bytes, random_pages, same_bytes, user_keys

SLOT = 4096  # PAGE_SHAPE pages (1024 bytes fp32) + header round up to one 4096-byte slot


def make_store(path, num_slots: int = 64, shape=PAGE_SHAPE, dtype=torch.float32, **kwargs) -> SSDPageStore:
    pb = page_bytes(shape, dtype)
    slot = (pb + 580 + 4095) // 4096 * 4096
    kwargs.setdefault("o_direct", False)
    return SSDPageStore(path, num_slots * slot, pb, **kwargs)


@pytest.fixture
def store(tmp_path):
    s = make_store(tmp_path / "ssd")
    yield s
    s.close()


def hashes(keys: list[PageKey]) -> list[int]:
    return [k.page_hash for k in keys]


@pytest.mark.parametrize("o_direct", [False, "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_byte_exact(tmp_path, dtype, o_direct):
    with make_store(tmp_path, dtype=dtype, o_direct=o_direct, slab_bytes=8 * SLOT) as s:
        keys = [k for u in (1, 2, 3) for k in user_keys(u, 4)]
        pages = random_pages(len(keys), dtype=dtype, seed=1)
        assert s.put_many(keys, pages) == [True] * 12
        order = torch.randperm(12, generator=torch.Generator().manual_seed(0)).tolist()
        out = torch.zeros_like(pages)
        assert s.get_many([keys[i] for i in order], out) == [True] * 12
        assert same_bytes(out, pages[order])
        st = s.stats()
        assert (st["hits"], st["misses"], st["pages_written"], st["corruptions"]) == (12, 0, 12, 0)
        assert st["io_mode"] in ("o_direct", "buffered")
        s.check()


def test_missing_and_foreign_keys_miss(store):
    keys = user_keys(1, 2)
    store.put_many(keys, random_pages(2))
    out = torch.zeros((3, *PAGE_SHAPE))
    wrong_hash = PageKey("ns", 1, 1, keys[1].page_hash ^ 1)
    other_ns = PageKey("other", 1, 0, keys[0].page_hash)
    assert store.get_many([wrong_hash, other_ns, keys[0]], out) == [False, False, True]
    assert store.stats()["misses"] == 2


def test_large_batches_coalesce_into_one_syscall_per_run(tmp_path):
    with make_store(tmp_path, num_slots=128, shape=ALIGNED_PAGE_SHAPE, num_threads=4) as s:
        keys = user_keys(7, 96)
        pages = random_pages(96, ALIGNED_PAGE_SHAPE, seed=3)
        assert s.put_many(keys, pages) == [True] * 96  # a fresh store: slots 0..95, adjacent
        out = torch.empty_like(pages)
        assert s.get_many(keys, out) == [True] * 96
        assert same_bytes(out, pages)
        # 96 slots of 8 KiB = 768 KiB < 1 MiB: one run, one syscall each way, in the calling thread
        assert (s.stats()["write_syscalls"], s.stats()["read_syscalls"]) == (1, 1)
    with make_store(tmp_path / "big", num_slots=256, shape=ALIGNED_PAGE_SHAPE, num_threads=4) as s:
        keys = user_keys(8, 256)
        pages = random_pages(256, ALIGNED_PAGE_SHAPE, seed=4)
        assert s.put_many(keys, pages) == [True] * 256
        out = torch.empty_like(pages)
        assert s.get_many(keys[::-1], out) == [True] * 256
        assert same_bytes(out, pages.flip(0))
        # 2 MiB: split into one run per thread, each one preadv
        assert s.stats()["read_syscalls"] == 4


def test_four_threads_at_once(store):
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def worker(tid: int) -> None:
        try:
            barrier.wait()
            for it in range(15):
                user = tid * 100 + it % 3
                keys = user_keys(user, 3, version=it // 3)
                pages = random_pages(3, seed=tid * 1000 + it)
                ok = store.put_many(keys, pages)
                assert ok == [True] * 3, ok
                out = torch.empty_like(pages)
                got = store.get_many(keys, out)
                # another thread may evict this user in between; what is read must be exact
                for i, hit in enumerate(got):
                    if hit:
                        assert same_bytes(out[i], pages[i])
                assert store.match("ns", user, hashes(keys)) in (0, 1, 2, 3)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    store.check()
    st = store.stats()
    assert st["corruptions"] == st["io_errors"] == 0 and st["in_flight"] == st["queued"] == 0


def test_o_direct_with_unaligned_tensors_goes_through_a_bounce_buffer(tmp_path):
    s = make_store(tmp_path, shape=ALIGNED_PAGE_SHAPE, o_direct="auto")
    with s:
        if s.io_mode != "o_direct":
            pytest.skip(f"{tmp_path} refuses O_DIRECT")
        numel = 5 * torch.empty(ALIGNED_PAGE_SHAPE).numel()
        src = torch.randn(numel + 1)[1:].view(5, *ALIGNED_PAGE_SHAPE)  # 4 bytes off alignment
        assert src.data_ptr() % 4096 != 0
        keys = user_keys(1, 5)
        assert s.put_many(keys, src) == [True] * 5
        out = torch.zeros(numel + 3)[3:].view(5, *ALIGNED_PAGE_SHAPE)
        assert s.get_many(keys, out) == [True] * 5
        assert same_bytes(out, src)
        aligned = torch.empty(5, *ALIGNED_PAGE_SHAPE)
        assert s.get_many(keys, aligned) == [True] * 5
        assert same_bytes(aligned, src)


def test_o_direct_refused_falls_back_or_raises(tmp_path, monkeypatch, caplog):
    real_open = os.open

    def no_direct(path, flags, *args, **kwargs):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_direct)
    with caplog.at_level(logging.INFO, logger="gr_plugin.cache.tiers.ssd"):
        s = make_store(tmp_path / "a", o_direct="auto")
    assert s.io_mode == "buffered"
    assert "refuses O_DIRECT" in caplog.text
    keys = user_keys(1, 2)
    pages = random_pages(2)
    assert s.put_many(keys, pages) == [True, True]
    out = torch.empty_like(pages)
    assert s.get_many(keys, out) == [True, True] and same_bytes(out, pages)
    s.close()
    with pytest.raises(ValueError, match="refuses O_DIRECT"):
        make_store(tmp_path / "b", o_direct=True)


def test_prefix_rule_and_divergent_suffix(store):
    keys = user_keys(1, 4)
    pages = random_pages(4)
    assert store.put_many(keys[2:], pages[2:]) == [False, False]  # pages 0, 1 missing
    assert store.put_many([keys[1], keys[0]], pages[:2].flip(0)) == [True, True]
    assert store.put_many(keys, pages) == [True] * 4
    assert store.stats()["pages_written"] == 4  # pages 0, 1 were not written again
    assert store.match("ns", 1, [*hashes(keys), 123]) == 4
    edited = user_keys(1, 3, first=1, version=1)  # history edited at page 1
    new_pages = random_pages(2, seed=9)
    assert store.put_many(edited, new_pages) == [True, True]
    assert store.match("ns", 1, hashes(keys)) == 1
    assert store.match("ns", 1, hashes(keys[:1] + edited)) == 3
    out = torch.empty(3, *PAGE_SHAPE)
    assert store.get_many(keys[:1] + edited, out) == [True] * 3
    assert same_bytes(out[0], pages[0]) and same_bytes(out[1:], new_pages)
    assert store.num_pages_stored == 3
    store.check()


def test_lru_eviction_order_is_exact(tmp_path):
    with make_store(tmp_path, num_slots=6) as s:
        for user in (1, 2, 3):
            assert s.put_many(user_keys(user, 2), random_pages(2, seed=user)) == [True, True]
        out = torch.empty(1, *PAGE_SHAPE)
        assert s.get_many(user_keys(1, 1), out) == [True]  # user 1 becomes most recent
        assert s.put_many(user_keys(4, 2), random_pages(2)) == [True, True]
        assert s.lru_order() == [("ns", 3), ("ns", 1), ("ns", 4)]
        assert s.put_many(user_keys(5, 4), random_pages(4)) == [True] * 4
        assert s.lru_order() == [("ns", 4), ("ns", 5)]
        st = s.stats()
        assert (st["evicted_users"], st["evicted_pages"]) == (3, 6)
        assert s.match("ns", 2, hashes(user_keys(2, 2))) == 0
        out = torch.empty(2, *PAGE_SHAPE)
        assert s.get_many(user_keys(4, 2), out) == [True, True]
        assert same_bytes(out, random_pages(2))


def test_a_user_being_read_is_not_evicted(tmp_path, monkeypatch):
    s = make_store(tmp_path, num_slots=4)
    a, b = user_keys(1, 2), user_keys(2, 2)
    pages = random_pages(2, seed=5)
    s.put_many(a, pages)
    s.put_many(b, random_pages(2))
    real_preadv = os.preadv
    started, release = threading.Event(), threading.Event()

    def slow_preadv(*args):
        if threading.current_thread() is reader:
            started.set()
            assert release.wait(10)
        return real_preadv(*args)

    monkeypatch.setattr(os, "preadv", slow_preadv)
    out = torch.empty_like(pages)
    got: list = []
    reader = threading.Thread(target=lambda: got.append(s.get_many(a, out)))
    reader.start()
    try:
        assert started.wait(10)
        assert s.get_many(b[:1], torch.empty(1, *PAGE_SHAPE)) == [True]
        assert s.lru_order() == [("ns", 1), ("ns", 2)]
        # user 1 is the least recent, but being read: user 2 is evicted instead
        assert s.put_many(user_keys(3, 2), random_pages(2)) == [True, True]
        assert s.lru_order() == [("ns", 1), ("ns", 3)]
        # user 3 is evicted for pages 0, 1; user 1 (being read) is not, so page 2 finds no room
        assert s.put_many(user_keys(4, 3), random_pages(3)) == [True, True, False]
    finally:
        release.set()
        reader.join()
    assert got == [[True, True]] and same_bytes(out, pages)
    s.check()
    s.close()


def test_corrupted_byte_misses_and_others_still_hit(store):
    keys = {u: user_keys(u, 3) for u in (1, 2)}
    pages = {u: random_pages(3, seed=u) for u in (1, 2)}
    for u in (1, 2):
        store.put_many(keys[u], pages[u])
    path, offset = store.page_location(keys[1][1])
    with open(path, "r+b") as f:  # flip one payload byte of user 1, page 1
        f.seek(offset + 100)
        byte = f.read(1)
        f.seek(offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    out = torch.empty(3, *PAGE_SHAPE)
    assert store.get_many(keys[1], out) == [True, False, True]
    assert same_bytes(out[0], pages[1][0]) and same_bytes(out[2], pages[1][2])
    assert store.stats()["corruptions"] == 1
    # the bad page and the pages after it are dropped: the stored prefix stays contiguous
    assert store.match("ns", 1, hashes(keys[1])) == 1
    assert store.get_many(keys[2], out) == [True] * 3 and same_bytes(out, pages[2])
    # the dropped pages can be stored again
    assert store.put_many(keys[1], pages[1]) == [True] * 3
    assert store.get_many(keys[1], out) == [True] * 3 and same_bytes(out, pages[1])
    store.check()


def test_corrupted_header_misses(store):
    keys = user_keys(1, 2)
    store.put_many(keys, random_pages(2))
    path, offset = store.page_location(keys[0])
    with open(path, "r+b") as f:  # the header follows the 1024-byte payload: hit the user id
        f.seek(offset + 1024 + 12)
        f.write(b"\x99")
    out = torch.empty(2, *PAGE_SHAPE)
    assert store.get_many(keys, out) == [False, True]
    assert store.stats()["corruptions"] == 1
    assert store.match("ns", 1, hashes(keys)) == 0


def test_truncated_slab_misses_without_raising(tmp_path):
    with make_store(tmp_path, num_slots=8, slab_bytes=4 * SLOT) as s:
        keys = user_keys(1, 8)
        pages = random_pages(8)
        assert s.put_many(keys, pages) == [True] * 8
        os.truncate(s.slab_path(0), 2 * SLOT + 100)  # slots 2, 3 of slab 0 are cut
        out = torch.empty_like(pages)
        got = s.get_many(keys, out)
        assert got == [True, True, False, False, True, True, True, True]
        assert same_bytes(out[:2], pages[:2]) and same_bytes(out[4:], pages[4:])
        assert s.stats()["corruptions"] == 2
        assert s.match("ns", 1, hashes(keys)) == 2
        s.check()


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EIO])
def test_write_errors_are_counted_not_raised(store, monkeypatch, caplog, code):
    keys = user_keys(1, 6)
    pages = random_pages(6)
    assert store.put_many(keys[:2], pages[:2]) == [True, True]

    def failing_pwritev(*args):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "pwritev", failing_pwritev)
    with caplog.at_level(logging.WARNING, logger="gr_plugin.cache.tiers.ssd"):
        for _ in range(5):
            assert store.put_many(keys, pages) == [True, True, False, False, False, False]
            assert store.put_many(user_keys(2, 2), pages[:2]) == [False, False]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, "one warning per burst, not one per page"
    assert errno.errorcode[code] in warnings[0].getMessage()
    st = store.stats()
    assert st["io_errors"] == 5 * (4 + 2) and st["put_rejected"] == 5 * (4 + 2)
    out = torch.empty(2, *PAGE_SHAPE)
    assert store.get_many(keys[:2], out) == [True, True] and same_bytes(out, pages[:2])
    assert store.match("ns", 1, hashes(keys)) == 2
    store.check()
    monkeypatch.undo()
    assert store.put_many(keys, pages) == [True] * 6  # the disk is back: the store works again


def test_read_errors_are_counted_not_raised(store, monkeypatch):
    keys = user_keys(1, 2)
    store.put_many(keys, random_pages(2))

    def failing_preadv(*args):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "preadv", failing_preadv)
    out = torch.empty(2, *PAGE_SHAPE)
    assert store.get_many(keys, out) == [False, False]
    assert store.stats()["io_errors"] == 2
    store.check()


def test_short_write_publishes_the_whole_pages_only(store, monkeypatch):
    keys = user_keys(1, 3)
    pages = random_pages(3)
    real_pwritev = os.pwritev

    def short_pwritev(fd, buffers, offset):
        return real_pwritev(fd, buffers[:3], offset)  # page 0 and page 1's payload: the disk filled up

    monkeypatch.setattr(os, "pwritev", short_pwritev)
    assert store.put_many(keys, pages) == [True, False, False]
    monkeypatch.undo()
    out = torch.empty(1, *PAGE_SHAPE)
    assert store.get_many(keys[:1], out) == [True] and same_bytes(out, pages[:1])
    assert store.stats()["io_errors"] == 2


def test_directory_that_cannot_be_written_raises_at_construction(tmp_path):
    afile = tmp_path / "a-file"
    afile.write_text("x")
    with pytest.raises(ValueError, match="a-file"):
        make_store(afile / "ssd")
    if os.geteuid() != 0:  # NOTE: root ignores directory permissions
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        try:
            with pytest.raises(ValueError, match="ro"):
                make_store(ro)
        finally:
            ro.chmod(0o700)


def test_directory_in_use_by_another_store(tmp_path):
    s = make_store(tmp_path)
    with pytest.raises(ValueError, match="in use"):
        make_store(tmp_path)
    s.close()
    make_store(tmp_path).close()


@pytest.mark.parametrize("kwargs, bad", [
    ({"capacity_bytes": 0}, "capacity_bytes"),
    ({"capacity_bytes": 100}, "capacity_bytes=100"),
    ({"page_bytes": -1}, "page_bytes"),
    ({"page_bytes": 1.5}, "page_bytes"),
    ({"num_threads": 0}, "num_threads"),
    ({"num_threads": 1000}, "num_threads"),
    ({"slab_bytes": 10}, "slab_bytes=10"),
    ({"o_direct": "yes"}, "'yes'"),
    ({"dir": ""}, "dir"),
])
def test_bad_construction_args(tmp_path, kwargs, bad):
    args = {"dir": tmp_path, "capacity_bytes": 1 << 20, "page_bytes": 1024, **kwargs}
    with pytest.raises(ValueError, match=bad):
        SSDPageStore(args.pop("dir"), args.pop("capacity_bytes"), args.pop("page_bytes"), **args)


def test_bad_tensors_raise(store):
    keys = user_keys(1, 2)
    with pytest.raises(ValueError, match="shape"):
        store.put_many(keys, random_pages(3))
    with pytest.raises(ValueError, match="bytes"):
        store.put_many(keys, random_pages(2, shape=(2, 2, 4, 2, 4)))
    with pytest.raises(ValueError, match="contiguous"):
        store.get_many(keys, torch.empty(*PAGE_SHAPE, 2).movedim(-1, 0))
    with pytest.raises(ValueError, match="PageKey"):
        store.get_many([("ns", 1, 0, 0)], torch.empty(1, *PAGE_SHAPE))
    assert store.put_many([], torch.empty(0, *PAGE_SHAPE)) == []


def test_evict_namespace_keeps_the_other_namespaces(store):
    for ns in ("a", "b"):
        for u in (1, 2):
            store.put_many(user_keys(u, 2, namespace=ns), random_pages(2))
    store.evict_namespace("a")
    assert [store.match(ns, u, hashes(user_keys(u, 2))) for ns in "ab" for u in (1, 2)] == [0, 0, 2, 2]
    assert store.num_pages_stored == 4
    store.check()


def test_evict_user_clear_and_close(store):
    for u in (1, 2):
        store.put_many(user_keys(u, 2), random_pages(2))
    store.evict_user("ns", 1)
    assert store.match("ns", 1, hashes(user_keys(1, 2))) == 0
    assert store.match("ns", 2, hashes(user_keys(2, 2))) == 2
    store.clear()
    assert store.num_pages_stored == 0 and store.lru_order() == []
    store.check()
    store.close()
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.match("ns", 2, [])
