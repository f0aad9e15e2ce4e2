"""The interface between the device cache and the tiers below it.

Owns `KVBackend`, the contract every lower-tier store keeps with `KVCacheManager` (the pinned host
tier of the ``native`` option, the tiered host/SSD/remote store of ``flexkv``). A backend stores
*full* pages of a user's history as a contiguous prefix, each identified by its prefix hash
(`gr_plugin.cache.hashing`), and exposes a pinned host table that the manager's transfer engine
copies to and from. The manager calls every method while holding its lock; a backend does its own
locking only for work it runs on other threads.

Life of a page in a backend: ``reserve_write_through`` after a commit (slots taken, not readable) →
the manager copies device pages into ``host_table[:, slots]`` → ``publish`` (readable; ``ok=False``
releases the slots).
Reading: ``match`` (how many pages of a request's prefix are held) → ``acquire`` (slots, pinned
against eviction) → the manager copies them to the device → ``release``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from gr_plugin.cache.config import KVCacheConfig

Key = tuple[str, int]


class TierReadError(RuntimeError):
    """A fail-closed backend (``fail_open`` False) could not read a lower tier: a read that failed
    or timed out, or a lookup that could not ask the remote tier (unreachable, backing off, refused)."""


class KVBackend(ABC):
    """Lower tiers below the device pages; see the module docstring for the protocol."""

    #: names of the tiers this backend serves, upper first (e.g. ``("host",)``)
    tier_names: tuple[str, ...] = ()

    @abstractmethod
    def bind(self, config: KVCacheConfig) -> None:
        """Allocate storage for pages of ``config``'s shape."""

    def rebind(self, config: KVCacheConfig) -> None:
        """The device table moved or changed dtype (its contents were cleared if the dtype
        changed): adapt storage that depends on it (pinning, dtype)."""
        self.bind(config)

    def check_bind(self, config: KVCacheConfig) -> None:
        """Raise ValueError, changing nothing, if `bind` would refuse ``config``."""
        return None

    @property
    @abstractmethod
    def host_table(self) -> torch.Tensor:
        """Pinned ``[num_layers, num_slots, 2, page_size, H, D]`` staging/storage table."""

    @abstractmethod
    def match(
        self, key: Key, tokens: torch.Tensor, start: int, length: int, seed: int, min_pages: int = 0
    ) -> dict[str, int]:
        """Full pages of this history's prefix held per tier (cumulative: a lower tier's count
        includes what the upper tiers hold). ``tokens[start:start+length]`` is the history.
        A tier that cannot hold more than ``min_pages`` may answer 0 without hashing."""

    @abstractmethod
    def version(self, key: Key) -> int:
        """Changes whenever what the backend holds for ``key`` changes (-1: nothing held)."""

    def versions(self, keys: list[Key]) -> list[int]:
        """`version` of each key (one call for a batch where a backend can batch it)."""
        return [self.version(k) for k in keys]

    def match_many(self, keys: list[Key], tokens: torch.Tensor, offsets: list[int], seed: int,
                   device_tokens: list[int], page_size: int) -> tuple[list[dict[str, int]], list[int]]:
        """A lookup's question for a batch: per user, the tier pages (`match`, ``min_pages`` = its device
        pages) and the `version`. A user is asked only when the backend holds something for it
        (version != -1) and its history ``tokens[offsets[b]:offsets[b+1]]`` has more whole pages than
        its ``device_tokens`` cover (``{}`` otherwise): the rule the C++ host core's ``match_beyond``
        applies too."""
        out, versions = [], []
        for b, key in enumerate(keys):
            start, length, dev = offsets[b], offsets[b + 1] - offsets[b], device_tokens[b]
            v = self.version(key)
            versions.append(v)
            asked = v != -1 and length // page_size > dev // page_size
            out.append(self.match(key, tokens, start, length, seed, min_pages=dev // page_size) if asked else {})
        return out, versions

    @abstractmethod
    def acquire(self, key: Key, first_page: int, num_pages: int) -> torch.Tensor | None:
        """Host slots ``[num_pages]`` of pages ``[first_page, first_page + num_pages)``, pinned
        against eviction until ``release``; ``None`` if they are no longer all held."""

    @abstractmethod
    def release(self, key: Key) -> None: ...

    @abstractmethod
    def reserve_write_through(self, core: torch.ScriptObject, core_ns: int,
                              keys: list[Key]) -> tuple[list[tuple[Key, int, torch.Tensor, torch.Tensor]], int]:
        """After a commit: reservations for the full pages of these users' device entries (the C++
        ``CacheCore`` ``core``, namespace id ``core_ns``) not stored or being stored yet, every
        reservation before any publish. Returns ``(key, first page, device pages, slots)`` per
        reservation (the manager copies, then ``publish``es each) and how many could not be had."""

    @abstractmethod
    def reserve(self, key: Key, first_page: int, page_hashes: list[int]) -> torch.Tensor | None:
        """Reserve slots for pages ``first_page..`` with these prefix hashes; ``None`` if full."""

    @abstractmethod
    def publish(self, key: Key, slots: torch.Tensor, ok: bool) -> None:
        """Make reserved slots readable (``ok``) or give them back."""

    # Tiers below the host (SSD, remote) are read into host slots by asynchronous tasks, FlexKV
    # style: ``match`` reports what each tier holds, ``prefetch`` launches one batched task that
    # brings those pages into host slots, ``wait`` finishes it (only the longest successfully read
    # prefix of each user is published), ``poll`` reaps tasks that ended meanwhile.
    def prefetch(self, requests: list[tuple[Key, torch.Tensor, int, int, int, dict[str, int]]]) -> int | None:
        """Launch one task for ``(key, tokens, start, length, seed, tier_pages)`` requests;
        returns a task id, or None when there is nothing to fetch."""
        return None

    def wait(self, task_id: int, timeout: float | None = None) -> str:
        """Finish a task: ``"ready"``, ``"failed"``, ``"timed_out"`` or ``"cancelled"``."""
        return "ready"

    def poll(self) -> None:
        """Reap tasks that ended since the last call (never blocks)."""
        return None

    def cancel(self, task_id: int) -> None:
        """Stop waiting for a task: nothing of it is published (its slots released when it ends)."""
        return None

    def settle(self, keys: list[Key] | None = None) -> None:
        """Wait for the read tasks touching ``keys`` (None: every task) to end, then publish or
        release them: their host reservations are gone (`evict` and `clear` refuse a busy user)."""
        return None

    def take_fetched(self, task_id: int) -> dict[Key, tuple[int, list[str]]]:
        """What a finished task published, once: per user its first page and each published page's
        tier (``"ssd"``/``"remote"``), so a step can count the pages it read from below the host."""
        return {}

    @property
    def fail_open(self) -> bool:
        """A lower-tier read that fails or times out, or a lower tier that cannot be asked at lookup,
        is a miss (True) or an error (False: `TierReadError`)."""
        return True

    @abstractmethod
    def evict(self, key: Key) -> None:
        """Drop what is stored for ``key`` (pinned pages stay until released)."""

    @abstractmethod
    def clear(self, namespace: str | None = None) -> None:
        """Drop every page this process's tiers hold; of a tier shared with other processes (a remote
        store), only ``namespace``'s pages (None: none)."""

    @abstractmethod
    def stats(self) -> dict[str, Any]: ...

    @abstractmethod
    def check(self) -> None:
        """Assert the backend's accounting invariants."""

    def close(self) -> None:
        return None
