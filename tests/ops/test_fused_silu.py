"""The cached step's SiLU without a pass of its own: `HSTULayer.project` with ``activate=False``
hands over ``u, q, k, v`` before their SiLU; `gr_plugin.ops.silu_append_kv` takes the SiLU of
``q, k, v`` and appends the new tokens' in one launch, and the paged attention's norm gate takes
``u``'s as it loads it (``silu_gate``). Each must give what the unfused step gives from ``F.silu``
of the projection: the same bits where the torch forms serve (CPU), the kernels' rounding of their
own SiLU elsewhere (the interpreter on CPU; the kernels on the GPU)."""

import pytest
import torch
import torch.nn.functional as F

from gr_plugin import ops
from gr_plugin.cache import paged_ops
from gr_plugin.ops import norm
from gr_plugin.ops.triton import hstu_attention as tri
from gr_plugin.ops.triton import layer_norm
from gr_plugin.ops.triton.append_kv import silu_append_kv as tri_silu_append

from .test_attention_norm_gate import CASE, gate_for, within_one_rounding
from .test_triton_attention import build, replayed, run

interpreter = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs where there is no GPU")


def silu_gate_of(gate):
    return gate._replace(u=F.silu(gate.u))


def wide(gate, scale=3.0):
    """``gate`` with ``u`` spread like a projection's, so that SiLU's negative side is exercised."""
    return gate._replace(u=gate.u * scale)


def test_reference_gate_takes_the_silu_of_u(monkeypatch):
    """Where the reference and the torch norm serve (CPU), ``silu_gate`` is the unfused op on
    ``F.silu(u)``: the same bits."""
    monkeypatch.setenv("GR_PLUGIN_ATTENTION", "reference")
    _, paged = build(*CASE, 8, 2, 16, torch.float32, "cpu")
    gate = wide(gate_for(paged["q"]))
    got = run(ops, "paged", {**paged, "norm_gate": gate, "silu_gate": True})
    assert torch.equal(got, run(ops, "paged", {**paged, "norm_gate": silu_gate_of(gate)}))


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("splits", [1, 3])
def test_interpreter_gate_takes_the_silu_of_u(dtype, splits):
    """The Triton attention (interpreter), split or not: the norm's pass (`_ln_mul` / `_sum_ln_mul`)
    takes ``u``'s SiLU as it loads it; equal to the launch on ``F.silu(u)`` up to the SiLU's own
    rounding (numpy's exp, not torch's), and not the launch on ``u`` itself."""
    _, paged = build(*CASE, 8, 2, 16, dtype, "cpu")
    gate = wide(gate_for(paged["q"]))
    launch = {**paged, "num_splits": splits}
    got = run(tri, "paged", {**launch, "norm_gate": tuple(gate), "silu_gate": True})
    want = run(tri, "paged", {**launch, "norm_gate": tuple(silu_gate_of(gate))})
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(got, want, **tol)
    assert not torch.allclose(got, run(tri, "paged", {**launch, "norm_gate": tuple(gate)}), rtol=1e-2, atol=1e-2)


@interpreter
def test_interpreter_empty_batch_gate_takes_the_silu():
    """No users: LayerNorm of zeros times ``SiLU(u)``."""
    _, paged = build(*CASE, 8, 2, 16, torch.float32, "cpu")
    args = {**paged, "q_offsets": paged["q_offsets"][:1], "history_lengths": paged["history_lengths"][:0],
            "new_lengths": paged["new_lengths"][:0], "kv_indptr": paged["kv_indptr"][:1]}
    gate = wide(gate_for(args["q"]))
    got = run(tri, "paged", {**args, "num_splits": 3, "norm_gate": tuple(gate), "silu_gate": True})
    want = F.layer_norm(torch.zeros(args["q"].shape[0], 32), (32,), gate.weight, gate.bias, 1e-5) * F.silu(gate.u)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def _projection(n=9, heads=2, dim=8, seed=3, dtype=torch.float32, device="cpu"):
    """``q, k, v`` as chunks of one projection row (strided rows, as `HSTULayer.project` hands them over)."""
    g = torch.Generator().manual_seed(seed)
    uvqk = (torch.randn(n, 4 * heads * dim, generator=g) * 3).to(dtype=dtype, device=device)
    _, v, q, k = uvqk.chunk(4, dim=-1)
    return tuple(t.reshape(n, heads, dim) for t in (q, k, v))


@pytest.mark.parametrize("separate_v", [False, True], ids=["chunks", "v apart"])
@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=interpreter)])
def test_silu_append_returns_and_writes_the_silu(kernel, separate_v):
    """`silu_append_kv` returns ``F.silu`` of ``q, k, v`` and writes the new tokens' ``F.silu(k),
    F.silu(v)`` at their slots, the rest of the table untouched: the torch form (CPU) gives the bits
    of ``F.silu`` then `append_kv`; the kernel (interpreter) gives them to its SiLU's rounding."""
    heads, dim, page = 2, 8, 4
    q, k, v = _projection(heads=heads, dim=dim)
    if separate_v:  # (its own row stride: each input's stride must be its own)
        v = v.contiguous() + 0.5
    table = torch.randn(5, 2, page, heads, dim, generator=torch.Generator().manual_seed(4))
    rows, slots = torch.tensor([0, 4, 8]), torch.tensor([1, page + 2, 4 * page + 3])
    want_table = table.clone()
    paged_ops.append_kv(want_table, F.silu(k), F.silu(v), slots, rows)
    got_table = table.clone()
    got = (tri_silu_append if kernel else ops.silu_append_kv)(got_table, q, k, v, slots, rows)
    want = (F.silu(q), F.silu(k), F.silu(v))
    if kernel:
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got_table, want_table, rtol=1e-6, atol=1e-6)
        # the pages hold the returned keys and values: one formula, one rounding
        assert torch.equal(got_table[1, 0, 2], got[1][4]) and torch.equal(got_table[4, 1, 3], got[2][8])
    else:
        assert all(torch.equal(a, b) for a, b in zip(got, want)) and torch.equal(got_table, want_table)
    untouched = torch.ones(5 * 2 * page, dtype=torch.bool)
    untouched[torch.cat(paged_ops._flat_kv_index(slots, page))] = False
    assert torch.equal(got_table.view(-1, heads, dim)[untouched], table.view(-1, heads, dim)[untouched])


@interpreter
def test_silu_append_without_new_tokens():
    """No new token: only the activation, the table untouched."""
    q, k, v = _projection(n=5)
    table = torch.zeros(3, 2, 4, 2, 8)
    none = torch.zeros(0, dtype=torch.int64)
    got = tri_silu_append(table, q, k, v, none, none)
    for a, b in zip(got, (q, k, v)):
        torch.testing.assert_close(a, F.silu(b), rtol=1e-6, atol=1e-6)
    assert not table.any()


def _bad_cases():
    def ints(*v):
        return lambda _: torch.tensor(v, dtype=torch.int64)

    return [  # (what to change, the error's first line)
        (dict(k=lambda k: k[:-1]),
         r"^k must be \(9, 2, 8\) torch.float32 on cpu with contiguous \[H, D\] rows, got \(8, 2, 8\)"),
        (dict(v=lambda v: v.half()), r"^v must be \(9, 2, 8\) torch.float32 on cpu .* got \(9, 2, 8\) torch.float16"),
        (dict(q=lambda q: q.transpose(1, 2).contiguous().transpose(1, 2)), r"^q must be .* strides \(16, 1, 2\)"),
        (dict(q=lambda q: q[0]), r"^q must be \[N, H, D\], got \(2, 8\)"),
        (dict(table=lambda t: t[..., :4]),
         r"^kv_layer must hold \[2, 8\] rows \(q's\), contiguous, got shape \(5, 2, 4, 2, 4\)"),
        (dict(table=lambda t: t[None]), r"^kv_layer must be \[num_pages, 2, P, H, D\], got \(1, 5, 2, 4, 2, 8\)"),
        (dict(slots=lambda s: s.int()), r"^slots must be 1-D int64 on cpu, got \(1,\) torch.int32 on cpu"),
        (dict(rows=ints(0, 1)), r"^rows and slots must name one new token each, got 2 and 1"),
        (dict(slots=ints(20)), r"^slots must lie in \[0, 20\) \(the table's\), got 20 to 20"),
        (dict(slots=ints(-1)), r"^slots must lie in \[0, 20\) \(the table's\), got -1 to -1"),
        (dict(rows=ints(9)), r"^rows must lie in \[0, 9\) \(q's rows\), got 9 to 9"),
    ]


@pytest.mark.parametrize("kernel", [False, True], ids=["dispatch", "triton form"])
@pytest.mark.parametrize(("change", "match"), _bad_cases())
def test_silu_append_names_bad_inputs_and_writes_nothing(kernel, change, match):
    """Both forms check every input before they write (the Triton form's checks run before its
    launch, so it raises on CPU tensors without the interpreter too)."""
    q, k, v = _projection()
    table = torch.zeros(5, 2, 4, 2, 8)
    args = dict(table=table, q=q, k=k, v=v, slots=torch.tensor([1]), rows=torch.tensor([0]))
    for name, fn in change.items():
        args[name] = fn(args[name])
    with pytest.raises(ValueError, match=match):
        (tri_silu_append if kernel else ops.silu_append_kv)(args["table"], args["q"], args["k"], args["v"],
                                                             args["slots"], args["rows"])
    assert not table.any()


def test_silu_append_keeps_the_gradient():
    """With a gradient wanted the torch form serves (the kernel has none): the returned ``q, k, v``
    carry SiLU's gradient; the pages take detached values."""
    q, k, v = (t.detach().requires_grad_() for t in _projection())
    table = torch.zeros(5, 2, 4, 2, 8)
    aq, ak, av = ops.silu_append_kv(table, q, k, v, torch.tensor([1]), torch.tensor([0]))
    (aq.sum() + ak.sum() + av.sum()).backward()
    for t in (q, k, v):
        x = t.detach()
        torch.testing.assert_close(t.grad, torch.sigmoid(x) * (1 + x * (1 - torch.sigmoid(x))))
    assert not table.requires_grad and torch.equal(table[0, 0, 1], F.silu(k[0]).detach())


@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=interpreter)])
def test_norm_gate_takes_the_silu_of_u(kernel):
    g = torch.Generator().manual_seed(4)
    a, u = torch.randn(6, 32, generator=g), torch.randn(6, 32, generator=g) * 3
    w, b = torch.randn(32, generator=g), torch.randn(32, generator=g)
    want = F.layer_norm(a, (32,), w, b, 1e-5) * F.silu(u)
    if kernel:
        torch.testing.assert_close(layer_norm.layer_norm_mul(a, w, b, 1e-5, u, True), want, rtol=1e-5, atol=1e-5)
        parts = torch.stack([a * 0.25, a * 0.75])
        got = layer_norm.sum_layer_norm_mul(parts, torch.tensor([0, 6]), 1, w, b, 1e-5, u, torch.float32, True)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(norm.layer_norm_mul(a, w, b, 1e-5, u, fused=False, silu_u=True), want)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_layer_attend_pages_unactivated_equals_activated(device, monkeypatch):
    """`HSTULayer.attend_pages` from `project(activate=False)` gives the bits of the activated
    projection's, and its pages get the same keys and values: on CPU the torch forms; on the GPU (bf16)
    the kernels with torch's SiLU (`EXACT_SILU`)."""
    import gr_plugin.ops.triton as tri_ops
    from tests.modules.helpers import tiny_model

    monkeypatch.setattr(tri_ops, "EXACT_SILU", True)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = tiny_model(0, head_dim=16).eval().to(device=device, dtype=dtype)
    layer = model.layers[0]
    _, paged = build(*CASE, 8, layer.num_heads, layer.head_dim, dtype, device)
    n = paged["q"].shape[0]
    x = torch.randn(n, model.config.embedding_dim, generator=torch.Generator().manual_seed(5)).to(device, dtype)
    q_off = paged["q_offsets"].cpu()
    new = paged["new_lengths"].tolist()
    rows = torch.cat([torch.arange(int(q_off[b]), int(q_off[b]) + new[b]) for b in range(len(new))]).to(device)
    pages = paged["kv_layer"].shape[0]
    slots = pages * 8 + torch.arange(rows.numel(), device=device)  # into pages past the users' (8-token pages)
    spare = torch.zeros(-(-rows.numel() // 8), *paged["kv_layer"].shape[1:], dtype=dtype, device=device)
    table = torch.cat([paged["kv_layer"], spare])
    outs = []
    for activate in (True, False):
        t = table.clone()
        with torch.no_grad():
            a = layer.attend_pages(layer.project(x, activate=activate), t, slots, rows, paged["kv_indices"],
                                   paged["kv_indptr"], paged["history_lengths"], paged["q_offsets"],
                                   paged["new_lengths"], max_q_len=paged["max_q_len"],
                                   max_history_len=paged["max_history_len"],
                                   num_history_tokens=paged["num_history_tokens"], activated=activate)
        outs.append((a, t))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert not torch.equal(outs[1][1], table)  # (the new tokens were written)


@pytest.fixture(params=[True, False], ids=["exact", "approximate"])
def exact(request, monkeypatch):
    """The kernels' SiLU: torch's (`EXACT_SILU`) or the approximate one (the default)."""
    import gr_plugin.ops.triton as tri_ops

    monkeypatch.setattr(tri_ops, "EXACT_SILU", request.param)
    return request.param


def same_or_one_step(got, want, exact):
    """torch's bits from the exact SiLU, one rounding step at most from the approximate one."""
    if exact:
        assert torch.equal(got, want)
    else:
        within_one_rounding(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize(("dim", "page_size"), [(128, 128), (256, 32), (64, 16)])
@pytest.mark.parametrize("splits", [None, 1, 4])
def test_gpu_graphed_gate_takes_the_silu_of_u(dim, page_size, splits, exact):
    """bf16, graphed as the buckets launch it (on Hopper the Gluon kernel): ``silu_gate`` against the
    same launch on ``F.silu(u)``: the norm's SiLU of ``u`` against torch's, both rounded to bf16, then
    the same pass."""
    hist, cand, cached = [4096, 300, 1000], [256, 1, 40], [3968, 0, 1000]
    _, paged = build(hist, cand, cached, page_size, 4, dim, torch.bfloat16, "cuda")
    gate = wide(gate_for(paged["q"]))
    launch = {**paged} if splits is None else {**paged, "num_splits": splits}
    got, want = replayed(lambda: (run(tri, "paged", {**launch, "norm_gate": tuple(gate), "silu_gate": True}),
                                  run(tri, "paged", {**launch, "norm_gate": tuple(silu_gate_of(gate))})))
    same_or_one_step(got, want, exact)


@pytest.mark.gpu
@pytest.mark.parametrize(("heads", "dim", "page"), [(4, 256, 32), (4, 128, 128), (2, 64, 16)])
def test_gpu_silu_append_writes_torchs_silu(heads, dim, page, exact):
    """bf16 on the GPU: the returned ``q, k, v`` and the written pages against ``F.silu`` then
    `append_kv`; the pages equal to the returned keys and values."""
    q, k, v = _projection(n=40, heads=heads, dim=dim, seed=6, dtype=torch.bfloat16, device="cuda")
    table = torch.randn(7, 2, page, heads, dim, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16).cuda()
    rows = torch.arange(0, 40, 2, device="cuda")
    slots = torch.arange(20, device="cuda") * 3 + 1  # (distinct: a slot written twice would race)
    got_table, want_table = table.clone(), table.clone()
    got = tri_silu_append(got_table, q, k, v, slots, rows)
    paged_ops.append_kv(want_table, F.silu(k), F.silu(v), slots, rows)
    for a, b in zip(got, (F.silu(q), F.silu(k), F.silu(v))):
        same_or_one_step(a, b, exact)
    same_or_one_step(got_table, want_table, exact)
    written = got_table.view(-1, heads, dim)[torch.cat(paged_ops._flat_kv_index(slots, page))]
    assert torch.equal(written, torch.cat([got[1][rows], got[2][rows]]))
