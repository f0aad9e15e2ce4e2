"""The SSD page store: pre-allocated slab files of fixed-size slots, positional I/O on a thread pool.

Owns `SSDPageStore`: the slab files under one directory (``slab-000.bin``, ...), the choice of
O_DIRECT or buffered I/O, batching of pages into coalesced runs (one ``preadv``/``pwritev`` per run
of adjacent slots, runs spread over a thread pool), and verification of every page read. Which slot
holds which page, the contiguous-prefix rule and LRU over users are `ssd_index.SlotIndex`'s; the
header format is `page_format`'s. Pages come and go through contiguous CPU tensors (see
`types.page_rows`); the store does not handle strided host-table slices.

Slot layout (``slot_bytes`` = page bytes + `MAX_HEADER_BYTES` rounded up to 4096)::

    [ payload: page_bytes | header (page_format) | padding ]

The payload comes first so that it starts on a 4096-byte boundary: with O_DIRECT an aligned caller
tensor is read and written in place (``preadv`` scatters each slot into its tensor row and its
header into a scratch buffer); an unaligned one goes through an aligned bounce buffer.

The index lives in memory only: a new store starts empty and overwrites what the slabs held. Writes
are not fsync'ed (this is a cache; a page lost in a crash is a miss). I/O errors never raise: the
page answers False, the error is counted and logged once per burst, and the store keeps serving
what it has.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import fcntl
import logging
import math
import mmap
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from gr_plugin.cache.tiers.burst_log import BurstLog, ThrottledLog
from gr_plugin.cache.tiers.page_format import (
    MAX_HEADER_BYTES,
    byte_view,
    checksum,
    dtype_code,
    encode_header,
    verify,
)
from gr_plugin.cache.tiers.ssd_index import SlotIndex, UserKey
from gr_plugin.cache.tiers.types import PageKey, PageStore, page_rows

logger = logging.getLogger(__name__)

ALIGN = 4096
#: NOTE: two iovecs per slot and Linux's IOV_MAX is 1024; 256 slots leaves room.
_MAX_RUN_SLOTS = 256
#: a run of adjacent slots is split above this so that large batches spread over the threads
_MAX_RUN_BYTES = 8 << 20
#: below this a batch runs in the calling thread: a pool hand-off costs more than it saves
_MIN_PARALLEL_BYTES = 1 << 20
_IO_ERROR = "I/O error"


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def slot_count(capacity_bytes: int, page_bytes: int) -> int:
    """Slots of pages of ``page_bytes`` (each with its header, aligned) that ``capacity_bytes`` holds;
    raises ValueError when none."""
    slot_bytes = _round_up(page_bytes + MAX_HEADER_BYTES, ALIGN)
    if capacity_bytes // slot_bytes == 0:
        raise ValueError(f"SSDPageStore.capacity_bytes={capacity_bytes} holds no slot of {slot_bytes} bytes "
                         f"(page_bytes={page_bytes} + header)")
    return capacity_bytes // slot_bytes


@dataclasses.dataclass
class _Run:
    """Adjacent slots of one slab, moved by one syscall: ``items`` are (key position, slot, row address)."""

    slab: int
    offset: int
    items: list[tuple[int, int, int]]


class SSDPageStore(PageStore):
    """Pages in slab files under ``dir``, ``capacity_bytes`` of slots in all (headers included).

    ``page_bytes``: bytes of one page (every tensor row put or read must have exactly this size).
    ``num_threads``: I/O threads. ``slab_bytes``: size of one slab file (rounded down to whole
    slots). ``o_direct``: ``True`` (refuse to run without it), ``False``, or ``"auto"`` (use it where
    the filesystem accepts it). Raises `ValueError` for bad arguments or a directory that cannot be
    created, written or locked.
    """

    tier_name = "ssd"

    def __init__(
        self,
        dir: str | os.PathLike,
        capacity_bytes: int,
        page_bytes: int,
        *,
        num_threads: int = 4,
        slab_bytes: int = 1 << 30,
        o_direct: bool | str = "auto",
    ) -> None:
        for name, value in (("capacity_bytes", capacity_bytes), ("page_bytes", page_bytes),
                            ("num_threads", num_threads), ("slab_bytes", slab_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"SSDPageStore.{name} must be a positive int, got {value!r}")
        if num_threads > 256:
            raise ValueError(f"SSDPageStore.num_threads must be <= 256, got {num_threads}")
        if o_direct not in (True, False, "auto"):
            raise ValueError(f"SSDPageStore.o_direct must be True, False or 'auto', got {o_direct!r}")
        if not isinstance(dir, str | os.PathLike) or not str(dir):
            raise ValueError(f"SSDPageStore.dir must be a path, got {dir!r}")
        self.page_bytes = page_bytes
        self.slot_bytes = _round_up(page_bytes + MAX_HEADER_BYTES, ALIGN)
        self.num_slots = slot_count(capacity_bytes, page_bytes)
        if slab_bytes < self.slot_bytes:
            raise ValueError(f"SSDPageStore.slab_bytes={slab_bytes} is smaller than one slot ({self.slot_bytes})")
        self.slots_per_slab = slab_bytes // self.slot_bytes
        self.num_threads = num_threads
        self.dir = Path(dir)
        self._closed = True
        self._lock_fd = -1
        self._fds: list[int] = []
        self._setup_dir()
        try:
            self.io_mode = self._open_slabs(o_direct)
        except BaseException:
            self._close_files()
            raise
        self._direct = self.io_mode == "o_direct"
        self._index = SlotIndex(self.num_slots)
        self._lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._tls = threading.local()
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="gr-ssd-io")
        self._errors = BurstLog(logger, f"SSD page store {self.dir}")
        self._corrupt_log = ThrottledLog(logger, f"SSD page store {self.dir}")
        self._counters: dict[str, float] = dict.fromkeys(
            ("hits", "misses", "pages_written", "put_rejected", "corruptions", "io_errors", "bytes_read",
             "bytes_written", "read_syscalls", "write_syscalls", "get_calls", "put_calls", "queued", "in_flight"), 0)
        self._counters.update(get_latency_s=0.0, put_latency_s=0.0)
        self._closed = False
        logger.info("SSD page store at %s: %d slots of %d bytes in %d slab(s), %s I/O, %d threads",
                    self.dir, self.num_slots, self.slot_bytes, len(self._fds), self.io_mode, num_threads)

    # ----------------------------------------------------------------- files
    def _setup_dir(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(self.dir / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ValueError(f"SSD cache dir {str(self.dir)!r} cannot be created or written: {exc}") from exc
        if not os.access(self.dir, os.W_OK | os.X_OK):
            self._close_files()
            raise ValueError(f"SSD cache dir {str(self.dir)!r} is not writable")
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            self._close_files()
            raise ValueError(f"SSD cache dir {str(self.dir)!r} is in use by another store: {exc}") from exc

    def slab_path(self, slab: int) -> Path:
        return self.dir / f"slab-{slab:03d}.bin"

    def _slab_size(self, slab: int) -> int:
        first = slab * self.slots_per_slab
        return min(self.slots_per_slab, self.num_slots - first) * self.slot_bytes

    def _open_slabs(self, o_direct: bool | str) -> str:
        num_slabs = math.ceil(self.num_slots / self.slots_per_slab)
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
        for slab in range(num_slabs):
            path, size = self.slab_path(slab), self._slab_size(slab)
            try:
                fd = os.open(path, flags, 0o600)
                self._fds.append(fd)
                os.ftruncate(fd, size)
            except OSError as exc:
                raise ValueError(f"SSD cache dir {str(self.dir)!r}: cannot create slab {path.name}: {exc}") from exc
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                    raise ValueError(
                        f"SSD cache dir {str(self.dir)!r} has no room for {size} bytes of {path.name}: {exc}"
                    ) from exc
                # NOTE: filesystems without fallocate keep a sparse file; ENOSPC then shows at write time.
        if o_direct is False:
            return "buffered"
        direct = self._reopen_direct()
        if direct is None:
            if o_direct is True:
                raise ValueError(f"SSD cache dir {str(self.dir)!r}: the filesystem refuses O_DIRECT")
            logger.info("SSD cache dir %s refuses O_DIRECT; using buffered I/O", self.dir)
            return "buffered"
        for fd in self._fds:
            os.close(fd)
        self._fds = direct
        return "o_direct"

    def _reopen_direct(self) -> list[int] | None:
        """The slabs opened with O_DIRECT, or ``None`` where the filesystem refuses it."""
        flag = getattr(os, "O_DIRECT", 0)
        if not flag:
            return None
        fds: list[int] = []
        probe = mmap.mmap(-1, ALIGN)
        try:
            for slab in range(len(self._fds)):
                fds.append(os.open(self.slab_path(slab), os.O_RDWR | os.O_CLOEXEC | flag))
            # NOTE: some filesystems accept the flag at open and refuse the I/O: probe one read.
            os.preadv(fds[0], [memoryview(probe)], 0)
        except OSError as exc:
            logger.debug("O_DIRECT refused in %s: %s", self.dir, exc)
            for fd in fds:
                os.close(fd)
            return None
        finally:
            probe.close()
        return fds

    def _close_files(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # NOTE: closing the last descriptor releases the flock
            self._lock_fd = -1

    # ----------------------------------------------------------------- I/O plumbing
    def _scratch(self, num_bytes: int) -> tuple[memoryview, int]:
        """This thread's page-aligned scratch buffer of at least ``num_bytes``, and its address."""
        tls = self._tls
        buf = getattr(tls, "buf", None)
        if buf is None or len(buf) < num_bytes:
            mem = mmap.mmap(-1, _round_up(max(num_bytes, 1 << 20), mmap.PAGESIZE))
            tls.addr = ctypes.addressof(ctypes.c_char.from_buffer(mem))
            tls.buf = buf = memoryview(mem)
        return buf, tls.addr

    def _runs(self, items: list[tuple[int, int, int]]) -> list[_Run]:
        """Group (key position, slot, address) into runs of adjacent slots of one slab."""
        items = sorted(items, key=lambda it: it[1])
        total = len(items) * self.slot_bytes
        cap = max(1, min(_MAX_RUN_SLOTS, _MAX_RUN_BYTES // self.slot_bytes))
        if total >= _MIN_PARALLEL_BYTES:  # NOTE: same threshold as `_execute`: split only what runs in parallel
            cap = max(1, min(cap, math.ceil(total / self.num_threads / self.slot_bytes)))
        runs: list[_Run] = []
        prev = -2
        for item in items:
            slot = item[1]
            slab, k = divmod(slot, self.slots_per_slab)
            run = runs[-1] if runs else None
            if run is None or slot != prev + 1 or run.slab != slab or len(run.items) >= cap:
                run = _Run(slab, k * self.slot_bytes, [])
                runs.append(run)
            run.items.append(item)
            prev = slot
        return runs

    def _execute(self, runs: list[_Run], fn: Callable[[_Run], list]) -> list:
        """``fn`` over every run: in the calling thread for small batches, else spread over the pool
        (the calling thread takes the first share). Returns the concatenated results."""
        total = sum(len(r.items) for r in runs) * self.slot_bytes
        shares = 1 if total < _MIN_PARALLEL_BYTES else min(self.num_threads, len(runs))
        chunks: list[list[_Run]] = [[] for _ in range(shares)]
        for j, run in enumerate(sorted(runs, key=lambda r: -len(r.items))):
            chunks[j % shares].append(run)
        futures = []
        for chunk in chunks[1:]:
            self._count(queued=1)
            futures.append(self._pool.submit(self._run_chunk, fn, chunk, True))
        out = self._run_chunk(fn, chunks[0], False)
        for future in futures:
            out.extend(future.result())
        return out

    def _run_chunk(self, fn: Callable[[_Run], list], chunk: list[_Run], queued: bool) -> list:
        self._count(queued=-1 if queued else 0, in_flight=1)
        try:
            out: list = []
            for run in chunk:
                out.extend(fn(run))
            return out
        finally:
            self._count(in_flight=-1)

    def _count(self, **deltas: float) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                self._counters[name] += delta

    def _io_failed(self, verb: str, run: _Run, exc: OSError) -> None:
        self._count(io_errors=len(run.items))
        self._errors.failure(f"{verb} {self.slab_path(run.slab).name} at {run.offset}: "
                             f"{errno.errorcode.get(exc.errno or 0, exc.errno)} {exc.strerror}")

    def _bounce(self, run: _Run) -> bool:
        """O_DIRECT needs aligned memory and lengths; pages that are not go through a bounce buffer."""
        return self._direct and (self.page_bytes % ALIGN != 0 or any(a % ALIGN for _, _, a in run.items))

    # ----------------------------------------------------------------- writing
    def _write_run(self, run: _Run, keys: list[PageKey], dtype: int) -> list[tuple[int, bool]]:
        pb, sb = self.page_bytes, self.slot_bytes
        n = len(run.items)
        if self._bounce(run):
            buf, base = self._scratch(n * sb)
            for j, (pos, _, addr) in enumerate(run.items):
                ctypes.memmove(base + j * sb, addr, pb)
                header = encode_header(keys[pos], dtype, pb, checksum(byte_view(addr, pb)))
                buf[j * sb + pb : j * sb + pb + len(header)] = header
            iov: list = [buf[: n * sb]]
        else:
            tail = sb - pb
            tails, _ = self._scratch(n * tail)
            iov = []
            for j, (pos, _, addr) in enumerate(run.items):
                page = byte_view(addr, pb)
                header = encode_header(keys[pos], dtype, pb, checksum(page))
                tails[j * tail : j * tail + len(header)] = header
                iov += [page, tails[j * tail : (j + 1) * tail]]
        try:
            done = os.pwritev(self._fds[run.slab], iov, run.offset)
        except OSError as exc:
            self._io_failed("write", run, exc)
            return [(pos, False) for pos, _, _ in run.items]
        self._count(write_syscalls=1, bytes_written=done)
        whole = done // sb
        if whole < n:  # a short write: the disk filled up part way
            self._count(io_errors=n - whole)
            self._errors.failure(f"short write to {self.slab_path(run.slab).name}: {done} of {n * sb} bytes")
        return [(pos, j < whole) for j, (pos, _, _) in enumerate(run.items)]

    def put_many(self, keys: list[PageKey], pages: torch.Tensor) -> list[bool]:
        """Store ``pages[i]`` (``[n, ...]`` contiguous CPU, ``page_bytes`` per row) as ``keys[i]``.

        Page ``i`` of a user is stored only if pages ``0..i-1`` are stored or in this call; a
        stored page with another hash drops the stored pages from there on. Already stored pages
        answer True without a write. A user whose previous put is still in flight accepts nothing
        new (False). When full, least-recently-used users not being read or written are evicted.
        """
        self._check_open()
        addrs, _ = page_rows(keys, pages, self.page_bytes, "pages")
        if not keys:
            return []
        start = time.perf_counter()
        with self._lock:
            plan = self._index.plan_put(keys)
        ok: dict[int, bool] = {}
        try:
            if plan.writes:
                runs = self._runs([(p, slot, addrs[p]) for p, slot in plan.writes])
                code = dtype_code(pages.dtype)
                ok = dict(self._execute(runs, lambda run: self._write_run(run, keys, code)))
        finally:
            with self._lock:
                results = self._index.finish_put(plan, ok)
        if ok and all(ok.values()):
            self._errors.success()
        stored = sum(ok.values())
        self._count(put_calls=1, pages_written=stored, put_rejected=results.count(False),
                    put_latency_s=time.perf_counter() - start)
        return results

    # ----------------------------------------------------------------- reading
    def _read_run(self, run: _Run, keys: list[PageKey], dtype: int) -> list[tuple[int, str | None]]:
        """Read a run into its rows; per page ``None`` (verified) or why it is not valid."""
        pb, sb = self.page_bytes, self.slot_bytes
        n = len(run.items)
        bounce = self._bounce(run)
        if bounce:
            buf, base = self._scratch(n * sb)
            iov: list = [buf[: n * sb]]
            headers, stride = buf[pb:], sb
        else:
            tail = sb - pb
            buf, _ = self._scratch(n * tail)
            iov = []
            for j, (_, _, addr) in enumerate(run.items):
                iov += [byte_view(addr, pb), buf[j * tail : (j + 1) * tail]]
            headers, stride = buf, tail
        try:
            done = os.preadv(self._fds[run.slab], iov, run.offset)
        except OSError as exc:
            self._io_failed("read", run, exc)
            return [(pos, _IO_ERROR) for pos, _, _ in run.items]
        self._count(read_syscalls=1, bytes_read=done)
        out: list[tuple[int, str | None]] = []
        for j, (pos, _, addr) in enumerate(run.items):
            if done < (j + 1) * sb:
                out.append((pos, f"short read ({done} of {n * sb} bytes): slab truncated"))
                continue
            if bounce:
                ctypes.memmove(addr, base + j * sb, pb)
            header = headers[j * stride : j * stride + MAX_HEADER_BYTES]
            out.append((pos, verify(header, keys[pos], dtype, byte_view(addr, pb), pb)))
        return out

    def get_many(self, keys: list[PageKey], out: torch.Tensor) -> list[bool]:
        """Read ``keys[i]`` into ``out[i]`` (``[n, ...]`` contiguous CPU, ``page_bytes`` per row).

        True only for a page that is stored, read whole, and whose header names ``keys[i]`` and
        whose checksum verifies; a page that fails is dropped (with the pages after it). Rows
        answered False hold unspecified bytes. A hit makes its user most recently used.
        """
        self._check_open()
        addrs, _ = page_rows(keys, out, self.page_bytes, "out")
        if not keys:
            return []
        start = time.perf_counter()
        results = [False] * len(keys)
        with self._lock:
            found = self._index.pin(keys)
        verdicts: list[tuple[int, str | None]] = []
        try:
            items = [(p, f[1], addrs[p]) for p, f in enumerate(found) if f is not None]
            if items:
                code = dtype_code(out.dtype)
                verdicts = self._execute(self._runs(items), lambda run: self._read_run(run, keys, code))
        finally:
            with self._lock:
                bad = []
                for pos, why in verdicts:
                    if why is None:
                        results[pos] = True
                    else:
                        entry, slot = found[pos]  # type: ignore[misc]
                        self._index.drop(keys[pos], entry, slot)
                        bad.append((keys[pos], why))
                for f in found:
                    if f is not None:
                        self._index.unpin(*f)
        corrupt = [b for b in bad if b[1] != _IO_ERROR]
        if corrupt:
            self._corrupt_log.warn(len(corrupt), f"{corrupt[0][0]}: {corrupt[0][1]} (dropped)")
        elif verdicts:
            self._errors.success()
        hits = sum(results)
        self._count(get_calls=1, hits=hits, misses=len(keys) - hits, corruptions=len(corrupt),
                    get_latency_s=time.perf_counter() - start)
        return results

    def match(self, namespace: str, user_id: int, page_hashes: list[int]) -> int:
        """Leading pages of ``page_hashes`` held (published); does not touch the LRU order."""
        self._check_open()
        with self._lock:
            return self._index.match((namespace, user_id), page_hashes)

    # ----------------------------------------------------------------- eviction
    def evict_user(self, namespace: str, user_id: int) -> None:
        """Forget a user's pages (slots still being read are reused only after the read ends)."""
        self._check_open()
        with self._lock:
            self._index.evict_user((namespace, user_id))

    def evict_namespace(self, namespace: str) -> None:
        self._check_open()
        with self._lock:
            for user in [u for u in self._index.lru_order() if u[0] == namespace]:
                self._index.evict_user(user)

    def clear(self) -> None:
        self._check_open()
        with self._lock:
            self._index.clear()

    # ----------------------------------------------------------------- introspection
    @property
    def num_pages_stored(self) -> int:
        with self._lock:
            return self._index.stats()["pages_stored"]

    def lru_order(self) -> list[UserKey]:
        """Users ``(namespace, user_id)``, least recently used first."""
        with self._lock:
            return self._index.lru_order()

    def page_location(self, key: PageKey) -> tuple[Path, int] | None:
        """Slab file and byte offset of a stored page's slot (for tools and fault-injection tests)."""
        with self._lock:
            slot = self._index.slot_of(key)
        if slot is None:
            return None
        slab, k = divmod(slot, self.slots_per_slab)
        return self.slab_path(slab), k * self.slot_bytes

    def stats(self) -> dict[str, Any]:
        with self._stats_lock:
            counters = dict(self._counters)
        with self._lock:
            index = self._index.stats()
        return {**counters, **index, "io_mode": self.io_mode, "slot_bytes": self.slot_bytes}

    def check(self) -> None:
        """Assert the index's slot accounting (for tests)."""
        with self._lock:
            self._index.check()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"SSD page store {self.dir} is closed")

    def close(self) -> None:
        """Wait for I/O in flight, close the slab files and release the directory; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        self._close_files()
