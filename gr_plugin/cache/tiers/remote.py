"""The remote page store: pages as values in Redis (or Valkey), shared by every replica.

Owns `RedisPageStore`: key naming, pipelined batches (one round trip per ``max_batch`` keys),
verification of every value read, and fail-open behaviour. Keys are content-addressed::

    {key_prefix}:{quote(namespace)}:{user_id}:{page_index}:{page_hash:032x}

so two replicas that write the same page write the same key and the same value: there is no
manifest to race on. A value is a `page_format` header followed by the page bytes. The namespace is
percent-quoted (``urllib.parse.quote(..., safe="")``), so it holds no ``:`` and no glob character
and a user's keys are exactly those matching ``{prefix}:{ns}:{user_id}:*``.

Fail-open: a connection error, a timeout or a dead server makes every call answer False / 0; the
error is counted and logged once per burst, and for ``retry_after_s`` the store does not call the
server at all (a blackholed host would otherwise cost a timeout per call). The client reconnects by
itself once the server is back. Only ``match`` and ``get_many`` asked with ``strict=True`` (a
fail-closed tiered backend's lookup and reads) raise instead: `PageStoreUnavailable`, naming the URL
and the cause. The store does not
enforce the contiguous-prefix rule (the server evicts keys on its own, e.g.
``maxmemory-policy allkeys-lru``); `match` counts leading pages only. ``redis`` is imported here
only, when a store is built.
"""

from __future__ import annotations

import ctypes
import logging
import re
import threading
import time
from collections.abc import Iterable, Iterator
from itertools import islice
from typing import Any
from urllib.parse import quote

import torch

from gr_plugin.cache.tiers.burst_log import BurstLog, ThrottledLog
from gr_plugin.cache.tiers.flexkv_config import MAX_TTL_S, redact
from gr_plugin.cache.tiers.page_format import (
    FIXED_BYTES,
    byte_view,
    checksum,
    dtype_code,
    encode_header,
    verify,
)
from gr_plugin.cache.tiers.types import PageKey, PageStore, PageStoreUnavailable, page_rows

logger = logging.getLogger(__name__)

_PREFIX_RE = re.compile(r"[A-Za-z0-9_.\-]+(:[A-Za-z0-9_.\-]+)*")
_SCAN_COUNT = 1000


def _address(value: bytes) -> int:
    """Address of a bytes object's own storage (no copy; ``value`` must stay alive)."""
    return ctypes.cast(ctypes.c_char_p(value), ctypes.c_void_p).value or 0


class RedisPageStore(PageStore):
    """Pages in a Redis server at ``url``, under keys starting with ``key_prefix``.

    ``socket_timeout_s`` bounds every call and connect; ``max_batch`` keys go in one pipelined
    round trip; ``ttl_s`` (None: no expiry) expires a page that long after its last write, read or
    `renew`;
    ``retry_after_s``: after an error, calls answer False / 0 at once for this long;
    ``page_bytes`` (optional) checks every tensor row. Raises `ValueError` for bad arguments;
    an unreachable server is not an error here (the store fails open), except to a strict `match` or
    `get_many`.
    """

    tier_name = "remote"

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        key_prefix: str = "gr",
        socket_timeout_s: float = 0.5,
        max_batch: int = 64,
        ttl_s: int | None = None,
        retry_after_s: float = 1.0,
        page_bytes: int | None = None,
    ) -> None:
        if not isinstance(key_prefix, str) or not _PREFIX_RE.fullmatch(key_prefix):
            raise ValueError(f"RedisPageStore.key_prefix must be [A-Za-z0-9_.-] words joined by ':', "
                             f"got {key_prefix!r}")
        for name, value in (("socket_timeout_s", socket_timeout_s), ("retry_after_s", retry_after_s)):
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"RedisPageStore.{name} must be a number >= 0, got {value!r}")
        if socket_timeout_s == 0:
            raise ValueError("RedisPageStore.socket_timeout_s must be > 0, got 0")
        for name, value in (("max_batch", max_batch), ("ttl_s", ttl_s), ("page_bytes", page_bytes)):
            if value is None and name != "max_batch":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"RedisPageStore.{name} must be a positive int, got {value!r}")
        if ttl_s is not None and ttl_s > MAX_TTL_S:
            raise ValueError(f"RedisPageStore.ttl_s must be at most {MAX_TTL_S} s, got {ttl_s!r}")
        if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"RedisPageStore.url must be a redis://, rediss:// or unix:// URL, got {redact(url)!r}")

        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._redis = redis
        try:
            # NOTE: one retry, no backoff: a pooled connection broken by a server restart is
            # replaced at once; a server that is down costs one failed connect, not the default
            # exponential retries.
            self._client = redis.Redis.from_url(
                url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s,
                retry=Retry(NoBackoff(), 1),
            )
        except ValueError as exc:
            raise ValueError(f"RedisPageStore.url is not a valid Redis URL: {redact(url)!r} "
                             f"({redact(str(exc))})") from exc
        self.url = url
        self.key_prefix = key_prefix
        self.max_batch = max_batch
        self.ttl_s = ttl_s
        self.retry_after_s = float(retry_after_s)
        self.page_bytes = page_bytes
        self._down_until = 0.0
        self._last_error = "an error"  # (the last failure: what a strict match backing off names)
        self._lock = threading.Lock()
        self._errors = BurstLog(logger, f"Redis page store {self._safe_url()}")
        self._corrupt_log = ThrottledLog(logger, f"Redis page store {self._safe_url()}")
        self._counters: dict[str, float] = dict.fromkeys(
            ("hits", "misses", "pages_written", "put_failed", "corruptions", "errors", "skipped_while_down",
             "bytes_read", "bytes_written", "round_trips", "in_flight", "pages_renewed", "renew_failed"), 0)
        self._counters.update(get_latency_s=0.0, put_latency_s=0.0, match_latency_s=0.0, renew_latency_s=0.0)
        self._closed = False

    # ----------------------------------------------------------------- keys
    def _safe_url(self) -> str:
        return redact(self.url)  # NOTE: never log a password

    def _user_prefix(self, namespace: str, user_id: int) -> str:
        return f"{self.key_prefix}:{quote(namespace, safe='')}:{user_id}:"

    def key_name(self, key: PageKey) -> str:
        """The Redis key of a page."""
        return f"{self._user_prefix(key.namespace, key.user_id)}{key.page_index}:{key.page_hash:032x}"

    # ----------------------------------------------------------------- plumbing
    def _count(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counters[name] += delta

    def _available(self) -> bool:
        if self._closed:
            raise RuntimeError(f"Redis page store {self._safe_url()} is closed")
        if time.monotonic() < self._down_until:
            self._count(skipped_while_down=1)
            return False
        return True

    @property
    def backing_off(self) -> bool:
        """True while the store does not ask the server (after a connection error)."""
        return time.monotonic() < self._down_until

    def _unavailable_backing_off(self) -> PageStoreUnavailable:
        """What a strict call raises while the store backs off (names the last failure)."""
        return PageStoreUnavailable(
            f"Redis page store {self._safe_url()} is not asked: backing off for "
            f"{max(self._down_until - time.monotonic(), 0.0):.3f} s after {self._last_error}")

    def _failed(self, what: str, exc: BaseException, back_off: bool = True) -> str:
        """Count and log a failure (backing off: the server is not asked for ``retry_after_s``);
        returns its description."""
        self._count(errors=1)
        if back_off:
            self._down_until = time.monotonic() + self.retry_after_s
        self._last_error = why = redact(f"{what}: {type(exc).__name__}: {exc}")
        self._errors.failure(why)
        return why

    def _pipelined(self, commands: Iterable[tuple[str, tuple, dict]]) -> Iterator[list[Any]]:
        """Run commands in pipelines of ``max_batch``; yields each batch's replies (errors as
        exception objects). Raises the client's error when the connection fails. ``commands`` is
        consumed one batch at a time (values of a put are built batch by batch)."""
        it = iter(commands)
        while batch := list(islice(it, self.max_batch)):
            pipe = self._client.pipeline(transaction=False)
            for name, args, kwargs in batch:
                getattr(pipe, name)(*args, **kwargs)
            self._count(round_trips=1, in_flight=1)
            try:
                replies = pipe.execute(raise_on_error=False)
            finally:
                self._count(in_flight=-1)
                pipe.reset()
            yield replies

    @property
    def _errors_types(self) -> tuple[type[BaseException], ...]:
        return (self._redis.exceptions.RedisError, OSError)

    # ----------------------------------------------------------------- writing
    def put_many(self, keys: list[PageKey], pages: torch.Tensor) -> list[bool]:
        """Store ``pages[i]`` (``[n, ...]`` contiguous CPU) as ``keys[i]``; False where the server
        did not take it (or cannot be reached)."""
        addrs, row = page_rows(keys, pages, self.page_bytes, "pages")
        if not keys:
            return []
        results = [False] * len(keys)
        if not self._available():
            self._count(put_failed=len(keys))
            return results
        start = time.perf_counter()
        code = dtype_code(pages.dtype)
        sizes: list[int] = []

        def commands() -> Iterator[tuple[str, tuple, dict]]:
            for key, addr in zip(keys, addrs):
                page = byte_view(addr, row)
                header = encode_header(key, code, row, checksum(page))
                value = bytearray(len(header) + row)
                value[: len(header)] = header
                value[len(header) :] = page
                sizes.append(len(value))
                yield "set", (self.key_name(key), value), {"ex": self.ttl_s}

        done = 0
        refused: BaseException | None = None
        try:
            for replies in self._pipelined(commands()):
                for reply in replies:
                    if isinstance(reply, BaseException):
                        refused = refused or reply
                    elif reply:
                        results[done] = True
                    done += 1
        except self._errors_types as exc:
            self._failed("SET", exc)
        else:
            if refused is not None:
                # NOTE: the server answered (e.g. OOM under maxmemory noeviction): reads still work,
                # so the store does not back off.
                self._failed("SET", refused, back_off=False)
            else:
                self._errors.success()
        stored = sum(results)
        self._count(pages_written=stored, put_failed=len(keys) - stored,
                    bytes_written=sum(n for n, ok in zip(sizes, results) if ok),
                    put_latency_s=time.perf_counter() - start)
        return results

    # ----------------------------------------------------------------- reading
    def get_many(self, keys: list[PageKey], out: torch.Tensor, *, strict: bool = False) -> list[bool]:
        """Read ``keys[i]`` into ``out[i]``; True only for a value whose header names ``keys[i]`` and
        whose checksum verifies. Rows answered False hold unspecified bytes. ``strict``: where the
        server cannot be asked (backing off), stops answering or refuses reads (READONLY, NOPERM),
        raise `PageStoreUnavailable` instead of answering False (counted and backed off from all the
        same); a missing, corrupt or foreign (WRONGTYPE) value is a False either way."""
        addrs, row = page_rows(keys, out, self.page_bytes, "out")
        if not keys:
            return []
        results = [False] * len(keys)
        if not self._available():
            self._count(misses=len(keys))
            if strict:
                raise self._unavailable_backing_off()
            return results
        start = time.perf_counter()
        code = dtype_code(out.dtype)
        if self.ttl_s:
            commands = [("getex", (self.key_name(k),), {"ex": self.ttl_s}) for k in keys]
        else:
            commands = [("get", (self.key_name(k),), {}) for k in keys]
        unavailable: PageStoreUnavailable | None = None  # (what a strict read raises, once counted)
        corrupt: list[tuple[PageKey, str]] = []
        refused: BaseException | None = None
        nbytes = 0
        pos = 0
        try:
            for replies in self._pipelined(commands):
                for value in replies:
                    key, addr = keys[pos], addrs[pos]
                    pos += 1
                    if not isinstance(value, bytes):
                        if isinstance(value, BaseException):  # e.g. WRONGTYPE: someone else's key
                            refused = refused or value
                        continue
                    nbytes += len(value)
                    why = self._check_value(value, key, code, row)
                    if why is not None:
                        corrupt.append((key, why))
                        continue
                    ctypes.memmove(addr, _address(value) + len(value) - row, row)
                    results[pos - 1] = True
        except self._errors_types as exc:
            why = self._failed("GET", exc)
            if strict:
                unavailable = PageStoreUnavailable(f"Redis page store {self._safe_url()} cannot be reached: {why}")
                unavailable.__cause__ = exc
        else:
            if refused is not None:
                why = self._failed("GET", refused, back_off=False)
                # NOTE: WRONGTYPE is one foreign key at a page's name (a miss); another refusal (READONLY,
                # NOPERM, ...) is the server's answer to every read: fail-closed, an error.
                if strict and not str(refused).startswith("WRONGTYPE"):
                    unavailable = PageStoreUnavailable(f"Redis page store {self._safe_url()} refused a read: {why}")
            else:
                self._errors.success()
        if corrupt:
            self._corrupt_log.warn(len(corrupt), f"{corrupt[0][0]}: {corrupt[0][1]}")
        hits = sum(results)
        self._count(hits=hits, misses=len(keys) - hits, corruptions=len(corrupt), bytes_read=nbytes,
                    get_latency_s=time.perf_counter() - start)
        if unavailable is not None:
            raise unavailable
        return results

    def renew(self, keys: list[PageKey]) -> list[bool | None]:
        """Restart the TTL of the pages of ``keys`` (pipelined EXPIRE). Per key: True renewed, False
        not on the server (nothing is created), None not known: unreachable (then the rest of the keys
        too), backing off, or a refused command (counted as ``renew_failed``). Without a ``ttl_s``
        nothing expires and nothing is sent (all False)."""
        out: list[bool | None] = [False] * len(keys)
        if not self.ttl_s or not keys:
            return out
        if not self._available():
            self._count(renew_failed=len(keys))
            return [None] * len(keys)
        t0, answered, refused = time.perf_counter(), 0, None
        try:
            for replies in self._pipelined(("expire", (self.key_name(k), self.ttl_s), {}) for k in keys):
                for r in replies:
                    if isinstance(r, BaseException):
                        out[answered], refused = None, refused or r
                    else:
                        out[answered] = r is True or r == 1
                    answered += 1
            if refused is None:
                self._errors.success()
        except self._errors_types as exc:
            self._failed("EXPIRE", exc)
            out[answered:] = [None] * (len(keys) - answered)
        if refused is not None:  # (the server answered: no back-off)
            self._failed("EXPIRE", refused, back_off=False)
        self._count(pages_renewed=sum(r is True for r in out), renew_failed=sum(r is None for r in out),
                    renew_latency_s=time.perf_counter() - t0)
        return out

    @staticmethod
    def _check_value(value: bytes, key: PageKey, code: int, row: int) -> str | None:
        if len(value) < FIXED_BYTES + row:
            return f"value of {len(value)} bytes is too short for a {row}-byte page"
        view = memoryview(value)
        header = view[: len(value) - row]
        why = verify(header, key, code, view[len(value) - row :], row)
        if why is None and len(header) != FIXED_BYTES + len(key.namespace.encode("utf-8")):
            why = f"header of {len(header)} bytes does not end where the page starts"
        return why

    def match(self, namespace: str, user_id: int, page_hashes: list[int], start: int = 0, *,
              strict: bool = False) -> int:
        """Leading pages of ``page_hashes`` whose keys exist (pipelined EXISTS, stops at the first
        batch with a missing page); 0 when the server cannot be reached. ``start``: pages before it
        are known to be held elsewhere (an upper tier) and are not asked for; they count.
        ``strict``: where the answer would come from a failure (backing off, the server unreachable,
        EXISTS refused) raise `PageStoreUnavailable` naming the URL and the cause instead (the error
        is counted and backed off from all the same)."""
        if len(page_hashes) <= start:
            return min(start, len(page_hashes)) if start else 0
        if not self._available():
            if strict:
                raise self._unavailable_backing_off()
            return start
        t0 = time.perf_counter()
        prefix = self._user_prefix(namespace, user_id)
        commands = [("exists", (f"{prefix}{i}:{page_hashes[i]:032x}",), {}) for i in range(start, len(page_hashes))]
        held = start
        try:
            for replies in self._pipelined(commands):
                for reply in replies:
                    if isinstance(reply, BaseException):
                        why = self._failed("EXISTS", reply, back_off=False)
                        if strict:
                            raise PageStoreUnavailable(f"Redis page store {self._safe_url()} refused {why}") from reply
                        return held
                    if not reply:
                        self._errors.success()
                        return held
                    held += 1
            self._errors.success()
        except self._errors_types as exc:
            why = self._failed("EXISTS", exc)
            if strict:
                raise PageStoreUnavailable(f"Redis page store {self._safe_url()} cannot be reached: {why}") from exc
            return 0
        finally:
            self._count(match_latency_s=time.perf_counter() - t0)
        return held

    # ----------------------------------------------------------------- eviction
    def _delete_matching(self, pattern: str) -> int:
        if not self._available():
            return 0
        deleted = 0
        try:
            batch: list[bytes] = []
            for name in self._client.scan_iter(match=pattern, count=_SCAN_COUNT):
                batch.append(name)
                if len(batch) >= _SCAN_COUNT:
                    deleted += self._client.unlink(*batch)
                    batch.clear()
            if batch:
                deleted += self._client.unlink(*batch)
            self._errors.success()
        except self._errors_types as exc:
            self._failed("SCAN/UNLINK", exc)
        return deleted

    def evict_user(self, namespace: str, user_id: int) -> None:
        """Delete the user's pages in this namespace (every replica loses them)."""
        self._delete_matching(self._user_prefix(namespace, user_id) + "*")

    def evict_namespace(self, namespace: str) -> None:
        """Delete every page of ``namespace`` (every replica loses them; other namespaces keep theirs).
        Best effort, like every call here: while the server cannot be reached nothing is deleted (the
        failure is counted and logged; a TTL still expires the pages)."""
        self._delete_matching(f"{self.key_prefix}:{quote(namespace, safe='')}:*")  # (quoted: no glob character)

    def clear(self) -> None:
        """Delete every page under ``key_prefix`` (all namespaces, all replicas)."""
        self._delete_matching(f"{self.key_prefix}:*")

    # ----------------------------------------------------------------- introspection
    @property
    def num_pages_stored(self) -> int:
        """Pages under ``key_prefix`` on the server (a SCAN; -1 when unreachable)."""
        if not self._available():
            return -1
        try:
            return sum(1 for _ in self._client.scan_iter(match=f"{self.key_prefix}:*", count=_SCAN_COUNT))
        except self._errors_types as exc:
            self._failed("SCAN", exc)
            return -1

    def stats(self) -> dict[str, Any]:
        with self._lock:
            counters = dict(self._counters)
        return {**counters, "failing": self._errors.failing, "url": self._safe_url()}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._client.close()
        except self._errors_types as exc:  # pragma: no cover - closing a dead connection
            logger.debug("closing Redis client: %s", exc)
