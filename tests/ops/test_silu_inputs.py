"""A cached layer's SiLU applied by the ops that read its projection (``silu_inputs`` / ``silu`` /
``silu_u``): the page append, the paged attention (queries, the candidates' own keys and values)
and the norm gate take the projection before its SiLU and must give what they give on ``F.silu``
of it. On the GPU, where the kernels' SiLU follows torch's formula with an accurate ``exp``, the same
bits; in the interpreter (numpy's ``exp``) to a few fp32 rounding steps."""

import pytest
import torch
import torch.nn.functional as F

from gr_plugin import ops
from gr_plugin.cache import paged_ops
from gr_plugin.modules.hstu import HSTUConfig, HSTULayer
from gr_plugin.ops import norm
from gr_plugin.ops.triton import append_kv as tri_append
from gr_plugin.ops.triton import hstu_attention as tri
from gr_plugin.ops.triton import layer_norm

from .test_attention_norm_gate import CASE, gate_for
from .test_triton_attention import build, run

# (the interpreter's bf16 is not the GPU's: it runs fp16 there)
CASES = [pytest.param("cpu", torch.float32, id="interpreter-fp32"),
         pytest.param("cpu", torch.float16, id="interpreter-fp16"),
         pytest.param("cuda", torch.float32, marks=pytest.mark.gpu, id="gpu-fp32"),
         pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu, id="gpu-bf16")]


def interpreter_only(device="cpu"):
    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("the interpreter runs where there is no GPU")


def raw_and_activated(paged, gate=None):
    """The projection before its SiLU (``paged``'s q, k, v, ``gate``'s u, scaled to reach SiLU's
    curved part) and after it; the pages are the same (they hold K/V after the SiLU)."""
    raw = {**paged, **{n: paged[n] * 3 for n in ("q", "k", "v")}}
    act = {**raw, **{n: F.silu(raw[n]) for n in ("q", "k", "v")}}
    if gate is None:
        return raw, act, None, None
    raw_gate = gate._replace(u=gate.u * 3)
    return raw, act, raw_gate, raw_gate._replace(u=F.silu(raw_gate.u))


def close(got, want, dtype):
    if want.is_cuda:
        assert torch.equal(got, want)
    else:
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("gated", [False, True])
def test_interpreter_attention_applies_the_silu(dtype, splits, gated):
    interpreter_only()
    _, paged = build(*CASE, 8, 2, 16, dtype, "cpu")
    raw, act, raw_gate, act_gate = raw_and_activated(paged, gate_for(paged["q"]) if gated else None)
    extra = {"num_splits": splits}
    got = run(tri, "paged", {**raw, **extra, "silu_inputs": True,
                             **({"norm_gate": tuple(raw_gate)} if gated else {})})
    want = run(tri, "paged", {**act, **extra, **({"norm_gate": tuple(act_gate)} if gated else {})})
    close(got, want, dtype)
    # and the candidates' own keys are the activated ones: a run on the raw keys differs
    assert not torch.allclose(run(tri, "paged", {**raw, **extra}), run(tri, "paged", {**act, **extra}))


@pytest.mark.parametrize("mode", ["reference", "triton"])
def test_dispatch_with_silu_inputs_equals_activated_inputs(monkeypatch, mode):
    """`ops.paged_hstu_attention` on either path (the reference applies ``F.silu`` itself), with the
    norm gate fused or not."""
    interpreter_only()
    monkeypatch.setenv("GR_PLUGIN_ATTENTION", mode)
    _, paged = build(*CASE, 8, 2, 16, torch.float32, "cpu")
    raw, act, raw_gate, act_gate = raw_and_activated(paged, gate_for(paged["q"]))
    for fused in (False, True):
        monkeypatch.setattr(norm, "use_fused", lambda *a, fused=fused: fused)
        got = run(ops, "paged", {**raw, "norm_gate": raw_gate, "silu_inputs": True})
        want = run(ops, "paged", {**act, "norm_gate": act_gate})
        close(got, want, torch.float32)
        close(run(ops, "paged", {**raw, "silu_inputs": True}), run(ops, "paged", act), torch.float32)


def test_jagged_form_refuses_silu_inputs():
    jag, _ = build(*CASE, 8, 2, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="silu_inputs applies to the paged form"):
        run(tri, "jagged", {**jag, "silu_inputs": True})


def _append_case(dtype, device):
    g = torch.Generator().manual_seed(3)
    table = torch.randn(6, 2, 8, 2, 16, generator=g).to(dtype=dtype, device=device)
    k, v = (torch.randn(11, 2, 16, generator=g).mul(3).to(dtype=dtype, device=device) for _ in range(2))
    slots = torch.tensor([5, 9, 17, 40, 41, 47], device=device)
    rows = torch.tensor([0, 2, 3, 7, 8, 10], device=device)
    return table, k, v, slots, rows


@pytest.mark.parametrize(("device", "dtype"), CASES)
def test_append_applies_the_silu(device, dtype):
    """The reference and the kernel write ``F.silu`` of the rows; the other slots keep their bits."""
    interpreter_only(device)
    table, k, v, slots, rows = _append_case(dtype, device)
    want = table.clone()
    paged_ops.append_kv(want, F.silu(k), F.silu(v), slots, rows)
    ref = table.clone()
    paged_ops.append_kv(ref, k, v, slots, rows, silu=True)
    assert torch.equal(ref, want)
    got = table.clone()
    tri_append.append_kv(got, k, v, slots, rows, silu=True)
    close(got, want, dtype)
    untouched = torch.ones(want.numel() // 32, dtype=torch.bool, device=want.device)
    flat = want.view(-1, 32)
    for s in slots.tolist():
        page, off = divmod(s, 8)
        untouched[page * 16 + off] = untouched[page * 16 + 8 + off] = False
    assert torch.equal(got.view(-1, 32)[untouched], flat[untouched])
    # the dispatch passes the flag on
    via = table.clone()
    ops.append_kv(via, k, v, slots, rows, silu=True)
    close(via, want, dtype)


@pytest.mark.parametrize(("device", "dtype"), CASES)
def test_gate_kernels_apply_the_silu(device, dtype):
    interpreter_only(device)
    g = torch.Generator().manual_seed(5)
    a = torch.randn(9, 32, generator=g).to(dtype=dtype, device=device)
    u = torch.randn(9, 128, generator=g).mul(3).to(dtype=dtype, device=device)[:, 32:64]
    w, b = (torch.randn(32, generator=g).to(dtype=dtype, device=device) for _ in range(2))
    close(layer_norm.layer_norm_mul(a, w, b, 1e-5, u, silu_u=True), layer_norm.layer_norm_mul(a, w, b, 1e-5, F.silu(u)),
          dtype)
    parts = torch.randn(3, 9, 32, generator=g).to(device)
    offsets = torch.tensor([0, 4, 9], device=device)
    close(layer_norm.sum_layer_norm_mul(parts, offsets, 2, w, b, 1e-5, u, dtype, silu_u=True),
          layer_norm.sum_layer_norm_mul(parts, offsets, 2, w, b, 1e-5, F.silu(u), dtype), dtype)
    # the torch form (no kernel) of the dispatch
    torch.testing.assert_close(norm.layer_norm_mul(a, w, b, 1e-5, u, fused=False, silu_u=True),
                               norm.layer_norm_mul(a, w, b, 1e-5, F.silu(u), fused=False), rtol=0, atol=0)


def test_project_before_its_silu():
    layer = HSTULayer(HSTUConfig(num_heads=2, head_dim=8, embedding_dim=16))
    x = torch.randn(5, 16)
    for got, want in zip(layer.project(x, activate=False), layer.project(x)):
        assert got.shape == want.shape and got.stride() == want.stride()
        # (the CPU's F.silu may round a strided view and a whole tensor one step apart)
        torch.testing.assert_close(F.silu(got), want, rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.parametrize(("dim", "page_size"), [(128, 128), (256, 32)])
@pytest.mark.parametrize("splits", [None, 1])
def test_gpu_attention_with_silu_inputs_has_the_bits_of_activated_inputs(dim, page_size, splits):
    """bf16 on the GPU, with the norm gate, the split rule's count (bs 1: split) and one split: the
    kernels' SiLU gives torch's bits, so the whole result does."""
    _, paged = build([300, 520], [40, 9], [256, 500], page_size, 4, dim, torch.bfloat16, "cuda")
    raw, act, raw_gate, act_gate = raw_and_activated(paged, gate_for(paged["q"]))
    extra = {} if splits is None else {"num_splits": splits}
    got = run(tri, "paged", {**raw, **extra, "silu_inputs": True, "norm_gate": tuple(raw_gate)})
    want = run(tri, "paged", {**act, **extra, "norm_gate": tuple(act_gate)})
    assert torch.equal(got, want)
    assert torch.equal(run(tri, "paged", {**raw, **extra, "silu_inputs": True}), run(tri, "paged", {**act, **extra}))
