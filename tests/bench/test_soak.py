"""Soak: many requests through small tiers; accounting holds and memory stays flat."""

import pytest

from gr_plugin.bench import soak


def _check(rows, num_requests):
    assert rows[-1]["requests"] == num_requests
    assert rows[-1]["verified_steps"] >= num_requests // 50
    assert rows[-1]["ssd_fetched"] > 0 and rows[-1]["evicted_users"] > 0  # every tier was used
    assert len({r["pinned_mb"] for r in rows}) == 1  # pinned host memory is fixed
    assert rows[-1]["tasks_in_flight"] == 0
    return rows


def test_short_soak(tmp_path):
    _check(soak.run(num_requests=2000, checkpoints=4, ssd_dir=str(tmp_path)), 2000)


@pytest.mark.slow
def test_soak_100k_requests_memory_stays_flat(tmp_path):
    rows = _check(soak.run(num_requests=100_000, checkpoints=10, ssd_dir=str(tmp_path)), 100_000)
    warm = rows[1]["rss_mb"]
    assert rows[-1]["rss_mb"] - warm < 64, [r["rss_mb"] for r in rows]
