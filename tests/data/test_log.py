from __future__ import annotations

import dataclasses

import pytest
import torch

from gr_plugin.data.log import InteractionLog, gather_ranges
from tests.data.conftest import make_log


def _fields(log: InteractionLog) -> dict[str, object]:
    return {f.name: getattr(log, f.name) for f in dataclasses.fields(log)}


@pytest.fixture
def log() -> InteractionLog:
    return make_log(
        [[(3, 5, 10), (1, 4, 20)], [], [(2, 1, 5), (2, 2, 5), (4, 3, 9)]],
        num_items=4,
        first_user_id=7,
    )


def test_counts_and_history(log: InteractionLog) -> None:
    assert (log.num_users, log.num_events, log.num_items) == (3, 5, 4)
    assert log.lengths.tolist() == [2, 0, 3]
    h = log.history(2)
    assert h["item_ids"].tolist() == [2, 2, 4]
    assert h["ratings"].tolist() == [1, 2, 3]
    assert h["timestamps"].tolist() == [5, 5, 9]
    assert log.history(1)["item_ids"].numel() == 0
    with pytest.raises(ValueError, match="user index 3"):
        log.history(3)


def test_frozen(log: InteractionLog) -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        log.num_items = 9  # type: ignore[misc]


def test_subset_keeps_histories(log: InteractionLog) -> None:
    sub = log.subset([2, 0])
    assert sub.user_ids.tolist() == [9, 7]
    assert sub.offsets.tolist() == [0, 3, 5]
    assert sub.item_ids.tolist() == [2, 2, 4, 3, 1]
    assert sub.timestamps.tolist() == [5, 5, 9, 10, 20]
    assert sub.num_items == 4
    with pytest.raises(ValueError, match="user index 3"):
        log.subset([3])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"offsets": torch.tensor([0, 2, 2, 4])}, "offsets\\[-1\\] = 4"),
        ({"offsets": torch.tensor([1, 2, 2, 5])}, "offsets\\[0\\] must be 0, got 1"),
        ({"offsets": torch.tensor([0, 3, 2, 5])}, "offsets decrease at user index 1"),
        ({"offsets": torch.tensor([0, 2, 5])}, "offsets has 3 entries"),
        ({"item_ids": torch.tensor([3, 0, 2, 2, 4])}, "item id 0 outside"),
        ({"item_ids": torch.tensor([3, 5, 2, 2, 4])}, "item id 5 outside"),
        ({"ratings": torch.tensor([5, 6, 1, 2, 3])}, "rating 6 outside"),
        ({"ratings": torch.tensor([5, 4, 1, 2])}, "ratings has 4 events"),
        ({"timestamps": torch.tensor([10, 20, 5, 9, 5])}, "at event 4: 9 then 5"),
        ({"user_ids": torch.tensor([7, 8, 7])}, "duplicate user id"),
        ({"user_ids": torch.tensor([7, 8, 9], dtype=torch.int32)}, "user_ids must be int64"),
        ({"num_items": 0}, "num_items must be a positive int, got 0"),
    ],
)
def test_validation(log: InteractionLog, change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        InteractionLog(**{**_fields(log), **change})


def test_time_may_drop_across_users(log: InteractionLog) -> None:
    # User 7 ends at t=20, user 9 starts at t=5: that is not a violation.
    assert int(log.timestamps[1]) > int(log.timestamps[2])
    InteractionLog(**_fields(log))


def test_gather_ranges() -> None:
    idx = gather_ranges(torch.tensor([5, 0, 9]), torch.tensor([2, 0, 3]))
    assert idx.tolist() == [5, 6, 9, 10, 11]
    assert gather_ranges(torch.tensor([4]), torch.tensor([0])).numel() == 0
