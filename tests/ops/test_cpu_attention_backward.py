"""The C++ backward of the jagged HSTU attention (``gr_kv::hstu_attention_jagged_backward``) and the autograd
function CPU training runs (`gr_plugin.ops.cpu_attention`), against the reference's autograd gradients."""

import pytest
import torch

from gr_plugin.ops import cpu_attention, library
from gr_plugin.ops.pytorch import hstu_attention as ref

from .test_triton_attention import build

OPS = torch.ops.gr_kv
assert library.LIBRARY_PATH  # (the import loads the gr_kv ops)
ALPHA, NORM = 0.35, 16.0
CASES = [  # history lengths, candidates
    ([37, 0, 90], [3, 2, 1]),  # an empty history (candidates only)
    ([64, 17], [1, 40]),  # more candidates than history
    ([0, 50, 5], [0, 1, 0]),  # an empty user, one candidate, no candidates
    ([300, 5, 0, 17, 9], [4, 1, 2, 3, 1]),  # one long user (cut by heads on several threads)
]


def _inputs(hist, cand, heads, dim, seed=0):
    jag, _ = build(hist, cand, [0] * len(hist), 8, heads, dim, torch.float64, "cpu", seed)
    dout = torch.randn(jag["q"].shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    return jag, dout


def _reference_grads(jag, dout, dtype=torch.float64):
    leaves = [jag[n].detach().to(dtype).requires_grad_() for n in ("q", "k", "v")]
    out = ref.hstu_attention_jagged(*leaves, jag["seq_offsets"], jag["num_candidates"], alpha=ALPHA, n_norm=NORM,
                                    max_seq_len=jag["max_seq_len"])
    out.backward(dout.to(dtype))
    return [t.grad for t in leaves]


def _op_grads(jag, dout, dtype):
    q, k, v = (jag[n].to(dtype) for n in ("q", "k", "v"))
    return OPS.hstu_attention_jagged_backward(dout.to(dtype), q, k, v, jag["seq_offsets"], jag["num_candidates"],
                                              ALPHA, NORM)


@pytest.mark.parametrize(("hist", "cand"), CASES)
@pytest.mark.parametrize(("threads", "heads"), [(1, 2), (2, 1), (2, 4), (3, 3)])
def test_backward_equals_the_reference_at_any_thread_and_head_count(hist, cand, threads, heads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        jag, dout = _inputs(hist, cand, heads, 16, seed=heads)
        exact = _reference_grads(jag, dout)
        got = _op_grads(jag, dout, torch.float64)
        for name, a, b in zip("qkv", got, exact):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=f"d{name}")
        got32 = _op_grads(jag, dout, torch.float32)
        for a, b in zip(got32, exact):
            assert a.dtype == torch.float32
            torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)
        assert all(torch.equal(a, b) for a, b in zip(_op_grads(jag, dout, torch.float32), got32))
    finally:
        torch.set_num_threads(before)


def test_bf16_gradients_within_twice_the_torch_reference():
    """bf16 in, fp32 inside (the op-math dtype), bf16 out: no worse than the reference's bf16 autograd."""
    jag, dout = _inputs([37, 0, 90], [3, 2, 1], 2, 32)
    low_in = {**jag, **{n: jag[n].to(torch.bfloat16).double() for n in ("q", "k", "v")}}
    exact = _reference_grads(low_in, dout.to(torch.bfloat16).double())  # the same rounded inputs, in fp64
    torch_low = _reference_grads(jag, dout, torch.bfloat16)
    got = _op_grads(jag, dout, torch.bfloat16)
    for name, a, t, e in zip("qkv", got, torch_low, exact):
        assert a.dtype == torch.bfloat16
        err, err_torch = (a.double() - e).abs().max().item(), (t.double() - e).abs().max().item()
        assert err <= 2 * err_torch, (name, err, err_torch)


def test_strided_inputs_and_an_expanded_grad():
    """q, k, v as chunks of one projection (the layer's views) and ``dout`` of a ``sum()`` (stride 0)."""
    jag, _ = _inputs([20, 9], [4, 2], 2, 16)
    t = jag["q"].shape[0]
    qkv = torch.cat([jag["q"], jag["k"], jag["v"]], dim=-1)  # [T, H, 3D]
    q, k, v = qkv.split(16, dim=-1)
    assert not q.is_contiguous()
    dout = torch.ones(1, 1, 1, dtype=torch.float64).expand(t, 2, 16)
    got = OPS.hstu_attention_jagged_backward(dout, q, k, v, jag["seq_offsets"], jag["num_candidates"], ALPHA, NORM)
    for a, b in zip(got, _reference_grads(jag, dout)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda a: a.update(grad_out=a["grad_out"][:-1]), r"grad_out must be q's shape, dtype and device, got \(5,"),
        (lambda a: a.update(grad_out=a["grad_out"].float()), "torch.float32"),
        (lambda a: a.update(num_candidates=torch.tensor([7])), r"num_candidates\[0\] = 7 is outside \[0, 6\]"),
        (lambda a: a.update(seq_offsets=torch.tensor([0, 5])), r"seq_offsets\[-1\] = 5 but q has 6 rows"),
        (lambda a: a.update(k=a["k"].float()), "share a dtype"),
    ],
)
def test_bad_inputs_are_refused_naming_the_value(mutate, match):
    jag, dout = _inputs([5], [1], 2, 16)
    a = {"grad_out": dout, "q": jag["q"], "k": jag["k"], "v": jag["v"], "seq_offsets": jag["seq_offsets"],
         "num_candidates": jag["num_candidates"]}
    mutate(a)
    with pytest.raises(ValueError, match=match):
        OPS.hstu_attention_jagged_backward(*a.values(), ALPHA, NORM)


def test_autograd_function_trains_q_alone_and_refuses_a_graph_of_itself():
    jag, dout = _inputs([30, 7], [3, 2], 2, 16)
    q = jag["q"].clone().requires_grad_()
    out = cpu_attention.hstu_attention_jagged(q, jag["k"], jag["v"], jag["seq_offsets"], jag["num_candidates"],
                                              alpha=ALPHA, n_norm=NORM)
    torch.testing.assert_close(out, ref.hstu_attention_jagged(jag["q"], jag["k"], jag["v"], jag["seq_offsets"],
                                                              jag["num_candidates"], alpha=ALPHA, n_norm=NORM,
                                                              max_seq_len=jag["max_seq_len"]), rtol=0, atol=1e-12)
    out.backward(dout)
    torch.testing.assert_close(q.grad, _reference_grads(jag, dout)[0], rtol=1e-10, atol=1e-12)
    q2 = jag["q"].clone().requires_grad_()
    out = cpu_attention.hstu_attention_jagged(q2, jag["k"], jag["v"], jag["seq_offsets"], jag["num_candidates"],
                                              alpha=ALPHA, n_norm=NORM)
    with pytest.raises(RuntimeError, match="backward is not differentiable"):
        torch.autograd.grad(out, q2, dout, create_graph=True)


def test_backward_op_passes_opcheck():
    jag, dout = _inputs([37, 0, 9], [3, 2, 1], 2, 16)
    args = (dout.float(), *(jag[n].float() for n in ("q", "k", "v")), jag["seq_offsets"], jag["num_candidates"],
            ALPHA, NORM)
    torch.library.opcheck(OPS.hstu_attention_jagged_backward, args)


@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_autocast_changes_nothing(threads):
    """Under a caller's bf16 autocast (Lightning's ``bf16-mixed`` on the CPU) the kernels still compute in
    fp32 on every thread: the same bits as without it, forward and backward, whichever thread runs a piece."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        jag, dout = _inputs([300, 5, 0, 17, 9], [4, 1, 2, 3, 1], 2, 16)
        args = [jag[n].float() for n in ("q", "k", "v")] + [jag["seq_offsets"], jag["num_candidates"]]
        plain = OPS.hstu_attention_jagged(*args, ALPHA, NORM), _op_grads(jag, dout, torch.float32)
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out, grads = OPS.hstu_attention_jagged(*args, ALPHA, NORM), _op_grads(jag, dout, torch.float32)
            assert out.dtype == torch.float32 and torch.equal(out, plain[0])
            assert all(torch.equal(a, b) for a, b in zip(grads, plain[1]))
    finally:
        torch.set_num_threads(before)
