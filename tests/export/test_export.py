"""torch.export + AOTInductor round trip of the whole cached step (embeddings, layer stack with the gr_kv
ops, head): equal to eager cached inference and to full recomputation on a replayed stream (several
visits per user, so the cache is hit)."""

import pytest
import torch

from gr_plugin.export.model import CachedRankerProgram, export_program, full_pass_inputs, program_inputs
from gr_plugin.export.runner import PackagedCachedRanker, export_package

from ..modules.helpers import User, make_inputs, tiny_cache, tiny_model


def _step(cache, users, cands):
    history, candidates, lengths, keys = make_inputs(users, cands)
    return history, candidates, cache.begin([u.uid for u in users], lengths, keys)


def test_program_equals_eager_cached_step():
    """The exportable module itself (no export): same logits as forward_cached, same pages written."""
    model = tiny_model(0, head_dim=16)
    cache = tiny_cache(model, backend="gpu")
    g = torch.Generator().manual_seed(0)
    users = [User(u, g) for u in range(3)]
    for _ in range(2):  # a miss, then a hit
        for u in users:
            u.grow(4 + u.uid)
        history, candidates, plan = _step(cache, users, [u.candidates(1 + u.uid) for u in users])
        with torch.no_grad():
            table = cache.kv_table.clone()
            eager = model.forward_cached(history, candidates, cache, plan)
            eager_table = cache.kv_table.clone()
            cache.kv_table.copy_(table)
            got = CachedRankerProgram(model)(*program_inputs(model, cache.kv_table, history, candidates, plan).args())
        torch.testing.assert_close(got, eager, rtol=0, atol=1e-5)
        assert (cache.kv_table - eager_table).abs().max() <= 1e-5
        cache.commit(plan)


def test_export_declares_the_table_mutation():
    model = tiny_model(0, head_dim=16)
    cache = tiny_cache(model, backend="gpu")
    g = torch.Generator().manual_seed(0)
    users = [User(u, g) for u in range(2)]
    for u in users:
        u.grow(6)
    history, candidates, plan = _step(cache, users, [u.candidates(2) for u in users])
    table = cache.kv_table.clone()
    program = export_program(model, program_inputs(model, cache.kv_table, history, candidates, plan))
    assert torch.equal(cache.kv_table, table)  # exporting only traces
    ops = {str(n.target) for n in program.graph.nodes}
    assert {"gr_kv.append_kv_layer.default", "gr_kv.paged_hstu_attention_layer.default",
            "aten.embedding.default"} <= ops
    decomposed = program.run_decompositions()
    assert list(decomposed.graph_signature.user_inputs_to_mutate.values()) == ["kv_table"]
    # the weights are the model's (shared, not copied into the program at export time)
    assert decomposed.state_dict["tables.0"].data_ptr() == model.embeddings.embeddings["item"].weight.data_ptr()
    cache.abort(plan)


def test_aoti_package_equals_eager_and_full_recompute(tmp_path, monkeypatch):
    model = tiny_model(1, head_dim=16)
    cache = tiny_cache(model, backend="native")
    g = torch.Generator().manual_seed(3)
    users = [User(u, g) for u in range(3)]
    for u in users:
        u.grow(5 + 3 * u.uid)
    history, candidates, plan = _step(cache, users, [u.candidates(3) for u in users])
    package = export_package(model, cache, history, candidates, plan, tmp_path / "model.pt2")
    cache.abort(plan)
    packaged = PackagedCachedRanker(model, cache, package)
    visits = [(2, 1), (3, 4), (0, 2), (1, 1)]  # (new events, candidates): new sizes, an all-cached visit
    for visit, (grow, ncand) in enumerate(visits):
        for u in users:
            u.grow(grow + (u.uid if grow else 0))
        cands = [u.candidates(ncand + (visit + u.uid) % 3) for u in users]
        history, candidates, plan = _step(cache, users, cands)
        with torch.no_grad():
            with monkeypatch.context() as m:  # the oracle: the pure-torch reference, not the package's C++ ops
                m.setenv("GR_PLUGIN_ATTENTION", "reference")
                full = model(history, candidates)
            table = cache.kv_table.clone()
            eager = model.forward_cached(history, candidates, cache, plan)
            eager_table = cache.kv_table.clone()
            cache.kv_table.copy_(table)  # the package must write the pages itself
            got = packaged.score(history, candidates, plan)
        assert (cache.kv_table - eager_table).abs().max().item() <= 1e-5
        cache.commit(plan)
        assert (got - eager).abs().max().item() <= 1e-5
        assert (got - full).abs().max().item() <= 1e-5
        if visit:
            assert sum(plan.cached_lengths) > 0
        if grow == 0:
            assert sum(plan.metadata.new_lengths.tolist()) == 0  # every history event was cached
    cache.manager.check()
    # the same package as a full pass, without the cache: a batch-sized scratch table (its page count
    # is a dynamic dimension of the package), the cache's table untouched
    before = cache.kv_table.clone()
    inputs = full_pass_inputs(model, cache.kv_table, history, candidates)
    assert inputs.kv_table.shape[1] != cache.kv_table.shape[1]
    eager_inputs = full_pass_inputs(model, cache.kv_table, history, candidates)
    with torch.no_grad():
        got = packaged.program(*inputs.args())
        CachedRankerProgram(model)(*eager_inputs.args())
    assert (got - full).abs().max().item() <= 1e-5
    # every layer's K/V went to that layer of the scratch table (a layer mix-up leaves the scores right)
    assert (inputs.kv_table - eager_inputs.kv_table).abs().max().item() <= 1e-5
    assert torch.equal(cache.kv_table, before)
    # a one-page scratch table: a single user with a history shorter than a page
    short = User(9, g)
    short.grow(3)
    history, candidates, _, _ = make_inputs([short], [short.candidates(2)])
    inputs = full_pass_inputs(model, cache.kv_table, history, candidates)
    assert inputs.kv_table.shape[1] == 1
    with torch.no_grad():
        assert (packaged.program(*inputs.args()) - model(history, candidates)).abs().max().item() <= 1e-5


def _gpu_package(tmp_path, num_pages):
    """A tiny model's package on CUDA (Triton kernels compiled into it, gr_plugin.ops.library), its
    cache (KV table on the GPU) and two users with 20 events."""
    from gr_plugin.cache import KVCacheConfig
    from gr_plugin.modules import KVCacheModule

    model = tiny_model(2, head_dim=16).cuda()
    c = model.config
    cache = KVCacheModule(KVCacheConfig(num_layers=c.num_layers, num_heads=c.num_heads, head_dim=c.head_dim,
                                        page_size=16, num_pages=num_pages, device="cuda"), "gpu")
    g = torch.Generator().manual_seed(5)
    users = [User(u, g) for u in range(2)]
    for u in users:
        u.grow(20)

    def step(cands):
        history, candidates, lengths, keys = make_inputs(users, cands)
        plan = cache.begin([u.uid for u in users], lengths, keys)
        return history.to("cuda"), candidates.to("cuda"), plan

    history, candidates, plan = step([u.candidates(3) for u in users])
    package = export_package(model, cache, history, candidates, plan, tmp_path / "model.pt2")
    cache.abort(plan)
    return model, cache, users, step, PackagedCachedRanker(model, cache, package)


@pytest.mark.gpu
def test_aoti_package_on_the_gpu_equals_full_recompute(tmp_path):
    model, cache, users, step, packaged = _gpu_package(tmp_path, 128)
    torch.backends.cuda.matmul.allow_tf32 = False
    for grow in (7, 5, 0):
        for u in users:
            u.grow(grow)
        history, candidates, plan = step([u.candidates(2) for u in users])
        with torch.no_grad():
            full = model(history, candidates)
            got = packaged.score(history, candidates, plan)
        cache.commit(plan)
        assert (got - full).abs().max().item() <= 1e-4
        assert sum(plan.cached_lengths) > 0 or grow == 7


@pytest.mark.gpu
def test_aoti_package_on_the_gpu_writes_the_table_in_place(tmp_path):
    """A step of the package allocates far less than the KV table: the kernels write the table
    itself. (Given per-layer views, Inductor copied the whole table for every layer, and the copy
    read past its end: docs/EXPORT.md.)"""
    model, cache, users, step, packaged = _gpu_package(tmp_path, 16384)
    table = cache.kv_table
    table_bytes = table.numel() * table.element_size()
    assert table_bytes >= 64 << 20
    for grow in (7, 3):
        for u in users:
            u.grow(grow)
        history, candidates, plan = step([u.candidates(2) for u in users])
        before = table.clone()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.no_grad():
            got = packaged.score(history, candidates, plan)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        assert peak < table_bytes // 16, (peak, table_bytes)
        # the new tokens landed in the cache's own table (and nothing else changed)
        changed = (table != before).flatten(2).any(-1)  # [L, num_pages]
        assert changed.any(1).all()  # every layer's own pages
        assert set(changed.nonzero()[:, 1].tolist()) <= set(plan.metadata.kv_indices.tolist())
        cache.commit(plan)
        with torch.no_grad():
            assert (got - model(history, candidates)).abs().max().item() <= 1e-4
