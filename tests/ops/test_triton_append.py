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
