"""Two replicas sharing a real redis-server: a user re-routed to the other replica hits there in the
remote tier, and a replica's shutdown flushes its pending pages to Redis."""

from __future__ import annotations

import time

import pytest
import redis

from gr_plugin.serving import ServeClient, route, tier_hit_rates
from gr_plugin.serving.client import scrape
from gr_plugin.serving.launch import ServerProcess
from gr_plugin.serving.metrics import cache_counters
from tests.serving.helpers import MODEL_OVERRIDES, max_abs_diff, oracle, visits

PAGE = 4


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, tiny_ckpt, stub_env, redis_server):
    workdir = tmp_path_factory.mktemp("replicas")
    common = [*MODEL_OVERRIDES, f"ckpt_path={tiny_ckpt}", "kvcache=flexkv", f"kvcache.page_size={PAGE}",
              "kvcache.num_pages=512", "kvcache.tiers.cpu_cache_gb=0.01", "kvcache.tiers.ssd_cache_gb=0",
              "kvcache.tiers.enable_3rd_remote=true", f"kvcache.tiers.remote_url={redis_server.url}"]
    procs = [ServerProcess([*common, "replica_id=0"], workdir, name="replica0"),
             # replica 1 publishes finished offloads only when it must: its shutdown has to flush them
             ServerProcess([*common, "replica_id=1", "publish_interval_s=600"], workdir, name="replica1")]
    try:
        for p in procs:
            p.launch()
        yield [p.wait_ready() for p in procs]
    finally:
        for p in procs:
            p.kill()


def test_a_rerouted_user_hits_in_the_remote_tier_and_shutdown_flushes(replicas, redis_url, tiny_ckpt):
    r0, r1 = replicas
    client = ServeClient([r0.info["http"], r1.info["http"]])
    by_user: dict[int, list] = {}
    for b in visits(num_users=12, seed=11):
        by_user.setdefault(int(b.user_ids), []).append(b)
    user, (v1, v2, *_) = next((u, vs) for u, vs in by_user.items() if route(u, 2) == 0 and len(vs) >= 2)
    ref = oracle(tiny_ckpt)

    assert max_abs_diff(client.score(v1), ref.score(v1).logits) <= 1e-5  # routed: replica 0
    full_pages = int(v1.history_lengths) // PAGE
    deadline = time.monotonic() + 20  # replica 0 publishes its pages to Redis in the background
    while cache_counters(scrape(r0.info["metrics"])).get("remote_pages_written", 0) < full_pages:
        assert time.monotonic() < deadline, "replica 0 never wrote the user's pages to Redis"
        time.sleep(0.05)

    before = [scrape(r1.info["metrics"])]
    moved = client.score(v2, replica=1)  # the user moves to replica 1 (explicit override)
    after = [scrape(r1.info["metrics"])]
    assert max_abs_diff(moved, ref.score(v2).logits) <= 1e-5
    rates = tier_hit_rates(before, after)
    assert rates["tokens_requested"] == int(v2.history_lengths)
    assert rates["hit_rate_remote"] == pytest.approx(full_pages * PAGE / int(v2.history_lengths))
    assert rates["hit_rate_device"] == 0 and rates["hit_rate_host"] == 0

    # a new user's first visit on replica 1, then an immediate graceful shutdown: its pages reach Redis
    other, (w1, *_) = next((u, vs) for u, vs in by_user.items() if u != user and int(vs[0].history_lengths) >= 8)
    client.score(w1, replica=1)
    store = redis.Redis.from_url(redis_url)
    # (keys hold the namespace percent-quoted: ``gr_plugin:w`` + 16 hex digits of the weights' fingerprint,
    # then the cache dtype)
    pattern = f"*:gr_plugin%3Aw{'?' * 16}%3Afloat32:{other}:*"
    assert not list(store.scan_iter(match=pattern))  # nothing published yet (interval 600 s)
    assert r1.stop() == 0
    assert len(list(store.scan_iter(match=pattern))) == int(w1.history_lengths) // PAGE
    assert r0.stop() == 0
