"""The request a cache step is about, validated at the boundary.

Owns `CacheRequest`: a batch of users, the length of each user's full history and the token rows
that identify it. Every check that can fail on user input happens here, before any cache state is
touched, and raises `ValueError` naming the bad value. It does not look anything up.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import torch

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _as_int_list(name: str, value: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise ValueError(
                f"{name} must be a CPU tensor or a list (no device sync), got device {value.device}"
            )
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise ValueError(f"{name} must hold integers, got dtype {value.dtype}")
        if value.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(value.shape)}")
        return value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{name} must be a sequence of ints or a 1-D tensor, got {type(value).__name__}")
    out = []
    for x in value:
        if isinstance(x, bool) or not isinstance(x, int):
            raise ValueError(f"{name} must hold ints, got {x!r}")
        out.append(x)
    return out


@dataclasses.dataclass(init=False)
class CacheRequest:
    """A batch of ``B`` users and their full histories.

    - ``user_ids``: ``B`` distinct int64 ids.
    - ``history_lengths``: ``[B]`` tokens of each user's whole history (>= 0).
    - ``tokens``: int64 CPU ``[sum(L)]`` or ``[sum(L), F]``, the histories concatenated in batch
      order; every feature of a row is part of its identity.
    - ``history_offsets``: ``[B+1]`` derived prefix sums.

    ``tokens`` is held, not copied (a contiguous one): the caller must not write into it until the
    step's `commit` or `abort`, which hashes the new pages from it.
    """

    user_ids: list[int]
    history_lengths: list[int]
    history_offsets: list[int]
    tokens: torch.Tensor

    def __init__(
        self,
        user_ids: Sequence[int] | torch.Tensor,
        history_lengths: Sequence[int] | torch.Tensor,
        tokens: torch.Tensor,
    ) -> None:
        users = _as_int_list("user_ids", user_ids)
        lengths = _as_int_list("history_lengths", history_lengths)
        if not users:
            raise ValueError("empty batch: user_ids has no entries")
        if len(lengths) != len(users):
            raise ValueError(
                f"history_lengths has {len(lengths)} entries but user_ids has {len(users)}"
            )
        for u in users:
            if not _INT64_MIN <= u <= _INT64_MAX:
                raise ValueError(f"user id {u} does not fit in int64")
        if len(set(users)) != len(users):
            seen: set[int] = set()
            dup = next(u for u in users if u in seen or seen.add(u))
            raise ValueError(f"user {dup} appears more than once in one batch")
        for u, n in zip(users, lengths):
            if n < 0:
                raise ValueError(f"negative history length {n} for user {u}")
        if not isinstance(tokens, torch.Tensor):
            raise ValueError(f"tokens must be a torch.Tensor, got {type(tokens).__name__}")
        if tokens.dtype != torch.int64:
            raise ValueError(f"tokens must be int64, got {tokens.dtype}")
        if tokens.device.type != "cpu":
            raise ValueError(f"tokens must be on the CPU (identity is hashed on host), got {tokens.device}")
        if tokens.dim() not in (1, 2):
            raise ValueError(f"tokens must be [sum(L)] or [sum(L), F], got shape {tuple(tokens.shape)}")
        total = sum(lengths)
        if tokens.shape[0] != total:
            raise ValueError(f"tokens has {tokens.shape[0]} rows but history_lengths sum to {total}")
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        self.user_ids = users
        self.history_lengths = lengths
        self.history_offsets = offsets
        self.tokens = tokens.contiguous()

    @classmethod
    def from_offsets(
        cls,
        user_ids: Sequence[int] | torch.Tensor,
        history_offsets: Sequence[int] | torch.Tensor,
        tokens: torch.Tensor,
    ) -> CacheRequest:
        """Build from jagged offsets ``[B+1]`` (non-decreasing, starting at 0)."""
        offsets = _as_int_list("history_offsets", history_offsets)
        if not offsets or offsets[0] != 0:
            raise ValueError(f"history_offsets must start at 0, got {offsets[:1]}")
        for i in range(1, len(offsets)):
            if offsets[i] < offsets[i - 1]:
                raise ValueError(
                    f"history_offsets decrease at index {i}: {offsets[i - 1]} -> {offsets[i]}"
                )
        return cls(user_ids, [b - a for a, b in itertools.pairwise(offsets)], tokens)

    @property
    def batch_size(self) -> int:
        return len(self.user_ids)
