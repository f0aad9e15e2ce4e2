from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gr_plugin.data import InteractionLog, time_gap_buckets


def _csr(lengths: list[int]) -> torch.Tensor:
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0, out=offsets[1:])
    return offsets


def test_exact_buckets() -> None:
    ts = torch.tensor([100, 100, 101, 103, 104, 200, 7, 1_000_000_007], dtype=torch.int64)
    offsets = _csr([6, 2])
    # gaps: first, 0, 1, 2, 1, 96 | first, 1e9
    assert time_gap_buckets(ts, offsets, 32).tolist() == [0, 1, 2, 3, 2, 8, 0, 31]
    # the cap: every gap >= 2**(num_buckets - 3) shares the last bucket
    assert time_gap_buckets(ts, offsets, 4).tolist() == [0, 1, 2, 3, 2, 3, 0, 3]
    assert time_gap_buckets(ts, offsets, 2).tolist() == [0, 1, 1, 1, 1, 1, 0, 1]


def test_power_of_two_edges_are_exact() -> None:
    gaps = [2**k + d for k in range(1, 40) for d in (-1, 0)]
    ts = torch.tensor([0, *torch.tensor(gaps).cumsum(0).tolist()], dtype=torch.int64)
    got = time_gap_buckets(ts, _csr([len(gaps) + 1]), 64)[1:].tolist()
    assert got == [1 + (g.bit_length()) for g in gaps]  # bucket 1 + floor(log2(g)) + 1 for g >= 1


def test_empty_users_and_empty_input() -> None:
    ts = torch.tensor([5, 9], dtype=torch.int64)
    assert time_gap_buckets(ts, _csr([0, 1, 0, 1]), 8).tolist() == [0, 0]
    assert time_gap_buckets(torch.zeros(0, dtype=torch.int64), _csr([0, 0]), 8).numel() == 0


@pytest.mark.parametrize(
    ("ts", "offsets", "num_buckets", "message"),
    [
        ([1, 2], [0, 2], 1, "num_buckets must be an int >= 2, got 1"),
        ([1, 2], [0, 3], 8, "offsets must run from 0 to 2"),
        ([1, 2, 3], [0, 2, 1, 3], 8, "non-decreasing"),
        ([5, 4], [0, 2], 8, "time goes back at event 1: 5 then 4"),
    ],
)
def test_errors(ts: list[int], offsets: list[int], num_buckets: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        time_gap_buckets(torch.tensor(ts), torch.tensor(offsets), num_buckets)


def test_float_timestamps_rejected() -> None:
    with pytest.raises(ValueError, match=r"timestamps must be a 1-D int64 tensor, got torch\.float32"):
        time_gap_buckets(torch.tensor([1.0, 2.0]), torch.tensor([0, 2]), 8)


_users = st.lists(st.lists(st.integers(0, 10**8), min_size=0, max_size=12), min_size=1, max_size=6)


@settings(max_examples=200, deadline=None)
@given(gaps=_users, keep=st.lists(st.integers(0, 12), min_size=6, max_size=6), num_buckets=st.integers(2, 40))
def test_appending_events_never_changes_earlier_buckets(
    gaps: list[list[int]], keep: list[int], num_buckets: int
) -> None:
    full = [torch.tensor(g, dtype=torch.int64).cumsum(0) + 1_600_000_000 for g in gaps]
    prefixes = [t[: min(k, t.numel())] for t, k in zip(full, keep)]
    full_buckets = time_gap_buckets(torch.cat(full), _csr([t.numel() for t in full]), num_buckets)
    prefix_buckets = time_gap_buckets(torch.cat(prefixes), _csr([t.numel() for t in prefixes]), num_buckets)
    full_offsets = _csr([t.numel() for t in full]).tolist()
    expected = torch.cat([full_buckets[o : o + p.numel()] for o, p in zip(full_offsets, prefixes)])
    assert torch.equal(prefix_buckets, expected)
    # and the range contract
    if full_buckets.numel():
        assert 0 <= int(full_buckets.min()) and int(full_buckets.max()) <= num_buckets - 1


def test_real_log_first_events_are_zero_and_rest_positive(synth: InteractionLog) -> None:
    b = time_gap_buckets(synth.timestamps, synth.offsets, 32)
    first = torch.zeros(synth.num_events, dtype=torch.bool)
    first[synth.offsets[:-1]] = True
    assert (b[first] == 0).all()
    assert (b[~first] >= 1).all()
    # in-session gaps (seconds) and between-session gaps (hours+) land in different buckets
    assert int(b[~first].max()) - int(b[~first].min()) >= 10
