"""Identity of cached tokens: prefix hashes over a user's history.

Owns the hash function and the zero-copy byte view of token rows. A page's identity is the hash of
*every* token from the start of the history to the end of that page, seeded by the namespace:
``page_hash(i) = XXH3-128(tokens[0 : (i + 1) * page_size], seed=namespace_seed)``. That is the chain
``h_i = H(h_{i-1}, page i)`` of the design written so that any prefix can be checked with one call:
a request matches a cached prefix of ``k`` pages iff its hash at page ``k - 1`` equals the stored one,
and because each hash commits to all earlier tokens, a match at ``k`` implies a match below ``k``
(so the longest match is found by bisection). The streaming hasher produces the same digests, so
consecutive page hashes cost only the new bytes.

Token rows are int64 ``[N]`` or ``[N, F]`` (F features per token, e.g. item id, action, timestamp):
all of them go into the hash, so a history that differs in any feature never matches.
The C++ core (``gr_plugin/csrc/core``) computes the same digests through the system's libxxhash;
digests cross that boundary as int64 ``[n, 2]`` (low, high) tensors (`to_pairs` / `from_pairs`).
K/V also depend on the weights that computed them: `weights_namespace` salts a namespace with a
fingerprint of the model's weights and config (`weights_fingerprint`), so a cache shared across
processes (SSD, Redis) never serves one model's K/V to another.
This module does not decide what is cached.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
from collections.abc import Mapping
from typing import Any

import torch
import xxhash

_U64 = (1 << 64) - 1


def as_int64(value: int) -> int:
    """A uint64 (a seed, half a digest) as the int64 with the same bits (what C++ receives)."""
    return value - (1 << 64) if value >> 63 else value


def to_pairs(digests: list[int]) -> torch.Tensor:
    """128-bit digests as int64 ``[n, 2]`` (low, high) with the same bits."""
    flat = []
    for d in digests:
        flat.append(as_int64(d & _U64))
        flat.append(as_int64(d >> 64))
    return torch.tensor(flat, dtype=torch.int64).view(-1, 2)


def from_pairs(pairs: torch.Tensor) -> list[int]:
    """Inverse of `to_pairs`."""
    flat = pairs.view(-1).tolist()
    return [((flat[i + 1] & _U64) << 64) | (flat[i] & _U64) for i in range(0, len(flat), 2)]


def page_digests(tokens: torch.Tensor, start: int, length: int, page_size: int, seed: int) -> list[int]:
    """Prefix hash at each full page of ``tokens[start : start + length]`` (one streaming pass)."""
    h = StreamHasher(seed)
    out = []
    for i in range(length // page_size):
        h.update(tokens, start + i * page_size, start + (i + 1) * page_size)
        out.append(h.digest())
    return out


def namespace_seed(namespace: str) -> int:
    """64-bit seed derived from a namespace (model/version salt)."""
    return xxhash.xxh3_64_intdigest(namespace.encode("utf-8"))


def weights_fingerprint(state: Mapping[str, Any], config: Mapping[str, Any] | None = None) -> str:
    """16 hex digits of a sha256 over ``config`` (JSON, keys sorted) and every entry of ``state``
    (a ``state_dict``: name, dtype, shape and bytes of each tensor, in name order): equal weights
    give equal fingerprints in any process, on any device."""
    h = hashlib.sha256(json.dumps(dict(config or {}), sort_keys=True, default=str).encode())
    for name in sorted(state):
        value = state[name]
        if isinstance(value, torch.Tensor):
            t = value.detach().to("cpu").contiguous()
            h.update(f"\0{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy())
        else:
            h.update(f"\0{name}\0{value!r}\0".encode())
    return h.hexdigest()[:16]


def module_namespace(salt: str, module: torch.nn.Module, config: Mapping[str, Any] | None = None) -> str:
    """`weights_namespace` of ``module``'s ``state_dict`` and ``config``: the namespace its K/V go under."""
    return weights_namespace(salt, weights_fingerprint(module.state_dict(), config))


def weights_namespace(salt: str, fingerprint: str) -> str:
    """The namespace of K/V computed by the weights with ``fingerprint``: the user's ``salt``
    (e.g. ``kvcache.namespace``), then ``:w`` and the fingerprint (a ``salt`` that already ends so
    is returned as is)."""
    suffix = f":w{fingerprint}"
    return salt if salt.endswith(suffix) else salt + suffix


def row_bytes(tokens: torch.Tensor) -> int:
    """Bytes of one token row of ``tokens`` (``[N]`` or ``[N, F]``, int64, contiguous)."""
    return tokens.element_size() * (tokens.shape[1] if tokens.dim() == 2 else 1)


def token_view(tokens: torch.Tensor, start: int, stop: int) -> ctypes.Array:
    """Zero-copy byte view of rows ``[start, stop)`` of a contiguous CPU tensor.

    The caller keeps ``tokens`` alive while the view is used.
    """
    rb = row_bytes(tokens)
    n = (stop - start) * rb
    return (ctypes.c_char * n).from_address(tokens.data_ptr() + start * rb)


def prefix_hash(tokens: torch.Tensor, start: int, num_tokens: int, seed: int) -> int:
    """Hash of ``num_tokens`` rows of ``tokens`` beginning at row ``start``."""
    return xxhash.xxh3_128_intdigest(token_view(tokens, start, start + num_tokens), seed=seed)


class StreamHasher:
    """Streaming prefix hash positioned at a page boundary; ``digest()`` equals ``prefix_hash``."""

    __slots__ = ("_h", "num_tokens")

    def __init__(self, seed: int) -> None:
        self._h = xxhash.xxh3_128(seed=seed)
        self.num_tokens = 0

    def update(self, tokens: torch.Tensor, start: int, stop: int) -> None:
        self._h.update(token_view(tokens, start, stop))
        self.num_tokens += stop - start

    def digest(self) -> int:
        return self._h.intdigest()

    def digest_with(self, tokens: torch.Tensor, start: int, stop: int) -> int:
        """Digest as if rows ``[start, stop)`` were appended, without moving this hasher."""
        h = self._h.copy()
        h.update(token_view(tokens, start, stop))
        return h.intdigest()


def longest_matching_prefix(
    stored: list[int], tokens: torch.Tensor, start: int, length: int, page_size: int, seed: int
) -> int:
    """Number of leading pages of ``stored`` (prefix hashes) that the history matches.

    The history is ``tokens[start : start + length]``. One hash call when everything matches,
    ``O(log pages)`` calls otherwise (prefix hashes make "matches at k" monotone in k).
    """
    hi = min(len(stored), length // page_size)
    if hi == 0:
        return 0
    if prefix_hash(tokens, start, hi * page_size, seed) == stored[hi - 1]:
        return hi
    lo = 0  # invariant: pages [0, lo) match, page hi does not
    hi -= 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if prefix_hash(tokens, start, mid * page_size, seed) == stored[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo
