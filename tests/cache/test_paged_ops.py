import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gr_plugin.cache import paged_ops


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 11), min_size=1, max_size=4), st.integers(1, 4), st.integers(0, 2**16))
def test_append_then_gather_round_trip(lengths, page_size, seed):
    g = torch.Generator().manual_seed(seed)
    H, D = 2, 3
    num_pages = sum(-(-n // page_size) for n in lengths) + 3
    table = paged_ops.new_kv_table(1, num_pages, page_size, H, D, dtype=torch.float32, device="cpu")
    perm = torch.randperm(num_pages, generator=g).tolist()
    indices, indptr = [], [0]
    for n in lengths:
        k = -(-n // page_size)
        indices += perm[:k]
        perm = perm[k:]
        indptr.append(len(indices))
    lengths_t = torch.tensor(lengths)
    offsets = torch.tensor([0, *torch.cumsum(lengths_t, 0).tolist()])
    kv_indices, kv_indptr = torch.tensor(indices, dtype=torch.int64), torch.tensor(indptr)
    slots = paged_ops.sequence_slots(kv_indices, kv_indptr, lengths_t, offsets, page_size, sum(lengths))
    # independent expectation: walk pages in order
    want = []
    for b, n in enumerate(lengths):
        for t in range(n):
            want.append(indices[indptr[b] + t // page_size] * page_size + t % page_size)
    assert slots.tolist() == want
    k = torch.randn(sum(lengths), H, D, generator=g)
    v = torch.randn(sum(lengths), H, D, generator=g)
    paged_ops.append_kv(table[0], k, v, slots)
    k2, v2 = paged_ops.gather_kv(table[0], slots)
    assert torch.equal(k2, k) and torch.equal(v2, v)
    for i, s in enumerate(want):  # K lands in [page, 0, offset], V in [page, 1, offset]
        assert torch.equal(table[0, s // page_size, 0, s % page_size], k[i])
        assert torch.equal(table[0, s // page_size, 1, s % page_size], v[i])


def test_copy_pages_moves_one_layer_only():
    src = torch.randn(2, 5, 2, 2, 1, 1)
    dst = torch.zeros_like(src)
    paged_ops.copy_pages(src, torch.tensor([4, 0]), dst, torch.tensor([1, 3]), layer=1)
    assert torch.equal(dst[1, 1], src[1, 4]) and torch.equal(dst[1, 3], src[1, 0])
    assert dst[0].abs().sum() == 0 and dst[1, 0].abs().sum() == 0


def test_raw_copies_need_a_cuda_runtime_and_whole_page_runs():
    """`gr_plugin.cache.cudart` on a machine without CUDA: no runtime, no raw copier (the transfer
    engine then copies with ``Tensor.copy_``); the page layout a raw copy needs is read from strides."""
    from gr_plugin.cache import cudart

    table = torch.zeros(3, 5, 2, 4, 2, 8)
    base, layer_bytes, page_bytes = cudart.page_layout(table)
    assert (base, layer_bytes, page_bytes) == (table.data_ptr(), 5 * 128 * 4, 128 * 4)
    assert cudart.page_layout(table.transpose(1, 2)) is None  # pages not contiguous
    assert cudart.page_layout(torch.zeros(3, 0, 2, 4, 2, 8)) is None
    # layers a layer's stride apart that do not hold its pages (they would overlap): no raw layout
    overlapping = table.view(-1)[: 7 * 128].as_strided((3, 5, 2, 4, 2, 8), (128, 128, 64, 16, 8, 1))
    assert cudart.page_layout(overlapping) is None
    assert cudart.page_layout(table[:1].expand(3, -1, -1, -1, -1, -1)) is None  # every layer the same memory
    one_layer = table[:1].as_strided((1, 5, 2, 4, 2, 8), (1, 128, 64, 16, 8, 1))  # (a lone layer's stride is moot)
    assert cudart.page_layout(one_layer) == (table.data_ptr(), 4, 128 * 4)
    if not torch.cuda.is_available():
        assert cudart.runtime() is None and cudart.raw_copier(table, table) is None
