"""Free-slot runs (C++ ``ExtentAllocator``, gr_plugin/csrc/core/page_pool.cpp): the host tier's slots and
the device pool's pages."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gr_plugin.csrc.core.build import load as load_core


class ExtentAllocator:
    def __init__(self, n: int) -> None:
        load_core()
        self._a = torch.classes.gr_kv_core.ExtentAllocator(n)
        self.alloc, self.free, self.free_slots = self._a.alloc, self._a.free, self._a.free_slots

    @property
    def num_free(self) -> int:
        return self._a.num_free()


def test_contiguous_runs_and_merging():
    a = ExtentAllocator(10)
    assert a.alloc(4) == [0, 1, 2, 3] and a.alloc(3) == [4, 5, 6]
    a.free([1, 2])
    assert a.alloc(3) == [7, 8, 9]  # first run that fits whole, not the hole of two
    a.free([0, 3])  # merges with 1..2 into 0..3
    assert a.alloc(4) == [0, 1, 2, 3]
    a.free([5, 4, 6])
    assert a.alloc(2) == [4, 5] and a.num_free == 1
    assert a.alloc(2) is None and a.num_free == 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 9)), max_size=60))
def test_random_alloc_free_keeps_accounting(ops):
    a = ExtentAllocator(40)
    held: list[list[int]] = []
    for is_alloc, n in ops:
        if is_alloc or not held:
            got = a.alloc(n)
            if got is None:
                assert n > a.num_free
                continue
            assert len(got) == n
            held.append(got)
        else:
            a.free(held.pop(n % len(held)))
        owned = [s for h in held for s in h]
        free = a.free_slots()
        assert len(set(owned)) == len(owned) and not set(owned) & set(free)
        assert len(owned) + len(free) == 40 == len(owned) + a.num_free


def test_double_free_and_out_of_range_raise():
    a = ExtentAllocator(4)
    got = a.alloc(2)
    a.free(got)
    with pytest.raises(RuntimeError, match="freed twice"):
        a.free([got[0]])
    with pytest.raises(RuntimeError, match="out of range"):
        a.free([7])
    with pytest.raises(RuntimeError, match="out of range"):
        a.free([2**63 - 1])  # start + n would overflow
    b = a.alloc(3)
    with pytest.raises(RuntimeError, match="freed twice"):
        a.free([b[0], 3])  # slot 3 is free: nothing of the call is freed
    assert a.num_free == 1
    a.free(b)
    assert a.num_free == 4 and a.free_slots() == [0, 1, 2, 3]
