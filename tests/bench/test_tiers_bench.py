"""``suite=tiers`` against a shared Redis: it deletes only its own pages; bad options name the value."""

import pytest
import redis

from gr_plugin.bench import tiers


def test_the_tier_hit_bench_leaves_a_shared_redis_as_it_found_it(tmp_path, redis_url):
    """It cleared every ``gr:*`` key of the server between repeats (every namespace, every replica's
    pages: a UAT finding); now it runs in a namespace of its own and deletes that one only."""
    client = redis.Redis.from_url(redis_url)
    client.set("gr:gr_plugin%3Aw1234:7:0:" + "0" * 32, b"a serving replica's page")
    client.set("someone-else:key", b"theirs")
    rows = tiers.tier_hit(tmp_path, history_lens=(64,), new_events=4, repeats=1, redis_url=redis_url)
    assert [r["case"].rsplit(" ", 1)[-1] for r in rows] == ["device", "host", "ssd", "remote"]
    assert sorted(client.scan_iter("*")) == [b"gr:gr_plugin%3Aw1234:7:0:" + b"0" * 32, b"someone-else:key"]
    client.close()


@pytest.mark.parametrize("kwargs, error", [
    (dict(directory="/nonexistent/dir"), r"tiers.directory='/nonexistent/dir' is not a directory"),
    (dict(parts=["ssd"]), r"unknown part\(s\) \['ssd'\]"),
])
def test_bad_options_are_named(kwargs, error):
    with pytest.raises(ValueError, match=error):
        tiers.run(**kwargs)


def test_one_part_may_be_given_by_name(monkeypatch):
    """``tiers.parts=launch`` reaches the run as a str: one part, not the letters of one."""
    ran = []
    monkeypatch.setattr(tiers, "launch", lambda root: ran.append("launch") or [])
    assert tiers.run(parts="launch") == [] and ran == ["launch"]
