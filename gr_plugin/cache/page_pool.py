"""The device page pool: which pages are free, and which are still being read.

Owns the Python face of the C++ pool (``gr_plugin/csrc/core/page_pool.cpp``): the free pages, as
sorted runs (a batch's new pages are consecutive whenever a free run fits them, so a user's pages
onboard and offload as one copy per layer), and the per-page reader counts of in-flight copies. A
page freed while a copy still reads it becomes a *zombie* and is free again only when the last
reader is done, so a page can never be handed out while its old bytes are on their way to a lower
tier. Ownership by users is the directory's business; this module only guarantees that no page is
handed out twice. Freeing a page that is not in use, or removing a reader a page does not have,
raises ValueError and changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from gr_plugin.csrc.core.build import load as load_core


class PagePool:
    """Free runs of ``num_pages`` pages, reader counts, zombies (see the module docstring)."""

    __slots__ = ("_pool", "num_pages")

    def __init__(self, num_pages: int, *, _handle: torch.ScriptObject | None = None) -> None:
        if _handle is None:
            load_core()
            _handle = torch.classes.gr_kv_core.PagePool(num_pages)
        self._pool = _handle
        self.num_pages = num_pages

    @classmethod
    def wrap(cls, handle: torch.ScriptObject) -> PagePool:
        """The pool of a C++ ``CacheCore`` (``core.pool()``), shared, not copied."""
        return cls(handle.num_pages(), _handle=handle)

    @property
    def num_free(self) -> int:
        return self._pool.num_free()

    @property
    def num_zombies(self) -> int:
        return self._pool.num_zombies()

    @property
    def _free(self) -> list[int]:
        """The free pages, ascending."""
        return self._pool.free_pages()

    def allocate(self, n: int) -> list[int] | None:
        """``n`` free pages (one run when a free run fits), or ``None`` (nothing taken) if fewer are free."""
        return self._pool.allocate(n)

    def free(self, pages: Iterable[int]) -> None:
        self._pool.free(list(pages))

    def add_readers(self, pages: Iterable[int]) -> None:
        self._pool.add_readers(list(pages))

    def remove_readers(self, pages: Iterable[int]) -> None:
        self._pool.remove_readers(list(pages))

    def is_read(self, page: int) -> bool:
        return self._pool.is_read(page)

    def check(self, owned: list[int]) -> None:
        """Assert every page is exactly one of: free, zombie, owned (``owned`` lists owned pages)."""
        problem = self._pool.check(list(owned))
        assert not problem, problem
