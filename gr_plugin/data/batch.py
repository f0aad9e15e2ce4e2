"""`RequestBatch`: the jagged tensors one ranking step consumes, validated at the boundary.

Owns the batch layout (histories and candidates of ``B`` distinct users, concatenated in batch
order) and its checks. It does not decide which users or visits go together (see `requests`), and
it knows nothing about the cache.
"""

from __future__ import annotations

import dataclasses

import torch

_HISTORY_FIELDS = ("history_items", "history_ratings", "history_timestamps", "history_time_buckets")
_PER_USER_FIELDS = ("user_ids", "history_lengths", "candidate_lengths", "visit_index")


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, 0, out=out[1:])
    return out


@dataclasses.dataclass
class RequestBatch:
    """One ranking step for ``B`` distinct users.

    Per user, ``[B]`` int64: ``user_ids`` (dataset user numbers), ``history_lengths`` (>= 1),
    ``candidate_lengths`` (>= 1), ``visit_index`` (0 for a user's first visit, 1 for the next...).
    Histories, ``[sum(history_lengths)]`` int64, users concatenated in batch order; each is the
    user's whole history prefix, oldest first: ``history_items``, ``history_ratings``,
    ``history_timestamps``, ``history_time_buckets`` (see `features.time_gap_buckets`).
    Candidates: ``candidate_items`` ``[sum(candidate_lengths)]`` int64 and ``labels``
    ``[sum(candidate_lengths), 2]`` float32: column 0 "liked" (a real next item rated >= 4),
    column 1 "watched" (1 for real next items, 0 for sampled negatives).
    """

    user_ids: torch.Tensor
    history_lengths: torch.Tensor
    history_items: torch.Tensor
    history_ratings: torch.Tensor
    history_timestamps: torch.Tensor
    history_time_buckets: torch.Tensor
    candidate_lengths: torch.Tensor
    candidate_items: torch.Tensor
    labels: torch.Tensor
    visit_index: torch.Tensor

    def __post_init__(self) -> None:
        for name in (*_PER_USER_FIELDS, *_HISTORY_FIELDS, "candidate_items"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 1:
                raise ValueError(f"{name} must be a 1-D int64 tensor, got {_describe(t)}")
        if not isinstance(self.labels, torch.Tensor) or self.labels.dtype != torch.float32:
            raise ValueError(f"labels must be a float32 tensor, got {_describe(self.labels)}")
        batch_size = self.user_ids.numel()
        if batch_size == 0:
            raise ValueError("empty batch: user_ids has no entries")
        for name in _PER_USER_FIELDS[1:]:
            n = getattr(self, name).numel()
            if n != batch_size:
                raise ValueError(f"{name} has {n} entries but user_ids has {batch_size}")
        users = self.user_ids.tolist()
        if len(set(users)) != batch_size:
            seen: set[int] = set()
            dup = next(u for u in users if u in seen or seen.add(u))
            raise ValueError(f"user {dup} appears more than once in one batch")
        totals = {}
        for name, what in (
            ("history_lengths", "empty history (a ranking request needs at least one event)"),
            ("candidate_lengths", "no candidates"),
        ):
            lengths = getattr(self, name).tolist()
            # NOTE: summed as Python ints: an int64 sum could wrap past 2**63 and match a column's size
            totals[name] = sum(lengths)
            for u, n in zip(users, lengths):
                if n < 0:
                    raise ValueError(f"negative {name} entry {n} for user {u}")
                if n == 0:
                    raise ValueError(f"user {u} has {what}: {name} is 0")
        for u, v in zip(users, self.visit_index.tolist()):
            if v < 0:
                raise ValueError(f"negative visit_index {v} for user {u}")
        total_history = totals["history_lengths"]
        for name in _HISTORY_FIELDS:
            n = getattr(self, name).numel()
            if n != total_history:
                raise ValueError(f"{name} has {n} events but history_lengths sum to {total_history}")
        total_candidates = totals["candidate_lengths"]
        if self.candidate_items.numel() != total_candidates:
            raise ValueError(
                f"candidate_items has {self.candidate_items.numel()} items but candidate_lengths "
                f"sum to {total_candidates}"
            )
        if tuple(self.labels.shape) != (total_candidates, 2):
            raise ValueError(f"labels has shape {tuple(self.labels.shape)}, expected ({total_candidates}, 2)")

    @property
    def batch_size(self) -> int:
        return self.user_ids.numel()

    @property
    def history_offsets(self) -> torch.Tensor:
        """``[B+1]`` int64 prefix sums of ``history_lengths``."""
        return _offsets(self.history_lengths)

    @property
    def candidate_offsets(self) -> torch.Tensor:
        """``[B+1]`` int64 prefix sums of ``candidate_lengths``."""
        return _offsets(self.candidate_lengths)

    @property
    def device(self) -> torch.device:
        return self.candidate_items.device

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> RequestBatch:
        """A copy with every tensor on ``device`` (``self`` when already there).

        A copy moved off the CPU keeps the CPU batch as ``host``, so host-side readers (the KV
        cache hashes histories there) never sync the device.
        """
        device = torch.device(device)
        if self.device == device:
            return self
        out = object.__new__(RequestBatch)
        # NOTE: skip __post_init__: the batch was validated on the host, and re-checking on a
        # device would sync it.
        for f in dataclasses.fields(self):
            setattr(out, f.name, getattr(self, f.name).to(device, non_blocking=non_blocking))
        host = self if self.device.type == "cpu" else getattr(self, "host", None)
        if host is not None:
            out.host = host
        return out

    def pin_memory(self) -> RequestBatch:
        """A copy in pinned host memory (DataLoader's ``pin_memory=True`` calls this)."""
        out = object.__new__(RequestBatch)
        for f in dataclasses.fields(self):
            setattr(out, f.name, getattr(self, f.name).pin_memory())
        return out


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__
