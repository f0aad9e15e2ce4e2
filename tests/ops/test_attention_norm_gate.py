"""The cached attention's ``norm_gate`` epilogue (``LayerNorm(attn) * u``, the HSTU layer's norm
and gate): a launch split over the keys adds its fp32 parts inside the norm's pass
(`layer_norm.sum_layer_norm_mul`) instead of writing the attention's output and reading it back.
It must give the attention followed by the norm on every path that takes it: the same bits in the
interpreter; on the GPU at most one rounding step apart (the compiler may order the norm's fp32 sums
over a row of fp32 parts differently from a row of bf16 values: seen at H*D = 1024)."""

import pytest
import torch

from gr_plugin import ops
from gr_plugin.ops import norm
from gr_plugin.ops.pytorch import hstu_attention as ref
from gr_plugin.ops.triton import hstu_attention as tri
from gr_plugin.ops.triton import layer_norm

from .test_triton_attention import ALPHA, NORM, build, replayed, run

CASE = ([37, 0, 90], [3, 2, 1], [20, 0, 64])  # mixed users, an empty history, partial last pages


def gate_for(q, seed=1):
    """A `NormGate` for queries ``q [N, H, D]``: ``u`` a strided column chunk, as the projection hands it over."""
    g = torch.Generator().manual_seed(seed)
    n = q.shape[1] * q.shape[2]
    u = torch.randn(q.shape[0], 4 * n, generator=g).to(dtype=q.dtype, device=q.device)[:, n : 2 * n]
    w = (torch.randn(n, generator=g) * 0.2 + 1).to(dtype=q.dtype, device=q.device)
    b = (torch.randn(n, generator=g) * 0.1).to(dtype=q.dtype, device=q.device)
    return norm.NormGate(w, b, 1e-5, u)


def with_padding(paged, rows=3):
    """Query rows past the last user's (as a graph bucket pads): no program owns them."""
    args = dict(paged)
    for name in ("q", "k", "v"):
        args[name] = torch.cat([args[name], torch.full((rows, *args[name].shape[1:]), 7.0, dtype=args[name].dtype,
                                                           device=args[name].device)])
    return args


def within_one_rounding(got, want):
    """bf16 ``got`` and ``want`` equal or one rounding step apart, element by element."""
    g, w = got.float(), want.float()
    big = torch.maximum(g.abs(), w.abs())
    step = torch.ldexp(torch.ones_like(big), torch.frexp(big).exponent - 8)  # bf16: 8 significant bits
    assert ((g - w).abs() <= step).all(), f"max difference {(g - w).abs().max().item()}"


def attention_then_norm(args, gate, **launch):
    a = run(tri, "paged", {**args, **launch})
    return layer_norm.layer_norm_mul(a.view(a.shape[0], -1), gate.weight, gate.bias, gate.eps, gate.u)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("splits", [1, 2, 5, 7])  # 7: a second round of four loads, two past the last
def test_interpreter_epilogue_gives_the_bits_of_attention_then_norm(dtype, splits):
    if torch.cuda.is_available():
        pytest.skip("the interpreter runs where there is no GPU")
    _, paged = build(*CASE, 8, 2, 16, dtype, "cpu")
    args = with_padding(paged)
    gate = gate_for(args["q"])
    n = paged["q"].shape[0]
    got = run(tri, "paged", {**args, "num_splits": splits, "norm_gate": tuple(gate)})
    want = attention_then_norm(args, gate, num_splits=splits)
    assert got.shape == (n + 3, 32) and got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got[:n], want[:n])
    if splits > 1:  # a split launch's padding rows sum to 0 both ways (one split leaves them unwritten)
        assert torch.equal(got[n:], want[n:])
    # and it is the reference attention's norm, to the kernel's rounding
    a = run(ref, "paged", paged, torch.float32)
    w = gate.u[:n].float()
    expect = torch.nn.functional.layer_norm(a.reshape(n, -1), (32,), gate.weight.float(), gate.bias.float(), 1e-5) * w
    torch.testing.assert_close(got[:n].float(), expect, rtol=0, atol=1e-4 if dtype == torch.float32 else 3e-2)


def test_interpreter_epilogue_of_an_empty_batch():
    if torch.cuda.is_available():
        pytest.skip("the interpreter runs where there is no GPU")
    _, paged = build(*CASE, 8, 2, 16, torch.float32, "cpu")
    args = {**paged, "q_offsets": paged["q_offsets"][:1], "history_lengths": paged["history_lengths"][:0],
            "new_lengths": paged["new_lengths"][:0], "kv_indptr": paged["kv_indptr"][:1]}
    gate = gate_for(args["q"])
    got = run(tri, "paged", {**args, "num_splits": 3, "norm_gate": tuple(gate)})
    zero = torch.zeros(args["q"].shape[0], 32)
    want = torch.nn.functional.layer_norm(zero, (32,), gate.weight, gate.bias, 1e-5) * gate.u
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("splits", [None, 1, 3])
def test_interpreter_epilogue_of_no_query_rows_and_of_head_major_queries(splits):
    """No query rows: an empty ``[0, H*D]``, as the op without the gate returns an empty ``[0, H, D]``.
    Queries laid out head-major (``[H, N, D]`` seen as ``[N, H, D]``), which the kernel reads: the
    output takes that layout and the gate still reads it as rows."""
    if torch.cuda.is_available():
        pytest.skip("the interpreter runs where there is no GPU")
    _, paged = build(*CASE, 8, 2, 16, torch.float32, "cpu")
    launch = {} if splits is None else {"num_splits": splits}
    empty = {**paged, **{k: paged[k][:0] for k in ("q", "k", "v")}, "q_offsets": torch.zeros_like(paged["q_offsets"]),
             "new_lengths": torch.zeros_like(paged["new_lengths"])}
    gate = gate_for(empty["q"])
    assert run(tri, "paged", {**empty, **launch, "norm_gate": tuple(gate)}).shape == (0, 32)
    args = dict(paged)
    for name in ("q", "k", "v"):
        args[name] = args[name].transpose(0, 1).contiguous().transpose(0, 1)
    gate = gate_for(args["q"])
    got = run(tri, "paged", {**args, **launch, "norm_gate": tuple(gate)})
    a = run(tri, "paged", {**args, **launch})
    assert torch.equal(got, layer_norm.layer_norm_mul(a.reshape(a.shape[0], -1), *gate))


@pytest.mark.parametrize(("field", "bad", "match"), [
    ("u", lambda u: u[:-1],
     r"norm_gate's u must be \[49, 32\] torch.float32 on cpu with contiguous columns, got \(48, 32\)"),
    ("u", lambda u: u.half(), r"got \(49, 32\) torch.float16"),
    ("u", lambda u: u.t().contiguous().t(), r"strides \(1, 49\)"),
    ("weight", lambda w: w[:-1], r"norm_gate's weight must be \[32\] on cpu, got \(31,\)"),
    ("bias", lambda b: b.view(2, 16), r"norm_gate's bias must be \[32\] on cpu, got \(2, 16\)"),
])
def test_bad_norm_gate_is_named(field, bad, match):
    _, paged = build(*CASE, 8, 2, 16, torch.float32, "cpu")
    gate = gate_for(paged["q"])
    gate = gate._replace(**{field: bad(getattr(gate, field))})
    with pytest.raises(ValueError, match=match):
        run(tri, "paged", {**paged, "num_splits": 2, "norm_gate": tuple(gate)})


def dispatch(paged, gate=None):
    a = dict(paged)
    pos = [a.pop(k) for k in ("q", "k", "v", "kv_layer", "kv_indices", "kv_indptr", "history_lengths", "q_offsets",
                              "new_lengths")]
    return ops.paged_hstu_attention(*pos, alpha=ALPHA, n_norm=NORM, norm_gate=gate, **a)


def test_dispatch_without_the_kernels_is_the_attention_then_the_torch_norm(monkeypatch):
    """On CPU (the reference attention, the torch norm) the epilogue is the two ops in turn, and a
    bad ``u`` is named by the norm's own check."""
    monkeypatch.setenv("GR_PLUGIN_ATTENTION", "reference")
    _, paged = build(*CASE, 8, 2, 16, torch.float32, "cpu")
    gate = gate_for(paged["q"])
    a = dispatch(paged)
    assert torch.equal(dispatch(paged, gate), norm.layer_norm_mul(a.reshape(a.shape[0], -1), *gate))
    with pytest.raises(ValueError, match=r"a and u must be \[M, N\] of one shape, got \(49, 32\) and \(48, 32\)"):
        dispatch(paged, gate._replace(u=gate.u[:-1]))


def triton_kernels_with_splits(monkeypatch, splits, fused_norm=True):
    """The Triton attention (interpreter) split ``splits`` ways, the fused norm on or off; returns
    the list that counts `sum_layer_norm_mul`'s calls."""
    monkeypatch.setenv("GR_PLUGIN_ATTENTION", "triton")
    monkeypatch.setattr(norm, "use_fused", lambda *a: fused_norm)
    monkeypatch.setattr(tri, "_default_splits", lambda *a, **k: splits)
    calls = []
    real = layer_norm.sum_layer_norm_mul
    monkeypatch.setattr(layer_norm, "sum_layer_norm_mul", lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.mark.parametrize("fused_norm", [True, False])
def test_dispatch_fuses_the_parts_only_where_both_kernels_serve(monkeypatch, fused_norm):
    """With the Triton attention and the fused norm both serving, a split launch runs
    `sum_layer_norm_mul` (counted) and gives the bits of the two kernels in turn; with the torch
    norm (``GR_PLUGIN_FUSED_NORM=0``-like) it does not, and gives the torch norm's result."""
    if torch.cuda.is_available():
        pytest.skip("the interpreter runs where there is no GPU")
    calls = triton_kernels_with_splits(monkeypatch, 3, fused_norm)
    _, paged = build(*CASE, 8, 2, 16, torch.float32, "cpu")
    gate = gate_for(paged["q"])
    got = dispatch(paged, gate)
    a = dispatch(paged)
    assert len(calls) == (1 if fused_norm else 0)
    assert torch.equal(got, norm.layer_norm_mul(a.reshape(a.shape[0], -1), *gate, fused=fused_norm))


@pytest.mark.parametrize("odd_u", ["dtype", "strided columns"])
def test_dispatch_takes_the_unfused_form_for_a_gate_the_kernel_cannot_read(monkeypatch, odd_u):
    """A ``u`` of another dtype (autocast's mixed types) or with strided columns: the attention,
    then `norm.layer_norm_mul` (which promotes / reads any strides); the fused sum is not run."""
    if torch.cuda.is_available():
        pytest.skip("the interpreter runs where there is no GPU")
    calls = triton_kernels_with_splits(monkeypatch, 3)
    _, paged = build(*CASE, 8, 2, 16, torch.float32, "cpu")
    gate = gate_for(paged["q"])
    u = gate.u.double() if odd_u == "dtype" else torch.randn(gate.u.shape[0], 64)[:, ::2]
    gate = gate._replace(u=u)
    got = dispatch(paged, gate)
    a = dispatch(paged)
    assert not calls
    assert torch.equal(got, norm.layer_norm_mul(a.flatten(1), *gate))


def test_dispatch_names_a_gate_of_the_wrong_shape_as_the_norm_does(monkeypatch):
    """With both kernels serving, a ``u`` of the wrong shape gets the norm's own error, the same
    message as on the unfused path; the fused sum is not run."""
    if torch.cuda.is_available():
        pytest.skip("the interpreter runs where there is no GPU")
    calls = triton_kernels_with_splits(monkeypatch, 3)
    _, paged = build(*CASE, 8, 2, 16, torch.float32, "cpu")
    gate = gate_for(paged["q"])
    with pytest.raises(ValueError, match=r"a and u must be \[M, N\] of one shape, got \(49, 32\) and \(49, 31\)"):
        dispatch(paged, gate._replace(u=gate.u[:, :31]))
    assert not calls


def test_model_cached_pass_with_the_epilogue_equals_the_full_pass(monkeypatch):
    """The model's cached loop (`HSTURanker.forward_cached`) hands each layer's norm and gate to the
    attention: with the Triton kernels in the interpreter and a split launch, the parts' fused sum
    runs and the cached scores equal the full pass's (fp32)."""
    if torch.cuda.is_available():
        pytest.skip("the interpreter runs where there is no GPU")
    from tests.modules.helpers import cached_scores, full_scores, tiny_cache, tiny_model
    from tests.ops.test_norm import _users_and_candidates

    model = tiny_model(0, head_dim=16).eval()
    users, cands = _users_and_candidates()
    cache = tiny_cache(model)
    cached_scores(model, cache, users, cands)
    for user in users:
        user.grow(3)
    cands = [user.candidates(4) for user in users]
    calls = triton_kernels_with_splits(monkeypatch, 2)
    got, plan = cached_scores(model, cache, users, cands)
    assert sum(plan.cached_lengths) > 0 and len(calls) == model.config.num_layers
    monkeypatch.setenv("GR_PLUGIN_ATTENTION", "reference")
    torch.testing.assert_close(got, full_scores(model, users, cands), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize(("dim", "page_size"), [(128, 128), (256, 32), (64, 16)])
@pytest.mark.parametrize("splits", [None, 1, 4])
def test_gpu_epilogue_gives_the_bits_of_attention_then_norm(dim, page_size, splits, monkeypatch):
    """bf16 on the GPU, the split count by the rule (None) or forced, eager and graphed. A graphed launch
    may take the other kernel (on Hopper the Gluon one, `hstu_gluon`, with its own split count): it
    gives the bits that kernel gives eagerly, and holds the project's rule against an fp32 reference."""
    from gr_plugin.ops.triton import hstu_gluon

    hist, cand, cached = [4096, 300, 1000], [256, 1, 40], [3968, 0, 1000]
    _, paged = build(hist, cand, cached, page_size, 4, dim, torch.bfloat16, "cuda")
    args = with_padding(paged, 5)
    gate = gate_for(args["q"])
    launch = {} if splits is None else {"num_splits": splits}
    want = attention_then_norm(args, gate, **launch)
    got = run(tri, "paged", {**args, **launch, "norm_gate": tuple(gate)})
    n = paged["q"].shape[0]
    within_one_rounding(got[:n], want[:n])
    if splits == 1:  # no parts: the same kernels in turn
        assert torch.equal(got[:n], want[:n])
    # graphed as the buckets launch it, both forms in one graph
    took = []
    real = hstu_gluon.launch
    monkeypatch.setattr(hstu_gluon, "launch", lambda *a: took.append(a[-1]) or real(*a))
    captured, captured_want = replayed(lambda: (run(tri, "paged", {**args, **launch, "norm_gate": tuple(gate)}),
                                                attention_then_norm(args, gate, **launch)))
    within_one_rounding(captured[:n], captured_want[:n])
    tiles = tri._gluon_tiles(dim, torch.bfloat16, page_size, args["q"].device)
    assert took == ([] if tiles is None else [tiles, tiles])  # (the gated launch, then attention_then_norm's)
    kernel = "gluon" if took else "triton"
    eager = run(tri, "paged", {**args, **launch, "norm_gate": tuple(gate), "kernel": kernel})
    assert torch.equal(captured[:n], eager[:n])
    # the rule: within 2x the error of the same steps in bf16 torch ops, both against fp32
    ln = torch.nn.functional.layer_norm
    width = 4 * dim
    a32 = run(ref, "paged", paged, torch.float32).reshape(n, width)
    exact = ln(a32, (width,), gate.weight.float(), gate.bias.float(), gate.eps) * gate.u[:n].float()
    a16 = run(ref, "paged", paged, torch.bfloat16).reshape(n, width)
    low = (ln(a16, (width,), gate.weight, gate.bias, gate.eps) * gate.u[:n]).float()
    err, err_low = (captured[:n].float() - exact).abs().max().item(), (low - exact).abs().max().item()
    assert err <= 2 * err_low + 1e-6, (err, err_low)
