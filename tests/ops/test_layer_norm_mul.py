"""The fused ``LayerNorm(a) * u`` kernel against the torch form (interpreter on CPU, the kernel on GPU),
its dispatch, its input checks, and the HSTU layer that uses it."""

import pytest
import torch
import torch.nn.functional as F

from gr_plugin.modules.hstu import HSTUConfig, HSTULayer
from gr_plugin.ops import norm


def inputs(m, n, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(m, n, generator=g) * 3 + 0.5).to(dtype=dtype, device=device)
    # u as the HSTU projection hands it over: a column chunk of a wider row (strided rows)
    u = torch.randn(m, 4 * n, generator=g).to(dtype=dtype, device=device)[:, n : 2 * n]
    w = (torch.randn(n, generator=g) * 0.2 + 1).to(dtype=dtype, device=device)
    b = (torch.randn(n, generator=g) * 0.1).to(dtype=dtype, device=device)
    return a, w, b, u


def torch_form(a, w, b, u, eps=1e-5):
    return F.layer_norm(a, (a.shape[1],), w, b, eps) * u


@pytest.mark.parametrize("n", [512, 1000, 1024])
def test_kernel_equals_the_torch_form_in_the_interpreter(n):
    if torch.cuda.is_available():
        pytest.skip("the interpreter runs where there is no GPU")
    a, w, b, u = inputs(37, n, torch.float32, "cpu")
    got = norm.layer_norm_mul(a, w, b, 1e-5, u, fused=True)
    assert got.shape == (37, n) and got.is_contiguous()
    torch.testing.assert_close(got, torch_form(a, w, b, u), rtol=1e-5, atol=1e-5)
    assert norm.layer_norm_mul(a[:0], w, b, 1e-5, u[:0], fused=True).shape == (0, n)


@pytest.mark.gpu
@pytest.mark.parametrize(("m", "n"), [(3072, 512), (7, 1024), (1, 256)])
def test_kernel_bf16_error_is_at_most_twice_the_torch_forms(m, n):
    a, w, b, u = inputs(m, n, torch.bfloat16, "cuda", seed=m)
    oracle = torch_form(*(t.float() for t in (a, w, b, u)))
    got = norm.layer_norm_mul(a, w, b, 1e-5, u, fused=True)
    plain = torch_form(a, w, b, u)
    assert got.dtype == torch.bfloat16
    err, ref_err = (got.float() - oracle).abs().max().item(), (plain.float() - oracle).abs().max().item()
    assert err <= 2 * ref_err + 1e-6, (err, ref_err)


def test_dispatch_takes_the_torch_form_off_cuda_and_for_autograd():
    a, w, b, u = inputs(4, 8, torch.float32, "cpu")
    assert not norm.use_fused(a, w, b, u)
    w.requires_grad_(True)
    out = norm.layer_norm_mul(a, w, b, 1e-5, u)
    out.sum().backward()
    assert w.grad is not None and w.grad.shape == (8,)


@pytest.mark.gpu
def test_dispatch_on_cuda_fuses_only_without_gradients():
    a, w, b, u = inputs(4, 8, torch.bfloat16, "cuda")
    assert norm.use_fused(a, w, b, u)
    w.requires_grad_(True)
    assert not norm.use_fused(a, w, b, u)
    with torch.no_grad():
        assert norm.use_fused(a, w, b, u)


@pytest.mark.parametrize(("a_shape", "u_shape", "wn", "match"), [
    ((4, 8), (4, 9), 8, r"\(4, 8\) and \(4, 9\)"),
    ((4, 8, 1), (4, 8, 1), 8, r"\[M, N\]"),
    ((4, 8), (4, 8), 7, r"must be \[8\], got \(7,\)"),
])
def test_bad_shapes_are_named(a_shape, u_shape, wn, match):
    with pytest.raises(ValueError, match=match):
        norm.layer_norm_mul(torch.zeros(a_shape), torch.ones(wn), torch.zeros(wn), 1e-5, torch.zeros(u_shape))


def test_mixed_dtypes_are_named():
    with pytest.raises(ValueError, match="torch.float16"):
        norm.layer_norm_mul(torch.zeros(2, 4), torch.ones(4), torch.zeros(4), 1e-5, torch.zeros(2, 4).half())


def test_layer_finish_into_a_buffer_equals_the_plain_form():
    torch.manual_seed(0)
    layer = HSTULayer(HSTUConfig(embedding_dim=16, num_layers=1, num_heads=2, head_dim=4)).eval()
    x = torch.randn(5, 16)
    u, q, k, v = layer.project(x)
    attn = torch.randn(5, 2, 4)
    want = x + layer.output(layer.attn_norm(attn.reshape(5, -1)) * u)
    buf = torch.full_like(x, float("nan"))
    with torch.no_grad():
        got = layer.finish(x, u, attn, out=buf)
    assert got.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(buf, want, rtol=0, atol=0)
    torch.testing.assert_close(layer.finish(x, u, attn), want, rtol=0, atol=0)
