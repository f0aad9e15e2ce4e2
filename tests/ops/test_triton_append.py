"""The Triton append against the reference: bit for bit (interpreter on CPU, the kernel on GPU)."""

import pytest
import torch

from gr_plugin.cache import paged_ops
from gr_plugin.ops.triton.append_kv import append_kv


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize(("heads", "dim", "page"), [(2, 8, 4), (4, 128, 128), (3, 16, 32)])
def test_matches_reference(device, heads, dim, page):
    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("the interpreter runs where there is no GPU")
    g = torch.Generator().manual_seed(heads * dim)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    table = torch.randn(7, 2, page, heads, dim, generator=g).to(dtype=dtype, device=device)
    want = table.clone()
    k = torch.randn(11, heads, dim, generator=g).to(dtype=dtype, device=device)
    v = torch.randn(11, heads, dim, generator=g).to(dtype=dtype, device=device)
    rows = torch.tensor([0, 3, 4, 9, 10], device=device)
    slots = torch.tensor([2, page, page + 1, 5 * page + page - 1, 3], device=device)
    append_kv(table, k, v, slots, rows)
    paged_ops.append_kv(want, k, v, slots, rows)
    assert torch.equal(table, want)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("heads", "dim", "page", "layer"), [(2, 8, 4, None), (4, 128, 128, 1), (3, 16, 32, None)])
def test_silu_append_matches_silu_then_append(device, dtype, heads, dim, page, layer):
    """`silu_append`: the layer's SiLU and the append in one launch compute what ``F.silu`` then
    the reference append compute: on the GPU the same bits (torch's ``expf`` and IEEE division);
    under the interpreter (CPU, which rounds bf16 its own way: not run) within float rounding. The
    projection's columns are [u | v | q | k]; rows of z that are not new tokens are SiLU'd only."""
    from gr_plugin.ops import silu_append as dispatch
    from gr_plugin.ops.triton.append_kv import silu_append

    if device == "cpu" and (torch.cuda.is_available() or dtype == torch.bfloat16):
        pytest.skip("the interpreter runs where there is no GPU, and rounds bf16 differently from torch")
    g = torch.Generator().manual_seed(heads * dim)
    hd = heads * dim
    shape = (7, 2, page, heads, dim) if layer is None else (3, 7, 2, page, heads, dim)
    table = torch.randn(shape, generator=g).to(dtype=dtype, device=device)
    want = table.clone()
    z = (4 * torch.randn(11, 4 * hd, generator=g)).to(dtype=dtype, device=device)
    z[0, :3] = torch.tensor([0.0, -100.0, 100.0])  # SiLU's tails and zero
    rows = torch.tensor([0, 3, 4, 9, 10], device=device)
    slots = torch.tensor([2, page, page + 1, 5 * page + page - 1, 3], device=device)
    s = silu_append(z, table, slots, rows, 3 * hd, hd, layer=layer)
    ref = torch.nn.functional.silu(z)
    kv = [ref[:, c : c + hd].reshape(-1, heads, dim) for c in (3 * hd, hd)]
    paged_ops.append_kv(want if layer is None else want[layer], *kv, slots, rows)
    if device == "cuda":
        assert torch.equal(s, ref) and torch.equal(table, want)
        again = table.clone()
        if layer is None:  # the dispatching entry point takes the kernel on CUDA
            assert torch.equal(dispatch(z, again, slots, rows, 3 * hd, hd), ref) and torch.equal(again, want)
    else:
        tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(s, ref, **tol)
        torch.testing.assert_close(table, want, **tol)
        again = table.clone()
        if layer is None:  # the dispatching entry point: the torch reference off CUDA
            assert torch.equal(dispatch(z, again, slots, rows, 3 * hd, hd), ref)
            torch.testing.assert_close(again, want, **tol)


def test_silu_append_refuses_bad_arguments_and_writes_nothing():
    """Columns past the projection, and rows/slots of different lengths, are refused before any
    page is written."""
    from gr_plugin.ops.triton.append_kv import silu_append

    table = torch.zeros(4, 2, 4, 2, 8)
    z = torch.randn(5, 64)
    slots, rows = torch.tensor([1, 2]), torch.tensor([0, 4])
    with pytest.raises(ValueError, match=r"k_col must be in \[0, 48\] \(z has 64 columns, K/V rows 16\), got 50"):
        silu_append(z, table, slots, rows, 50, 16)
    with pytest.raises(ValueError, match=r"v_col must be in \[0, 48\] .* got -1"):
        silu_append(z, table, slots, rows, 48, -1)
    with pytest.raises(ValueError, match="rows has 1 entries, slots 2"):
        silu_append(z, table, slots, rows[:1], 48, 16)
    assert torch.equal(table, torch.zeros_like(table))
