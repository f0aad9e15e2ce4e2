from __future__ import annotations

import dataclasses

import pytest
import torch

from gr_plugin.data import InteractionLog, split_visits, synthetic_log


def _same(a: InteractionLog, b: InteractionLog) -> bool:
    return all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        for x, y in zip(dataclasses.astuple(a), dataclasses.astuple(b))
    )


def test_deterministic_per_seed() -> None:
    a = synthetic_log(20, 256, 4096, 5000, seed=3)
    assert _same(a, synthetic_log(20, 256, 4096, 5000, seed=3))
    assert not _same(a, synthetic_log(20, 256, 4096, 5000, seed=4))


def test_shape_and_ranges() -> None:
    log = synthetic_log(200, 256, 4096, 5000, seed=0)
    lengths = log.lengths
    assert log.user_ids.tolist() == list(range(1, 201))
    assert int(lengths.min()) >= 256 and int(lengths.max()) <= 4096
    # log-uniform: about half the users below the geometric mean (1024)
    assert 0.3 < float((lengths < 1024).float().mean()) < 0.7
    assert int(log.item_ids.min()) >= 1 and int(log.item_ids.max()) <= 5000
    assert set(log.ratings.unique().tolist()) == {1, 2, 3, 4, 5}
    first = torch.zeros(log.num_events, dtype=torch.bool)
    first[log.offsets[:-1]] = True
    assert (log.timestamps.diff()[~first[1:]] >= 1).all()  # strictly increasing within a user


def test_zipf_popularity() -> None:
    log = synthetic_log(50, 256, 1024, 5000, seed=0)
    counts = torch.bincount(log.item_ids, minlength=5001)[1:].sort(descending=True).values
    top_share = float(counts[:50].sum()) / log.num_events  # top 1% of items
    assert top_share > 0.3  # uniform would give 0.01; Zipf(1) gives ~0.49
    flat = synthetic_log(50, 256, 1024, 5000, seed=0, zipf_exponent=0.0)
    flat_counts = torch.bincount(flat.item_ids, minlength=5001)[1:].sort(descending=True).values
    assert float(flat_counts[:50].sum()) / flat.num_events < 0.03


def test_sessions_have_realistic_gaps() -> None:
    log = synthetic_log(30, 256, 1024, 1000, seed=0, mean_session_len=24)
    visits = split_visits(log, min_history=0)
    mean_session = log.num_events / visits.num_visits
    assert 12 < mean_session < 48
    sizes = visits.ends - visits.starts
    assert int(sizes.max()) > 1


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="max_len=10 is below min_len=20"):
        synthetic_log(5, 20, 10, 100, seed=0)
    with pytest.raises(ValueError, match="num_items must be an int >= 1, got 0"):
        synthetic_log(5, 1, 10, 0, seed=0)
