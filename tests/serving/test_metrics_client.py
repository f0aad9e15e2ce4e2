"""Prometheus exposition and parsing, the /metrics endpoint, routing, replay ordering."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections import Counter

import numpy as np
import pytest

from gr_plugin.serving import ServeClient, replay, route, split_by_replica, tier_hit_rates
from gr_plugin.serving.client import scrape
from gr_plugin.serving.metrics import MetricsServer, cache_counters, parse_prometheus, render_prometheus
from gr_plugin.serving.service import concat_batches
from tests.serving.helpers import visits

STATS = {"serve": {"requests": 5, "step_seconds": 0.25},
         "kvcache": {"tokens_requested": 100, "tokens_reused_device": 30, "tokens_reused_host": 50,
                     "tokens_reused_ssd": 8, "tokens_reused_remote": 12, "ssd_pages_fetched": 3,
                     "remote_pages_fetched": 5, "page_size": 4, "device_users": 7,
                     "copies_in_flight": 1, "remote_failing": False, "remote_url": "redis://secret@host/0",
                     "hit_rate": 0.8}}


def test_exposition_types_names_and_tiers():
    text = render_prometheus(STATS, {"replica": "1"})
    assert '# TYPE gr_serve_requests_total counter\ngr_serve_requests_total{replica="1"} 5' in text
    assert 'gr_kvcache_tokens_requested_total{replica="1"} 100' in text
    assert "# TYPE gr_kvcache_device_users gauge" in text and "# TYPE gr_kvcache_copies_in_flight gauge" in text
    assert 'gr_kvcache_remote_failing{replica="1"} 0' in text
    assert "secret" not in text  # strings (URLs, paths) are not exported
    tiers = {t: parse_prometheus(line)["gr_kvcache_tokens_reused_tier_total"]
             for t in ("device", "host", "ssd", "remote") for line in text.splitlines() if f'tier="{t}"' in line}
    assert tiers == {"device": 30, "host": 50 - 8 - 12, "ssd": 8, "remote": 12}
    assert cache_counters(text)["tokens_reused_device"] == 30 and cache_counters(text)["page_size"] == 4


def test_tier_hit_rates_are_deltas_over_replicas():
    before = [render_prometheus(STATS), render_prometheus(STATS)]
    later = {**STATS["kvcache"], "tokens_requested": 200, "tokens_reused_device": 80, "tokens_reused_host": 70,
             "tokens_reused_remote": 32, "remote_pages_fetched": 12}
    after = [render_prometheus({"kvcache": later}), render_prometheus(STATS)]
    rates = tier_hit_rates(before, after)
    assert rates["tokens_requested"] == 100
    assert rates["hit_rate_device"] == pytest.approx(0.5) and rates["hit_rate_remote"] == pytest.approx(0.2)
    # the remote's 20 tokens were onboarded through the host tier (its count rose by 20): host's own share 0,
    # whatever else was fetched and not read (the pages fetched do not enter the rates)
    assert rates["hit_rate_host"] == pytest.approx(0.0)
    assert rates["hit_rate"] == pytest.approx(0.7)


def test_metrics_server_serves_only_metrics():
    calls = []
    server = MetricsServer(lambda: calls.append(1) or STATS, port=0, labels={"replica": "0"}).start()
    try:
        url = f"http://127.0.0.1:{server.port}"
        text = scrape(url + "/metrics")
        assert 'gr_serve_requests_total{replica="0"} 5' in text and len(calls) == 1
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(url + "/other", timeout=5)
    finally:
        server.stop()


def test_route_is_stable_and_spreads_users():
    assert [route(u, 2) for u in range(8)] == [route(u, 2) for u in range(8)]
    assert route(12345, 1) == 0
    counts = Counter(route(u, 4) for u in range(4000))
    assert set(counts) == {0, 1, 2, 3} and min(counts.values()) > 850
    with pytest.raises(ValueError, match="num_replicas must be >= 1, got 0"):
        route(1, 0)


def test_split_by_replica_keeps_every_user_once():
    reqs = visits(num_users=8)
    seen, picked = set(), []
    for b in reqs:
        if int(b.user_ids) not in seen:
            seen.add(int(b.user_ids))
            picked.append(b)
    batch = concat_batches(picked)
    parts = split_by_replica(batch, 2)
    assert sorted(u for _, b in parts for u in b.user_ids.tolist()) == sorted(batch.user_ids.tolist())
    assert all(route(u, 2) == r for r, b in parts for u in b.user_ids.tolist())
    with pytest.raises(ValueError, match="route to replicas"):
        ServeClient(["a:1", "b:2"]).replica_of(batch)


class _FakeClient:
    """Stands in for the network only, to check replay's ordering (the real client is tested
    against a real server in test_server.py)."""

    def __init__(self):
        self.lock, self.active, self.log = threading.Lock(), set(), []

    def score(self, batch, replica):
        users = set(batch.user_ids.tolist())
        with self.lock:
            assert not users & self.active, "a user had two requests in flight"
            self.active |= users
            self.log.append((int(batch.user_ids[0]), int(batch.history_lengths[0])))
        time.sleep(0.002)
        with self.lock:
            self.active -= users
        return np.zeros((int(batch.candidate_lengths.sum()), 2), np.float32)


def test_replay_keeps_each_users_visits_in_order():
    reqs = visits(num_users=10)
    client = _FakeClient()
    report = replay(client, [(0, b) for b in reqs], num_threads=4)
    assert report.requests == len(reqs) and not report.errors and len(report.latencies_s) == len(reqs)
    per_user: dict[int, list[int]] = {}
    for u, h in client.log:
        per_user.setdefault(u, []).append(h)
    assert all(h == sorted(h) for h in per_user.values()) and len(per_user) == 10
    s = report.summary()
    assert s["latency_ms_p50"] >= 2.0 and s["throughput_rps"] > 0 and s["per_replica"] == {0: len(reqs)}


def test_a_negative_user_id_offset_is_refused_before_any_request():
    from gr_plugin.configs.serve import ServeClientConfig
    from gr_plugin.serving import client_app

    # NOTE: no server listens on this port: the check must come before anything is sent
    with pytest.raises(ValueError, match="user_id_offset must be >= 0, got -1"):
        client_app.run(ServeClientConfig(urls=["127.0.0.1:9"], metrics_urls=[], user_id_offset=-1))
