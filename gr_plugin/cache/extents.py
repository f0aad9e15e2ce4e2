"""`ExtentAllocator`: free slots kept as sorted runs, handed out as contiguous runs when possible.

Owns the host tier's free-slot bookkeeping. A user's pages written in one reservation land in one
run of consecutive slots whenever such a run is free, so a later copy of them is one large transfer
per layer instead of one per page (separate small host->device copies run at a fraction of link
speed). Freed slots merge with their free neighbours.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

#: runs looked at for one that fits whole before taking pieces of several
_SCAN = 64


class ExtentAllocator:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._starts: list[int] = [0] if num_slots else []
        self._lens: dict[int, int] = {0: num_slots} if num_slots else {}
        self.num_free = num_slots

    def __len__(self) -> int:
        return self.num_free

    def alloc(self, n: int) -> list[int] | None:
        """``n`` slots (one run if any free run of ``n`` is among the first few), or None."""
        if n > self.num_free:
            return None
        if n == 0:
            return []
        for s in self._starts[:_SCAN]:
            if self._lens[s] >= n:
                self._take(s, n)
                return list(range(s, s + n))
        out: list[int] = []
        while len(out) < n:
            s = self._starts[0]
            k = min(self._lens[s], n - len(out))
            self._take(s, k)
            out.extend(range(s, s + k))
        return out

    def _take(self, start: int, n: int) -> None:
        length = self._lens.pop(start)
        i = bisect.bisect_left(self._starts, start)
        if length == n:
            del self._starts[i]
        else:
            self._starts[i] = start + n
            self._lens[start + n] = length - n
        self.num_free -= n

    def free(self, slots: Iterable[int]) -> None:
        ordered = sorted(slots)
        i = 0
        while i < len(ordered):
            j = i
            while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
                j += 1
            self._insert(ordered[i], j - i + 1)
            i = j + 1

    def _insert(self, start: int, n: int) -> None:
        i = bisect.bisect_left(self._starts, start)
        assert i == len(self._starts) or self._starts[i] >= start + n, f"slots {start}..{start + n} freed twice"
        if i > 0:
            p = self._starts[i - 1]
            assert p + self._lens[p] <= start, f"slots {start}..{start + n} freed twice"
        self.num_free += n
        # merge with the next run
        if i < len(self._starts) and self._starts[i] == start + n:
            n += self._lens.pop(self._starts[i])
            del self._starts[i]
        # merge with the previous run
        if i > 0 and self._starts[i - 1] + self._lens[self._starts[i - 1]] == start:
            self._lens[self._starts[i - 1]] += n
            return
        self._starts.insert(i, start)
        self._lens[start] = n

    def free_slots(self) -> list[int]:
        return [s for start in self._starts for s in range(start, start + self._lens[start])]
