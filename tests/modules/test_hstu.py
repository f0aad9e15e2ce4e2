"""HSTURanker and KVCacheModule as torchrec-style modules: tracing, meta device, buffers, inputs."""

import pytest
import torch
import torchrec
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gr_plugin.cache import KVCacheConfig
from gr_plugin.modules import HSTUConfig, HSTURanker, KVCacheModule

from .helpers import NUM_ITEMS, User, cached_scores, full_scores, make_inputs, tiny_cache, tiny_model


def test_fx_trace_matches_eager():
    model = tiny_model()
    g = torch.Generator().manual_seed(0)
    users = [User(0, g), User(1, g)]
    users[0].grow(5)
    users[1].grow(2)
    history, candidates, _, _ = make_inputs(users, [users[0].candidates(3), users[1].candidates(1)])
    traced = torchrec.fx.symbolic_trace(model)
    targets = {str(n.target) for n in traced.graph.nodes if n.op == "call_function"}
    assert any("build_token_layout" in t for t in targets)
    with torch.no_grad():
        torch.testing.assert_close(traced(history, candidates), model(history, candidates), rtol=0, atol=0)


def test_meta_device_builds_without_memory():
    cfg = HSTUConfig(num_items=10_000_000, embedding_dim=256)
    model = HSTURanker(cfg, device=torch.device("meta"))
    assert all(p.is_meta for p in model.parameters())
    cache = KVCacheModule(KVCacheConfig(num_layers=2, num_heads=2, head_dim=32, num_pages=1_000_000,
                                        host_cache_bytes=1 << 40), "native", device="meta")
    assert cache.kv_table.is_meta and cache.manager.backend.host_table.is_meta


def test_cache_table_is_not_in_checkpoints_and_follows_to():
    model = tiny_model()
    cache = tiny_cache(model)
    assert "kv_table" not in cache.state_dict()
    assert list(cache.buffers()) and cache.kv_table is cache.manager.kv_table
    g = torch.Generator().manual_seed(3)
    u = User(7, g)
    u.grow(9)
    cached_scores(model, cache, [u], [u.candidates(2)])
    cache.manager.offload_flush()
    assert cache.manager.cached_length(7) == 9
    cache.to(torch.bfloat16)  # a new dtype clears every tier
    assert cache.kv_table.dtype == torch.bfloat16 and cache.config.dtype == "bfloat16"
    assert cache.manager.cached_length(7) == 0 and cache.stats()["host_slots_used"] == 0
    cache.to(torch.float32)
    u.grow(1)
    out, plan = cached_scores(model, cache, [u], [c := u.candidates(2)])
    assert plan.cached_lengths == [0]
    assert (out - full_scores(model, [u], [c])).abs().max() <= 1e-5


def _kjts(hist_keys=("item", "action", "time"), cand_keys=("item",), hist=(3,), cand=(2,), item=1):
    h = KeyedJaggedTensor(keys=list(hist_keys), values=torch.full((sum(hist) * len(hist_keys),), item),
                          lengths=torch.tensor(list(hist) * len(hist_keys)))
    c = KeyedJaggedTensor(keys=list(cand_keys), values=torch.full((sum(cand) * len(cand_keys),), 1),
                          lengths=torch.tensor(list(cand) * len(cand_keys)))
    return h, c


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(hist_keys=("item", "action")), "history KJT must have keys"),
        (dict(cand_keys=("item", "action")), "candidates KJT must have keys"),
        (dict(hist=(3, 2), cand=(1,)), "2 users but candidates have 1"),
        (dict(hist=(0,)), "0 history events"),
        (dict(cand=(0,)), "0 candidates events"),
        (dict(item=NUM_ITEMS + 1), f"item id {NUM_ITEMS + 1} is outside"),
        (dict(item=0), "item id 0 is outside"),
    ],
)
def test_bad_requests_are_rejected(kwargs, match):
    model = tiny_model()
    history, candidates = _kjts(**kwargs)
    with pytest.raises(ValueError, match=match):
        model.validate(history, candidates)


def test_plan_for_another_batch_is_rejected():
    model = tiny_model()
    cache = tiny_cache(model)
    g = torch.Generator().manual_seed(0)
    a, b = User(1, g), User(2, g)
    a.grow(3)
    b.grow(3)
    _, _, lengths, keys = make_inputs([a], [a.candidates(1)])
    plan = cache.begin([1], lengths, keys)
    h2, c2, _, _ = make_inputs([a, b], [a.candidates(1), b.candidates(1)])
    with pytest.raises(ValueError, match="plan is for 1 users"):
        model.forward_cached(h2, c2, cache, plan)
    cache.abort(plan)
    cache.manager.check()


def test_direct_embedding_lookup_equals_torchrec_collection():
    from gr_plugin.modules.tokens import EMBEDDING_KEYS, build_token_layout

    model = tiny_model()
    g = torch.Generator().manual_seed(3)
    users = [User(0, g), User(1, g)]
    users[0].grow(6)
    users[1].grow(3)
    history, candidates, _, _ = make_inputs(users, [users[0].candidates(2), users[1].candidates(4)])
    layout = build_token_layout(history, candidates, torch.tensor([2, 0]), model.config.max_positions)
    out = model.embeddings(layout.features)  # torchrec's own forward
    expected = sum(out[k].values() for k in EMBEDDING_KEYS)
    torch.testing.assert_close(model._embed(layout), expected, rtol=0, atol=0)
    assert layout.features.length_per_key() == [layout.num_query_tokens] * len(EMBEDDING_KEYS)
    assert layout.to("cpu") is layout
