"""GPU paths (marker ``gpu``): CUDA transfers, layerwise onboarding, no syncs on the request path,
and the cached model against full recomputation in bf16 (the 2x rule) and fp32."""

import pytest
import torch

from gr_plugin.bench.common import count_device_syncs
from gr_plugin.cache import CacheRequest, HostTier, KVCacheConfig, KVCacheManager, paged_ops

pytestmark = pytest.mark.gpu


def _kv(user: int, n: int, layer: int, heads: int, dim: int):
    g = torch.Generator().manual_seed(user * 100 + layer)
    k = torch.randn(n, heads, dim, generator=g).to(torch.bfloat16).cuda()
    return k, -k


def test_cuda_round_trip_device_host_device_layerwise_and_no_syncs():
    cfg = KVCacheConfig(num_layers=3, num_heads=2, head_dim=64, page_size=16, num_pages=64, dtype="bfloat16",
                        device="cuda", host_cache_bytes=64 * KVCacheConfig(num_layers=3, num_heads=2, head_dim=64,
                                                                            page_size=16, dtype="bfloat16").page_bytes)
    m = KVCacheManager(cfg, HostTier())
    assert m.backend.host_table.is_pinned()
    rows = torch.arange(100)
    req = CacheRequest([5], [100], rows)
    # NOTE: warm up with the same shapes: a pinned buffer of a new size is allocated (and synced) once.
    m.abort(m.allocate(m.lookup(req)))
    with count_device_syncs() as syncs:
        plan = m.allocate(m.lookup(req))
    assert syncs[0] == 0, syncs
    for layer in range(3):
        k, v = _kv(5, 100, layer, 2, 64)
        m.append(layer, k, v, plan)
    m.commit(plan)
    m.offload_flush()
    assert m.stats()["host_pages_written"] == 6
    m.evict([5])
    req = CacheRequest([5], [110], torch.arange(110))
    m.abort(m.allocate(m.lookup(req)))
    m.offload_flush()
    with count_device_syncs() as syncs:
        plan = m.allocate(m.lookup(req))
    assert syncs[0] == 0 and plan.onboard_tokens == [96], syncs
    handle = m.onboard_launch(plan)
    meta = plan.metadata
    slots = paged_ops.sequence_slots(meta.kv_indices, meta.kv_indptr, meta.total_lengths, meta.total_offsets, 16,
                                     meta.num_total_tokens)
    for layer in range(3):
        handle.wait_layer(layer)  # the stream waits for this layer's pages only
        got_k, got_v = paged_ops.gather_kv(m.kv_table[layer], slots[:96])
        k, v = _kv(5, 100, layer, 2, 64)
        assert torch.equal(got_k, k[:96]) and torch.equal(got_v, v[:96])
    m.abort(plan)
    m.offload_flush()
    m.check()


def _model_pair(dtype):
    from gr_plugin.cache import KVCacheConfig
    from gr_plugin.modules import KVCacheModule
    from tests.modules.helpers import User, make_inputs, tiny_model

    model = tiny_model(0, head_dim=16)  # a head size the Triton kernels serve
    ref = tiny_model(0, head_dim=16)
    model = model.cuda().to(dtype)
    c = model.config
    cfg = KVCacheConfig(num_layers=c.num_layers, num_heads=c.num_heads, head_dim=c.head_dim, page_size=16,
                        num_pages=256, dtype={torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype],
                        device="cuda", host_cache_bytes=0)
    return model, ref, KVCacheModule(cfg, "gpu"), User, make_inputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cached_model_on_gpu_matches_full_recompute(dtype):
    torch.backends.cuda.matmul.allow_tf32 = False
    model, ref, cache, User, make_inputs = _model_pair(dtype)
    g = torch.Generator().manual_seed(4)
    users = [User(u, g) for u in range(3)]
    worst_cached, worst_full = 0.0, 0.0
    for visit in range(3):
        for u in users:
            u.grow(20 + 7 * u.uid)
        cands = [u.candidates(9) for u in users]
        history, candidates, lengths, keys = make_inputs(users, cands)
        with torch.no_grad():
            exact = ref(history, candidates)  # fp32 on the CPU: the oracle
            plan = cache.begin([u.uid for u in users], lengths, keys)
            h, c = history.to("cuda"), candidates.to("cuda")
            cached = model.forward_cached(h, c, cache, plan, num_candidates=27, max_candidates=9).float().cpu()
            cache.commit(plan)
            full = model(h, c).float().cpu()
        worst_cached = max(worst_cached, (cached - exact).abs().max().item())
        worst_full = max(worst_full, (full - exact).abs().max().item())
        if visit:
            assert sum(plan.cached_lengths) > 0
    if dtype == torch.float32:
        assert worst_cached <= 1e-4 and worst_full <= 1e-4, (worst_cached, worst_full)
    else:  # bf16: the cached step is no worse than 2x the full pass in the same precision
        assert worst_cached <= 2 * worst_full + 1e-3, (worst_cached, worst_full)


def test_cuda_graphs_replay_the_eager_cached_step():
    from gr_plugin.modules.graphs import CachedStackGraphs
    from gr_plugin.modules.tokens import build_token_layout
    from tests.modules.helpers import User, make_inputs

    model, _, cache, _, _ = _model_pair(torch.bfloat16)
    graphs = CachedStackGraphs(model, cache, capture_after=1)
    g = torch.Generator().manual_seed(7)
    users = [User(u, g) for u in range(2)]
    for visit in range(4):
        for u in users:
            u.grow(16 if visit else 40)  # same shape every returning visit: one bucket, replayed
        cands = [u.candidates(8) for u in users]
        history, candidates, lengths, keys = make_inputs(users, cands)
        h, c = history.to("cuda"), candidates.to("cuda")
        with torch.no_grad():
            plan = cache.begin([u.uid for u in users], lengths, keys)
            eager = model.forward_cached(h, c, cache, plan, num_candidates=16, max_candidates=8).float()
            host = build_token_layout(history, candidates, torch.tensor(plan.cached_lengths),
                                      model.config.max_positions)
            graphed = graphs.step(host, plan).float()
            cache.commit(plan)
        assert (eager - graphed).abs().max().item() <= 1e-2
    # 80 and 32 new events round to one padded bucket: captured once (whole step), replayed every visit
    assert graphs.captures == 1 and graphs.replays == 4
    cache.manager.check()  # the scratch page is accounted for


def test_cuda_graphs_with_layerwise_onboarding_replay_per_layer():
    """A step whose pages come up from the host tier replays the per-layer graphs (waits between
    them) and scores what the eager step scores."""
    from gr_plugin.modules.graphs import CachedStackGraphs
    from gr_plugin.modules.tokens import build_token_layout
    from tests.modules.helpers import User, make_inputs, tiny_cache, tiny_model

    model = tiny_model(0, head_dim=16).to("cuda", torch.bfloat16)
    cache = tiny_cache(model, num_pages=64, page_size=16, backend="native", host_pages=64, dtype="bfloat16",
                       device="cuda")
    graphs = CachedStackGraphs(model, cache, capture_after=1)
    g = torch.Generator().manual_seed(3)
    users = [User(u, g) for u in range(2)]
    layered_steps = 0
    for visit in range(4):
        for u in users:
            u.grow(16 if visit else 40)
        cands = [u.candidates(8) for u in users]
        history, candidates, lengths, keys = make_inputs(users, cands)
        with torch.no_grad():
            plan = cache.begin([u.uid for u in users], lengths, keys)
            layered_steps += any(plan.onboard_tokens)
            eager = model.forward_cached(history.to("cuda"), candidates.to("cuda"), cache, plan).float()
            host = build_token_layout(history, candidates, torch.tensor(plan.cached_lengths),
                                      model.config.max_positions)
            graphed = graphs.step(host, plan).float()
            cache.commit(plan)
        assert (eager - graphed).abs().max().item() <= 1e-2
        cache.manager.offload_flush()
        cache.manager.evict([u.uid for u in users])  # next visit: every cached page comes from the host tier
    assert layered_steps == 3 and graphs.replays == 4 and graphs.captures == 2  # whole, then per layer
    cache.manager.check()


def test_host_built_layout_moved_in_one_copy_equals_the_device_built_one():
    from gr_plugin.modules.tokens import build_token_layout
    from tests.modules.helpers import User, make_inputs

    g = torch.Generator().manual_seed(5)
    users = [User(u, g) for u in range(3)]
    for u in users:
        u.grow(10 + 5 * u.uid)
    history, candidates, _, _ = make_inputs(users, [u.candidates(3 + u.uid) for u in users])
    cached = torch.tensor([4, 0, 12])
    host = build_token_layout(history, candidates, cached, 64, None, None, 12)
    moved = host.to("cuda")
    on_device = build_token_layout(history.to("cuda"), candidates.to("cuda"), cached.cuda(), 64,
                                   host.num_query_tokens, host.max_q_len, 12)
    for name in ("q_offsets", "history_lengths", "new_lengths", "candidate_lengths", "candidate_rows", "new_rows"):
        assert getattr(moved, name).is_cuda
        assert torch.equal(getattr(moved, name), getattr(on_device, name)), name
    assert torch.equal(moved.features.values(), on_device.features.values())
    assert torch.equal(moved.features.lengths(), on_device.features.lengths())
    assert moved.features.length_per_key() == on_device.features.length_per_key()
