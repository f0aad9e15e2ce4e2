"""`RankingEngine.prepare` reads the batch's columns directly (no KJTs): the same layout as the
KJT path, the same cache keys, and bad ids refused by name before the cache is touched."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gr_plugin.bench.e2e import stream
from gr_plugin.cache import KVCacheConfig
from gr_plugin.inference import RankingEngine, batch_to_kjts
from gr_plugin.modules import HSTUConfig, HSTURanker, KVCacheModule, tokens
from gr_plugin.modules.tokens import build_token_layout

CFG = HSTUConfig(num_items=50_000, num_time_buckets=32, max_positions=48, embedding_dim=8, num_layers=1,
                 num_heads=1, head_dim=8, n_norm=64.0)
LAYOUT_TENSORS = ("q_offsets", "history_lengths", "new_lengths", "candidate_lengths", "candidate_rows", "new_rows")


def _engine(cache: bool) -> RankingEngine:
    torch.manual_seed(0)
    model = HSTURanker(CFG).eval()
    kv = KVCacheModule(KVCacheConfig(num_layers=1, num_heads=1, head_dim=8, page_size=4, num_pages=64,
                                     device="cpu"), "gpu", device=torch.device("cpu")) if cache else None
    return RankingEngine(model, kv, "cpu")


def _assert_same_layout(got, want):
    assert got.num_query_tokens == want.num_query_tokens
    assert got.max_q_len >= int((want.q_offsets[1:] - want.q_offsets[:-1]).max())  # a bound is fine
    assert torch.equal(got.features.values(), want.features.values())
    assert torch.equal(got.features.lengths(), want.features.lengths())
    for name in LAYOUT_TENSORS:
        assert torch.equal(getattr(got, name), getattr(want, name)), name


@pytest.mark.parametrize("cache", [True, False])
def test_the_prepared_layout_is_the_kjt_layout(cache, monkeypatch):
    # histories past max_positions (positions clamp), 3 users, visits of 5 new events
    batches = stream(3, 3, 40, 55, 5, 8)
    engine = _engine(cache)
    for batch in batches:
        step = engine.prepare(batch)
        history, candidates = batch_to_kjts(batch)
        cached = torch.tensor(step.plan.cached_lengths) if step.plan is not None else None
        if cache and batch is not batches[0]:
            assert sum(step.plan.cached_lengths) > 0  # a returning step, not only first visits
        monkeypatch.setattr(tokens, "_HOST_NUMPY", False)  # the torch ops, from the KJTs
        want = build_token_layout(history, candidates, cached, CFG.max_positions)
        monkeypatch.setattr(tokens, "_HOST_NUMPY", True)
        _assert_same_layout(step.layout, want)
        # the KJTs, built on first use, are the batch's
        for got, ref in zip((step.history, step.candidates), (history, candidates)):
            assert got.keys() == ref.keys()
            assert torch.equal(got.values(), ref.values()) and torch.equal(got.lengths(), ref.lengths())
        engine.run(step)


@pytest.mark.parametrize("column, key, bad", [("history_items", "item", 50_001), ("history_items", "item", 0),
                                              ("history_ratings", "action", 6),
                                              ("history_time_buckets", "time", -1),
                                              ("candidate_items", "candidate item", 70_000)])
def test_prepare_names_a_bad_id_and_leaves_the_cache_unchanged(column, key, bad):
    first, second = stream(2, 2, 20, 25, 5, 8)[:2]
    engine = _engine(True)
    engine.run(engine.prepare(first))
    before = engine.cache.stats()
    values = getattr(second, column).clone()
    values[-1] = bad
    with pytest.raises(ValueError, match=rf"^{key} id {bad} is outside the table range"):
        engine.prepare(dataclasses.replace(second, **{column: values}))
    assert engine.cache.stats() == before
    step = engine.prepare(second)  # the cache still holds the first visit
    assert sum(step.plan.cached_lengths) == int(first.history_lengths.sum())
    engine.discard(step)


def test_prepare_refuses_a_column_that_does_not_match_the_lengths():
    # a RequestBatch checks its sizes when built; one changed afterwards must not score a prefix
    first, second = stream(2, 2, 20, 25, 5, 8)[:2]
    engine = _engine(True)
    engine.run(engine.prepare(first))
    before = engine.cache.stats()
    n = int(second.history_lengths.sum())
    second.history_ratings = torch.cat([second.history_ratings, torch.zeros(3, dtype=torch.int64)])
    with pytest.raises(ValueError, match=rf"^action column has {n + 3} entries but the lengths sum to {n}"):
        engine.prepare(second)
    assert engine.cache.stats() == before


def test_validate_ids_takes_separate_columns_and_names_the_user_without_events():
    lengths, cands = torch.tensor([2, 1]), torch.tensor([1, 1])
    cols = (torch.tensor([1, 2, 3]), torch.tensor([0, 5, 1]), torch.tensor([0, 1, 7]))
    tokens.validate_ids(lengths, cols, cands, torch.tensor([4, 9]), num_items=9, num_actions=6,
                        num_time_buckets=8)
    with pytest.raises(ValueError, match="user at batch index 1 has 0 candidates events"):
        tokens.validate_ids(lengths, cols, torch.tensor([1, 0]), torch.tensor([4]), num_items=9, num_actions=6,
                            num_time_buckets=8)
    with pytest.raises(ValueError, match=r"^time id 7 is outside the table range \[0, 6\]"):
        tokens.validate_ids(lengths, cols, cands, torch.tensor([4, 9]), num_items=9, num_actions=6,
                            num_time_buckets=7)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_cache_keys_pack_each_field_into_its_bits(dtype):
    g = torch.Generator().manual_seed(0)
    top = 2**38 if dtype == torch.int64 else 2**31 - 1
    items = torch.randint(0, top, (1000,), generator=g, dtype=torch.int64).to(dtype)
    actions = torch.randint(0, 256, (1000,), generator=g).to(dtype)
    times = torch.randint(0, 2**16, (1000,), generator=g).to(dtype)
    keys = tokens.cache_token_keys(items, actions, times)
    assert keys.dtype == torch.int64
    want = [(i << 24) | (a << 16) | t for i, a, t in zip(items.tolist(), actions.tolist(), times.tolist())]
    assert keys.tolist() == want
