"""The Triton HSTU attention kernel against the pure-torch reference.

Without a GPU the kernel runs in Triton's interpreter (fp32 / fp16 on CPU tensors: tight match).
On a GPU (marker ``gpu``): bf16/fp16 inputs, head_dim 64/128/256, page sizes 16..128; the kernel's
error against an fp32 reference must be at most 2x the error of the same-precision torch reference.
"""

import pytest
import torch
import triton

from gr_plugin.ops.pytorch import hstu_attention as ref
from gr_plugin.ops.triton import hstu_attention as tri

from .launch_spy import spy_launches
from .paged_inputs import scatter_into_pages

ALPHA, NORM = 0.35, 16.0
# CPU tensors reach the kernel only through Triton's interpreter, which tests/conftest.py turns on where there is no
# CUDA device: on a GPU machine the tests that launch on CPU tensors skip those launches (CI runs them).
INTERPRETED = triton.knobs.runtime.interpret
interpreter_only = pytest.mark.skipif(not INTERPRETED, reason="launches on CPU tensors: TRITON_INTERPRET is off")


def skip_unless_interpreted() -> None:
    """Skip the rest of a test (its launches on CPU tensors) where the interpreter is off."""
    if not INTERPRETED:
        pytest.skip("the rest launches on CPU tensors: TRITON_INTERPRET is off")


def build(hist, cand, cached, page_size, heads, dim, dtype, device, seed=0):
    """Random paged + jagged inputs; returns (full-pass args, cached-step args) as dicts."""
    g = torch.Generator().manual_seed(seed)
    full = [tuple(torch.randn(h + c, heads, dim, generator=g) for _ in range(3)) for h, c in zip(hist, cand)]
    table, indices, indptr = scatter_into_pages(full, hist, page_size, 3, g)
    lens = [h + c for h, c in zip(hist, cand)]
    to = dict(dtype=dtype, device=device)
    i64 = dict(dtype=torch.int64, device=device)
    jag = dict(q=torch.cat([f[0] for f in full]).to(**to), k=torch.cat([f[1] for f in full]).to(**to),
               v=torch.cat([f[2] for f in full]).to(**to),
               seq_offsets=torch.tensor([0, *torch.cumsum(torch.tensor(lens), 0).tolist()], **i64),
               num_candidates=torch.tensor(cand, **i64), max_seq_len=max(lens))
    new = [h - c for h, c in zip(hist, cached)]
    ql = [n + c for n, c in zip(new, cand)]
    sl = [slice(c, h + k) for c, h, k in zip(cached, hist, cand)]
    paged = dict(q=torch.cat([f[0][s] for f, s in zip(full, sl)]).to(**to),
                 k=torch.cat([f[1][s] for f, s in zip(full, sl)]).to(**to),
                 v=torch.cat([f[2][s] for f, s in zip(full, sl)]).to(**to), kv_layer=table.to(**to),
                 kv_indices=torch.tensor(indices, **i64), kv_indptr=torch.tensor(indptr, **i64),
                 history_lengths=torch.tensor(hist, **i64),
                 q_offsets=torch.tensor([0, *torch.cumsum(torch.tensor(ql), 0).tolist()], **i64),
                 new_lengths=torch.tensor(new, **i64), max_q_len=max(ql), max_history_len=max(max(hist), 1),
                 num_history_tokens=sum(hist))
    return jag, paged


def run(mod, which, args, dtype=None):
    a = dict(args)
    if dtype is not None:
        for k in ("q", "k", "v", "kv_layer"):
            if k in a:
                a[k] = a[k].to(dtype)
    fn = mod.hstu_attention_jagged if which == "jagged" else mod.paged_hstu_attention
    if mod is ref:
        a.pop("num_splits", None)
    pos = [a.pop(k) for k in (("q", "k", "v", "seq_offsets", "num_candidates") if which == "jagged" else
                              ("q", "k", "v", "kv_layer", "kv_indices", "kv_indptr", "history_lengths", "q_offsets",
                               "new_lengths"))]
    return fn(*pos, alpha=ALPHA, n_norm=NORM, **a)


CASES = [  # history lengths, candidates, cached
    ([37, 0, 90], [3, 2, 1], [20, 0, 64]),  # mixed, an empty history, partial last pages
    ([64, 17], [1, 40], [64, 17]),  # all cached: only candidates are queries
    ([50], [1], [0]),  # nothing cached, one candidate
]


@pytest.mark.parametrize("which", ["jagged", "paged"])
@pytest.mark.parametrize(("hist", "cand", "cached"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("page_size", "splits"), [(8, 1), (64, 3)])
def test_interpreter_matches_reference(which, hist, cand, cached, dtype, page_size, splits):
    if torch.cuda.is_available():
        pytest.skip("covered by the GPU test")
    jag, paged = build(hist, cand, cached, page_size, 2, 16, dtype, "cpu")
    args = jag if which == "jagged" else paged
    want = run(ref, which, args, torch.float32)
    got = run(tri, which, {**args, "num_splits": splits})
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    torch.testing.assert_close(got.float(), want, rtol=0, atol=tol)


@pytest.mark.parametrize("which", ["jagged", "paged"])
@pytest.mark.parametrize(("dim", "page_size"), [(64, 16), (64, 64), (256, 16), (256, 64), (16, 16), (16, 64)])
def test_interpreter_fp32_tiles_match_reference(which, dim, page_size, monkeypatch):
    """fp32's own tiles (`_blocks`: 32x64 from head_dim 64, 16x32 at 256, 32x32 for the paged form at 16),
    which a launch naming none takes: a page smaller than a key block (16, gathered row by row) and
    larger (64); equal to the reference."""
    if torch.cuda.is_available():
        pytest.skip("covered by the GPU test")
    jag, paged = build([37, 0, 90], [3, 2, 1], [20, 0, 64], page_size, 2, dim, torch.float32, "cpu")
    args = jag if which == "jagged" else paged
    took = []
    spy_launches(monkeypatch, tri, "_hstu_fwd",
                 lambda grid, kw: took.append((kw["BLOCK_M"], kw["BLOCK_N"], kw["num_warps"], kw["num_stages"])))
    got = run(tri, which, args)
    assert took == [tri._blocks(dim, torch.float32, which == "paged", torch.device("cpu"))]
    assert took[0] == {64: (32, 64, 4, 1), 256: (16, 32, 4, 1), 16: (32, 32, 4, 1) if which == "paged"
                       else (64, 64, 4, 3)}[dim]
    torch.testing.assert_close(got, run(ref, which, args), rtol=0, atol=1e-5)


def test_fp32_dot_precision_reaches_the_kernel_and_bad_ones_are_refused(monkeypatch):
    """fp32 launches run their dots at `FP32_DOTS` ("tf32x3") or the launch's ``fp32_dots``; 16-bit ones
    keep Triton's default; a precision outside `FP32_DOT_CHOICES` (given, or through GR_PLUGIN_FP32_DOTS)
    is a ValueError naming it, raised before any launch."""
    if torch.cuda.is_available():
        pytest.skip("runs the kernel through the interpreter (CPU tensors)")
    jag, paged = build([37, 0, 9], [3, 2, 1], [20, 0, 4], 8, 2, 16, torch.float32, "cpu")
    took = []
    spy_launches(monkeypatch, tri, "_hstu_fwd", lambda grid, kw: took.append(kw["DOTS"]))
    monkeypatch.setattr(tri, "FP32_DOTS", "tf32x3")  # (the default; GR_PLUGIN_FP32_DOTS may name another)
    for which, args in (("jagged", jag), ("paged", paged)):
        want = run(ref, which, args)
        for given, dots in ((None, "tf32x3"), ("ieee", "ieee"), ("tf32", "tf32")):
            took.clear()
            got = run(tri, which, {**args, "fp32_dots": given})
            assert took == [dots]
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # (the interpreter's dots are fp32's)
        took.clear()
        run(tri, which, {**args, "fp32_dots": "ieee"}, torch.float16)
        assert took == ["tf32"]
        with pytest.raises(ValueError, match=r"fp32_dots must be one of .* got 'fp64'"):
            run(tri, which, {**args, "fp32_dots": "fp64"})
        monkeypatch.setattr(tri, "FP32_DOTS", "TF32X3")
        with pytest.raises(ValueError, match=r"GR_PLUGIN_FP32_DOTS must be one of .* got 'TF32X3'"):
            run(tri, which, args)
        monkeypatch.setattr(tri, "FP32_DOTS", "tf32x3")
        assert took == ["tf32"]  # (the refused launches reached no kernel)


@pytest.mark.parametrize(("hist", "cand", "cached"), [*CASES, ([200, 5, 130, 0], [9, 1, 4, 3], [150, 5, 0, 0])])
@pytest.mark.parametrize(("page_size", "programs", "tma"), [(8, 7, False), (64, 1, False), (64, 3, True),
                                                             (16, 40, False)])
@pytest.mark.parametrize("reversed_programs", [False, True])
def test_interpreter_stream_k_matches_reference(hist, cand, cached, page_size, programs, tma, reversed_programs):
    """Stream-K (``schedule="stream"``, an option): the tiles' key blocks cut into one range per
    program, tiles shared by programs summed by the last to finish; 1 program (every tile whole), a few
    (tiles cut in two or three), more programs than key blocks (some programs idle); ``tma``: full
    blocks read through a tensor descriptor (the interpreter emulates it). The interpreter runs the
    programs in order, so a tile's last contributor is always its highest program; reversed, it is
    its lowest, which catches a fix-up that reads parts not yet written or slots overwritten."""
    if torch.cuda.is_available():
        pytest.skip("covered by the GPU test")
    _, paged = build(hist, cand, cached, page_size, 2, 16, torch.float16, "cpu")
    want = run(ref, "paged", paged, torch.float32)
    blocks = (16, min(page_size, 64), 4, 1)
    got = run(tri, "paged", {**paged, "schedule": "stream", "programs": programs, "tma": tma, "blocks": blocks,
                             "reversed_programs": reversed_programs})
    torch.testing.assert_close(got.float(), want, rtol=0, atol=3e-3)


@interpreter_only
def test_schedule_is_checked(monkeypatch):
    _, paged = build([9], [2], [3], 8, 2, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="schedule must be None, 'split' or 'stream', got 'persistent'"):
        run(tri, "paged", {**paged, "schedule": "persistent"})
    with pytest.raises(ValueError, match="num_splits applies to the split schedule, got num_splits=2"):
        run(tri, "paged", {**paged, "schedule": "stream", "num_splits": 2})
    monkeypatch.setattr(tri, "_STREAM_TILES", 1)
    with pytest.raises(ValueError, match=r"1 users x 2 query blocks \(padded to powers of two\) exceed 1"):
        run(tri, "paged", {**paged, "schedule": "stream", "blocks": (4, 8, 4, 1)})  # 8 query rows: 2 blocks
    monkeypatch.setattr(tri, "SCHEDULE", "auto")
    with pytest.raises(ValueError, match="GR_PLUGIN_ATTENTION_SCHEDULE must be split or stream, got 'auto'"):
        run(tri, "paged", paged)
    run(tri, "paged", {**paged, "schedule": "split"})  # an explicit schedule does not read it


@pytest.mark.parametrize("which", ["jagged", "paged"])
@pytest.mark.parametrize("splits", [2, 5, 7])
def test_interpreter_split_parts(which, splits):
    """The split grid writes each key split's fp32 part to its own slice and `_sum_parts` adds them
    in split order: equal to the reference. Query rows past the last user's (trailing rows no user
    owns, no program's; their slices are never written) come out 0 (with one split they are left
    unwritten)."""
    if torch.cuda.is_available():
        pytest.skip("covered by the GPU test")
    jag, paged = build([37, 0, 90], [3, 2, 1], [20, 0, 64], 8, 2, 16, torch.float16, "cpu")
    args = dict(jag if which == "jagged" else paged)
    want = run(ref, which, args, torch.float32)
    n = want.shape[0]
    for name in ("q", "k", "v"):  # 3 padding rows at the end of the query/token rows
        args[name] = torch.cat([args[name], torch.full((3, *args[name].shape[1:]), 7.0, dtype=args[name].dtype)])
    got = run(tri, which, {**args, "num_splits": splits})
    assert got.shape[0] == n + 3 and got.dtype == torch.float16
    torch.testing.assert_close(got[:n].float(), want, rtol=0, atol=3e-3)
    assert torch.equal(got[n:], torch.zeros_like(got[n:]))


def test_split_count_fills_the_sms_with_any_count(monkeypatch):
    """The split grid cuts the keys into up to one wave of programs (as many per SM as fit, at least
    `MIN_SPLIT_BLOCKS` key blocks each); the count is a runtime argument, so it need not be a power
    of two. Sizes of an H200: 132 SMs, 227 KB of shared memory a block may use. The paged bf16
    form's tiles with `MAKESPAN` constants take the makespan model's count instead
    (`test_makespan_rule_takes_the_h200_sweeps_launches`); where it agrees with one wave, both are
    asked, else the one-wave rule alone (``model=False``)."""
    monkeypatch.setattr(tri, "_num_sms", lambda device: 132)
    monkeypatch.setattr(tri, "_shared_memory", lambda device: 232448)
    cpu = torch.device("cpu")
    big, small = (128, 128, 8, 2), (64, 32, 4, 2)  # head_dim 128 / 256 tiles of the paged form (bf16)
    assert tri._resident(big, 128, 2, cpu) == 1 and tri._resident(small, 256, 2, cpu) == 2
    assert tri._resident((64, 64, 4, 3), 64, 2, cpu) == 2  # 4 would fit by the estimate: capped at the measured 2
    # the candidates' own keys and values (128 rows each), not one 16-key stage, set the shared memory
    assert tri._resident((128, 16, 4, 1), 256, 2, cpu) == 1
    assert tri._splits(12, 4096, big, 128, 2, cpu) == 11  # bs 1, 4 heads x 3 query blocks: 132 programs
    assert tri._splits(24, 4096, big, 128, 2, cpu) == 5
    assert tri._splits(96, 4096, big, 128, 2, cpu, model=False) == 1  # bs 8: one wave already
    assert tri._splits(96, 4096, big, 128, 2, cpu) == 4  # the model: 384 programs, 2.9 waves
    assert tri._splits(200, 4096, big, 128, 2, cpu) == 1  # more programs than SMs
    assert tri._splits(48, 4096, small, 256, 2, cpu) == 5  # two programs per SM: 240 of 264
    assert tri._splits(12, 512, big, 128, 2, cpu) == 4 // tri.MIN_SPLIT_BLOCKS  # short history: few blocks each
    assert tri._splits(1, 1 << 20, big, 128, 2, cpu) == 32  # capped
    monkeypatch.setattr(tri, "_shared_memory", lambda device: 0)  # not known: one program per SM, no model
    assert tri._resident(small, 256, 2, cpu) == 1 and tri._splits(48, 4096, small, 256, 2, cpu) == 2
    assert tri._makespan(96, 4096, big, 128, cpu) is None and tri._splits(96, 4096, big, 128, 2, cpu) == 1


# (head_dim, history, bs) -> the launch (blocks, splits) that was fastest in `scripts/gpu/tune_attention.py grid`
# on the H200 (docs/BENCHMARKS.md, 2026-12-01), and the launch the makespan rule takes where that differs
GRID_BEST = {
    (128, 1024, 4): ((64, 64, 4, 2), 2), (128, 1024, 8): ((64, 64, 4, 2), 1), (128, 1024, 32): ((64, 64, 4, 2), 1),
    (128, 4096, 4): ((64, 64, 4, 2), 5), (128, 4096, 8): ((64, 64, 4, 2), 4), (128, 4096, 32): ((128, 128, 8, 2), 1),
    (128, 16384, 8): ((128, 128, 8, 2), 4), (128, 16384, 16): ((128, 128, 8, 2), 2),
    (256, 4096, 4): ((64, 32, 4, 2), 5), (256, 4096, 8): ((64, 32, 4, 2), 4), (256, 4096, 16): ((64, 32, 4, 2), 2),
}
GRID_RULE_ELSEWHERE = {  # best measured, the rule's: ms of each in that sweep
    (128, 1024, 16): ((64, 64, 4, 2), 2),  # 64x32 tiles unsplit 0.0510; the rule's 0.0588 (the one-wave rule 0.0628)
    (128, 4096, 16): ((64, 64, 4, 2), 2),  # 64x32 unsplit 0.1501 (128x128, 2: 0.1506); the rule's 0.1537
    #                                          (one-wave 0.1773)
    (128, 16384, 4): ((64, 64, 4, 2), 8),  # 128x128 with 5 splits 0.1415; the rule's 0.1482 (one-wave 0.1629)
}


def test_makespan_rule_takes_the_h200_sweeps_launches(monkeypatch):
    """The paged bf16 form past the few query tiles: `_launch_blocks` takes the 128x128 or the 64x64
    tiles at head_dim 128 by the makespan model's time, `_splits` the model's count. On an H200's
    sizes, at 128 new + 256 candidates per user, it takes the launch that measured fastest in the
    H200's sweep in 11 of its 14 cases (`GRID_BEST`), and the launches of `GRID_RULE_ELSEWHERE`
    (15%, 2.4% and 4.7% slower than the best there) in the other three. The few-tile batches keep
    their launch (bs 1: 11 splits of 64-row tiles, as the one-wave rule counted)."""
    monkeypatch.setattr(tri, "_num_sms", lambda device: 132)
    monkeypatch.setattr(tri, "_shared_memory", lambda device: 232448)
    cpu = torch.device("cpu")

    def launch(dim, hist, bs):
        blocks = tri._launch_blocks(384 * bs, bs, 4, 384, hist, dim, torch.bfloat16, True, cpu)
        return blocks, tri._default_splits(384 * bs, bs, 4, 384, hist, blocks, dim, 2, cpu)

    assert {k: launch(*k) for k in GRID_BEST} == GRID_BEST
    assert {k: launch(*k) for k in GRID_RULE_ELSEWHERE} == GRID_RULE_ELSEWHERE
    assert launch(128, 4096, 1) == ((64, 64, 4, 2), 11) and launch(128, 1024, 1) == ((64, 64, 4, 2), 8)
    assert launch(256, 4096, 1) == ((64, 64, 8, 2), 5) and launch(256, 4096, 2) == ((64, 32, 4, 2), 5)
    # the model itself: whole waves of programs, each split's fixed cost; at least MIN_SPLIT_BLOCKS key
    # blocks a split, at most 32 splits; a tie keeps the fewer
    per_key, per_program = tri.MAKESPAN[(128, (128, 128, 8, 2))]
    ms, splits = tri._makespan(96, 4096, (128, 128, 8, 2), 128, cpu)
    assert splits == 4 and ms == pytest.approx(3 * (per_key * 4096 / 4 + per_program))
    assert tri._makespan(12, 512, (128, 128, 8, 2), 128, cpu)[1] == 4 // tri.MIN_SPLIT_BLOCKS
    assert tri._makespan(1, 1 << 20, (128, 128, 8, 2), 128, cpu)[1] == 32
    assert tri._makespan(1, 0, (128, 128, 8, 2), 128, cpu)[1] == 1
    monkeypatch.setitem(tri.MAKESPAN, (128, (128, 128, 8, 2)), (0.0, 1.0))  # no work per key: one split is as fast
    assert tri._makespan(12, 4096, (128, 128, 8, 2), 128, cpu) == (1.0, 1)
    assert tri._makespan(12, 4096, (64, 64, 4, 3), 128, cpu) is None  # no constants for these tiles
    assert tri._makespan(24, 4096, (64, 64, 8, 2), 256, cpu) is None  # head_dim 256's few-tile ones: one-wave rule
    assert tri.paged_launch(384, 1, 4, 384, 4096, 128, torch.bfloat16, cpu) == launch(128, 4096, 1)
    assert tri._splits(12, 4096, (64, 64, 4, 2), 128, 2, cpu) == 22  # the model: 264 programs, one wave
    assert tri._splits(12, 4096, (64, 64, 4, 2), 128, 4, cpu) == 11  # 4-byte elements: the one-wave rule, 1 per SM
    assert tri._splits(12, 4096, tri._blocks(128, torch.float32, True, cpu), 128, 4, cpu) == 22  # fp32's tiles: 2
    monkeypatch.setattr(tri, "_shared_memory", lambda device: 166912)  # an A100's: not the device it was fitted on
    assert tri._makespan(12, 4096, (64, 64, 4, 2), 128, cpu) is None
    assert tri._splits(12, 4096, (64, 64, 4, 2), 128, 2, cpu) == 22  # the one-wave rule: 2 per SM there too


def test_few_query_tiles_take_64_row_tiles(monkeypatch):
    """`_launch_blocks`: a paged bf16 launch with few query tiles (bs 1 and 2 at head_dim 128, bs 1
    at 256, 128 new + 256 candidates each; the graph buckets of those with their padding user) on
    an H200-sized device takes 64-row tiles; more tiles, fp32, the jagged form or a device without
    ~200 KB of shared memory per block keep `_blocks`. A launch that names its split count (a traced
    one) or runs stream-K does not ask."""
    monkeypatch.setattr(tri, "_shared_memory", lambda device: 232448)
    monkeypatch.setattr(tri, "_num_sms", lambda device: 132)
    cpu, bf16 = torch.device("cpu"), torch.bfloat16

    def blocks(bs, dim, nq=None, users=None, dtype=bf16, paged=True, hist=4096):
        return tri._launch_blocks(nq or 384 * bs, users or bs, 4, 384, hist, dim, dtype, paged, cpu)

    assert [blocks(bs, 128) for bs in (1, 2)] == [(64, 64, 4, 2)] * 2
    # more tiles: the makespan model's choice between the two (`test_makespan_rule_takes_the_h200_sweeps_launches`)
    assert [blocks(8, 128, hist=h) for h in (4096, 16384)] == [(64, 64, 4, 2), (128, 128, 8, 2)]
    assert [blocks(bs, 256) for bs in (1, 2, 8)] == [(64, 64, 8, 2), (64, 32, 4, 2), (64, 32, 4, 2)]
    assert blocks(2, 128, nq=1024, users=3) == (64, 64, 4, 2)  # bs 2's bucket: 36 tiles
    assert blocks(1, 256, nq=512, users=2) == (64, 64, 8, 2)  # bs 1's bucket: 20 tiles
    assert blocks(2, 256, nq=1024, users=3) == (64, 32, 4, 2)
    assert blocks(1, 128, dtype=torch.float32) == tri._blocks(128, torch.float32, True, cpu)
    # fp32's own small tiles (its FMA dots hold their operands in registers; the H200 sweep in `_blocks`)
    assert [tri._blocks(d, torch.float32, p, cpu) for d in (64, 128, 256) for p in (True, False)] == \
        [(32, 64, 4, 1)] * 4 + [(16, 32, 4, 1)] * 2
    assert tri._blocks(32, torch.float32, True, cpu) == (64, 64, 4, 3)  # (not measured: unchanged)
    assert blocks(1, 128, paged=False) == tri._blocks(128, bf16, False, cpu)
    assert blocks(1, 64) == tri._blocks(64, bf16, True, cpu)
    monkeypatch.setattr(tri, "_shared_memory", lambda device: 166912)  # an A100's 163 KB
    assert blocks(1, 128) == tri._blocks(128, bf16, True, cpu) == (64, 64, 4, 3)
    skip_unless_interpreted()
    asked = []
    monkeypatch.setattr(tri, "_launch_blocks", lambda *a: asked.append(a[:4]) or (16, 8, 4, 1))
    _, paged = build([40, 0], [3, 2], [20, 0], 8, 2, 16, torch.float32, "cpu")
    run(tri, "paged", {**paged, "max_q_len": 64})
    assert asked == [(25, 2, 2, 64)]  # 23 + 2 query rows, 2 users, 2 heads
    run(tri, "paged", {**paged, "max_q_len": 64, "num_splits": 1})
    run(tri, "paged", {**paged, "max_q_len": 64, "schedule": "stream"})
    monkeypatch.setattr(tri, "SCHEDULE", "stream")  # GR_PLUGIN_ATTENTION_SCHEDULE=stream, no schedule named
    run(tri, "paged", {**paged, "max_q_len": 64})
    assert len(asked) == 1


def test_split_rule_counts_the_tiles_that_can_hold_rows(monkeypatch):
    """`_query_tiles` bounds the (user, query block) tiles holding rows by the rows there are, so a
    CUDA graph bucket (``max_q_len`` = all its rows, a padding user) is split as its rows allow:
    bs 1's bucket (384 real rows + 128 padding rows, 2 users, 128-row blocks) counts 5 tiles, not
    the grid's 8. The bound is tight for some layout and never above the grid."""
    assert tri._query_tiles(512, 2, 4, 128) == 5
    assert tri._query_tiles(384, 1, 3, 128) == 3  # the block bench: max_q_len = the user's rows
    assert tri._query_tiles(3072, 8, 3, 128) == 24  # bs 8: the grid is the smaller bound
    assert tri._query_tiles(0, 3, 1, 64) == 1
    assert tri._query_tiles(2, 3, 1, 64) == 2  # fewer rows than users
    # tight: users of 129, 129 and 254 rows (512 rows, 3 users) fill 2 + 2 + 2 = 6 tiles
    assert tri._query_tiles(512, 3, 4, 128) == 6
    for lens in ([129, 129, 254], [1, 1, 510], [128, 128, 256], [100, 200, 212], [0, 0, 512], [1, 0, 0]):
        assert sum(-(-n // 128) for n in lens) <= tri._query_tiles(sum(lens), len(lens), 4, 128)
    for nq, bsz, m_blocks in ((512, 3, 4), (10_000, 2, 5), (7, 9, 1)):
        assert tri._query_tiles(nq, bsz, m_blocks, 128) <= m_blocks * bsz
    skip_unless_interpreted()
    counted = []
    monkeypatch.setattr(tri, "_splits", lambda n, *a: counted.append(n) or 1)
    _, paged = build([40, 0], [3, 2], [20, 0], 8, 2, 16, torch.float32, "cpu")
    run(tri, "paged", {**paged, "max_q_len": 64, "blocks": (16, 8, 4, 1)})  # 23 + 2 rows: at most 2 + 1 tiles
    assert counted == [3 * 2]  # (the grid: 4 blocks x 2 users) x 2 heads


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, 1025])
def test_bad_split_count_is_refused(bad):
    _, paged = build([9], [2], [3], 8, 2, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match=rf"num_splits must be an int in \[1, 1024\], got {bad!r}"):
        run(tri, "paged", {**paged, "num_splits": bad})


@pytest.mark.gpu
def test_gpu_graph_capture_takes_tma_loads_with_equal_results(monkeypatch):
    """Captured into a CUDA graph (where the graph buckets launch it), the paged kernel reads full key
    blocks through a TMA descriptor; eager launches use pointers. Same bytes, same math: equal bits."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs Hopper or newer")
    decided = []
    real = tri._use_tma
    monkeypatch.setattr(tri, "_use_tma", lambda *a: decided.append(real(*a)) or decided[-1])
    _, paged = build([700, 300], [40, 9], [650, 0], 128, 4, 128, torch.float32, "cuda", 7)
    args = {k: (v.to(torch.bfloat16) if k in ("q", "k", "v", "kv_layer") else v) for k, v in paged.items()}
    args["kernel"] = "triton"  # (a captured launch naming none takes the Gluon kernel: test_gluon_attention.py)
    eager = run(tri, "paged", args)
    assert decided == [False]
    captured = replayed(lambda: run(tri, "paged", args))  # (the TMA kernel compiles at capture: host-side work)
    assert decided[-1] is True
    assert torch.equal(captured, eager)


def test_tma_covers_only_tables_one_descriptor_can_read():
    """`tma_covers` (the TMA loads of both attention kernels): a contiguous 16-bit table, one layer or
    the whole ``[L, ...]`` table, with a 16-byte aligned base and fewer than 2^31 rows of ``H * D``."""
    from gr_plugin.ops.triton import tma_covers

    layer = torch.zeros(6, 2, 16, 2, 64, dtype=torch.bfloat16)
    assert tma_covers(layer) and tma_covers(torch.zeros(3, *layer.shape, dtype=torch.float16))
    assert not tma_covers(layer.float())  # 32-bit values
    assert not tma_covers(layer[:0])  # no pages
    assert not tma_covers(layer[:, :, ::2])  # not contiguous
    flat = torch.zeros(layer.numel() + 1, dtype=torch.bfloat16)
    assert not tma_covers(flat[1:].view(layer.shape))  # a base 2 bytes past an aligned one
    rows = torch.empty(2 ** 24, 2, 128, 4, 128, dtype=torch.bfloat16, device="meta")  # (no memory) 2^32 rows
    assert not tma_covers(rows) and tma_covers(rows[: 2 ** 22])  # 2^30 rows


def replayed(fn):
    """``fn()``'s result as a CUDA graph gives it: captured on a side stream, replayed once."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    return out


_WRITES = """
import json, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from gr_plugin.ops.triton import hstu_attention as tri
from tests.ops.test_triton_attention import build


class Hopper:  # what Triton's TTIR generation asks a driver (no GPU here)
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


triton.runtime.driver.set_active(Hopper())
try:
    from torch._higher_order_ops.triton_kernel_wrap import identify_accessed_tensors

    def writes_of(launch):
        return sorted(d.name for d in identify_accessed_tensors(kernel, launch, {}).read_writes.writes)
except ImportError:  # torch before identify_accessed_tensors (2.11, the GPU machine's): the mutation analysis
    from torch._higher_order_ops.triton_kernel_wrap import identify_mutated_tensors

    def writes_of(launch):
        return sorted(identify_mutated_tensors(kernel, launch, {}))

kernel, launches = tri._hstu_fwd, []


class Spy:
    def __getitem__(self, grid):
        def launch(*args, **kw):
            kw = {k: a for k, a in kw.items() if k not in ("num_warps", "num_stages")}
            launches.append({**dict(zip(kernel.arg_names, args)), **kw})
        return launch


tri._hstu_fwd = Spy()
jag, p = build([37, 0, 90], [3, 2, 1], [20, 0, 64], 64, 2, 16, torch.float32, "cpu")
for dtype in (torch.float32, torch.bfloat16):
    q, k, v, kv = (p[n].to(dtype) for n in ("q", "k", "v", "kv_layer"))
    rest = [p[n] for n in ("kv_indices", "kv_indptr", "history_lengths", "q_offsets", "new_lengths")]
    kw = dict(alpha=0.3, n_norm=16.0, max_q_len=p["max_q_len"], max_history_len=p["max_history_len"],
              num_history_tokens=0, num_splits=1)
    tri.paged_hstu_attention(q, k, v, kv, *rest, **kw)
    tri.paged_hstu_attention(q, k, v, torch.stack([kv, kv]), *rest, layer=1, **kw)
    tri.hstu_attention_jagged(*(jag[n].to(dtype) for n in ("q", "k", "v")), jag["seq_offsets"],
                              jag["num_candidates"], alpha=0.3, n_norm=16.0, max_seq_len=jag["max_seq_len"],
                              num_splits=1)
writes = [writes_of(a) for a in launches]
json.dump(writes, sys.stdout)
"""


def test_inductor_sees_the_attention_kernel_write_only_its_output():
    """What a traced launch (AOTInductor's compile) learns from Inductor's analysis of the kernel's
    TTIR (generated for a Hopper target; no GPU needed): the kernel writes ``Out`` and nothing else.
    Were the KV table among the writes, the package would copy the whole table at every layer (a
    store address built from a helper's results did that: `_tile`'s NOTE)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", _WRITES], env=env, cwd=root, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout) == [["Out"]] * 6


@pytest.mark.parametrize("layer", [0, 2])
@pytest.mark.parametrize("page_size", [8, 64])  # 64: a key block within one page (the kernel's one-index branch)
def test_whole_table_form_equals_the_layer_view(layer, page_size):
    """The kernels given the whole table ``[L, num_pages, ...]`` and a layer (what the exported stack's
    ops pass, gr_plugin/ops/library.py) read and write exactly what they do given that layer's view:
    equal attention output, the append's tokens in that layer only, every other layer untouched."""
    from gr_plugin.ops.triton import append_kv as tri_append

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    _, p = build([37, 0, 90], [3, 2, 1], [20, 0, 64], page_size, 2, 16, torch.float32, dev)
    g = torch.Generator().manual_seed(5)
    table = torch.randn(3, *p["kv_layer"].shape, generator=g).to(dev)
    table[layer] = p["kv_layer"]
    before = table.clone()
    whole = run(tri, "paged", {**p, "kv_layer": table, "layer": layer})
    torch.testing.assert_close(whole, run(tri, "paged", p), rtol=0, atol=0)
    slots, rows = torch.tensor([5, 90, 31], device=dev), torch.tensor([2, 0, 7], device=dev)
    tri_append.append_kv(table, p["k"], p["v"], slots, rows, layer=layer)
    view = p["kv_layer"].clone()
    tri_append.append_kv(view, p["k"], p["v"], slots, rows)
    assert torch.equal(table[layer], view) and not torch.equal(view, p["kv_layer"])
    others = [i for i in range(3) if i != layer]
    assert torch.equal(table[others], before[others])
    with pytest.raises(ValueError, match="layers must follow each other"):
        tri_append.append_kv(table.transpose(0, 1), p["k"], p["v"], slots, rows, layer=layer)
    for bad in (3, -1):
        with pytest.raises(ValueError, match=rf"layer {bad} is outside \[0, 3\)"):
            tri_append.append_kv(table, p["k"], p["v"], slots, rows, layer=bad)
    assert torch.equal(table[others], before[others])


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["jagged", "paged"])
@pytest.mark.parametrize(("dim", "page_size"), [(64, 16), (128, 128), (256, 32), (128, 64), (16, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("fast_silu", [False, True])
@pytest.mark.parametrize("schedule", ["split", "stream"])
def test_gpu_kernel_error_within_twice_the_torch_reference(which, dim, page_size, dtype, seed, fast_silu, schedule,
                                                           monkeypatch):
    if which == "jagged" and schedule == "stream":
        pytest.skip("the schedule setting applies to the paged form (the jagged one has many tiles)")
    monkeypatch.setattr(tri, "FAST_SILU", fast_silu)  # tanh.approx SiLU (bf16 only)
    monkeypatch.setattr(tri, "SCHEDULE", schedule)
    g = torch.Generator().manual_seed(seed)
    bsz = 4
    hist = torch.randint(0, 700, (bsz,), generator=g).tolist()
    cand = torch.randint(1, 70, (bsz,), generator=g).tolist()
    cached = [int(torch.randint(0, h + 1, (1,), generator=g)) for h in hist]
    cached[0] = 0
    cached[-1] = hist[-1]
    if dtype == torch.float32 and fast_silu:
        pytest.skip("the fast SiLU is bf16's only: the fp32 case runs once")
    jag, paged = build(hist, cand, cached, page_size, 4, dim, torch.float32, "cuda", seed)
    args = jag if which == "jagged" else paged
    oracle = torch.float64 if dtype == torch.float32 else torch.float32  # (fp32's own tiles, `_blocks`: against fp64)
    exact = run(ref, which, args, oracle)
    torch_low = run(ref, which, args, dtype).to(oracle)
    kernel = run(tri, which, {k: (v.to(dtype) if k in ("q", "k", "v", "kv_layer") else v) for k, v in args.items()})
    assert not kernel.isnan().any()
    err_kernel = (kernel.to(oracle) - exact).abs().max().item()
    err_torch = (torch_low - exact).abs().max().item()
    assert err_kernel <= 2 * err_torch + 1e-6, (err_kernel, err_torch)
    # stream-K adds a shared tile's parts in program order, the split grid its key splits' parts in
    # split order (`_sum_parts`; the paged cases here split their keys 2-5 ways, the jagged ones
    # not at all): the same bits every run
    again = run(tri, which, {k: (v.to(dtype) if k in ("q", "k", "v", "kv_layer") else v) for k, v in args.items()})
    assert torch.equal(again, kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["jagged", "paged"])
@pytest.mark.parametrize(("dim", "page_size"), [(64, 16), (128, 128), (256, 32), (16, 32)])
@pytest.mark.parametrize("fp32_dots", ["tf32x3", "ieee"])
def test_gpu_fp32_dot_precisions_error_within_twice_the_torch_reference(which, dim, page_size, fp32_dots):
    """Both fp32 dot precisions a user may pick (the default "tf32x3" and "ieee"), named at the launch,
    against fp64: within 2x the fp32 torch reference's error (TF32 off), the same bits every run."""
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator().manual_seed(dim + page_size)
    hist = torch.randint(0, 900, (4,), generator=g).tolist()
    cand = torch.randint(1, 70, (4,), generator=g).tolist()
    jag, paged = build(hist, cand, [0, hist[1] // 2, hist[2], hist[3]], page_size, 4, dim, torch.float32, "cuda",
                       dim)
    args = jag if which == "jagged" else paged
    exact = run(ref, which, args, torch.float64)
    err_torch = (run(ref, which, args).double() - exact).abs().max().item()
    got = run(tri, which, {**args, "fp32_dots": fp32_dots})
    err = (got.double() - exact).abs().max().item()
    assert err <= 2 * err_torch + 1e-6, (err, err_torch)
    assert torch.equal(run(tri, which, {**args, "fp32_dots": fp32_dots}), got)


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("programs", [None, 5, 300])
def test_gpu_stream_k_and_tma_equal_the_split_kernel(tma, programs):
    """Long histories, bs 1 and 8 (the block bench's shapes, scaled down): stream-K with one program per
    SM, few programs (whole tiles in sequence) and more programs than SMs, with and without the TMA
    loads, no less accurate than the split schedule (the same products, summed in another order)."""
    g = torch.Generator().manual_seed(3)
    for bsz in (1, 8):
        hist = torch.randint(1000, 2100, (bsz,), generator=g).tolist()
        cand = [64] * bsz
        cached = [h - 32 for h in hist]
        _, paged = build(hist, cand, cached, 128, 4, 128, torch.float32, "cuda", 3)
        args = {k: (v.to(torch.bfloat16) if k in ("q", "k", "v", "kv_layer") else v) for k, v in paged.items()}
        exact = run(ref, "paged", paged, torch.float32)
        split = run(tri, "paged", {**args, "schedule": "split", "num_splits": 1, "tma": False}).float()
        got = run(tri, "paged", {**args, "schedule": "stream", "programs": programs, "tma": tma}).float()
        assert not got.isnan().any()
        assert (got - exact).abs().max() <= 1.5 * (split - exact).abs().max() + 1e-6
        if programs is None:  # the split grid's key splits (bs 1 splits them) and their sum
            got = run(tri, "paged", {**args, "schedule": "split", "tma": tma}).float()
            assert not got.isnan().any()
            assert (got - exact).abs().max() <= 1.5 * (split - exact).abs().max() + 1e-6


def test_training_takes_the_differentiable_path(monkeypatch):
    """With q/k/v requiring grad on CPU tensors the dispatcher uses the C++ kernels and their backward
    under ``auto`` (gradients flow; their values: test_hstu_attention.py); a forced ``triton`` trains the
    full form through its Triton backward
    (tests/ops/test_triton_attention_bwd.py) and refuses the forward-only paged form rather than cutting
    its gradient (the refusal: the bwd tests)."""
    from gr_plugin.ops import hstu_attention as dispatch

    jag, _ = build([9, 4], [2, 3], [0, 0], 8, 2, 16, torch.float32, "cpu")
    for name in ("q", "k", "v"):
        jag[name] = jag[name].clone().requires_grad_()
    pos = [jag[k] for k in ("q", "k", "v", "seq_offsets", "num_candidates")]
    monkeypatch.setenv("GR_PLUGIN_ATTENTION", "triton")
    assert dispatch._use_triton(*pos[:3], backward=True)
    with pytest.raises(ValueError, match="forward-only"):
        dispatch._use_triton(*pos[:3])
    with torch.no_grad():  # inference: the kernel serves it
        assert dispatch._use_triton(*pos[:3])
    monkeypatch.setenv("GR_PLUGIN_ATTENTION", "auto")
    assert not dispatch._use_triton(*pos[:3], backward=True)  # (CPU tensors)
    out = dispatch.hstu_attention_jagged(*pos, alpha=ALPHA, n_norm=NORM, max_seq_len=jag["max_seq_len"])
    assert type(out.grad_fn).__name__ == "CppJaggedAttentionBackward"
    out.square().sum().backward()
    assert all(jag[n].grad is not None and jag[n].grad.abs().sum() > 0 for n in ("q", "k", "v"))


@pytest.mark.gpu
def test_gpu_training_gradients_equal_the_reference(monkeypatch):
    """On the GPU, a full-form bf16 or fp32 (tf32x3 dots, head_dim <= 128) forward that needs gradients runs
    the Triton kernels and their backward (`hstu_attention_bwd`): the bf16 gradients flow (finite, non-zero;
    their error rule: tests/ops/test_triton_attention_bwd.py), the fp32 ones equal those of the CPU's
    kernels. fp32 on IEEE dots, or at head_dim 256, takes the reference (measured faster there)."""
    from gr_plugin.ops import hstu_attention as dispatch

    monkeypatch.setattr(tri, "FP32_DOTS", "tf32x3")  # (the default; GR_PLUGIN_FP32_DOTS may name another)
    torch.backends.cuda.matmul.allow_tf32 = False
    jag, _ = build([300, 40, 0], [7, 3, 5], [0, 0, 0], 16, 2, 64, torch.float32, "cpu")
    grads = {}
    for key, device, dt in (("cpu", "cpu", torch.float32), ("fp32", "cuda", torch.float32),
                            ("bf16", "cuda", torch.bfloat16)):
        leaves = {n: jag[n].detach().to(device, dt).requires_grad_() for n in ("q", "k", "v")}
        out = dispatch.hstu_attention_jagged(leaves["q"], leaves["k"], leaves["v"], jag["seq_offsets"].to(device),
                                             jag["num_candidates"].to(device), alpha=ALPHA, n_norm=NORM,
                                             max_seq_len=jag["max_seq_len"])
        assert out.requires_grad
        assert (type(out.grad_fn).__name__ == "JaggedAttentionBackward") == (device == "cuda")
        (out.float() * torch.linspace(-1, 1, out.numel(), device=device).view_as(out)).sum().backward()
        grads[key] = {n: t.grad.float().cpu() for n, t in leaves.items()}
    for n in ("q", "k", "v"):
        torch.testing.assert_close(grads["fp32"][n], grads["cpu"][n], rtol=1e-4, atol=1e-5)
        assert torch.isfinite(grads["bf16"][n]).all() and grads["bf16"][n].abs().sum() > 0
    q = jag["q"].cuda().requires_grad_()
    monkeypatch.setattr(tri, "FP32_DOTS", "ieee")
    assert not dispatch._use_triton(q, q, q, backward=True)
    monkeypatch.setattr(tri, "FP32_DOTS", "tf32x3")
    assert dispatch._use_triton(q, q, q, backward=True)
    wide = torch.zeros(4, 2, 256, device="cuda", requires_grad=True)
    assert not dispatch._use_triton(wide, wide, wide, backward=True)
    assert dispatch._use_triton(wide.bfloat16(), backward=True)


@interpreter_only
def test_paged_launch_names_what_the_launch_takes(monkeypatch):
    """`paged_launch` (what a graph bucket keys on) names the tiles and split count `_launch` takes
    for a paged launch naming neither, on the interpreter with an H200's sizes; under
    ``SCHEDULE=stream`` it names stream-K while the tiles' table fits, else the split grid's
    fallback."""
    monkeypatch.setattr(tri, "_num_sms", lambda device: 132)
    monkeypatch.setattr(tri, "_shared_memory", lambda device: 232448)
    _, paged = build([400, 0, 300], [3, 2, 9], [20, 0, 30], 8, 2, 16, torch.float16, "cpu")
    args = {**paged, "max_q_len": 64}
    took = []

    def record(grid, kw):
        block_m = kw["BLOCK_M"]
        took.append(((block_m, kw["BLOCK_N"], kw["num_warps"], kw["num_stages"]),
                     grid[0] // -(-64 // block_m)))  # the grid: query blocks x splits

    spy_launches(monkeypatch, tri, "_hstu_fwd", record)
    run(tri, "paged", args)
    assert took[0][1] > 1  # a split launch
    assert tri.paged_launch(paged["q"].shape[0], 3, 2, 64, paged["max_history_len"], 16, torch.float16,
                            torch.device("cpu")) == took[0]
    monkeypatch.setattr(tri, "SCHEDULE", "stream")
    assert tri.paged_launch(100, 3, 2, 64, 4096, 16, torch.float16, torch.device("cpu")) == ("stream",)
    assert tri.paged_launch(10_000, 5000, 2, 64, 4096, 16, torch.float16, torch.device("cpu"))[0] == \
        tri._blocks(16, torch.float16, True, torch.device("cpu"))


def test_the_timeline_probe_still_patches_the_kernel():
    """`scripts/gpu/probe_attention_timeline.py` adds its clock stamps by patching this module's source
    (each patch must match exactly once): a kernel change that moves a patched line shows up here, not
    in a device call (ae0f84d renamed an argument and broke it unnoticed)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "probe_attention_timeline.py"
    spec = importlib.util.spec_from_file_location("probe_attention_timeline", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    probed = probe.probed_module()
    assert probed.PROBE == [None] and callable(probed.paged_hstu_attention)
