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


def test_raw_page_copies_equal_tensor_copies_and_are_used():
    """The transfer engine's raw ``cudaMemcpyAsync`` launches (gr_plugin.cache.cudart) move exactly
    the bytes ``Tensor.copy_`` does, both ways, over runs of pages of every layer; where they cannot
    (pageable host memory, another dtype, pages not contiguous) there is no raw copier."""
    from gr_plugin.cache import cudart
    from gr_plugin.cache.transfer import CudaTransferEngine

    assert cudart.runtime() is not None, "the CUDA runtime torch loaded was not found: every copy goes through copy_"
    g = torch.Generator().manual_seed(0)
    host = torch.randn(3, 20, 2, 16, 2, 64, generator=g).to(torch.bfloat16).pin_memory()
    src, dst = torch.tensor([3, 4, 5, 9, 10, 0]), torch.tensor([7, 8, 9, 1, 2, 30])
    results = []
    for raw in (True, False):
        engine = CudaTransferEngine(torch.device("cuda"), raw_copies=raw)
        dev = torch.zeros(3, 40, 2, 16, 2, 64, dtype=torch.bfloat16, device="cuda")
        engine.copy(host, src, dev, dst).wait()
        back = torch.zeros_like(host).pin_memory()
        engine.copy(dev, dst, back, src).wait()
        results.append((dev.cpu(), back))
    (dev_raw, back_raw), (dev_copy, back_copy) = results
    # the copies are ordered after the caller's queued work: a slow fill of the table queued before
    # the onboard does not land after it
    engine = CudaTransferEngine(torch.device("cuda"))
    dev = torch.zeros(3, 40, 2, 16, 2, 64, dtype=torch.bfloat16, device="cuda")
    torch.cuda._sleep(50_000_000)  # tens of ms of GPU time on the caller's stream
    dev.fill_(7)
    engine.copy(host, src, dev, dst).wait()
    torch.cuda.synchronize()
    assert torch.equal(dev[:, dst].cpu(), host[:, src]) and (dev[:, [0, 3, 39]] == 7).all()
    assert torch.equal(dev_raw, dev_copy) and torch.equal(back_raw, back_copy)
    assert torch.equal(dev_raw[:, dst], host[:, src]) and dev_raw[:, [0, 3, 39]].abs().sum() == 0
    assert torch.equal(back_raw[:, src], host[:, src]) and back_raw[:, [1, 2, 19]].abs().sum() == 0
    cuda_table = torch.zeros(3, 40, 2, 16, 2, 64, dtype=torch.bfloat16, device="cuda")
    assert cudart.raw_copier(host, cuda_table) is not None
    assert cudart.raw_copier(host.clone(), cuda_table) is None  # pageable
    assert cudart.raw_copier(host.float().pin_memory(), cuda_table) is None
    assert cudart.raw_copier(host, cuda_table.transpose(2, 3)) is None


@pytest.mark.parametrize("grouped", [False, True])
def test_raw_onboard_launches_each_layer_when_it_is_waited_for(grouped):
    """One layer ahead, a raw onboard copies layers 0 and 1 at launch and layer ``i + 1`` at the
    first wait for layer ``i`` (or a later one), all of them on ``wait``; grouped, layers 1 and 2 are one copy, so both
    go at launch; a plan committed after waiting for some layers only still gets every layer before
    its entry is published."""
    from gr_plugin.cache.transfer import CudaTransferEngine

    g = torch.Generator().manual_seed(1)
    host = torch.randn(4, 12, 2, 16, 2, 64, generator=g).to(torch.bfloat16).pin_memory()
    src, dst = torch.tensor([2, 3, 4]), torch.tensor([5, 6, 7])
    engine = CudaTransferEngine(torch.device("cuda"), onboard_lookahead=1, group_layers=grouped)
    dev = torch.zeros(4, 10, 2, 16, 2, 64, dtype=torch.bfloat16, device="cuda")
    handle = engine.copy(host, src, dev, dst)
    copied = lambda: [bool(torch.equal(dev[layer, dst].cpu(), host[layer, src])) for layer in range(4)]  # noqa: E731
    torch.cuda.synchronize()
    assert copied() == [True, True, grouped, False]
    handle.wait_layer(1)
    torch.cuda.synchronize()
    assert copied() == [True, True, True, False]
    handle.wait_layer(2)
    torch.cuda.synchronize()
    assert copied() == [True] * 4
    with pytest.raises(ValueError, match="layer 4 is outside"):
        handle.wait_layer(4)
    handle.wait()
    assert copied() == [True] * 4 and handle.done()
    assert dev[:, [0, 4, 8, 9]].abs().sum() == 0

    cfg = KVCacheConfig(num_layers=3, num_heads=2, head_dim=64, page_size=16, num_pages=64, dtype="bfloat16",
                        device="cuda", host_cache_bytes=64 * KVCacheConfig(num_layers=3, num_heads=2, head_dim=64,
                                                                            page_size=16, dtype="bfloat16").page_bytes)
    m = KVCacheManager(cfg, HostTier())
    plan = m.allocate(m.lookup(CacheRequest([5], [64], torch.arange(64))))
    for layer in range(3):
        m.append(layer, *_kv(5, 64, layer, 2, 64), plan)
    m.commit(plan)
    m.offload_flush()
    m.evict([5])
    plan = m.allocate(m.lookup(CacheRequest([5], [80], torch.arange(80))))
    assert plan.onboard_tokens == [64]
    m.onboard_launch(plan).wait_layer(0)  # the step reads layer 0 only, then commits
    for layer in range(3):
        m.append(layer, *(t[64:] for t in _kv(5, 80, layer, 2, 64)), plan)
    m.commit(plan)
    torch.cuda.synchronize()
    meta = plan.metadata
    slots = paged_ops.sequence_slots(meta.kv_indices, meta.kv_indptr, meta.total_lengths, meta.total_offsets, 16,
                                     meta.num_total_tokens)
    for layer in range(3):
        got_k, _ = paged_ops.gather_kv(m.kv_table[layer], slots[:64])
        assert torch.equal(got_k, _kv(5, 64, layer, 2, 64)[0]), layer
    m.offload_flush()
    m.check()


def _count_2d_copies(monkeypatch) -> list:
    """Spy on the raw 2-D copies (`cudart.Runtime.memcpy2d_async`): one entry per launch."""
    from gr_plugin.cache import cudart

    calls, real = [], cudart.Runtime.memcpy2d_async

    def spy(self, *args):
        calls.append(args[5])  # the rows: layers
        return real(self, *args)
    monkeypatch.setattr(cudart.Runtime, "memcpy2d_async", spy)
    return calls


def test_a_raw_copy_of_several_layers_equals_a_copy_per_layer(monkeypatch):
    """The raw copier's ``layers``: one 2-D copy of a run of pages of consecutive layers where both
    tables' layer strides are within the device's pitch limit, else one copy per layer (a limit
    between the two strides: per layer); both ways, the same bytes, nothing else written."""
    from gr_plugin.cache import cudart

    rt = cudart.runtime()
    assert rt is not None and rt.max_pitch(torch.cuda.current_device()) >= 1 << 20
    g = torch.Generator().manual_seed(5)
    host = torch.randn(5, 20, 2, 16, 2, 64, generator=g).to(torch.bfloat16).pin_memory()  # 163840 B a layer
    want = torch.zeros(5, 30, 2, 16, 2, 64, dtype=torch.bfloat16)  # 245760 B a layer
    want[1:4, 7:11], want[0, 0:2] = host[1:4, 3:7], host[0, 10:12]
    want_back = torch.zeros_like(host)
    want_back[2:5, 0:4] = want[2:5, 7:11]
    stream = torch.cuda.Stream()
    calls = _count_2d_copies(monkeypatch)
    real_limit = cudart.Runtime.max_pitch
    for limit, two_d in ((None, [3, 3]), (200_000, []), (0, [])):
        if limit is not None:
            monkeypatch.setattr(cudart.Runtime, "max_pitch", lambda self, device, limit=limit: limit)
        else:
            monkeypatch.setattr(cudart.Runtime, "max_pitch", real_limit)
        calls.clear()
        dev = torch.zeros(want.shape, dtype=torch.bfloat16, device="cuda")
        back = torch.zeros_like(host).pin_memory()
        torch.cuda.synchronize()
        cudart.raw_copier(host, dev)(1, 3, 7, 4, stream, layers=3)  # layers 1-3, host pages 3-6 -> 7-10
        cudart.raw_copier(host, dev)(0, 10, 0, 2, stream)
        cudart.raw_copier(dev, back)(2, 7, 0, 4, stream, 3)  # layers 2-4, device pages 7-10 -> host 0-3
        stream.synchronize()
        assert calls == two_d, limit
        assert torch.equal(dev.cpu(), want), limit
        assert torch.equal(back, want_back), limit


def test_a_grouped_raw_onboard_moves_the_bytes_of_a_per_layer_one(monkeypatch):
    """Eight layers, two runs of pages, 30 MiB a layer: the engine's grouped raw onboard (0 | 1 2 |
    3 4 | 5 6 | 7: one 2-D copy per run and pair), its per-layer one and ``Tensor.copy_`` copies
    leave identical device tables, and a read of each layer on its own stream right after its wait
    sees its pages (each layer's copy takes ~0.6 ms, far longer than the host's loop over the
    waits, so a read ordered by an earlier copy's event would see NaN)."""
    from gr_plugin.cache.transfer import CudaTransferEngine

    g = torch.Generator().manual_seed(6)
    host = torch.randn(8, 140, 2, 128, 4, 128, generator=g).to(torch.bfloat16).pin_memory()  # 256 KiB a page
    src, dst = torch.tensor([*range(2, 120), 130, 131]), torch.tensor([*range(10, 128), 3, 4])
    calls = _count_2d_copies(monkeypatch)
    dst_dev = dst.cuda()  # (no host->device index copy among the reads)
    tables = []
    for kw, two_d in (({"group_layers": True}, [2] * 6), ({"group_layers": False}, []), ({"raw_copies": False}, [])):
        calls.clear()
        engine = CudaTransferEngine(torch.device("cuda"), **kw)
        dev = torch.full((8, 134, 2, 128, 4, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
        torch.cuda.synchronize()
        handle = engine.copy(host, src, dev, dst)
        seen, streams = [], [torch.cuda.Stream() for _ in range(8)]
        for layer, stream in enumerate(streams):  # each read ordered by its own layer's wait only
            with torch.cuda.stream(stream):
                handle.wait_layer(layer)
                seen.append(dev[layer].index_select(0, dst_dev))
        handle.wait()
        torch.cuda.synchronize()
        assert calls == two_d, kw
        assert torch.equal(torch.stack(seen).cpu(), host[:, src]), kw
        tables.append(dev.cpu())
        del dev
    assert torch.equal(tables[0][:, dst], host[:, src])
    assert tables[0][:, [0, 1, 2, 5, 6, 7, 8, 9, 128, 133]].isnan().all()
    assert all(torch.equal(t.nan_to_num(7), tables[0].nan_to_num(7)) for t in tables[1:])


@pytest.mark.parametrize("ahead, grouped, at_launch, after_wait_1",
                         [(2, False, 3, 4), (None, False, 5, 5), (None, True, 5, 5), (1, True, 3, 3)])
def test_raw_onboard_queues_its_look_ahead_at_launch(ahead, grouped, at_launch, after_wait_1):
    """Five layers: per layer, ``onboard_lookahead=2`` copies layers 0..2 at launch and layer
    ``i + 2`` at the first wait for ``i``; the default (None) copies every layer at launch, grouped
    (0 | 1 2 | 3 | 4) or not; one ahead, grouped, layers 0..2 at launch (layer 1's copy is layer
    2's) and nothing more at the wait for layer 1."""
    from gr_plugin.cache.transfer import CudaTransferEngine

    g = torch.Generator().manual_seed(2)
    host = torch.randn(5, 12, 2, 16, 2, 64, generator=g).to(torch.bfloat16).pin_memory()
    src, dst = torch.tensor([2, 3, 4]), torch.tensor([5, 6, 7])
    kw = {} if ahead is None else {"onboard_lookahead": ahead}
    engine = CudaTransferEngine(torch.device("cuda"), group_layers=grouped, **kw)
    assert engine.onboard_lookahead == ahead
    dev = torch.zeros(5, 10, 2, 16, 2, 64, dtype=torch.bfloat16, device="cuda")
    handle = engine.copy(host, src, dev, dst)
    copied = lambda: [bool(torch.equal(dev[layer, dst].cpu(), host[layer, src])) for layer in range(5)]  # noqa: E731
    torch.cuda.synchronize()
    assert copied() == [i < at_launch for i in range(5)]
    handle.wait_layer(1)
    torch.cuda.synchronize()
    assert copied() == [i < after_wait_1 for i in range(5)]
    handle.wait_layer(3)
    handle.wait()
    assert copied() == [True] * 5 and dev[:, [0, 4, 8, 9]].abs().sum() == 0


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


@pytest.mark.parametrize("direction", ["onboard", "offload"])
def test_a_copy_failing_partway_has_its_queued_copies_done_before_the_error(direction, monkeypatch):
    """``Tensor.copy_`` copies (no raw runtime) that fail after some layers were queued: the error
    reaches the caller only once those layers' copies have run, so none still writes into pages or
    slots the caller frees on the error (and hands out again)."""
    from gr_plugin.cache.transfer import CudaTransferEngine

    host = torch.ones(4, 64, 2, 128, 4, 128, dtype=torch.bfloat16).pin_memory()  # 16 MiB a layer
    dev = torch.zeros(4, 64, 2, 128, 4, 128, dtype=torch.bfloat16, device="cuda")
    pages = torch.arange(64)
    engine = CudaTransferEngine(torch.device("cuda"), raw_copies=False)
    args = (host, pages, dev, pages) if direction == "onboard" else (dev, pages, host, pages)
    stream = engine.h2d_stream if direction == "onboard" else engine.d2h_stream
    real_copy, calls = torch.Tensor.copy_, []

    def copy_(t, src, non_blocking=False):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected copy failure")
        return real_copy(t, src, non_blocking=non_blocking)

    torch.cuda.synchronize()
    torch.cuda._sleep(20_000_000)  # the copies queue behind this on the caller's stream (fenced)
    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    with pytest.raises(RuntimeError, match="injected copy failure"):
        engine.copy(*args)
    monkeypatch.undo()
    assert len(calls) == 3 and stream.query()  # the two queued layers' copies have run
    torch.cuda.synchronize()
    if direction == "onboard":
        assert (dev[:2] == 1).all() and (dev[2:] == 0).all()
    else:  # the device's zeros reached the host's first two layers only
        assert (host[:2] == 0).all() and (host[2:] == 1).all()


def test_a_raw_onboard_failing_partway_through_layer_0_waits_for_its_queued_runs(monkeypatch):
    """Raw copies: the engine queues layer 0 before it builds the lazy handle, so a failure there is
    ``copy``'s to handle: layer 0's first run (queued) has run when the error reaches the caller,
    its second run never went, and no later layer was launched."""
    from gr_plugin.cache import transfer

    host = torch.ones(4, 64, 2, 128, 4, 128, dtype=torch.bfloat16).pin_memory()  # 16 MiB a layer
    dev = torch.zeros(4, 64, 2, 128, 4, 128, dtype=torch.bfloat16, device="cuda")
    src, dst = torch.tensor([*range(0, 40), 50]), torch.tensor([*range(0, 40), 60])  # two runs
    engine = transfer.CudaTransferEngine(torch.device("cuda"))
    real = transfer.raw_copier(host, dev)
    assert real is not None, "no raw copies on this machine"
    calls = []

    def failing(layer, s0, d0, count, stream, layers=1):
        calls.append((layer, s0, count))
        if len(calls) == 2:
            raise RuntimeError("injected raw copy failure")
        real(layer, s0, d0, count, stream, layers)

    monkeypatch.setattr(engine, "_raw_copier", lambda a, b: failing)
    torch.cuda.synchronize()
    torch.cuda._sleep(20_000_000)  # the copies queue behind this on the caller's stream (fenced)
    with pytest.raises(RuntimeError, match="injected raw copy failure"):
        engine.copy(host, src, dev, dst)
    assert calls == [(0, 0, 40), (0, 50, 1)] and engine.h2d_stream.query()  # layer 0's first run has run
    torch.cuda.synchronize()
    assert (dev[0, :40] == 1).all() and (dev[0, 40:] == 0).all() and (dev[1:] == 0).all()


@pytest.mark.parametrize("silu_pass", [True, False])  # the eager default, and the pre-SiLU form (`silu_append_kv`)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cached_model_on_gpu_matches_full_recompute(dtype, silu_pass):
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
            cached = model.forward_cached(h, c, cache, plan, num_candidates=27, max_candidates=9,
                                          silu_pass=silu_pass).float().cpu()
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


def _graph_vs_eager(model, make_cache, visits, grow, capture_after=1, evict_between=False, eager_ok=False,
                    **graph_kwargs):
    """Run the same visits through a graphed cache and an eager one (separate caches, so the graph
    step's own appends and waits are what it reads) and return the worst logit difference, the
    graphs and how many graph steps onboarded pages. ``eager_ok``: a step the graphs decline
    (None) runs eagerly on the graphed cache instead of failing the test."""
    from gr_plugin.modules.graphs import CachedStackGraphs
    from gr_plugin.modules.tokens import build_token_layout
    from tests.modules.helpers import User, make_inputs

    g_cache, e_cache = make_cache(), make_cache()
    graphs = CachedStackGraphs(model, g_cache, capture_after=capture_after, **graph_kwargs)
    assert graphs.supported(torch.device("cuda"))
    g = torch.Generator().manual_seed(7)
    users = [User(u, g) for u in range(2)]
    worst, onboarding = 0.0, 0
    for visit in range(visits):
        for u in users:
            u.grow(grow(visit))
        cands = [u.candidates(8) for u in users]
        history, candidates, lengths, keys = make_inputs(users, cands)
        uids = [u.uid for u in users]
        with torch.no_grad():
            g_plan = g_cache.begin(uids, lengths, keys)
            onboarding += any(g_plan.onboard_tokens)
            host = build_token_layout(history, candidates, torch.tensor(g_plan.cached_lengths),
                                      model.config.max_positions)
            graphed = graphs.step(host, g_plan)  # first: nothing else has waited or appended for it
            if graphed is None and eager_ok:
                graphed = model.forward_cached(history.to("cuda"), candidates.to("cuda"), g_cache, g_plan)
            assert graphed is not None
            g_cache.commit(g_plan)
            e_plan = e_cache.begin(uids, lengths, keys)
            eager = model.forward_cached(history.to("cuda"), candidates.to("cuda"), e_cache, e_plan)
            e_cache.commit(e_plan)
        assert g_plan.cached_lengths == e_plan.cached_lengths
        worst = max(worst, (eager.float() - graphed.float()).abs().max().item())
        if evict_between:  # next visit: every cached page comes up from the host tier
            for c in (g_cache, e_cache):
                c.manager.offload_flush()
                c.manager.evict(uids)
    for c in (g_cache, e_cache):
        c.manager.check()  # the scratch page is accounted for
    return worst, graphs, onboarding


def test_cuda_graphs_replay_the_eager_cached_step():
    from gr_plugin.modules import KVCacheModule

    model, _, cache, _, _ = _model_pair(torch.bfloat16)
    worst, graphs, _ = _graph_vs_eager(model, lambda: KVCacheModule(cache.config, "gpu"), 4,
                                       lambda visit: 16 if visit else 40)
    assert worst <= 1e-2, worst
    # 80 and 32 new events round to one padded bucket: captured once (whole step), replayed every visit
    assert graphs.captures == 1 and graphs.replays == 4 and graphs.layered_replays == 0


def test_cuda_graph_buckets_give_up_the_least_recently_used_when_idle():
    """Two shapes in turn (80 and 32 new events, buckets of 16) with room for one bucket: with no
    idle time required each step drops the other shape's bucket and captures its own, and scores
    what the eager step scores; with the default idle time the second shape runs eagerly instead
    of capturing on every step."""
    from gr_plugin.modules import KVCacheModule

    model, _, cache, _, _ = _model_pair(torch.bfloat16)
    quanta = dict(token_quantum=16, new_quantum=16, q_quantum=16, max_buckets=1)
    worst, graphs, _ = _graph_vs_eager(model, lambda: KVCacheModule(cache.config, "gpu"), 4,
                                       lambda visit: 16 if visit % 2 else 40, idle_steps=0, **quanta)
    assert worst <= 1e-2, worst
    assert graphs.captures == 4 and graphs.evictions == 3 and graphs.replays == 4 and len(graphs._buckets) == 1
    # the last visit's 2 x (16 new + 8 candidates) rows fill their bucket: no padding row, the padding user empty
    assert next(iter(graphs._buckets))[:2] == (3, 48)
    worst, graphs, _ = _graph_vs_eager(model, lambda: KVCacheModule(cache.config, "gpu"), 4,
                                       lambda visit: 16 if visit % 2 else 40, eager_ok=True, **quanta)
    assert worst <= 1e-2, worst
    assert graphs.captures == 1 and graphs.evictions == 0 and graphs.replays == 2  # visits 1 and 3


def test_cuda_graph_buckets_replay_across_history_bounds(monkeypatch):
    """head_dim 128 (the makespan rule's tiles) with 2 users' histories growing from 700 to 2300
    tokens, across the history bounds 1024, 2048 and 4096: graphed scores equal the eager step's
    (which launches with the real longest history). Bounds that give the same attention launch share
    one bucket, captured at its first bound and replayed past it (the kernel reads the real lengths;
    the bound only picks the launch): on an H200 the 400-event visits' bucket takes 64x64 tiles and
    7 splits at both 2048 and 4096, so the last visit replays the bucket of bound 2048."""
    from gr_plugin.cache import KVCacheConfig
    from gr_plugin.modules import KVCacheModule
    from gr_plugin.modules.graphs import CachedStackGraphs
    from tests.modules.helpers import tiny_model

    seen = []
    real_key = CachedStackGraphs._key

    def key(self, *a):
        got = real_key(self, *a)
        seen.append(got)
        return got

    monkeypatch.setattr(CachedStackGraphs, "_key", key)

    model = tiny_model(0, head_dim=128).to("cuda", torch.bfloat16)
    c = model.config

    def make_cache():
        cfg = KVCacheConfig(num_layers=c.num_layers, num_heads=c.num_heads, head_dim=c.head_dim, page_size=64,
                            num_pages=128, dtype="bfloat16", device="cuda", host_cache_bytes=0)
        return KVCacheModule(cfg, "gpu")

    worst, graphs, _ = _graph_vs_eager(model, make_cache, 5, lambda visit: 400 if visit else 700)
    # NOTE: the graphed and the eager step may split the keys differently (the bucket's bound against
    # the real longest history), so their fp32 sums differ in order; this model's logits stay below 4
    # (3.43 at most in fp32 on the CPU), where two bf16 steps are 2 ** -5. A wrong history (keys left
    # out) moves logits by far more.
    assert worst <= 2 * 2 ** -6, worst
    assert [bound for _, bound in seen] == [1024, 2048, 2048, 2048, 4096]  # each visit's own bound
    assert graphs.replays == 5 and graphs.captures == len(graphs._buckets) == len({k for k, _ in seen}) == 2
    # every bucket holds the first bound it was seen with; the last visit ran past its bucket's
    assert all(graphs._buckets[k].hist <= bound for k, bound in seen)
    assert graphs._buckets[seen[-1][0]].hist == 2048


def test_cuda_graphs_with_layerwise_onboarding_replay_per_layer():
    """A step whose pages come up from the host tier replays the layer segments, each layer's
    onboard wait between its projection and its append (no other step waits for them), and scores
    what the eager step scores."""
    from tests.modules.helpers import tiny_cache, tiny_model

    model = tiny_model(0, head_dim=16).to("cuda", torch.bfloat16)

    def make_cache():
        return tiny_cache(model, num_pages=64, page_size=16, backend="native", host_pages=64, dtype="bfloat16",
                          device="cuda")

    worst, graphs, onboarding = _graph_vs_eager(model, make_cache, 4, lambda visit: 16 if visit else 40,
                                                evict_between=True)
    assert worst <= 1e-2, worst
    assert onboarding == 3 and graphs.layered_replays == 3 and graphs.replays == 4
    assert graphs.captures == 2  # the whole step (first visit), then in layer segments
    (bucket,) = graphs._buckets.values()
    assert len(bucket.layered[0]) == len(model.layers) + 1


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
