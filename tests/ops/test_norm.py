"""The fused norm kernels (``LayerNorm(a) * u``; the residual add with the next layer's input norm)
against their torch forms (interpreter on CPU, the kernels on GPU), their dispatch, their input
checks, and the HSTU layer and model that use them."""

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


def test_mixed_dtypes_take_the_promoting_torch_form_and_devices_must_match():
    """An fp32 residual stream and bf16 matmul outputs (autocast) promote as torch does."""
    a, w, b, u = inputs(3, 8, torch.float32, "cpu")
    got = norm.layer_norm_mul(a, w, b, 1e-5, u.bfloat16(), fused=True)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch_form(a, w, b, u.bfloat16()), rtol=0, atol=0)
    y, z = norm.add_layer_norm(a, u.bfloat16(), w, b, 1e-5, fused=True)
    assert y.dtype == z.dtype == torch.float32
    torch.testing.assert_close(y, a + u.bfloat16(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="u is on meta, a is on cpu"):
        norm.layer_norm_mul(a, w, b, 1e-5, torch.zeros(3, 8, device="meta"))


def test_layer_finish_into_a_buffer_equals_the_plain_form():
    torch.manual_seed(0)
    layer = HSTULayer(HSTUConfig(embedding_dim=16, num_layers=1, num_heads=2, head_dim=4)).eval()
    x = torch.randn(5, 16)
    u = layer.project(x)[0]
    attn = torch.randn(5, 2, 4)
    want = x + layer.output(layer.attn_norm(attn.reshape(5, -1)) * u)
    buf = torch.full_like(x, float("nan"))
    with torch.no_grad():
        got = layer.finish(x, u, attn, out=buf)
    assert got.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(buf, want, rtol=0, atol=0)
    torch.testing.assert_close(layer.finish(x, u, attn), want, rtol=0, atol=0)


def add_norm_torch_form(x, o, w, b, eps=1e-5):
    y = x + o
    return y, F.layer_norm(y, (y.shape[1],), w, b, eps)


@pytest.mark.parametrize("n", [512, 1000, 1024])
def test_add_norm_kernel_equals_the_torch_form_in_the_interpreter(n):
    if torch.cuda.is_available():
        pytest.skip("the interpreter runs where there is no GPU")
    x, w, b, o = inputs(29, n, torch.float32, "cpu", seed=n)
    out, normed_out = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    y, z = norm.add_layer_norm(x, o, w, b, 1e-5, out=out, normed_out=normed_out, fused=True)
    assert y.data_ptr() == out.data_ptr() and z.data_ptr() == normed_out.data_ptr()
    want_y, want_z = add_norm_torch_form(x, o, w, b)
    torch.testing.assert_close(y, want_y, rtol=0, atol=0)
    torch.testing.assert_close(z, want_z, rtol=1e-5, atol=1e-5)
    y, z = norm.add_layer_norm(x, o, w, b, 1e-5, fused=True)  # fresh outputs
    torch.testing.assert_close(z, want_z, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize(("m", "n"), [(3072, 1024), (5, 1000)])
def test_add_norm_kernel_bf16_rounds_the_stream_as_torch_and_errs_at_most_twice(m, n):
    x, w, b, o = inputs(m, n, torch.bfloat16, "cuda", seed=m)
    y, z = norm.add_layer_norm(x, o, w, b, 1e-5, fused=True)
    plain_y, plain_z = add_norm_torch_form(x, o, w, b)
    assert torch.equal(y, plain_y)  # the residual stream is torch's add, bit for bit
    oracle = F.layer_norm(plain_y.float(), (n,), w.float(), b.float(), 1e-5)
    err, ref_err = (z.float() - oracle).abs().max().item(), (plain_z.float() - oracle).abs().max().item()
    assert err <= 2 * ref_err + 1e-6, (err, ref_err)


def test_add_norm_checks_its_buffers():
    x = torch.zeros(3, 4)
    with pytest.raises(ValueError, match=r"x and o must be \[M, N\] of one shape, got \(3, 4\) and \(3, 5\)"):
        norm.add_layer_norm(x, torch.zeros(3, 5), torch.ones(4), torch.zeros(4), 1e-5)
    with pytest.raises(ValueError, match=r"normed_out must be \(3, 4\) torch\.float32"):
        norm.add_layer_norm(x, x, torch.ones(4), torch.zeros(4), 1e-5, normed_out=torch.zeros(3, 4).half())


def test_finish_and_norm_hands_the_next_layer_its_input_norm():
    torch.manual_seed(0)
    cfg = HSTUConfig(embedding_dim=16, num_layers=2, num_heads=2, head_dim=4)
    first, second = (HSTULayer(cfg).eval() for _ in range(2))
    x, attn = torch.randn(5, 16), torch.randn(5, 2, 4)
    u = first.project(x)[0]
    with torch.no_grad():
        y, normed = first.finish_and_norm(x, u, attn, second)
        torch.testing.assert_close(y, first.finish(x, u, attn), rtol=0, atol=0)
        torch.testing.assert_close(normed, second.input_norm(y), rtol=0, atol=0)
        for got, want in zip(second.project(y, normed), second.project(y)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        last_y, none = second.finish_and_norm(y, u, attn, None)
    assert none is None
    torch.testing.assert_close(last_y, second.finish(y, u, attn), rtol=0, atol=0)


@pytest.mark.gpu
def test_model_on_gpu_fused_norms_equal_the_torch_forms_within_the_2x_rule(monkeypatch):
    """The whole tiny model in bf16 on the GPU, fused norms vs the torch forms, both against fp32."""
    from tests.modules.helpers import User, make_inputs, tiny_model

    model = tiny_model(0, head_dim=16).cuda().eval()
    g = torch.Generator().manual_seed(3)
    users = [User(u, g) for u in range(3)]
    for n, user in zip((40, 7, 30), users):
        user.grow(n)
    history, candidates, _, _ = make_inputs(users, [user.candidates(5) for user in users])
    history, candidates = history.to("cuda"), candidates.to("cuda")
    with torch.no_grad():
        monkeypatch.setenv("GR_PLUGIN_FUSED_NORM", "0")
        oracle = model(history, candidates).float()  # fp32, torch forms
        model = model.to(torch.bfloat16)
        plain = model(history, candidates).float()
        monkeypatch.setenv("GR_PLUGIN_FUSED_NORM", "1")
        assert norm.use_fused(torch.zeros(1, 1, device="cuda"))
        fused = model(history, candidates).float()
    err, ref_err = (fused - oracle).abs().max().item(), (plain - oracle).abs().max().item()
    assert err <= 2 * ref_err + 1e-6, (err, ref_err)


def _users_and_candidates(seed=5):
    from tests.modules.helpers import User

    g = torch.Generator().manual_seed(seed)
    users = [User(u, g) for u in range(3)]
    for n, user in zip((12, 3, 20), users):
        user.grow(n)
    return users, [user.candidates(4) for user in users]


def test_model_with_the_kernels_forced_equals_the_torch_forms_full_and_cached(monkeypatch):
    """The model's loops with the norm kernels (interpreter on CPU, fp32): the full pass equals the
    torch forms, and the cached pass (second visit, history from pages) equals the full pass."""
    if torch.cuda.is_available():
        pytest.skip("the interpreter runs where there is no GPU")
    from tests.modules.helpers import cached_scores, full_scores, tiny_cache, tiny_model

    model = tiny_model(0).eval()
    users, cands = _users_and_candidates()
    plain = full_scores(model, users, cands)
    calls = []
    monkeypatch.setattr(norm, "use_fused", lambda *a: calls.append(1) or True)
    fused = full_scores(model, users, cands)
    assert calls, "the kernels were not used"
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    cache = tiny_cache(model)
    cached_scores(model, cache, users, cands)
    for user in users:
        user.grow(3)
    cands = [user.candidates(4) for user in users]
    got, plan = cached_scores(model, cache, users, cands)
    assert sum(plan.cached_lengths) > 0
    torch.testing.assert_close(got, full_scores(model, users, cands), rtol=1e-5, atol=1e-5)


def test_model_runs_under_autocast_as_lightning_bf16_mixed_does():
    """``precision: bf16-mixed``: an fp32 residual stream meets bf16 matmul outputs; the forward
    promotes as torch does, is close to fp32, and trains (gradients reach every layer)."""
    from tests.modules.helpers import full_scores, make_inputs, tiny_model

    model = tiny_model(0)
    users, cands = _users_and_candidates()
    want = full_scores(model, users, cands)
    history, candidates, _, _ = make_inputs(users, cands)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = model(history, candidates)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.05)
    got.float().sum().backward()
    assert all(layer.uvqk.weight.grad is not None for layer in model.layers)
