from __future__ import annotations

import dataclasses
import itertools
from collections import Counter

import pytest
import torch

from gr_plugin.data import (
    InteractionLog,
    Request,
    RequestBatch,
    batch_requests,
    build_requests,
    collate_requests,
    make_request,
    replay_order,
    split_visits,
    time_gap_buckets,
)
from tests.data.conftest import make_log

NUM_CANDIDATES, MAX_NEXT = 32, 8


@pytest.fixture(scope="module")
def visit_ends(synth: InteractionLog) -> dict[tuple[int, int], int]:
    """(user row, visit start) -> visit end, for the visits the requests are built from."""
    visits = split_visits(synth, max_visit_len=16)
    return {(u, s): e for u in range(synth.num_users) for s, e in visits.of_user(u)}


@pytest.fixture(scope="module")
def requests(synth: InteractionLog) -> list[Request]:
    visits = split_visits(synth, max_visit_len=16)
    return build_requests(synth, visits, num_candidates=NUM_CANDIDATES, max_next=MAX_NEXT, seed=0)


def _events(log: InteractionLog, r: Request) -> tuple[list[int], list[int]]:
    h = log.history(r.user_index)
    return h["item_ids"].tolist(), h["ratings"].tolist()


# -- build_requests ---------------------------------------------------------------------------------


def test_every_request_has_exactly_num_candidates_distinct_items(
    synth: InteractionLog, requests: list[Request]
) -> None:
    assert len(requests) > 100
    for r in requests:
        assert r.candidate_items.dtype == torch.int64 and r.labels.dtype == torch.float32
        assert r.candidate_items.shape == (NUM_CANDIDATES,) and r.labels.shape == (NUM_CANDIDATES, 2)
        assert torch.unique(r.candidate_items).numel() == NUM_CANDIDATES
        assert 1 <= int(r.candidate_items.min()) and int(r.candidate_items.max()) <= synth.num_items


def test_positives_are_the_real_next_items_with_their_labels(
    synth: InteractionLog, requests: list[Request], visit_ends: dict[tuple[int, int], int]
) -> None:
    for r in requests:
        items, ratings = _events(synth, r)
        end = min(visit_ends[r.user_index, r.history_len], r.history_len + MAX_NEXT)
        expected: dict[int, float] = {}
        for item, rating in zip(items[r.history_len : end], ratings[r.history_len : end]):
            expected.setdefault(item, float(rating >= 4))
        watched = r.labels[:, 1] == 1
        got = dict(zip(r.candidate_items[watched].tolist(), r.labels[watched, 0].tolist()))
        assert got == expected
        assert set(r.labels[:, 1].tolist()) <= {0.0, 1.0}
        assert (r.labels[~watched] == 0).all()


def test_negatives_were_never_touched_so_far(
    synth: InteractionLog, requests: list[Request], visit_ends: dict[tuple[int, int], int]
) -> None:
    for r in requests:
        items, _ = _events(synth, r)
        touched = set(items[: visit_ends[r.user_index, r.history_len]])
        negatives = r.candidate_items[r.labels[:, 1] == 0].tolist()
        assert len(negatives) >= NUM_CANDIDATES - MAX_NEXT
        assert not touched & set(negatives)


def test_candidates_are_shuffled(requests: list[Request]) -> None:
    first_is_positive = [bool(r.labels[0, 1]) for r in requests]
    assert not all(first_is_positive)
    positions = Counter(int(i) for r in requests for i in torch.nonzero(r.labels[:, 1]).flatten())
    assert max(positions) > NUM_CANDIDATES // 2  # positives are not kept at the front


def test_visit_index_counts_each_users_visits(requests: list[Request]) -> None:
    per_user: dict[int, list[Request]] = {}
    for r in requests:
        per_user.setdefault(r.user_id, []).append(r)
    for rs in per_user.values():
        assert [r.visit_index for r in rs] == list(range(len(rs)))
        assert [r.history_len for r in rs] == sorted(r.history_len for r in rs)


def test_deterministic_and_independent_of_other_users(synth: InteractionLog, requests: list[Request]) -> None:
    again = build_requests(
        synth, split_visits(synth, max_visit_len=16), num_candidates=NUM_CANDIDATES, max_next=MAX_NEXT, seed=0
    )
    assert all(torch.equal(a.candidate_items, b.candidate_items) for a, b in zip(requests, again))
    other = build_requests(
        synth, split_visits(synth, max_visit_len=16), num_candidates=NUM_CANDIDATES, max_next=MAX_NEXT, seed=1
    )
    assert any(not torch.equal(a.candidate_items, b.candidate_items) for a, b in zip(requests, other))
    sub = synth.subset([5])
    alone = build_requests(
        sub, split_visits(sub, max_visit_len=16), num_candidates=NUM_CANDIDATES, max_next=MAX_NEXT, seed=0
    )
    mine = [r for r in requests if r.user_index == 5]
    assert len(alone) == len(mine)
    for a, b in zip(alone, mine):
        assert a.user_id == b.user_id and a.history_len == b.history_len
        assert torch.equal(a.candidate_items, b.candidate_items) and torch.equal(a.labels, b.labels)


def test_max_history_len_drops_whole_requests_never_truncates(
    synth: InteractionLog, requests: list[Request]
) -> None:
    visits = split_visits(synth, max_visit_len=16)
    capped = build_requests(
        synth, visits, num_candidates=NUM_CANDIDATES, max_next=MAX_NEXT, seed=0, max_history_len=100
    )
    expected = [(r.user_id, r.visit_index, r.history_len) for r in requests if r.history_len <= 100]
    assert [(r.user_id, r.visit_index, r.history_len) for r in capped] == expected
    assert len(capped) < len(requests)


@pytest.fixture
def tiny() -> InteractionLog:
    # One user who has touched items 1..8; items 9..12 are all that is left.
    return make_log([[(i, 5 if i % 2 else 2, 100 * i) for i in range(1, 9)]], num_items=12)


def test_dense_case_takes_every_remaining_item(tiny: InteractionLog) -> None:
    r = make_request(tiny, 0, 6, 8, visit_index=0, num_candidates=6, max_next=2, seed=0)
    assert sorted(r.candidate_items.tolist()) == [7, 8, 9, 10, 11, 12]
    labels = dict(zip(r.candidate_items.tolist(), r.labels.tolist()))
    assert labels[7] == [1.0, 1.0] and labels[8] == [0.0, 1.0] and labels[9] == [0.0, 0.0]


def test_make_request_rejects_an_unknown_row(tiny: InteractionLog) -> None:
    with pytest.raises(ValueError, match=r"user row 1 outside 0\.\.0"):
        make_request(tiny, 1, 1, 2, visit_index=0, num_candidates=2, max_next=1, seed=0)


def test_too_few_items_left(tiny: InteractionLog) -> None:
    with pytest.raises(ValueError, match="user 1 at history 6: 5 negatives needed but only 4"):
        make_request(tiny, 0, 6, 8, visit_index=0, num_candidates=7, max_next=2, seed=0)


@pytest.mark.parametrize(
    ("history_len", "visit_end", "message"),
    [(0, 2, "visit \\[0, 2\\)"), (3, 3, "visit \\[3, 3\\)"), (3, 9, "<= 8 \\(its length\\)")],
)
def test_make_request_rejects_a_bad_visit(
    tiny: InteractionLog, history_len: int, visit_end: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        make_request(tiny, 0, history_len, visit_end, visit_index=0, num_candidates=6, max_next=2, seed=0)


@pytest.mark.parametrize(
    ("num_candidates", "max_next", "message"),
    [(6, 7, "max_next=7 exceeds num_candidates=6"), (0, 1, "num_candidates must be an int >= 1, got 0")],
)
def test_build_requests_rejects_bad_counts(
    tiny: InteractionLog, num_candidates: int, max_next: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        build_requests(
            tiny, split_visits(tiny, stride=2), num_candidates=num_candidates, max_next=max_next, seed=0
        )


# -- replay_order and batching ----------------------------------------------------------------------


def _fake(user: int, history_len: int) -> Request:
    return Request(
        user_index=user,
        user_id=100 + user,
        visit_index=history_len,
        history_len=history_len + 1,
        candidate_items=torch.tensor([1]),
        labels=torch.zeros(1, 2),
    )


def test_round_robin_over_a_window_of_users() -> None:
    reqs = [_fake(u, v) for u in range(5) for v in (2, 0, 1)]  # input order does not matter
    order = replay_order(reqs, interleave_users=2, seed=0)
    entry = list(dict.fromkeys(r.user_index for r in order))
    letters = "".join("abcde"[entry.index(r.user_index)] for r in order)
    assert letters == "abababcdcdcdeee"
    for u in range(5):
        assert [r.visit_index for r in order if r.user_index == u] == [0, 1, 2]


def test_one_active_user_serves_users_one_after_another() -> None:
    order = replay_order([_fake(u, v) for u in range(4) for v in range(3)], interleave_users=1, seed=0)
    users = [r.user_index for r in order]
    assert all(users[i * 3 : i * 3 + 3] == [users[i * 3]] * 3 for i in range(4))


def test_replay_order_on_real_requests(requests: list[Request]) -> None:
    order = replay_order(requests, interleave_users=8, seed=0)
    assert sorted(map(id, order)) == sorted(map(id, requests))
    for u in {r.user_index for r in requests}:
        lens = [r.history_len for r in order if r.user_index == u]
        assert lens == sorted(lens) and len(set(lens)) == len(lens)
    # while 8 users are active nobody is served twice within 8 consecutive requests
    head = order[: len(order) // 2]
    for i in range(len(head) - 8):
        assert len({r.user_index for r in head[i : i + 8]}) == 8
    assert [r.user_index for r in replay_order(requests, interleave_users=8, seed=0)] == [
        r.user_index for r in order
    ]
    assert [r.user_index for r in replay_order(requests, interleave_users=8, seed=1)] != [
        r.user_index for r in order
    ]


def test_batches_never_repeat_a_user_and_keep_the_order(
    synth: InteractionLog, requests: list[Request]
) -> None:
    order = replay_order(requests, interleave_users=6, seed=0)
    batches = batch_requests(order, 8, synth)
    flat = [(int(u), int(n)) for b in batches for u, n in zip(b.user_ids, b.history_lengths)]
    assert flat == [(r.user_id, r.history_len) for r in order]
    for b, nxt in itertools.pairwise(batches):
        assert len(set(b.user_ids.tolist())) == b.batch_size <= 8
        # closed early only because the next request's user is already in it
        assert b.batch_size == 8 or int(nxt.user_ids[0]) in b.user_ids.tolist()
    assert any(b.batch_size < 8 for b in batches[:-1])  # interleave 6 < 8 forces early closes


def test_collate_gathers_whole_prefixes(synth: InteractionLog, requests: list[Request]) -> None:
    picked = [requests[3], requests[40], requests[-1]]
    batch = collate_requests(picked, synth, num_time_buckets=16)
    full_buckets = time_gap_buckets(synth.timestamps, synth.offsets, 16)
    off = batch.history_offsets.tolist()
    coff = batch.candidate_offsets.tolist()
    assert batch.user_ids.tolist() == [r.user_id for r in picked]
    for i, r in enumerate(picked):
        lo = int(synth.offsets[r.user_index])
        sl = slice(off[i], off[i + 1])
        assert off[i + 1] - off[i] == r.history_len
        assert torch.equal(batch.history_items[sl], synth.item_ids[lo : lo + r.history_len])
        assert torch.equal(batch.history_ratings[sl], synth.ratings[lo : lo + r.history_len])
        assert torch.equal(batch.history_timestamps[sl], synth.timestamps[lo : lo + r.history_len])
        assert torch.equal(batch.history_time_buckets[sl], full_buckets[lo : lo + r.history_len])
        assert torch.equal(batch.candidate_items[coff[i] : coff[i + 1]], r.candidate_items)
        assert torch.equal(batch.labels[coff[i] : coff[i + 1]], r.labels)
    assert batch.visit_index.tolist() == [r.visit_index for r in picked]


def test_collate_rejects_foreign_requests(synth: InteractionLog, requests: list[Request]) -> None:
    with pytest.raises(ValueError, match="does not belong to this log"):
        collate_requests([dataclasses.replace(requests[0], user_id=999)], synth)
    with pytest.raises(ValueError, match=r"history_len 1000000 outside 1\.\."):
        collate_requests([dataclasses.replace(requests[0], history_len=10**6)], synth)
    with pytest.raises(ValueError, match="history_len 0 outside"):
        collate_requests([dataclasses.replace(requests[0], history_len=0)], synth)
    with pytest.raises(ValueError, match="empty list"):
        collate_requests([], synth)


# -- RequestBatch validation ------------------------------------------------------------------------


def _batch_fields() -> dict[str, torch.Tensor]:
    return {
        "user_ids": torch.tensor([7, 9]),
        "history_lengths": torch.tensor([2, 1]),
        "history_items": torch.tensor([1, 2, 3]),
        "history_ratings": torch.tensor([5, 4, 3]),
        "history_timestamps": torch.tensor([10, 20, 5]),
        "history_time_buckets": torch.tensor([0, 5, 0]),
        "candidate_lengths": torch.tensor([2, 1]),
        "candidate_items": torch.tensor([4, 5, 6]),
        "labels": torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 1.0]]),
        "visit_index": torch.tensor([0, 3]),
    }


def test_batch_properties() -> None:
    b = RequestBatch(**_batch_fields())
    assert b.batch_size == 2
    assert b.history_offsets.tolist() == [0, 2, 3]
    assert b.candidate_offsets.tolist() == [0, 2, 3]


def test_to_moves_every_tensor_without_revalidating() -> None:
    b = RequestBatch(**_batch_fields())
    assert b.to("cpu") is b
    meta = b.to("meta")  # validating on meta would fail: .tolist() needs real data
    assert all(getattr(meta, f.name).device.type == "meta" for f in dataclasses.fields(meta))
    assert b.user_ids.device.type == "cpu"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"history_lengths": torch.tensor([-1, 4])}, "negative history_lengths entry -1 for user 7"),
        ({"candidate_lengths": torch.tensor([4, -1])}, "negative candidate_lengths entry -1 for user 9"),
        (
            {"history_lengths": torch.tensor([3, 1])},
            "history_items has 3 events but history_lengths sum to 4",
        ),
        ({"history_time_buckets": torch.tensor([0, 5])}, "history_time_buckets has 2 events"),
        (  # summed as Python ints: an int64 sum would wrap to -2**63 (and with more users could match)
            {"history_lengths": torch.tensor([2**62, 2**62])},
            "history_items has 3 events but history_lengths sum to 9223372036854775808",
        ),
        (
            {"candidate_lengths": torch.tensor([2, 2])},
            "candidate_items has 3 items but candidate_lengths sum to 4",
        ),
        ({"labels": torch.zeros(3, 1)}, "labels has shape \\(3, 1\\), expected \\(3, 2\\)"),
        ({"labels": torch.zeros(3, 2, dtype=torch.float64)}, "labels must be a float32 tensor"),
        ({"history_lengths": torch.tensor([3, 0])}, "user 9 has empty history"),
        ({"candidate_lengths": torch.tensor([0, 3])}, "user 7 has no candidates"),
        ({"user_ids": torch.tensor([9, 9])}, "user 9 appears more than once"),
        ({"user_ids": torch.tensor([7, 9, 11])}, "history_lengths has 2 entries but user_ids has 3"),
        ({"visit_index": torch.tensor([0, -2])}, "negative visit_index -2 for user 9"),
        ({"history_items": torch.tensor([1, 2, 3], dtype=torch.int32)}, "history_items must be a 1-D int64"),
        ({"user_ids": torch.zeros(0, dtype=torch.int64)}, "empty batch"),
    ],
)
def test_batch_validation(change: dict[str, torch.Tensor], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RequestBatch(**{**_batch_fields(), **change})


def test_to_keeps_the_host_copy_for_host_side_readers():
    import torch

    from gr_plugin.data import RequestBatch

    cpu = RequestBatch(
        user_ids=torch.tensor([3]), history_lengths=torch.tensor([2]), history_items=torch.tensor([1, 2]),
        history_ratings=torch.tensor([4, 5]), history_timestamps=torch.tensor([10, 20]),
        history_time_buckets=torch.tensor([0, 5]), candidate_lengths=torch.tensor([1]),
        candidate_items=torch.tensor([7]), labels=torch.zeros(1, 2), visit_index=torch.tensor([0]))
    moved = cpu.to("meta")
    assert moved.device.type == "meta" and moved.host is cpu
    assert moved.to("meta") is moved and cpu.to("cpu") is cpu
