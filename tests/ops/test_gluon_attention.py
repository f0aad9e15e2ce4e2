"""The paged attention's Gluon kernel (`gr_plugin.ops.triton.hstu_gluon`): when `_launch` takes it, what it
refuses, its split rule; on a Hopper GPU (marker ``gpu``) its error against an fp32 reference within 2x the
same-precision torch reference's, and a captured launch equal to an eager one."""

import pytest
import torch

from gr_plugin.ops.pytorch import hstu_attention as ref
from gr_plugin.ops.triton import hstu_attention as tri

from .test_triton_attention import build, replayed, run

CPU = torch.device("cpu")


def _bf16(args):
    return {k: (v.to(torch.bfloat16) if k in ("q", "k", "v", "kv_layer") else v) for k, v in args.items()}


def test_gluon_is_taken_only_where_it_can_run(monkeypatch):
    """`_gluon_tiles`: bf16, Hopper (capability 9: its warpgroup MMA is not on Blackwell), a head size it
    has tiles for, pages a multiple of its key block, with ``GLUON``, ``TMA`` and ``FAST_SILU`` on."""
    cuda = torch.device("cuda", 0)
    assert tri._gluon_tiles(128, torch.bfloat16, 128, CPU) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert tri._gluon_tiles(128, torch.bfloat16, 128, cuda) == tri.GLUON_TILES[128]
    assert tri._gluon_tiles(256, torch.bfloat16, 32, cuda) == tri.GLUON_TILES[256]
    assert tri._gluon_tiles(128, torch.bfloat16, 32, cuda) is None  # a 64-key block spans pages
    assert tri._gluon_tiles(128, torch.float16, 128, cuda) is None
    assert tri._gluon_tiles(64, torch.bfloat16, 128, cuda) is None  # no measured tiles
    monkeypatch.setattr(tri, "FAST_SILU", False)
    assert tri._gluon_tiles(128, torch.bfloat16, 128, cuda) is None
    monkeypatch.setattr(tri, "FAST_SILU", True)
    monkeypatch.setattr(tri, "GLUON", False)
    assert tri._gluon_tiles(128, torch.bfloat16, 128, cuda) is None
    monkeypatch.setattr(tri, "GLUON", True)
    monkeypatch.setattr(tri, "TMA", False)  # (its loads are TMA loads)
    assert tri._gluon_tiles(128, torch.bfloat16, 128, cuda) is None
    monkeypatch.setattr(tri, "TMA", True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert tri._gluon_tiles(128, torch.bfloat16, 128, cuda) is None


def _spy_kernels(monkeypatch) -> list:
    """Record which kernel each launch reaches (``("gluon", its tiles)`` / ``"triton"``) instead of
    running it."""
    from gr_plugin.ops.triton import hstu_gluon

    took = []

    class Triton:
        def __getitem__(self, grid):
            return lambda *a, **kw: took.append("triton")

    monkeypatch.setattr(hstu_gluon, "launch", lambda *a: took.append(("gluon", a[-1])))
    monkeypatch.setattr(tri, "_hstu_fwd", Triton())
    return took


def test_gluon_refuses_a_launch_it_cannot_take(monkeypatch):
    """``kernel="gluon"`` names why it cannot run, and runs nothing; an unknown kernel is refused."""
    took = _spy_kernels(monkeypatch)
    _, paged = build([37, 90], [3, 1], [20, 64], 64, 2, 64, torch.float32, "cpu")
    with pytest.raises(ValueError, match="bf16 only"):
        run(tri, "paged", {**paged, "kernel": "gluon"})
    with pytest.raises(ValueError, match="Hopper only"):
        run(tri, "paged", {**_bf16(paged), "kernel": "gluon"})
    from gr_plugin.ops.triton import hstu_gluon

    with monkeypatch.context() as m:
        m.setattr(hstu_gluon, "supported", lambda *a: None)  # (as on a Hopper GPU: the options' checks next)
        with pytest.raises(ValueError, match="the exact one asked"):
            run(tri, "paged", {**_bf16(paged), "kernel": "gluon", "fast": False})
        for option in ({"tma": False}, {"warp_specialize": True}):
            with pytest.raises(ValueError, match="no form without TMA loads or with warp specialisation"):
                run(tri, "paged", {**_bf16(paged), "kernel": "gluon", **option})
        m.setattr(tri, "FAST_SILU", False)
        with pytest.raises(ValueError, match="the exact one asked"):
            run(tri, "paged", {**_bf16(paged), "kernel": "gluon"})
    with pytest.raises(ValueError, match="the split grid only"):
        run(tri, "paged", {**_bf16(paged), "kernel": "gluon", "schedule": "stream"})
    with pytest.raises(ValueError, match="kernel must be None, 'triton' or 'gluon', got 'cuda'"):
        run(tri, "paged", {**paged, "kernel": "cuda"})
    assert took == []


def test_auto_launch_takes_gluon_unless_a_triton_option_is_named(monkeypatch):
    """Where the Gluon kernel could run (here: as if on Hopper, capturing), a launch naming none of the
    Triton kernel's options takes it, on `_gluon_tiles`' tiles (a split count, the fast SiLU or
    ``kernel="gluon"`` may be named); one naming tiles, a TMA setting, stream-K (asked or by
    ``SCHEDULE``), warp specialisation, the exact SiLU or the Triton kernel keeps the Triton kernel, as
    does one `_gluon_tiles` has no tiles for (e.g. ``GLUON`` off) or whose tensors the kernel refuses;
    an eager launch (`_use_tma` false) keeps it too."""
    from gr_plugin.ops.triton import hstu_gluon

    took = _spy_kernels(monkeypatch)
    _, paged = build([300, 90], [3, 1], [200, 64], 64, 2, 64, torch.float32, "cpu")
    args = {**_bf16(paged), "num_splits": 1, "fast": True}  # (the fast SiLU: a CUDA bf16 launch's default)
    monkeypatch.setattr(tri, "_use_tma", lambda kv, q=None: True)
    monkeypatch.setattr(tri, "_gluon_tiles", lambda dim, dtype, page, device: (64, 64, 4, 4))
    monkeypatch.setattr(hstu_gluon, "supported", lambda *a: None)
    gluon = ("gluon", (64, 64, 4, 4))
    cases = [({}, gluon), ({"blocks": (64, 64, 4, 2)}, "triton"), ({"tma": False}, "triton"),
             ({"tma": True}, "triton"), ({"schedule": "stream", "num_splits": None}, "triton"),
             ({"warp_specialize": True}, "triton"), ({"fast": False}, "triton"), ({"kernel": "triton"}, "triton"),
             ({"kernel": "gluon"}, ("gluon", (64, 64, 4, 3)))]  # (forced at head_dim 64: the default tiles)
    for extra, kernel in cases:
        took.clear()
        run(tri, "paged", {**args, **extra})
        assert took == [kernel], extra
    with monkeypatch.context() as m:
        m.setattr(tri, "SCHEDULE", "stream")
        took.clear()
        run(tri, "paged", {**args, "num_splits": None})
        assert took == ["triton"]
        m.setattr(tri, "_gluon_tiles", lambda dim, dtype, page, device: None)
        m.setattr(tri, "SCHEDULE", "split")
        took.clear()
        run(tri, "paged", args)
        assert took == ["triton"]
    monkeypatch.setattr(hstu_gluon, "supported", lambda *a: "not these tensors")
    took.clear()
    run(tri, "paged", args)
    assert took == ["triton"]
    monkeypatch.setattr(tri, "_use_tma", lambda kv, q=None: False)  # eager
    monkeypatch.setattr(hstu_gluon, "supported", lambda *a: None)
    took.clear()
    run(tri, "paged", args)
    assert took == ["triton"]


def test_full_pass_takes_gluon_only_where_it_can_run(monkeypatch):
    """The full pass (`hstu_attention_jagged`) on the Gluon kernel: `_gluon_tiles` gives `GLUON_FULL_TILES`
    (no page size) unless ``GLUON_FULL`` is off, which leaves the paged launches theirs; a captured
    launch naming no Triton option takes it (the one-wave split rule), an eager one, one naming tiles
    or one whose keys no TMA descriptor covers keeps the Triton kernel, which never reads the full
    pass through TMA."""
    from gr_plugin.ops.triton import hstu_gluon

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(tri, "GLUON_FULL", True)  # (whatever GR_PLUGIN_ATTENTION_GLUON_FULL says here)
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        assert tri._gluon_tiles(128, torch.bfloat16, None, cuda) == tri.GLUON_FULL_TILES[128]
        assert tri._gluon_tiles(256, torch.bfloat16, None, cuda) == tri.GLUON_FULL_TILES[256]
        m.setattr(tri, "GLUON_FULL", False)
        assert tri._gluon_tiles(128, torch.bfloat16, None, cuda) is None
        assert tri._gluon_tiles(128, torch.bfloat16, 128, cuda) == tri.GLUON_TILES[128]
    took = []
    monkeypatch.setattr(hstu_gluon, "launch", lambda *a, **kw: took.append(("gluon", a[5] is None, a[-1], a[12])))

    class Triton:
        def __getitem__(self, grid):
            return lambda *a, **kw: took.append(("triton", kw["TMA"]))

    monkeypatch.setattr(tri, "_hstu_fwd", Triton())
    jag, _ = build([300, 90, 0], [3, 1, 7], [0, 0, 0], 64, 2, 64, torch.float32, "cpu")
    args = {**_bf16(jag), "fast": True}
    monkeypatch.setattr(tri, "_use_tma", lambda kv, q=None: kv is None)  # (capturing; the table case unused)
    monkeypatch.setattr(tri, "_gluon_tiles", lambda dim, dtype, page, device: (64, 64, 4, 2) if page is None else None)
    monkeypatch.setattr(hstu_gluon, "supported", lambda *a: None)
    run(tri, "jagged", args)
    assert took == [("gluon", True, (64, 64, 4, 2), 1)]  # (a full pass, its tiles, one split: 12 programs here)
    with monkeypatch.context() as m:
        m.setattr(tri, "SCHEDULE", "stream")  # (the setting applies to the paged form only)
        took.clear()
        run(tri, "jagged", args)
        assert took == [("gluon", True, (64, 64, 4, 2), 1)]
    for extra in ({"blocks": (64, 64, 4, 2)}, {"kernel": "triton"}, {"tma": False}):
        took.clear()
        run(tri, "jagged", {**args, **extra})
        assert took == [("triton", False)], extra
    took.clear()
    run(tri, "jagged", {**args, "kernel": "gluon", "num_splits": 3})
    assert took == [("gluon", True, tri.GLUON_FULL_TILES.get(64, (64, 64, 4, 3)), 3)]
    monkeypatch.setattr(hstu_gluon, "supported", lambda *a: "not these keys")
    took.clear()
    run(tri, "jagged", args)
    assert took == [("triton", False)]
    with pytest.raises(ValueError, match="cannot take this launch: not these keys"):
        run(tri, "jagged", {**args, "kernel": "gluon"})
    took.clear()
    with pytest.raises(ValueError, match="tma=True applies to the paged form"):
        run(tri, "jagged", {**args, "tma": True})
    assert took == []
    monkeypatch.setattr(tri, "_use_tma", lambda kv, q=None: False)  # eager
    monkeypatch.setattr(hstu_gluon, "supported", lambda *a: None)
    took.clear()
    run(tri, "jagged", args)
    assert took == [("triton", False)]


def test_full_pass_split_count_is_the_one_wave_rule(monkeypatch):
    """`GLUON_MAKESPAN`'s constants were fitted on the paged launch; the full pass (causal: its programs'
    key ranges differ) takes the one-wave rule with the same tiles. At an H200's sizes, bs 1 of the
    block's 4096 + 256 tokens: one split (68 query tiles x 4 heads fill the wave), where the makespan
    model would take 3."""
    monkeypatch.setattr(tri, "_num_sms", lambda device: 132)
    monkeypatch.setattr(tri, "_shared_memory", lambda device: 232448)
    tiles = tri.GLUON_FULL_TILES[128]
    assert (128, tuple(tiles)) in tri.GLUON_MAKESPAN  # (else the model would not apply to these tiles anyway)
    sizes = (4352, 1, 4, 128, torch.bfloat16, CPU, 4352, 4352)
    _, _, full = tri._plan(*sizes, False, None, tiles, "split", True, gluon=True)
    _, _, model = tri._plan(*sizes, True, None, tiles, "split", True, gluon=True)
    assert (full, model) == (1, 3)


def test_gluon_launch_runs_the_full_pass_heaviest_first(monkeypatch):
    """`hstu_gluon.launch`: the full pass (no table) reads keys and values through descriptors of its own
    ``k`` / ``v`` and runs the query tiles last to first; the paged launch in order, on the table."""
    from gr_plugin.ops.triton import hstu_gluon

    seen = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *a, **kw: seen.append((a[5], a[6], kw))

    monkeypatch.setattr(hstu_gluon, "_paged_fwd", Kernel())
    jag, paged = build([300, 90], [3, 1], [200, 64], 64, 2, 64, torch.bfloat16, "cpu")
    i64 = torch.zeros(3, dtype=torch.int64)
    out = torch.empty_like(jag["q"])
    hstu_gluon.launch((1, 2, 2), jag["q"], jag["k"], jag["v"], out, None, i64, i64, 0, i64, i64, i64, 1, 0,
                      (0, 0, 0, 0), 0.1, 1.0, (64, 64, 4, 3))
    kd, vd, kw = seen.pop()
    assert kw["PAGED"] is False and kw["HEAVY_FIRST"] is True and kd.base is jag["k"] and vd.base is jag["v"]
    table = paged["kv_layer"]
    hstu_gluon.launch((1, 2, 2), paged["q"], paged["k"], paged["v"], torch.empty_like(paged["q"]), table, i64, i64, 0,
                      i64, i64, i64, 1, 0, tuple(table.stride()[:4]), 0.1, 1.0, (64, 64, 4, 3))
    kd, vd, kw = seen.pop()
    assert kw["PAGED"] is True and kw["HEAVY_FIRST"] is False and kd is vd and kw["PAGE_SIZE"] == 64


def test_tma_covers_rows_takes_the_models_projections_only():
    """`tma_covers_rows`: the ``q``/``k``/``v`` views the layer's projection makes (chunks of one ``[T, 4 H D]``
    tensor) and contiguous ``[T, H, D]`` tensors; not heads apart, fp32, a row stride or base off 16 bytes,
    or no rows."""
    from gr_plugin.ops.triton import tma_covers_rows

    uvqk = torch.zeros(10, 4 * 4 * 32, dtype=torch.bfloat16)
    assert all(tma_covers_rows(x.reshape(10, 4, 32)) for x in uvqk.chunk(4, dim=-1))
    assert tma_covers_rows(torch.zeros(10, 4, 32, dtype=torch.bfloat16))
    assert not tma_covers_rows(torch.zeros(10, 4, 40, dtype=torch.bfloat16)[..., :32])  # heads apart
    assert not tma_covers_rows(torch.zeros(10, 32, 4, dtype=torch.bfloat16).transpose(1, 2))  # values apart
    assert not tma_covers_rows(torch.zeros(10, 4, 32))  # fp32
    assert not tma_covers_rows(torch.zeros(10, 4 * 32 + 4, dtype=torch.bfloat16)[:, :128].reshape(10, 4, 32))
    assert not tma_covers_rows(torch.zeros(10 * 128 + 4, dtype=torch.bfloat16)[4:].view(10, 4, 32))  # base
    assert not tma_covers_rows(torch.zeros(0, 4, 32, dtype=torch.bfloat16))


# (head_dim, history, bs) -> the split count that measured fastest for the Gluon tiles on the H200
# (`scripts/gpu/gluon_attention.py grid`, docs/BENCHMARKS.md, 2026-12-01), where the rule takes it
GLUON_GRID_BEST = {(128, 4096, 2): 5, (128, 4096, 4): 2, (128, 4096, 8): 1, (128, 16384, 8): 4, (128, 1024, 8): 1,
                   (256, 4096, 1): 5, (256, 4096, 4): 4, (256, 4096, 8): 2, (256, 16384, 2): 5, (256, 1024, 2): 2}


def test_gluon_split_rule_takes_the_h200_sweeps_counts(monkeypatch):
    """`_gluon_splits`: `GLUON_MAKESPAN`'s model at an H200's sizes takes the measured best count in
    these cases (31 of the sweep's 36; bs 1 at head_dim 128 takes 11 splits against the best 5, 3.2%
    slower at 4096); with a loose history bound or tiles without constants, the one-wave rule.
    `paged_launch` names the Gluon launch where a captured launch would take it."""
    monkeypatch.setattr(tri, "_num_sms", lambda device: 132)
    monkeypatch.setattr(tri, "_shared_memory", lambda device: 232448)
    got = {(dim, hist, bs): tri._gluon_splits(384 * bs, bs, 4, 384, hist, tri.GLUON_TILES[dim], dim, CPU, True)
           for dim, hist, bs in GLUON_GRID_BEST}
    assert got == GLUON_GRID_BEST
    assert tri._gluon_splits(384, 1, 4, 384, 4096, tri.GLUON_TILES[128], 128, CPU, True) == 11
    assert tri._gluon_splits(384, 1, 4, 384, 4096, tri.GLUON_TILES[128], 128, CPU, False) == \
        tri._splits(24, 4096, tri.GLUON_TILES[128], 128, 2, CPU, model=False)
    other = (128, 64, 8, 2)  # tiles the constants were not fitted on: the one-wave rule (2 here, 5 by the model)
    assert tri._gluon_splits(384 * 8, 8, 4, 384, 16384, other, 128, CPU, True) == \
        tri._splits(96, 16384, other, 128, 2, CPU, model=False) == 2
    assert tri.paged_launch(384 * 8, 8, 4, 384, 4096, 128, torch.bfloat16, CPU, page_size=128) == \
        tri.paged_launch(384 * 8, 8, 4, 384, 4096, 128, torch.bfloat16, CPU)  # no Gluon off CUDA
    monkeypatch.setattr(tri, "_gluon_tiles", lambda dim, dtype, page, device: tri.GLUON_TILES[dim])
    assert tri.paged_launch(384 * 8, 8, 4, 384, 4096, 128, torch.bfloat16, CPU, page_size=128) == \
        ("gluon", tri.GLUON_TILES[128], 1)
    monkeypatch.setattr(tri, "SCHEDULE", "stream")  # stream-K asked: no Gluon launch to key on
    assert tri.paged_launch(384 * 8, 8, 4, 384, 4096, 128, torch.bfloat16, CPU, page_size=128) == ("stream",)


def _need_hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel needs a Hopper GPU")


@pytest.mark.gpu
@pytest.mark.parametrize(("dim", "page_size"), [(128, 128), (128, 64), (256, 32), (64, 64)])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_gpu_gluon_error_within_twice_the_torch_reference(dim, page_size, seed, splits):
    """Random jagged batches (nothing cached for one user, no history at all for another, all cached for
    a third, partial last pages, 1-70 candidates), every slot of the table that no history holds NaN:
    the kernel's error against an fp32 reference is at most 2x the bf16 torch reference's; the same
    bits on a second run."""
    _need_hopper()
    g = torch.Generator().manual_seed(seed)
    bsz = 4
    hist = torch.randint(0, 700, (bsz,), generator=g).tolist()
    cand = torch.randint(1, 70, (bsz,), generator=g).tolist()
    cached = [int(torch.randint(0, h + 1, (1,), generator=g)) for h in hist]
    hist[1] = 0  # a user with no history: candidates only
    cached[0], cached[1], cached[-1] = 0, 0, hist[-1]
    _, paged = build(hist, cand, cached, page_size, 4, dim, torch.float32, "cuda", seed)
    table = paged["kv_layer"]
    used = torch.zeros(table.shape[0], page_size, dtype=torch.bool, device="cuda")
    for b, h in enumerate(hist):
        pages = paged["kv_indices"][paged["kv_indptr"][b]:paged["kv_indptr"][b + 1]]
        t = torch.arange(h, device="cuda")
        used[pages[t // page_size], t % page_size] = True
    table.permute(0, 2, 1, 3, 4)[~used] = float("nan")  # (a view: the table's own slots)
    assert table.isnan().any()
    exact = run(ref, "paged", paged, torch.float32)
    torch_low = run(ref, "paged", paged, torch.bfloat16).float()
    args = {**_bf16(paged), "kernel": "gluon", "num_splits": splits}
    got = run(tri, "paged", args)
    assert not got.isnan().any()
    err, err_torch = (got.float() - exact).abs().max().item(), (torch_low - exact).abs().max().item()
    assert err <= 2 * err_torch + 1e-6, (err, err_torch)
    assert torch.equal(run(tri, "paged", args), got)


def _record_gluon_tiles(monkeypatch) -> list:
    """The tiles of each Gluon launch, which still runs."""
    from gr_plugin.ops.triton import hstu_gluon

    took = []
    real = hstu_gluon.launch
    monkeypatch.setattr(hstu_gluon, "launch", lambda *a: took.append(a[-1]) or real(*a))
    return took


@pytest.mark.gpu
def test_gpu_graphed_launch_takes_gluon_with_an_eager_launchs_bits(monkeypatch):
    """Captured into a CUDA graph on Hopper, a paged bf16 launch naming no tiles takes the Gluon kernel
    (with its split rule), and gives the bits of the same kernel launched eagerly; the whole-table form
    (a layer of ``[L, num_pages, ...]``) the bits of its layer's view."""
    _need_hopper()
    took = _record_gluon_tiles(monkeypatch)
    _, paged = build([1500, 700, 300], [40, 9, 64], [1400, 650, 0], 128, 4, 128, torch.float32, "cuda", 7)
    args = _bf16(paged)
    eager = run(tri, "paged", {**args, "kernel": "gluon"})
    table = torch.stack([torch.randn_like(args["kv_layer"]), args["kv_layer"]])
    whole = run(tri, "paged", {**args, "kv_layer": table, "layer": 1, "kernel": "gluon"})
    assert torch.equal(whole, eager)
    took.clear()
    captured = replayed(lambda: run(tri, "paged", args))
    assert took == [tri.GLUON_TILES[128]]
    assert torch.equal(captured, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_gpu_gluon_full_pass_error_within_twice_the_torch_reference(dim, seed, splits):
    """The full pass on the Gluon kernel (every history token and candidate a query, keys read from ``k`` /
    ``v``): random jagged batches (no history for one user, 1-70 candidates), keys and values as the
    layer's projection makes them (views of one tensor): error against an fp32 reference at most 2x the
    bf16 torch reference's; the same bits on a second run and with the query tiles in order."""
    _need_hopper()
    from gr_plugin.ops.triton import hstu_gluon

    g = torch.Generator().manual_seed(seed)
    bsz = 4
    hist = torch.randint(0, 700, (bsz,), generator=g).tolist()
    hist[1] = 0
    cand = torch.randint(1, 70, (bsz,), generator=g).tolist()
    jag, _ = build(hist, cand, [0] * bsz, 64, 4, dim, torch.float32, "cuda", seed)
    exact = run(ref, "jagged", jag, torch.float32)
    torch_low = run(ref, "jagged", jag, torch.bfloat16).float()
    t = jag["q"].shape[0]
    uvqk = torch.empty(t, 4, 4 * dim, dtype=torch.bfloat16, device="cuda")
    for i, name in enumerate(("q", "k", "v"), start=1):
        uvqk[:, i] = jag[name].flatten(1)
    views = {name: uvqk[:, i].view(t, 4, dim) for i, name in enumerate(("q", "k", "v"), start=1)}
    args = {**jag, **views, "kernel": "gluon", "num_splits": splits}
    got = run(tri, "jagged", args)
    assert not got.isnan().any()
    err, err_torch = (got.float() - exact).abs().max().item(), (torch_low - exact).abs().max().item()
    assert err <= 2 * err_torch + 1e-6, (err, err_torch)
    assert torch.equal(run(tri, "jagged", args), got)
    real = hstu_gluon.launch
    try:
        hstu_gluon.launch = lambda *a: real(*a, heavy_first=False)
        assert torch.equal(run(tri, "jagged", args), got)
    finally:
        hstu_gluon.launch = real


@pytest.mark.gpu
def test_gpu_graphed_full_pass_takes_gluon_with_an_eager_launchs_bits(monkeypatch):
    """Captured into a CUDA graph on Hopper, a bf16 full pass naming no tiles takes the Gluon kernel on
    `GLUON_FULL_TILES`, with the bits of the same kernel launched eagerly; keys whose heads lie apart (no
    TMA descriptor covers them) keep the Triton kernel, and a forced Gluon launch on them names why."""
    _need_hopper()
    took = _record_gluon_tiles(monkeypatch)
    jag, _ = build([1500, 700, 300], [40, 9, 64], [0, 0, 0], 128, 4, 128, torch.float32, "cuda", 7)
    args = _bf16(jag)
    eager = run(tri, "jagged", {**args, "kernel": "gluon"})
    took.clear()
    captured = replayed(lambda: run(tri, "jagged", args))
    assert took == [tri.GLUON_FULL_TILES[128]]
    assert torch.equal(captured, eager)
    apart = torch.zeros(*args["k"].shape[:2], 136, dtype=torch.bfloat16, device="cuda")[..., :128]  # heads 136 apart
    apart.copy_(args["k"])
    took.clear()
    replayed(lambda: run(tri, "jagged", {**args, "k": apart}))
    assert took == []
    with pytest.raises(ValueError, match="keys and values one TMA descriptor covers only"):
        run(tri, "jagged", {**args, "k": apart, "kernel": "gluon"})
