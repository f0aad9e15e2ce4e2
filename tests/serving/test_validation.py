"""Boundary checks of one request: the wire encoding round-trips, and every bad input is a clear
``ValueError`` naming the input, the user and the value."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from gr_plugin.serving import RequestLimits, bucket_width, decode_scores, encode_batch, parse_request
from gr_plugin.serving.client import subset_batch
from tests.serving.helpers import NUM_ITEMS, tiny_limits, visits


@pytest.fixture(scope="module")
def batch():
    reqs = visits(num_users=6)
    users, picked = set(), []
    for b in reqs:  # three distinct users in one request
        if int(b.user_ids) not in users:
            users.add(int(b.user_ids))
            picked.append(b)
        if len(picked) == 3:
            break
    from gr_plugin.serving.service import concat_batches

    return concat_batches(picked)


def test_bucket_width_is_a_power_of_two_at_least_the_minimum():
    assert [bucket_width(n) for n in (0, 1, 16, 17, 100, 128, 129)] == [16, 16, 16, 32, 128, 128, 256]
    assert bucket_width(3, min_width=1) == 4
    with pytest.raises(ValueError, match="-1"):
        bucket_width(-1)


def test_encode_then_parse_gives_back_the_batch(batch):
    wire = encode_batch(batch)
    assert wire["history_items"].shape == (3, bucket_width(int(batch.history_lengths.max())))
    assert all(a.dtype == np.int64 for a in wire.values())
    parsed = parse_request(wire, tiny_limits())
    for name in ("user_ids", "history_lengths", "history_items", "history_ratings", "history_time_buckets",
                 "candidate_lengths", "candidate_items"):
        assert torch.equal(getattr(parsed, name), getattr(batch, name)), name
    # padding is never read: garbage there changes nothing
    wire["history_items"][wire["history_items"] == 0] = 10_000
    assert torch.equal(parse_request(wire, tiny_limits()).history_items, batch.history_items)


def test_decode_scores_drops_the_padding(batch):
    c = batch.candidate_lengths.numpy()
    scores = np.full((3, 16, 2), np.nan, dtype=np.float32)
    flat = np.arange(int(c.sum()) * 2, dtype=np.float32).reshape(-1, 2)
    scores[np.arange(16)[None, :] < c[:, None]] = flat
    assert np.array_equal(decode_scores(scores, c), flat)


def test_subset_batch_keeps_each_users_rows(batch):
    sub = subset_batch(batch, [2, 0])
    assert sub.user_ids.tolist() == [batch.user_ids[2].item(), batch.user_ids[0].item()]
    h = batch.history_offsets
    assert torch.equal(sub.history_items[: int(batch.history_lengths[2])], batch.history_items[h[2]:h[3]])


def _bad(batch, **edits):
    wire = encode_batch(batch)
    for name, fn in edits.items():
        wire[name] = fn(wire[name])
    return wire


def _set(index, value):
    def fn(a):
        a = a.copy()
        a[index] = value
        return a
    return fn


@pytest.mark.parametrize("edits, message", [
    (dict(history_length=_set((1, 0), -3)), r"history_length -3 of user \d+ is negative"),
    (dict(history_length=_set((1, 0), 0)), r"history_length 0 of user \d+ is 0"),
    (dict(history_length=_set((0, 0), 10_000)), r"history_length 10000 of user \d+ exceeds the \d+ entries"),
    (dict(candidate_length=_set((2, 0), 0)), r"candidate_length 0 of user \d+ is 0"),
    (dict(user_id=_set((1, 0), -1)), r"user_id -1 is outside \[0, "),
    (dict(history_items=_set((0, 0), NUM_ITEMS + 1)),
     rf"history_items: value {NUM_ITEMS + 1} of user \d+ is outside \[1, {NUM_ITEMS}\]"),
    (dict(history_items=_set((0, 0), 0)), r"history_items: value 0 of user \d+ is outside"),
    (dict(history_ratings=_set((1, 0), 6)), r"history_ratings: value 6 of user \d+ is outside \[0, 5\]"),
    (dict(history_time_buckets=_set((2, 0), -1)), r"history_time_buckets: value -1 .* outside \[0, 31\]"),
    (dict(candidate_items=_set((0, 0), 999)), r"candidate_items: value 999 of user \d+ is outside"),
    (dict(user_id=lambda a: np.full_like(a, 7)), r"user 7 appears more than once in one request"),
    (dict(history_items=lambda a: a.astype(np.int32)), r"input 'history_items' must be int64, got int32"),
    (dict(history_ratings=lambda a: a[:, :-1]), r"'history_ratings' rows are \d+ wide but 'history_items' rows"),
    (dict(candidate_items=lambda a: a[:2]), r"'candidate_items' has 2 rows but 'user_id' has 3"),
    (dict(user_id=lambda a: a.reshape(-1)), r"input 'user_id' must have 2 dims"),
    (dict(history_length=lambda a: np.concatenate([a, a], axis=1)), r"'history_length' must have shape \[3, 1\]"),
    ({n: (lambda a: np.ones((3, 4096), np.int64)) for n in ("history_items", "history_ratings",
                                                             "history_time_buckets")},
     r"history rows are 4096 wide; at most 256"),
])
def test_bad_requests_are_clear_errors(batch, edits, message):
    with pytest.raises(ValueError, match=message):
        parse_request(_bad(batch, **edits), tiny_limits())


def test_limits_on_users_lengths_and_inputs(batch):
    wire = encode_batch(batch)
    tight = dataclasses.replace(tiny_limits(), max_users=2)
    with pytest.raises(ValueError, match="request of 3 users exceeds max_batch_size=2"):
        parse_request(wire, tight)
    short = dataclasses.replace(tiny_limits(), max_history_len=int(batch.history_lengths.max()) - 1)
    with pytest.raises(ValueError, match=r"exceeds max_history_len="):
        parse_request(wire, short)
    with pytest.raises(ValueError, match=r"missing input\(s\) \['candidate_items'\]"):
        parse_request({k: v for k, v in wire.items() if k != "candidate_items"}, tiny_limits())
    with pytest.raises(ValueError, match=r"unknown input\(s\) \['extra'\]"):
        parse_request({**wire, "extra": wire["user_id"]}, tiny_limits())
    with pytest.raises(ValueError, match="empty request"):
        parse_request({k: v[:0] for k, v in wire.items()}, tiny_limits())
    with pytest.raises(ValueError, match=r"RequestLimits.max_users must be an int >= 1, got 0"):
        RequestLimits(0, 1, 1, 1, 1, 1)
