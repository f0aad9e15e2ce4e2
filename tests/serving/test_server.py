"""The real server: ``python -m recipes.serve`` (stock tritonserver through PyTriton) on free
loopback ports, scored from several client threads against full recomputation, fuzzed with bad
requests, then shut down gracefully."""

from __future__ import annotations

import dataclasses
import json
import threading

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from gr_plugin.serving import ServeClient, bucket_width, encode_batch, replay
from gr_plugin.serving.client import RequestRejected, scrape
from gr_plugin.serving.launch import ServerProcess
from gr_plugin.serving.metrics import parse_prometheus
from tests.serving.helpers import MAX_BATCH, MODEL_OVERRIDES, NUM_ITEMS, max_abs_diff, oracle, visits


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_ckpt, stub_env):
    proc = ServerProcess([*MODEL_OVERRIDES, f"ckpt_path={tiny_ckpt}", "kvcache=native", "kvcache.page_size=4",
                          "kvcache.num_pages=512", "kvcache.host_cache_gb=0.01",
                          "triton.max_queue_delay_us=20000"],  # wide window: concurrent requests share batches
                         tmp_path_factory.mktemp("serve"), name="replica0")
    try:
        yield proc.start()
    finally:
        proc.kill()  # no-op after the graceful-shutdown test


@pytest.fixture(scope="module")
def client(server):
    return ServeClient([server.info["http"]])


def serve_counters(server) -> dict[str, float]:
    return parse_prometheus(scrape(server.info["metrics"]), "gr_")


def check_all(results: dict, ckpt) -> float:
    ref = oracle(ckpt)
    return max(max_abs_diff(scores, ref.score(batch).logits) for batch, scores in results.values())


def test_concurrent_clients_get_the_scores_of_full_recomputation(server, client, tiny_ckpt):
    reqs = visits(num_users=12)
    results = {}
    report = replay(client, [(0, b) for b in reqs], num_threads=4,
                    on_result=lambda i, b, s: results.__setitem__(i, (b, s)))
    assert not report.errors and len(results) == len(reqs) > 30
    assert check_all(results, tiny_ckpt) <= 1e-5
    m = serve_counters(server)
    assert m["gr_kvcache_tokens_reused_total"] > 0.3 * m["gr_kvcache_tokens_requested_total"]  # returning users hit
    assert m["gr_serve_requests_total"] == len(reqs) and m["gr_serve_requests_rejected_total"] == 0


def same_width_burst(seed: int, size: int, repeat_one: bool = False) -> list:
    """First visits of ``size`` users whose padded history rows are equally wide (Triton batches
    only requests of equal shapes), plus, with ``repeat_one``, the second visit of one of them."""
    by_user: dict[int, list] = {}
    for b in visits(num_users=32, seed=seed):
        by_user.setdefault(int(b.user_ids), []).append(b)
    width = lambda b: bucket_width(int(b.history_lengths))  # noqa: E731
    by_width: dict[int, list] = {}
    for vs in by_user.values():
        by_width.setdefault(width(vs[0]), []).append(vs)
    group = max(by_width.values(), key=len)[:size]
    assert len(group) == size
    if not repeat_one:
        return [vs[0] for vs in group]
    again = next(vs for vs in group if len(vs) > 1 and width(vs[1]) == width(vs[0]))
    return [vs[0] for vs in group] + [again[1]]


def test_simultaneous_requests_share_a_dynamic_batch_and_repeated_users_are_split(server, client, tiny_ckpt):
    burst = same_width_burst(seed=3, size=5, repeat_one=True)
    before = serve_counters(server)
    barrier, results = threading.Barrier(len(burst)), {}

    def send(i, batch):
        barrier.wait()
        results[i] = (batch, client.score(batch, 0))

    threads = [threading.Thread(target=send, args=(i, b)) for i, b in enumerate(burst)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == len(burst) and check_all(results, tiny_ckpt) <= 1e-5
    after = serve_counters(server)
    assert after["gr_serve_requests_total"] - before["gr_serve_requests_total"] == len(burst)
    assert after["gr_serve_batches_total"] - before["gr_serve_batches_total"] < len(burst)  # Triton merged some


def _good(seed: int = 5):
    return visits(num_users=4, seed=seed)


STRUCTURAL = {  # Triton rejects these before any batch is formed
    "float history": lambda w: {**w, "history_items": w["history_items"].astype(np.float32)},
    "1-d user_id": lambda w: {**w, "user_id": w["user_id"].reshape(-1)},
    "missing input": lambda w: {k: v for k, v in w.items() if k != "candidate_items"},
    "extra input": lambda w: {**w, "bogus": w["user_id"]},
    "oversized batch": lambda w: {k: np.repeat(v, MAX_BATCH + 1, axis=0) for k, v in w.items()},
    "rows of another batch": lambda w: {**w, "history_ratings": np.repeat(w["history_ratings"], 2, axis=0)},
}
SEMANTIC = {  # the service rejects these (per request, in the `error` output)
    "negative length": lambda w: {**w, "history_length": -w["history_length"]},
    "length past the row": lambda w: {**w, "history_length": w["history_length"] + 500},
    "zero candidates": lambda w: {**w, "candidate_length": 0 * w["candidate_length"]},
    "item out of range": lambda w: {**w, "candidate_items": w["candidate_items"] + NUM_ITEMS},
    "negative user": lambda w: {**w, "user_id": -1 - w["user_id"]},
    "history too long": lambda w: {**w, **{n: np.ones((1, 1024), np.int64) for n in
                                           ("history_items", "history_ratings", "history_time_buckets")},
                                   "history_length": np.full((1, 1), 300, np.int64)},
    "duplicate user": lambda w: {k: np.repeat(v, 2, axis=0) for k, v in w.items()},
}


def test_fuzzed_bad_requests_get_errors_and_change_nothing(server, client, tiny_ckpt):
    good = _good()
    wire = encode_batch(good[0])
    before = serve_counters(server)
    for name, mutate in STRUCTURAL.items():
        with pytest.raises(InferenceServerException) as exc:
            client.infer_raw(mutate(wire))
        assert str(exc.value), name
    with pytest.raises(InferenceServerException, match=r"unknown model|not found"):
        client.infer_raw(wire, model_name="no_such_model")
    for name, mutate in SEMANTIC.items():
        out = client.infer_raw(mutate(wire))
        errors = {e.decode() for e in out["error"].reshape(-1)}
        assert len(errors) == 1 and errors.pop(), name
        assert np.isnan(out["scores"]).all(), name
    items = good[0].candidate_items.clone()
    items[0] = 10_000
    with pytest.raises(RequestRejected, match=r"candidate_items: value 10000 of user \d+ is outside \[1, 60\]"):
        client.score(dataclasses.replace(good[0], candidate_items=items), 0)
    after = serve_counters(server)
    assert after["gr_serve_requests_rejected_total"] - before["gr_serve_requests_rejected_total"] == len(SEMANTIC) + 1
    for key in ("gr_kvcache_lookups_total", "gr_kvcache_plans_total", "gr_serve_steps_total"):
        assert after[key] == before[key], key  # nothing reached the engine or the cache
    # ...and the server keeps serving correct scores
    results = {i: (b, client.score(b, 0)) for i, b in enumerate(_good(seed=6)[:6])}
    assert check_all(results, tiny_ckpt) <= 1e-5


def test_bad_requests_batched_with_good_ones_fail_alone(server, client, tiny_ckpt):
    good = same_width_burst(seed=7, size=4)
    bad = encode_batch(good[0])
    bad["history_items"] = bad["history_items"] * 0 + 999
    before = serve_counters(server)
    barrier, results, rejected = threading.Barrier(len(good) + 2), {}, []

    def send_good(i, batch):
        barrier.wait()
        results[i] = (batch, client.score(batch, 0))

    def send_bad():
        barrier.wait()
        rejected.append(client.infer_raw(bad)["error"][0, 0].decode())

    threads = [threading.Thread(target=send_good, args=(i, b)) for i, b in enumerate(good)]
    threads += [threading.Thread(target=send_bad) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(rejected) == 2 and all("history_items: value 999" in r for r in rejected)
    assert len(results) == len(good) and check_all(results, tiny_ckpt) <= 1e-5
    after = serve_counters(server)
    assert after["gr_serve_batches_total"] - before["gr_serve_batches_total"] < len(good) + 2  # they shared batches


def test_metrics_endpoints(server):
    assert server.info["device"] == "cpu" and server.info["dtype"] == "float32"  # what the replica runs on
    ours = scrape(server.info["metrics"])
    assert "# TYPE gr_kvcache_tokens_reused_device_total counter" in ours
    assert 'gr_kvcache_tokens_reused_tier_total{replica="0",model="hstu_ranker",tier="host"}' in ours
    triton = parse_prometheus(scrape(server.info["triton_metrics"]), "nv_inference_")
    # Triton's own counters: requests answered, and fewer model executions than requests (dynamic batching)
    assert 0 < triton["nv_inference_exec_count"] < triton["nv_inference_request_success"]


def test_graceful_shutdown_flushes_and_exits_zero(server, client):
    client.score(_good(seed=8)[0], 0)
    assert server.stop() == 0
    log = server.log()
    assert "signal SIGTERM: shutting down gracefully" in log and "replica 0 stopped" in log
    final = json.loads(log[log.rindex("\n{\n") + 1:])  # the recipe prints the final stats last
    assert final["kvcache"]["copies_in_flight"] == 0 and final["kvcache"]["plans_in_flight"] == 0
    assert final["kvcache"]["host_pages_written"] == final["kvcache"]["offload_pages"] > 0
    assert not server.ready_file.exists()
