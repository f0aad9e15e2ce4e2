from hypothesis import given, settings
from hypothesis import strategies as st

from gr_plugin.cache.extents import ExtentAllocator


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
