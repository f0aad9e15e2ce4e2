import torch

from gr_plugin.cache.tiers import aligned_empty


def test_aligned_empty_is_page_aligned_and_writable():
    for dtype, shape in ((torch.bfloat16, (3, 5, 7)), (torch.float32, (1,)), (torch.int16, (4096, 3))):
        t = aligned_empty(shape, dtype)
        assert t.shape == shape and t.dtype == dtype and t.data_ptr() % 4096 == 0 and t.is_contiguous()
        t.fill_(1)
        assert int(t.float().sum()) == t.numel()
