"""The device page pool: which pages are free, and which are still being read.

Owns the free queue and the per-page reader counts of in-flight copies. A page freed while a copy
still reads it becomes a *zombie* and returns to the queue only when the last reader is done, so a
page can never be handed out while its old bytes are on their way to a lower tier. Ownership by
users is the manager's business; this module only guarantees that no page is handed out twice.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable


class PagePool:
    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        # NOTE: FIFO, so a freed page is reused as late as possible and ids are deterministic.
        self._free: deque[int] = deque(range(num_pages))
        self._readers: Counter[int] = Counter()
        self._zombies: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_zombies(self) -> int:
        return len(self._zombies)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` free pages in queue order, or ``None`` (nothing taken) if fewer are free."""
        if n > len(self._free):
            return None
        pop = self._free.popleft
        return [pop() for _ in range(n)]

    def free(self, pages: Iterable[int]) -> None:
        for p in pages:
            if self._readers[p]:
                self._zombies.add(p)
            else:
                self._free.append(p)

    def add_readers(self, pages: Iterable[int]) -> None:
        self._readers.update(pages)

    def remove_readers(self, pages: Iterable[int]) -> None:
        for p in pages:
            self._readers[p] -= 1
            if not self._readers[p]:
                del self._readers[p]
                if p in self._zombies:
                    self._zombies.discard(p)
                    self._free.append(p)

    def is_read(self, page: int) -> bool:
        return self._readers[page] > 0

    def check(self, owned: list[int]) -> None:
        """Assert every page is exactly one of: free, zombie, owned (``owned`` lists owned pages)."""
        free = set(self._free)
        assert len(free) == len(self._free), "free queue holds a page twice"
        owned_set = set(owned)
        assert len(owned_set) == len(owned), (
            f"pages owned twice: {sorted(p for p, c in Counter(owned).items() if c > 1)[:8]}"
        )
        for name, a, b in (("free/owned", free, owned_set), ("free/zombie", free, self._zombies),
                           ("owned/zombie", owned_set, self._zombies)):
            both = a & b
            assert not both, f"pages both {name}: {sorted(both)[:8]}"
        total = len(free) + len(owned_set) + len(self._zombies)
        assert total == self.num_pages, f"{self.num_pages - total} pages leaked"
        for p in self._zombies:
            assert self._readers[p] > 0, f"zombie page {p} has no reader"
