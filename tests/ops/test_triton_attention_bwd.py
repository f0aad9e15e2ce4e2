"""The Triton backward of the full (jagged) HSTU attention against the reference's autograd gradients.

Without a GPU the kernels run in Triton's interpreter (fp32 / fp16 on CPU tensors) against the fp64
reference. On a GPU (marker ``gpu``): bf16/fp16/fp32, head_dim 64/128/256; each gradient's error against
a higher-precision reference must be at most 2x the error of the same-precision torch reference.
"""

import pytest
import torch

from gr_plugin.ops.pytorch import hstu_attention as ref
from gr_plugin.ops.triton import hstu_attention_bwd as bwd

from .launch_spy import spy_launches
from .test_triton_attention import ALPHA, NORM, build, interpreter_only

CASES = [  # history lengths, candidates
    ([37, 0, 90], [3, 2, 1]),  # an empty history (candidates only), a block of history and candidates mixed
    ([64, 17], [1, 40]),  # block edges at the history's end; more candidates than history
    ([0, 50, 5], [0, 1, 0]),  # an empty user, one candidate, no candidates
]
TILES = [None, (16, 32, 4, 1), (32, 16, 4, 1), (16, 16, 4, 1)]


def _inputs(hist, cand, heads, dim, dtype, device, seed=0):
    jag, _ = build(hist, cand, [0] * len(hist), 8, heads, dim, torch.float32, device, seed)
    g = torch.Generator().manual_seed(seed + 100)
    dout = torch.randn(jag["q"].shape, generator=g).to(device)
    return jag, dout


def _reference_grads(jag, dout, dtype):
    leaves = [jag[n].detach().to(dtype).requires_grad_() for n in ("q", "k", "v")]
    out = ref.hstu_attention_jagged(*leaves, jag["seq_offsets"], jag["num_candidates"], alpha=ALPHA, n_norm=NORM,
                                    max_seq_len=jag["max_seq_len"])
    out.backward(dout.to(dtype))
    return [t.grad for t in leaves]


def _assert_within_twice_the_torch_error(got, low, exact):
    """Each gradient's max abs error against ``exact`` at most 2x the same-precision torch reference's
    (``low``), + 1e-6."""
    for name, a, t, e in zip("qkv", got, low, exact):
        err, err_torch = (a.to(e.dtype) - e).abs().max().item(), (t.to(e.dtype) - e).abs().max().item()
        assert err <= 2 * err_torch + 1e-6, (name, err, err_torch)


def _kernel_grads(jag, dout, dtype, tiles=None, fp32_dots=None):
    q, k, v = (jag[n].to(dtype) for n in ("q", "k", "v"))
    return bwd.hstu_attention_jagged_backward(dout.to(dtype), q, k, v, jag["seq_offsets"], jag["num_candidates"],
                                              alpha=ALPHA, n_norm=NORM, max_seq_len=jag["max_seq_len"], tiles=tiles,
                                              fp32_dots=fp32_dots)


@interpreter_only
@pytest.mark.parametrize(("hist", "cand"), CASES)
@pytest.mark.parametrize("tiles", TILES)
def test_interpreter_gradients_match_the_reference(hist, cand, tiles):
    jag, dout = _inputs(hist, cand, 2, 16, torch.float32, "cpu")
    exact = _reference_grads(jag, dout, torch.float64)
    got = _kernel_grads(jag, dout, torch.float32, tiles)
    for name, a, b in zip("qkv", got, exact):
        assert a.dtype == torch.float32 and a.shape == b.shape
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6, msg=f"d{name}")


@interpreter_only
def test_interpreter_fp16_gradients_within_twice_the_torch_reference():
    jag, dout = _inputs([37, 0, 90], [3, 2, 1], 2, 32, torch.float16, "cpu")
    exact = _reference_grads(jag, dout, torch.float64)
    low = _reference_grads(jag, dout, torch.float16)
    _assert_within_twice_the_torch_error(_kernel_grads(jag, dout, torch.float16), low, exact)


@interpreter_only
def test_rows_outside_every_sequence_get_zero_gradients_and_strided_inputs_are_read():
    """q, k, v as views of one projection ``[T, 3, H, D]`` (the layer's split), and two rows past the last
    sequence (a bucket's padding): the sequences' gradients equal the reference's, the padding rows' are 0."""
    jag, dout = _inputs([20, 9], [4, 2], 2, 16, torch.float32, "cpu")
    t = jag["q"].shape[0]
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(t + 2, 3, 2, 16, generator=g)
    qkv[:t] = torch.stack([jag["q"], jag["k"], jag["v"]], 1)
    q, k, v = qkv.unbind(1)
    assert not q.is_contiguous()
    d_pad = torch.cat([dout, torch.randn(2, 2, 16, generator=g)])
    got = bwd.hstu_attention_jagged_backward(d_pad, q, k, v, jag["seq_offsets"], jag["num_candidates"], alpha=ALPHA,
                                             n_norm=NORM, max_seq_len=jag["max_seq_len"])
    exact = _reference_grads(jag, dout, torch.float64)
    for a, b in zip(got, exact):
        torch.testing.assert_close(a[:t].double(), b, rtol=1e-5, atol=1e-6)
        assert torch.equal(a[t:], torch.zeros_like(a[t:]))


@interpreter_only
def test_the_same_bits_every_run():
    jag, dout = _inputs([64, 17], [1, 40], 2, 16, torch.float32, "cpu")
    first, again = _kernel_grads(jag, dout, torch.float32), _kernel_grads(jag, dout, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


@interpreter_only
def test_only_the_gradients_asked_for_are_computed(monkeypatch):
    """Through the autograd function with only q requiring grad: dq equals the reference's, and the dk/dv
    kernel is not launched; a graph of the backward (a second-order gradient) raises instead of leaving
    out the gradients' dependence on q, k, v."""
    jag, dout = _inputs([30, 7], [3, 2], 2, 16, torch.float32, "cpu")
    launched = []
    for name in ("_bwd_dkdv", "_bwd_dq"):
        spy_launches(monkeypatch, bwd, name, lambda grid, kw, _name=name: launched.append(_name))
    q = jag["q"].clone().requires_grad_()
    out = bwd.hstu_attention_jagged(q, jag["k"], jag["v"], jag["seq_offsets"], jag["num_candidates"], alpha=ALPHA,
                                    n_norm=NORM, max_seq_len=jag["max_seq_len"])
    out.backward(dout)
    assert launched == ["_bwd_dq"]
    torch.testing.assert_close(q.grad.double(), _reference_grads(jag, dout, torch.float64)[0], rtol=1e-5, atol=1e-6)
    q2 = jag["q"].clone().requires_grad_()
    out = bwd.hstu_attention_jagged(q2, jag["k"], jag["v"], jag["seq_offsets"], jag["num_candidates"], alpha=ALPHA,
                                    n_norm=NORM, max_seq_len=jag["max_seq_len"])
    with pytest.raises(RuntimeError, match="backward is not differentiable"):
        torch.autograd.grad(out, q2, dout, create_graph=True)


def test_tiles_fit_the_device(monkeypatch):
    """The 128x64 tiles (98-213 KB of shared memory at head_dim 128-256) only where a block may hold about
    200 KB (Hopper: 227 KB); an A100 (163 KB) or an sm86/89 card (99 KB) gets the smaller tiles."""
    from gr_plugin.ops.triton import hstu_attention as fwd

    dev = torch.device("cuda", 0)
    monkeypatch.setattr(fwd, "FP32_DOTS", "tf32x3")  # (the default; GR_PLUGIN_FP32_DOTS may name another)
    for smem, want128, want256 in ((232448, (128, 64, 8, 1), (128, 64, 8, 1)), (166912, (64, 64, 4, 1), (32, 32, 4, 1)),
                                   (101376, (64, 64, 4, 1), (32, 32, 4, 1))):
        monkeypatch.setattr(fwd, "_shared_memory", lambda device, _s=smem: _s)
        assert bwd.blocks(128, torch.bfloat16, dev) == want128
        assert bwd.blocks(256, torch.float16, dev) == want256
        assert bwd.blocks(64, torch.bfloat16, dev) == (64, 64, 4, 1)
        assert bwd.blocks(128, torch.float32, dev) == bwd.blocks(256, torch.float32, dev) == (16, 32, 4, 1)
        assert bwd.blocks(64, torch.float32, dev) == (64, 32, 4, 1)  # (smaller heads, larger tiles: measured)
        assert bwd.blocks(16, torch.float32, dev) == bwd.blocks(32, torch.float32, dev) == (64, 64, 4, 1)
        assert bwd.blocks(32, torch.float32, dev, "ieee") == (32, 32, 4, 1)
        assert bwd.blocks(128, torch.float32, dev, "ieee") == (32, 32, 4, 1)
        assert bwd.blocks(128, torch.bfloat16, dev, "ieee") == want128


def test_bad_shapes_are_refused():
    jag, dout = _inputs([5], [1], 2, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"got \(6, 2, 16\), \(6, 2, 16\), \(5, 2, 16\)"):
        bwd.hstu_attention_jagged_backward(dout, jag["q"], jag["k"][:5], jag["v"], jag["seq_offsets"],
                                           jag["num_candidates"], alpha=ALPHA, n_norm=NORM, max_seq_len=6)
    with pytest.raises(ValueError, match=r"fp32_dots must be one of .* got 'fp64'"):
        bwd.hstu_attention_jagged_backward(dout, jag["q"], jag["k"], jag["v"], jag["seq_offsets"],
                                           jag["num_candidates"], alpha=ALPHA, n_norm=NORM, max_seq_len=6,
                                           fp32_dots="fp64")


@interpreter_only
def test_fp32_dot_precision_reaches_both_kernels(monkeypatch):
    """fp32 gradients run both kernels' dots at the launch's ``fp32_dots`` (default `FP32_DOTS`)."""
    from gr_plugin.ops.triton import hstu_attention as fwd

    monkeypatch.setattr(fwd, "FP32_DOTS", "tf32x3")  # (the default; GR_PLUGIN_FP32_DOTS may name another)
    jag, dout = _inputs([30, 7], [3, 2], 2, 16, torch.float32, "cpu")
    took = []
    for name in ("_bwd_dkdv", "_bwd_dq"):
        spy_launches(monkeypatch, bwd, name, lambda grid, kw: took.append(kw["DOTS"]))
    exact = _reference_grads(jag, dout, torch.float64)
    for given, dots in ((None, "tf32x3"), ("ieee", "ieee")):
        took.clear()
        got = bwd.hstu_attention_jagged_backward(dout, jag["q"], jag["k"], jag["v"], jag["seq_offsets"],
                                                 jag["num_candidates"], alpha=ALPHA, n_norm=NORM,
                                                 max_seq_len=jag["max_seq_len"], fp32_dots=given)
        assert took == [dots, dots]
        for a, e in zip(got, exact):
            torch.testing.assert_close(a.double(), e, rtol=1e-5, atol=1e-6)


@interpreter_only
def test_dispatch_trains_through_the_triton_backward(monkeypatch):
    """``GR_PLUGIN_ATTENTION=triton`` (the interpreter here; ``auto`` on CUDA in bf16/fp16) with q/k/v requiring grad:
    the full form runs the autograd function whose backward is the kernels', gradients equal the
    reference's; the paged form, forward-only, still refuses."""
    from gr_plugin.ops import hstu_attention as dispatch

    jag, paged = build([30, 7], [3, 2], [20, 0], 8, 2, 16, torch.float32, "cpu")
    g = torch.Generator().manual_seed(1)
    dout = torch.randn(jag["q"].shape, generator=g)
    monkeypatch.setenv("GR_PLUGIN_ATTENTION", "triton")
    leaves = [jag[n].clone().requires_grad_() for n in ("q", "k", "v")]
    out = dispatch.hstu_attention_jagged(*leaves, jag["seq_offsets"], jag["num_candidates"], alpha=ALPHA,
                                         n_norm=NORM, max_seq_len=jag["max_seq_len"])
    assert type(out.grad_fn).__name__ == "JaggedAttentionBackward"
    out.backward(dout)
    exact = _reference_grads(jag, dout, torch.float64)
    for leaf, e in zip(leaves, exact):
        torch.testing.assert_close(leaf.grad.double(), e, rtol=1e-5, atol=1e-6)
    p = dict(paged)
    p["q"] = p["q"].clone().requires_grad_()
    pos = [p.pop(n) for n in ("q", "k", "v", "kv_layer", "kv_indices", "kv_indptr", "history_lengths", "q_offsets",
                              "new_lengths")]
    with pytest.raises(ValueError, match="forward-only"):
        dispatch.paged_hstu_attention(*pos, alpha=ALPHA, n_norm=NORM, **p)


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [16, 32, 64, 128, 256])
@pytest.mark.parametrize(("dtype", "fp32_dots"), [(torch.bfloat16, None), (torch.float16, None),
                                                  (torch.float32, "tf32x3"), (torch.float32, "ieee")])
@pytest.mark.parametrize("seed", [0, 1])
def test_gpu_gradient_error_within_twice_the_torch_reference(dim, dtype, fp32_dots, seed):
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator().manual_seed(seed)
    hist = torch.randint(0, 700, (4,), generator=g).tolist()
    cand = torch.randint(1, 70, (4,), generator=g).tolist()
    jag, dout = _inputs(hist, cand, 4, dim, torch.float32, "cuda", seed)
    oracle = torch.float64 if dtype == torch.float32 else torch.float32
    exact = _reference_grads(jag, dout, oracle)
    low = _reference_grads(jag, dout, dtype)
    got = _kernel_grads(jag, dout, dtype, fp32_dots=fp32_dots)
    assert all(a.dtype == dtype and not a.isnan().any() for a in got)
    _assert_within_twice_the_torch_error(got, low, exact)
    again = _kernel_grads(jag, dout, dtype, fp32_dots=fp32_dots)
    assert all(torch.equal(a, b) for a, b in zip(got, again))


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [128, 256])
def test_gpu_small_device_tiles_error_within_twice_the_torch_reference(monkeypatch, dim):
    """The tiles `blocks` picks for a device with less shared memory (an sm86/89 card's 99 KB: 64x64 at
    head_dim 128, 32x32 at 256), run here: bf16 gradients within 2x the torch reference's error, the same
    bits every run."""
    from gr_plugin.ops.triton import hstu_attention as fwd

    monkeypatch.setattr(fwd, "_shared_memory", lambda device: 101376)
    dev = torch.device("cuda", 0)
    tiles = bwd.blocks(dim, torch.bfloat16, dev)
    assert tiles == ((64, 64, 4, 1) if dim == 128 else (32, 32, 4, 1))
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator().manual_seed(dim + 7)
    hist = torch.randint(0, 900, (4,), generator=g).tolist()
    cand = torch.randint(1, 70, (4,), generator=g).tolist()
    jag, dout = _inputs(hist, cand, 4, dim, torch.float32, "cuda", dim)
    exact = _reference_grads(jag, dout, torch.float32)
    low = _reference_grads(jag, dout, torch.bfloat16)
    got = _kernel_grads(jag, dout, torch.bfloat16)
    _assert_within_twice_the_torch_error(got, low, exact)
    assert all(torch.equal(a, b) for a, b in zip(got, _kernel_grads(jag, dout, torch.bfloat16)))


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "dim"), [*((d, h) for d in (torch.bfloat16, torch.float16) for h in (64, 128, 256)),
                                            *((torch.float32, h) for h in (16, 32, 64, 128))])
def test_gpu_training_path_error_within_twice_the_torch_reference(monkeypatch, dtype, dim):
    """What ``auto`` trains through (the dispatcher: the Triton forward, its fast SiLU included, and the
    autograd function's backward) in bf16/fp16, and in fp32 (tf32x3 dots) up to head_dim 128: each
    gradient's error against the fp32 reference (fp64 for fp32) at most 2x the same-precision torch
    reference's."""
    from gr_plugin.ops import hstu_attention as dispatch
    from gr_plugin.ops.triton import hstu_attention as fwd

    monkeypatch.setattr(fwd, "FP32_DOTS", "tf32x3")  # (the default; GR_PLUGIN_FP32_DOTS may name another)
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator().manual_seed(dim)
    hist = torch.randint(0, 1200, (4,), generator=g).tolist()
    cand = torch.randint(1, 70, (4,), generator=g).tolist()
    jag, dout = _inputs(hist, cand, 4, dim, torch.float32, "cuda", dim)
    exact = _reference_grads(jag, dout, torch.float64 if dtype == torch.float32 else torch.float32)
    low = _reference_grads(jag, dout, dtype)
    leaves = [jag[n].to(dtype).requires_grad_() for n in ("q", "k", "v")]
    out = dispatch.hstu_attention_jagged(*leaves, jag["seq_offsets"], jag["num_candidates"], alpha=ALPHA,
                                         n_norm=NORM, max_seq_len=jag["max_seq_len"])
    assert type(out.grad_fn).__name__ == "JaggedAttentionBackward"
    out.backward(dout.to(dtype))
    for name, leaf, t, e in zip("qkv", leaves, low, exact):
        err, err_torch = (leaf.grad.float() - e).abs().max().item(), (t.float() - e).abs().max().item()
        assert err <= 2 * err_torch + 1e-6, (name, err, err_torch)


@pytest.mark.gpu
def test_gpu_layer_stack_training_step_equals_the_reference(monkeypatch):
    """A training step of a 2-layer stack (fp32, dropout off): the parameters' gradients with the Triton
    attention and its backward (``triton``; ``auto`` takes it in bf16/fp16) equal those with the reference's."""
    from gr_plugin.bench.block import _Layout, _offsets
    from gr_plugin.modules.hstu import HSTUConfig, HSTULayer, full_stack

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    cfg = HSTUConfig(embedding_dim=64, num_layers=2, num_heads=2, head_dim=32, n_norm=256.0, dropout=0.0)
    stack = [HSTULayer(cfg, device=torch.device("cuda")).train() for _ in range(2)]
    lens, cands = [200, 37, 90], [20, 1, 9]
    layout = _Layout(_offsets(lens), torch.tensor(cands, device="cuda"), max(lens))
    x = torch.randn(sum(lens), 64, device="cuda")
    grads = {}
    for mode in ("reference", "triton"):
        monkeypatch.setenv("GR_PLUGIN_ATTENTION", mode)
        for layer in stack:
            layer.zero_grad(set_to_none=True)
        full_stack(stack, x, layout).square().mean().backward()
        grads[mode] = [p.grad.clone() for layer in stack for p in layer.parameters()]
    assert len(grads["triton"]) > 0
    for a, b in zip(grads["triton"], grads["reference"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
