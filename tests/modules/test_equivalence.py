"""The golden rule: a cached answer equals the uncached answer (fp32 CPU, max abs diff <= 1e-5)."""

import pytest
import torch

from .helpers import User, cached_scores, full_scores, tiny_cache, tiny_model

TOL = 1e-5


def assert_same(cached, full):
    assert cached.shape == full.shape
    diff = (cached - full).abs().max().item()
    assert diff <= TOL, f"cached vs full max abs diff {diff}"


@pytest.mark.parametrize("backend", ["gpu", "native"])
@pytest.mark.parametrize("attention", ["auto", "reference"])  # the C++ CPU kernels, the pure-torch reference
def test_returning_users_get_recompute_scores(backend, attention, monkeypatch):
    monkeypatch.setenv("GR_PLUGIN_ATTENTION", attention)
    model = tiny_model()
    cache = tiny_cache(model, backend=backend)
    g = torch.Generator().manual_seed(1)
    users = [User(u, g) for u in range(3)]
    for visit in range(4):
        for u in users:
            u.grow(3 + visit * 2 + u.uid)
        cands = [u.candidates(5) for u in users]
        out, plan = cached_scores(model, cache, users, cands)
        assert_same(out, full_scores(model, users, cands))
        if visit:
            assert sum(plan.cached_lengths) > 0
    assert cache.stats()["hit_rate"] > 0.4


def test_cpu_kernels_score_as_the_reference(monkeypatch):
    """The model's scores on the C++ CPU attention (``auto``) equal the reference's, cached and full."""
    model = tiny_model()
    from gr_plugin.ops import hstu_attention as dispatch

    assert dispatch._cpu_ops() is not None  # (else ``auto`` would run the reference too)
    got = {}
    for attention in ("auto", "reference"):
        monkeypatch.setenv("GR_PLUGIN_ATTENTION", attention)
        g = torch.Generator().manual_seed(4)  # (the same users and candidates for both)
        users = [User(u, g) for u in range(3)]
        cache = tiny_cache(model, backend="gpu")
        for visit in range(2):
            for u in users:
                u.grow(2 if visit else 9 + 4 * u.uid)
            cands = [u.candidates(4) for u in users]
            cached, plan = cached_scores(model, cache, users, cands)
        assert sum(plan.cached_lengths) > 0
        got[attention] = (cached, full_scores(model, users, cands))
    assert_same(got["auto"][0], got["reference"][0])
    assert_same(got["auto"][1], got["reference"][1])


def test_candidate_scores_do_not_depend_on_the_other_candidates():
    model = tiny_model()
    g = torch.Generator().manual_seed(2)
    u = User(1, g)
    u.grow(9)
    c = u.candidates(6)
    together = full_scores(model, [u], [c])
    alone = torch.cat([full_scores(model, [u], [c[i : i + 1]]) for i in range(6)])
    torch.testing.assert_close(together, alone, rtol=0, atol=TOL)


@pytest.mark.parametrize("backend", ["gpu", "native"])
@pytest.mark.parametrize(("seed", "attention"), [(0, "auto"), (1, "auto"), (2, "auto"), (0, "reference")])
def test_random_streams_with_pressure_edits_and_failures(backend, seed, attention, monkeypatch):
    """Several visits per user, a cache too small for everyone (evictions, host round trips),
    edited histories and steps that fail after allocate; on the C++ CPU attention and (one seed) on
    the reference, which also reads the host sizes the GPU kernels take (``max_q_len``, ...)."""
    monkeypatch.setenv("GR_PLUGIN_ATTENTION", attention)
    model = tiny_model(seed)
    cache = tiny_cache(model, num_pages=14, page_size=4, backend=backend, host_pages=40)
    g = torch.Generator().manual_seed(100 + seed)
    users = [User(u, g) for u in range(6)]
    for u in users:
        u.grow(1)
    for step in range(24):
        pick = torch.randperm(6, generator=g)[: 1 + step % 3].tolist()
        batch = [users[i] for i in pick]
        for u in batch:
            r = int(torch.randint(0, 10, (1,), generator=g))
            if r == 0 and u.items.numel() > 2:
                u.edit(int(torch.randint(0, u.items.numel(), (1,), generator=g)))
            else:
                u.grow(int(torch.randint(0, 9, (1,), generator=g)))
        cands = [u.candidates(int(torch.randint(1, 6, (1,), generator=g))) for u in batch]
        outcome = "abort" if step % 7 == 6 else "commit"
        out, plan = cached_scores(model, cache, batch, cands, outcome)
        if plan is None:  # did not fit: the caller recomputes
            continue
        assert_same(out, full_scores(model, batch, cands))
        cache.manager.offload_flush()
        cache.manager.check()
    s = cache.stats()
    assert s["evicted_users"] > 0 and s["tokens_reused_device"] > 0
    if backend == "native":
        assert s["tokens_reused_host"] > 0


def test_flexkv_streams_through_every_tier_equal_recompute(tmp_path, redis_url):
    """A device cache for ~2 users, a host tier for ~3, SSD and Redis below: users fall to the
    lower tiers and come back; every score equals the full pass."""
    from gr_plugin.cache.tiers import TierConfig

    model = tiny_model(5)
    c = model.config
    page_bytes = tiny_cache(model, backend="gpu").config.page_bytes
    tiers = TierConfig(cpu_cache_gb=10 * page_bytes / 2**30, ssd_cache_gb=400 * page_bytes / 2**30,
                       ssd_cache_dir=str(tmp_path / "ssd"), enable_3rd_remote=True, remote_url=redis_url)
    from gr_plugin.cache import KVCacheConfig
    from gr_plugin.modules import KVCacheModule

    cfg = KVCacheConfig(num_layers=c.num_layers, num_heads=c.num_heads, head_dim=c.head_dim, page_size=4,
                        num_pages=12, host_cache_bytes=10 * page_bytes)
    cache = KVCacheModule(cfg, "flexkv", tiers=tiers)
    g = torch.Generator().manual_seed(9)
    users = [User(u, g) for u in range(5)]
    for step in range(20):
        batch = [users[step % 5]]
        batch[0].grow(int(torch.randint(1, 7, (1,), generator=g)))
        cands = [batch[0].candidates(3)]
        out, plan = cached_scores(model, cache, batch, cands)
        if plan is None:
            continue
        assert_same(out, full_scores(model, batch, cands))
        cache.manager.offload_flush()
        cache.manager.backend.flush_writes()
        cache.manager.check()
    s = cache.stats()
    assert s["ssd_pages_fetched"] > 0 and s["tokens_reused_host"] > 0 and s["evicted_users"] > 0
    assert s["remote_pages_written"] > 0
    with pytest.raises(ValueError, match="in use by another store"):  # (the SSD directory is locked while open)
        KVCacheModule(cfg, "flexkv", tiers=tiers)
    cache.close()
    cache.close()  # (idempotent)
    again = KVCacheModule(cfg, "flexkv", tiers=tiers)  # closed: the next cache (a sweep's next job) takes it
    cands = [users[0].candidates(3)]
    out, plan = cached_scores(model, again, [users[0]], cands)
    assert plan.cached_lengths[0] > 0  # (from Redis: this replica's SSD and host start empty)
    assert_same(out, full_scores(model, [users[0]], cands))
    again.close()
