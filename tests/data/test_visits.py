from __future__ import annotations

import itertools

import pytest
import torch

from gr_plugin.data import InteractionLog, split_visits
from tests.data.conftest import make_log

# One user: sessions at t=0..20 (3 events), t=5000..5100 (4 events), t=20000 (1 event).
_TIMES = [0, 10, 20, 5000, 5050, 5060, 5100, 20000]


@pytest.fixture
def log() -> InteractionLog:
    one = [(i + 1, 4, t) for i, t in enumerate(_TIMES)]
    two = [(1, 3, 0), (2, 3, 1799), (3, 3, 3598)]  # gaps of 1799 s: a single session
    return make_log([one, [], two], num_items=10)


def test_sessions_by_default(log: InteractionLog) -> None:
    v = split_visits(log)
    assert v.of_user(0) == [(3, 7), (7, 8)]  # the first session has no history, so no visit
    assert v.of_user(1) == []
    assert v.of_user(2) == []
    assert v.offsets.tolist() == [0, 2, 2, 2]


def test_session_gap_is_a_threshold(log: InteractionLog) -> None:
    assert split_visits(log, session_gap_s=1799).of_user(2) == [(1, 2), (2, 3)]
    assert split_visits(log, session_gap_s=1800).of_user(2) == []


def test_min_history_zero_keeps_first_session(log: InteractionLog) -> None:
    v = split_visits(log, min_history=0)
    assert v.of_user(0) == [(0, 3), (3, 7), (7, 8)]
    assert split_visits(log, min_history=4).of_user(0) == [(7, 8)]


def test_max_visit_len_chunks_each_session(log: InteractionLog) -> None:
    v = split_visits(log, max_visit_len=2)
    # sessions [0,3) [3,7) [7,8) -> chunks [0,2) [2,3) [3,5) [5,7) [7,8)
    assert v.of_user(0) == [(2, 3), (3, 5), (5, 7), (7, 8)]
    assert v.of_user(2) == [(2, 3)]


def test_stride_ignores_time(log: InteractionLog) -> None:
    v = split_visits(log, stride=3)
    assert v.of_user(0) == [(3, 6), (6, 8)]
    assert v.of_user(2) == []
    same = split_visits(log, session_gap_s=None, max_visit_len=3)
    assert torch.equal(v.starts, same.starts) and torch.equal(v.ends, same.ends)


def test_max_visits_per_user_keeps_the_latest(log: InteractionLog) -> None:
    v = split_visits(log, max_visit_len=2, max_visits_per_user=2)
    assert v.of_user(0) == [(5, 7), (7, 8)]
    assert v.of_user(2) == [(2, 3)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stride": 4, "max_visit_len": 2}, "give stride=4 or max_visit_len=2, not both"),
        ({"stride": 0}, "stride must be an int >= 1, got 0"),
        ({"session_gap_s": 0}, "session_gap_s must be > 0"),
        ({"min_history": -1}, "min_history must be an int >= 0, got -1"),
        ({"max_visits_per_user": 0}, "max_visits_per_user must be an int >= 1 or None, got 0"),
    ],
)
def test_bad_arguments(log: InteractionLog, kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        split_visits(log, **kwargs)


def test_visits_tile_each_history_after_the_first_kept_start(synth: InteractionLog) -> None:
    v = split_visits(synth, max_visit_len=16)
    for u in range(synth.num_users):
        visits = v.of_user(u)
        assert visits, "every synthetic user has sessions after the first"
        for (_, end), (start, _) in itertools.pairwise(visits):
            assert end == start
        assert visits[-1][1] == int(synth.lengths[u])
        assert all(0 < e - s <= 16 for s, e in visits)
        ts = synth.history(u)["timestamps"]
        for s, e in visits:  # a visit never spans a session break
            assert (ts[s:e].diff() < 1800).all()
