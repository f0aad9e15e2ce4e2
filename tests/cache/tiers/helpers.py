"""Helpers of the tier tests: small random pages and keys with chained hashes."""

from __future__ import annotations

import torch
import xxhash

from gr_plugin.cache.tiers import PageKey

#: [num_layers, 2, page_size, num_heads, head_dim]: 1024 bytes in fp32
PAGE_SHAPE = (2, 2, 4, 2, 8)
#: 4096 bytes in fp32: O_DIRECT can read these in place
ALIGNED_PAGE_SHAPE = (2, 2, 16, 2, 8)


def page_bytes(shape: tuple[int, ...] = PAGE_SHAPE, dtype: torch.dtype = torch.float32) -> int:
    return torch.empty(shape, dtype=dtype).nbytes


def random_pages(n: int, shape: tuple[int, ...] = PAGE_SHAPE, dtype: torch.dtype = torch.float32,
                 seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *shape), generator=g).to(dtype)


def page_hash(user: int, index: int, version: int = 0) -> int:
    """A stand-in prefix hash: depends on the user, the page and everything before it (``version``)."""
    return xxhash.xxh3_128_intdigest(f"{user}/{index}/{version}".encode())


def user_keys(user: int, num_pages: int, *, first: int = 0, namespace: str = "ns", version: int = 0) -> list[PageKey]:
    return [PageKey(namespace, user, i, page_hash(user, i, version)) for i in range(first, num_pages)]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte-exact equality (NaN-safe, any dtype)."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
