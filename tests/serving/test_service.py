"""`RankingService` in process (no Triton): per-request validation, user-distinct steps, offload flush."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gr_plugin.apps.common import load_module
from gr_plugin.cache import KVCacheConfig
from gr_plugin.inference import RankingEngine
from gr_plugin.modules import KVCacheModule
from gr_plugin.serving import RankingService, decode_scores, encode_batch
from gr_plugin.serving.service import distinct_user_groups
from tests.serving.helpers import TINY, max_abs_diff, oracle, tiny_limits, visits


def make_service(ckpt, backend: str = "native") -> RankingService:
    model = load_module(ckpt, TINY).model.eval()
    cfg = KVCacheConfig(num_layers=TINY.num_layers, num_heads=TINY.num_heads, head_dim=TINY.head_dim, page_size=4,
                        num_pages=256, dtype="float32", host_cache_bytes=1 << 20)
    return RankingService(RankingEngine(model, KVCacheModule(cfg, backend)), tiny_limits())


@pytest.fixture(scope="module")
def two_visits():
    """(visit 1, visit 2) of one user and a visit of another user."""
    reqs = visits(num_users=6)
    by_user: dict[int, list] = {}
    for b in reqs:
        by_user.setdefault(int(b.user_ids), []).append(b)
    vs, ws = list(by_user.values())[:2]
    return vs[0], vs[1], ws[0]


def test_groups_keep_each_users_order_and_never_repeat_a_user(two_visits):
    a1, a2, b1 = two_visits
    assert distinct_user_groups([a1, b1, a2]) == [[0, 1], [2]]
    assert distinct_user_groups([a1, a2, a2, b1]) == [[0, 3], [1], [2]]
    assert distinct_user_groups([b1]) == [[0]]


def test_one_call_scores_valid_requests_and_rejects_only_the_bad_one(tiny_ckpt, two_visits):
    a1, a2, b1 = two_visits
    service, ref = make_service(tiny_ckpt), oracle(tiny_ckpt)
    bad = encode_batch(b1)
    bad["history_length"] = bad["history_length"] * 0 - 1
    responses = service([encode_batch(a1), bad, encode_batch(b1), encode_batch(a2)])
    assert len(responses) == 4
    msg = responses[1]["error"][0, 0].decode()
    assert msg.startswith("history_length -1 of user") and np.isnan(responses[1]["scores"]).all()
    for resp, batch in zip([responses[0], responses[2], responses[3]], [a1, b1, a2]):
        assert resp["error"][0, 0] == b""
        scores = decode_scores(resp["scores"], batch.candidate_lengths.numpy())
        assert max_abs_diff(scores, ref.score(batch).logits) <= 1e-5
        assert np.isnan(resp["scores"][0, int(batch.candidate_lengths):]).all()  # padding
    stats = service.stats()
    # a1 and b1 share a step, a2 (same user as a1) runs after it and reuses a1's pages
    assert stats["serve"]["steps"] == 2 and stats["serve"]["requests_rejected"] == 1
    assert stats["kvcache"]["lookups"] == 2 and stats["kvcache"]["tokens_reused_device"] > 0
    service.close()


def test_rejected_requests_leave_the_cache_untouched(tiny_ckpt, two_visits):
    a1, _, b1 = two_visits
    service = make_service(tiny_ckpt)
    service([encode_batch(a1)])
    before = service.stats()["kvcache"]
    bad = [encode_batch(b1) for _ in range(3)]
    bad[0]["candidate_items"][0, 0] = 10_000
    bad[1]["user_id"][0, 0] = -5
    bad[2] = {k: v for k, v in bad[2].items() if k != "history_ratings"}
    out = service(bad)
    assert [r["error"][0, 0].decode().split(" ")[0] for r in out] == ["candidate_items:", "user_id", "missing"]
    assert service.stats()["kvcache"] == before
    service.close()


def test_close_flushes_pending_offloads_and_stops_scoring(tiny_ckpt, two_visits):
    a1, _, b1 = two_visits
    service = make_service(tiny_ckpt)
    service([encode_batch(a1), encode_batch(b1)])
    final = service.close()["kvcache"]
    assert final["copies_in_flight"] == 0 and final["offload_pages"] > 0
    assert final["host_pages_written"] == final["offload_pages"]  # every offloaded page reached the host tier
    with pytest.raises(RuntimeError, match="shutting down"):
        service([encode_batch(a1)])
    assert service.close() == {}  # idempotent


def test_without_a_cache_the_service_is_the_full_pass(tiny_ckpt, two_visits):
    a1, a2, _ = two_visits
    model = load_module(tiny_ckpt, TINY).model.eval()
    service = RankingService(RankingEngine(model, None), tiny_limits())
    out = service([encode_batch(a1), encode_batch(a2)])
    ref = oracle(tiny_ckpt)
    for resp, batch in zip(out, [a1, a2]):
        got = decode_scores(resp["scores"], batch.candidate_lengths.numpy())
        assert max_abs_diff(got, ref.score(batch).logits) <= 1e-5
    assert "kvcache" not in service.stats() and service.close()["serve"]["steps"] == 2
    assert torch.is_grad_enabled()  # the engine's no_grad does not leak
