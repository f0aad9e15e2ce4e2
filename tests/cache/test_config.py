import pytest
import torch

from gr_plugin.cache import KVCacheConfig


def test_defaults_and_derived_sizes():
    cfg = KVCacheConfig(num_layers=3, num_heads=2, head_dim=8, page_size=16, num_pages=10,
                        dtype="bfloat16", host_cache_bytes=10_000_000)
    assert cfg.torch_dtype == torch.bfloat16
    assert cfg.page_numel == 2 * 16 * 2 * 8
    assert cfg.page_bytes == 3 * cfg.page_numel * 2
    assert cfg.num_host_slots == 10_000_000 // cfg.page_bytes
    assert cfg.pages_for(0) == 0 and cfg.pages_for(16) == 1 and cfg.pages_for(17) == 2


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_layers", 0), ("num_heads", -1), ("head_dim", 2.5), ("page_size", True), ("num_pages", "8"),
     ("dtype", "float64"), ("device", "gpu7"), ("host_cache_bytes", -1), ("namespace", "")],
)
def test_bad_values_are_named(field, value):
    with pytest.raises(ValueError, match=field) as err:
        KVCacheConfig(**{field: value})
    assert repr(value) in str(err.value) or str(value) in str(err.value)
