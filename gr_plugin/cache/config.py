"""Configuration of the paged KV cache.

Owns `KVCacheConfig`, the one description of a cache's shape, capacity and identity. It is a plain
dataclass so Hydra can register it as a structured-config schema; validation happens in
`__post_init__` and names the offending value. This module does not build anything.
"""

from __future__ import annotations

import dataclasses
import math

import torch

DTYPES = {  # the dtypes a cache (and a model serving from it) may hold, by name
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


#: the longest cache namespace in utf-8 bytes: a lower tier's page header holds 512, and the tiers
#: file pages under the namespace and ``:<dtype>`` (at most 9 more)
MAX_NAMESPACE_BYTES = 500


def check_namespace(namespace: object, name: str = "namespace") -> None:
    """Raise ValueError naming ``name`` unless ``namespace`` is a non-empty str of at most
    `MAX_NAMESPACE_BYTES` utf-8 bytes."""
    if not isinstance(namespace, str) or not namespace:
        raise ValueError(f"{name} must be a non-empty str, got {namespace!r}")
    size = len(namespace.encode("utf-8"))
    if size > MAX_NAMESPACE_BYTES:
        raise ValueError(f"{name} must be at most {MAX_NAMESPACE_BYTES} utf-8 bytes, got {size}: "
                         f"{namespace[:40]!r}...")


@dataclasses.dataclass
class KVCacheConfig:
    """Shape, capacity and identity of one KV cache.

    The device table holds ``num_pages`` pages; one page stores ``page_size`` tokens of K and V for
    every layer (``[num_layers, num_pages, 2, page_size, num_heads, head_dim]``). The host tier holds
    ``host_cache_bytes`` of pinned memory in slots of the same page shape (0 disables it).
    ``namespace`` salts every identity: a cache built for another model version never matches.
    """

    num_layers: int = 2
    num_heads: int = 2
    head_dim: int = 16
    page_size: int = 32
    num_pages: int = 256
    dtype: str = "float32"
    device: str = "cpu"
    host_cache_bytes: int = 0
    namespace: str = "default"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "head_dim", "page_size", "num_pages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVCacheConfig.{name} must be a positive int, got {value!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"KVCacheConfig.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"KVCacheConfig.device is not a torch device: {self.device!r}") from exc
        hb = self.host_cache_bytes
        if isinstance(hb, bool) or not isinstance(hb, int) or hb < 0:
            raise ValueError(f"KVCacheConfig.host_cache_bytes must be an int >= 0, got {hb!r}")
        check_namespace(self.namespace, "KVCacheConfig.namespace")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def page_numel(self) -> int:
        """Elements of one page in one layer (K and V)."""
        return 2 * self.page_size * self.num_heads * self.head_dim

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all layers: the unit every tier stores and moves."""
        return self.num_layers * self.page_numel * self.torch_dtype.itemsize

    @property
    def num_host_slots(self) -> int:
        return self.host_cache_bytes // self.page_bytes

    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)
