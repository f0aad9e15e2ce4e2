"""The cached step's SiLU taken where its consumers load the projection (no SiLU pass of its own):
`HSTULayer.project` with ``activate=False`` hands over ``u, q, k, v`` before their SiLU, and the
append (``silu=True``), the paged attention (``silu_inputs=True``: the query tile, a candidate's own
key and value) and the norm gate (its ``u``) apply it. Each form must give what the same op gives
on ``F.silu`` of its inputs: the same bits where the op is the torch reference, the kernel's
rounding of its own SiLU elsewhere (the interpreter on CPU; the Gluon kernel on the H200)."""

import pytest
import torch
import torch.nn.functional as F

from gr_plugin import ops
from gr_plugin.cache import paged_ops
from gr_plugin.ops import norm
from gr_plugin.ops.pytorch import hstu_attention as ref
from gr_plugin.ops.triton import hstu_attention as tri
from gr_plugin.ops.triton import layer_norm
from gr_plugin.ops.triton.append_kv import append_kv as tri_append

from .test_attention_norm_gate import CASE, gate_for, within_one_rounding
from .test_triton_attention import build, replayed, run

interpreter = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs where there is no GPU")


def activated(args, gate=None):
    """``args`` with ``q, k, v`` replaced by their SiLU (and ``gate``'s ``u``): what the unfused step hands over."""
    out = {**args, **{name: F.silu(args[name]) for name in ("q", "k", "v")}}
    return out if gate is None else (out, gate._replace(u=F.silu(gate.u)))


def pre_silu(paged, scale=3.0):
    """Projection-like inputs: ``q, k, v`` spread wide enough that SiLU's negative side is exercised."""
    return {**paged, **{name: paged[name] * scale for name in ("q", "k", "v")}}


def test_reference_dispatch_takes_the_silu_of_every_input_first(monkeypatch):
    """Where the reference serves (CPU), ``silu_inputs`` is ``F.silu`` of ``q, k, v`` and of the
    gate's ``u``, then the unfused op: the same bits."""
    monkeypatch.setenv("GR_PLUGIN_ATTENTION", "reference")
    _, paged = build(*CASE, 8, 2, 16, torch.float32, "cpu")
    paged = pre_silu(paged)
    gate = gate_for(paged["q"])
    act, act_gate = activated(paged, gate)
    for g, ag in ((None, None), (gate, act_gate)):
        got = run(ops, "paged", {**paged, "norm_gate": g, "silu_inputs": True})
        want = run(ops, "paged", {**act, "norm_gate": ag})
        assert torch.equal(got, want)


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("gated", [False, True])
def test_interpreter_kernel_takes_the_silu_where_it_loads(dtype, splits, gated):
    """The Triton kernel (interpreter) with ``silu_inputs``: its query tile and the candidates' own
    keys and values activated as loaded, the gate's ``u`` in the norm's pass (split or not); equal
    to the same launch on activated inputs up to the SiLU's own rounding (numpy's exp, not torch's)."""
    _, paged = build(*CASE, 8, 2, 16, dtype, "cpu")
    paged = pre_silu(paged)
    gate = gate_for(paged["q"]) if gated else None
    act, act_gate = activated(paged, gate) if gated else (activated(paged), None)
    launch = {"num_splits": splits}
    if gated:
        launch_got, launch_want = {**launch, "norm_gate": tuple(gate)}, {**launch, "norm_gate": tuple(act_gate)}
    else:
        launch_got = launch_want = launch
    got = run(tri, "paged", {**paged, **launch_got, "silu_inputs": True})
    want = run(tri, "paged", {**act, **launch_want})
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(got, want, **tol)
    # and not the launch on the raw inputs: the SiLU is really taken
    assert not torch.allclose(got, run(tri, "paged", {**paged, **launch_got}), rtol=1e-2, atol=1e-2)


@interpreter
def test_interpreter_empty_batch_gate_takes_the_silu():
    """No users: LayerNorm of zeros times ``SiLU(u)``."""
    _, paged = build(*CASE, 8, 2, 16, torch.float32, "cpu")
    args = {**paged, "q_offsets": paged["q_offsets"][:1], "history_lengths": paged["history_lengths"][:0],
            "new_lengths": paged["new_lengths"][:0], "kv_indptr": paged["kv_indptr"][:1]}
    gate = gate_for(args["q"])
    got = run(tri, "paged", {**args, "num_splits": 3, "norm_gate": tuple(gate), "silu_inputs": True})
    want = F.layer_norm(torch.zeros(args["q"].shape[0], 32), (32,), gate.weight, gate.bias, 1e-5) * F.silu(gate.u)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_full_pass_refuses_silu_inputs():
    """The full pass reads every key from ``k`` and ``v`` (by TMA in the Gluon kernel): not offered."""
    jag, _ = build(*CASE, 8, 2, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"^silu_inputs applies to the paged form"):
        run(tri, "jagged", {**jag, "silu_inputs": True})


@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=interpreter)])
def test_append_writes_the_silu(kernel):
    """``append_kv(..., silu=True)`` writes ``F.silu(k)``, ``F.silu(v)`` (the reference: the same
    bits; the kernel in the interpreter: to its SiLU's rounding), the rest of the table untouched."""
    g = torch.Generator().manual_seed(3)
    heads, dim, page = 2, 8, 4
    table = torch.randn(5, 2, page, heads, dim, generator=g)
    k, v = (torch.randn(9, heads, dim, generator=g) * 3 for _ in range(2))
    rows, slots = torch.tensor([0, 4, 8]), torch.tensor([1, page + 2, 4 * page + 3])
    got, want = table.clone(), table.clone()
    paged_ops.append_kv(want, F.silu(k), F.silu(v), slots, rows)
    if kernel:
        tri_append(got, k, v, slots, rows, silu=True)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        ops.append_kv(got, k, v, slots, rows, silu=True)
        assert torch.equal(got, want)
    untouched = torch.ones(5 * 2 * page, dtype=torch.bool)
    untouched[torch.cat(paged_ops._flat_kv_index(slots, page))] = False
    assert torch.equal(got.view(-1, heads, dim)[untouched], table.view(-1, heads, dim)[untouched])


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


def test_layer_attend_pages_unactivated_equals_activated():
    """`HSTULayer.attend_pages` from `project(activate=False)` (CPU: the references) gives the bits
    of the activated projection's, and its pages get the same keys and values."""
    from tests.modules.helpers import tiny_model

    model = tiny_model(0, head_dim=16).eval()
    layer = model.layers[0]
    _, paged = build(*CASE, 8, layer.num_heads, layer.head_dim, torch.float32, "cpu")
    n = paged["q"].shape[0]
    x = torch.randn(n, model.config.embedding_dim, generator=torch.Generator().manual_seed(5))
    q_off = paged["q_offsets"]
    new = paged["new_lengths"].tolist()
    rows = torch.cat([torch.arange(int(q_off[b]), int(q_off[b]) + new[b]) for b in range(len(new))])
    pages = paged["kv_layer"].shape[0]
    slots = pages * 8 + torch.arange(rows.numel())  # into pages past the users' (8-token pages)
    table = torch.cat([paged["kv_layer"], torch.zeros(-(-rows.numel() // 8), *paged["kv_layer"].shape[1:])])
    outs = []
    for activate in (True, False):
        t = table.clone()
        with torch.no_grad():
            a = layer.attend_pages(layer.project(x, activate=activate), t, slots, rows, paged["kv_indices"],
                                   paged["kv_indptr"], paged["history_lengths"], q_off, paged["new_lengths"],
                                   max_q_len=paged["max_q_len"], max_history_len=paged["max_history_len"],
                                   num_history_tokens=paged["num_history_tokens"], activated=activate)
        outs.append((a, t))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.gpu
@pytest.mark.parametrize(("dim", "page_size"), [(128, 128), (256, 32), (64, 16)])
@pytest.mark.parametrize("splits", [None, 1])
def test_gpu_graphed_launch_takes_the_silu_where_it_loads(dim, page_size, splits):
    """bf16, graphed as the buckets launch it (on Hopper the Gluon kernel): ``silu_inputs`` with the
    norm gate against the same launch on activated inputs, within one rounding step of the output
    (the only difference: the kernel's SiLU of a query, key or value against torch's, both rounded
    to bf16); and the project's rule against an fp32 reference of the activated step."""
    hist, cand, cached = [4096, 300, 1000], [256, 1, 40], [3968, 0, 1000]
    _, paged = build(hist, cand, cached, page_size, 4, dim, torch.bfloat16, "cuda")
    paged = pre_silu(paged)
    gate = gate_for(paged["q"])
    act, act_gate = activated(paged, gate)
    launch = {} if splits is None else {"num_splits": splits}
    got, want = replayed(lambda: (run(tri, "paged", {**paged, **launch, "norm_gate": tuple(gate), "silu_inputs": True}),
                                  run(tri, "paged", {**act, **launch, "norm_gate": tuple(act_gate)})))
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6, atol=1e-3)
    n = paged["q"].shape[0]
    width = 4 * dim
    ln = F.layer_norm
    a32 = run(ref, "paged", act, torch.float32).reshape(n, width)
    exact = ln(a32, (width,), gate.weight.float(), gate.bias.float(), gate.eps) * act_gate.u.float()
    a16 = run(ref, "paged", act, torch.bfloat16).reshape(n, width)
    low = (ln(a16, (width,), act_gate.weight, act_gate.bias, gate.eps) * act_gate.u).float()
    err, err_low = (got.float() - exact).abs().max().item(), (low - exact).abs().max().item()
    assert err <= 2 * err_low + 1e-6, (err, err_low)


@pytest.mark.gpu
def test_gpu_append_kernel_writes_torchs_silu():
    g = torch.Generator().manual_seed(6)
    table = torch.randn(7, 2, 32, 4, 256, generator=g).to(torch.bfloat16).cuda()
    k, v = ((torch.randn(40, 4, 256, generator=g) * 3).to(torch.bfloat16).cuda() for _ in range(2))
    rows = torch.arange(0, 40, 2, device="cuda")
    slots = torch.arange(20, device="cuda") * 7 % (7 * 32)
    got, want = table.clone(), table.clone()
    tri_append(got, k, v, slots, rows, silu=True)
    paged_ops.append_kv(want, F.silu(k), F.silu(v), slots, rows)
    within_one_rounding(got, want)
