"""Leaf types of the page stores below the pinned host tier.

Owns `PageKey` (the identity of one stored page), the `PageStore` contract that the SSD and remote
stores keep (and `PageStoreUnavailable`, what a store asked strictly raises), and `page_rows`, the
boundary check that turns a batch tensor into per-page addresses. It does not store anything and
does not know the byte format (`page_format`).

A *page* here is the bytes of one page across all layers: one row of a contiguous CPU tensor
``[n, num_layers, 2, page_size, num_heads, head_dim]``. The host tier's ``host_table[:, slot]`` is
not contiguous, so the caller gathers pages into a contiguous staging tensor first (for instance
``staging.copy_(host_table[:, slots].transpose(0, 1))``) and scatters them back after a read;
stores never handle strides.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import Any

import torch

#: the namespace is stored in every page header; longer ones are refused
MAX_NAMESPACE_BYTES = 512
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


@dataclasses.dataclass(frozen=True, slots=True)
class PageKey:
    """Identity of one stored page: page ``page_index`` of ``user_id``'s history in ``namespace``,
    whose prefix hash (`gr_plugin.cache.hashing`, XXH3-128) is ``page_hash``."""

    namespace: str
    user_id: int
    page_index: int
    page_hash: int

    def __post_init__(self) -> None:
        if not isinstance(self.namespace, str) or not self.namespace:
            raise ValueError(f"PageKey.namespace must be a non-empty str, got {self.namespace!r}")
        if len(self.namespace.encode("utf-8")) > MAX_NAMESPACE_BYTES:
            raise ValueError(f"PageKey.namespace is longer than {MAX_NAMESPACE_BYTES} bytes: {self.namespace!r}")
        uid = self.user_id
        if isinstance(uid, bool) or not isinstance(uid, int) or not _INT64_MIN <= uid <= _INT64_MAX:
            raise ValueError(f"PageKey.user_id must be an int64, got {uid!r}")
        idx = self.page_index
        if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx <= _INT64_MAX:
            raise ValueError(f"PageKey.page_index must be an int >= 0, got {idx!r}")
        h = self.page_hash
        if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < 2**128:
            raise ValueError(f"PageKey.page_hash must be an unsigned 128-bit int, got {h!r}")

    @property
    def user(self) -> tuple[str, int]:
        """The LRU unit of every store: ``(namespace, user_id)``."""
        return (self.namespace, self.user_id)


def page_rows(keys: list[PageKey], pages: torch.Tensor, page_bytes: int | None, what: str) -> tuple[list[int], int]:
    """Addresses of the rows of ``pages`` (``[n, ...]``, contiguous, CPU) and the bytes of one row.

    Raises `ValueError` naming the bad value when the tensor does not fit ``keys`` (and
    ``page_bytes``, when given). The caller keeps ``pages`` alive while the addresses are used.
    """
    if not isinstance(pages, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, got {type(pages).__name__}")
    if pages.device.type != "cpu":
        raise ValueError(f"{what} must be a CPU tensor, got device {pages.device}")
    if pages.dim() < 1 or pages.shape[0] != len(keys):
        raise ValueError(f"{what} must have shape [{len(keys)}, ...] (one row per key), got {tuple(pages.shape)}")
    if not pages.is_contiguous():
        raise ValueError(f"{what} must be contiguous (gather through a staging tensor), got strides {pages.stride()}")
    for key in keys:
        if not isinstance(key, PageKey):
            raise ValueError(f"keys must be PageKey, got {key!r}")
    n = len(keys)
    if n == 0:
        return [], 0 if page_bytes is None else page_bytes
    row = pages.nbytes // n
    if page_bytes is not None and row != page_bytes:
        raise ValueError(f"{what} rows hold {row} bytes, the store's pages hold {page_bytes}")
    if row == 0:
        raise ValueError(f"{what} rows are empty: shape {tuple(pages.shape)}")
    base = pages.data_ptr()
    return [base + i * row for i in range(n)], row


class PageStoreUnavailable(RuntimeError):
    """A store asked strictly (``RedisPageStore.match`` / ``get_many`` with ``strict=True``) could not
    answer: its server is unreachable, being backed off from, or refused the command. The message names the
    (redacted) URL and the cause."""


class PageStore(ABC):
    """A store of whole pages, keyed by `PageKey`, safe to call from several threads at once.

    Every user's pages form a contiguous prefix of their history where the store can enforce it.
    Calls never raise for I/O or network errors: they answer False / 0 and count the error (a
    store's ``match`` or ``get_many`` asked with ``strict=True``, where it takes one, raises
    `PageStoreUnavailable` instead). Bad arguments raise `ValueError`.
    """

    #: a short name for logs and stats (``"ssd"``, ``"remote"``)
    tier_name: str = ""

    @abstractmethod
    def put_many(self, keys: list[PageKey], pages: torch.Tensor) -> list[bool]:
        """Store ``pages[i]`` under ``keys[i]``; ``pages`` is ``[n, L, 2, P, H, D]``, contiguous, CPU.
        ``False`` means not stored (rejected, no room, or an I/O error)."""

    @abstractmethod
    def get_many(self, keys: list[PageKey], out: torch.Tensor) -> list[bool]:
        """Read ``keys[i]`` into ``out[i]`` (``[n, ...]``, contiguous, CPU, pinned or not). ``True`` only
        if the page was found, its checksum verified and its stored key equals ``keys[i]``; rows
        answered ``False`` hold unspecified bytes."""

    @abstractmethod
    def match(self, namespace: str, user_id: int, page_hashes: list[int]) -> int:
        """Number of leading pages of ``page_hashes`` (pages ``0..``) this store holds."""

    def renew(self, keys: list[PageKey]) -> list[bool | None]:
        """Restart the expiry of the pages of ``keys`` that this store holds. Per key: True renewed,
        False not held (or nothing to renew), None not known (the store could not be asked, or refused):
        worth asking again. A store whose pages do not expire (this default) answers False for all."""
        return [False] * len(keys)

    @abstractmethod
    def evict_user(self, namespace: str, user_id: int) -> None: ...

    @abstractmethod
    def evict_namespace(self, namespace: str) -> None:
        """Delete every page of ``namespace`` (every user's)."""

    @abstractmethod
    def clear(self) -> None: ...

    @abstractmethod
    def stats(self) -> dict[str, Any]: ...

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> PageStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def aligned_empty(shape: tuple[int, ...], dtype: torch.dtype, alignment: int = 4096) -> torch.Tensor:
    """An uninitialised CPU tensor whose memory starts on an ``alignment`` boundary (page-aligned
    anonymous memory), so stores using O_DIRECT read and write it in place, without a bounce copy."""
    import mmap

    numel = 1
    for n in shape:
        numel *= n
    nbytes = max(numel * torch.empty((), dtype=dtype).element_size(), 1)
    buf = mmap.mmap(-1, -(-nbytes // alignment) * alignment)
    return torch.frombuffer(buf, dtype=torch.uint8)[: numel * torch.empty((), dtype=dtype).element_size()].view(
        dtype).view(shape)
