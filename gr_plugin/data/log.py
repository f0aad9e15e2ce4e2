"""The interaction log: every user's time-sorted history in flat CSR form.

Owns `InteractionLog`, the one in-memory shape every data source produces and every consumer reads
(request building, the datamodule, benchmarks). It validates its own invariants at construction.
It does not parse files (see `movielens`, `synthetic`), cut histories into visits or build requests
(see `requests`).
"""

from __future__ import annotations

import dataclasses

import torch

MIN_RATING, MAX_RATING = 1, 5
PAD_ITEM_ID = 0


def _check_int64_vector(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype != torch.int64:
        raise ValueError(f"{name} must be int64, got {value.dtype}")
    if value.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(value.shape)}")
    if value.device.type != "cpu":
        raise ValueError(f"{name} must live on the CPU, got device {value.device}")
    return value


@dataclasses.dataclass(frozen=True)
class InteractionLog:
    """Every user's history, sorted by time, as CSR int64 CPU tensors.

    - ``user_ids``: ``[U]`` the dataset's own user numbers (MovieLens ``1m_42`` -> 42), distinct.
    - ``offsets``: ``[U+1]`` user ``u`` owns events ``offsets[u]:offsets[u+1]``; ``offsets[0] == 0``.
    - ``item_ids``: ``[E]`` dense ids in ``1..num_items`` (``0`` is reserved for padding).
    - ``ratings``: ``[E]`` in ``1..5``.
    - ``timestamps``: ``[E]`` unix seconds, non-decreasing within each user.
    - ``num_items``: size of the item vocabulary, excluding the padding id.

    Tensors are shared, not copied: treat them as read-only.
    """

    user_ids: torch.Tensor
    offsets: torch.Tensor
    item_ids: torch.Tensor
    ratings: torch.Tensor
    timestamps: torch.Tensor
    num_items: int

    def __post_init__(self) -> None:
        for field in ("user_ids", "offsets", "item_ids", "ratings", "timestamps"):
            _check_int64_vector(field, getattr(self, field))
        if isinstance(self.num_items, bool) or not isinstance(self.num_items, int) or self.num_items < 1:
            raise ValueError(f"num_items must be a positive int, got {self.num_items!r}")
        num_users = self.user_ids.numel()
        num_events = self.item_ids.numel()
        if self.offsets.numel() != num_users + 1:
            raise ValueError(
                f"offsets has {self.offsets.numel()} entries, expected num_users + 1 = {num_users + 1}"
            )
        for field in ("ratings", "timestamps"):
            n = getattr(self, field).numel()
            if n != num_events:
                raise ValueError(f"{field} has {n} events but item_ids has {num_events}")
        if self.offsets[0].item() != 0:
            raise ValueError(f"offsets[0] must be 0, got {self.offsets[0].item()}")
        if self.offsets[-1].item() != num_events:
            raise ValueError(f"offsets[-1] = {self.offsets[-1].item()} but there are {num_events} events")
        lengths = self.offsets.diff()
        if (lengths < 0).any():
            u = int(torch.nonzero(lengths < 0)[0])
            raise ValueError(f"offsets decrease at user index {u}: {self.offsets[u : u + 2].tolist()}")
        if torch.unique(self.user_ids).numel() != num_users:
            raise ValueError("user_ids holds a duplicate user id")
        if num_events:
            lo, hi = int(self.item_ids.min()), int(self.item_ids.max())
            if lo < 1 or hi > self.num_items:
                bad = lo if lo < 1 else hi
                raise ValueError(f"item id {bad} outside 1..num_items={self.num_items}")
            lo, hi = int(self.ratings.min()), int(self.ratings.max())
            if lo < MIN_RATING or hi > MAX_RATING:
                bad = lo if lo < MIN_RATING else hi
                raise ValueError(f"rating {bad} outside {MIN_RATING}..{MAX_RATING}")
            going_back = self.timestamps.diff() < 0
            # NOTE: a drop in time across a user boundary is fine; only drops inside one user are not.
            starts = self.offsets[1:-1]
            going_back[starts[(starts >= 1) & (starts < num_events)] - 1] = False
            if going_back.any():
                e = int(torch.nonzero(going_back)[0]) + 1
                raise ValueError(
                    f"timestamps not sorted within a user at event {e}: "
                    f"{self.timestamps[e - 1].item()} then {self.timestamps[e].item()}"
                )

    @property
    def num_users(self) -> int:
        return self.user_ids.numel()

    @property
    def num_events(self) -> int:
        return self.item_ids.numel()

    @property
    def lengths(self) -> torch.Tensor:
        """``[U]`` int64: events per user."""
        return self.offsets.diff()

    def _check_index(self, u_index: int) -> None:
        if isinstance(u_index, bool) or not isinstance(u_index, int) or not 0 <= u_index < self.num_users:
            raise ValueError(f"user index {u_index!r} outside 0..{self.num_users - 1}")

    def history(self, u_index: int) -> dict[str, torch.Tensor]:
        """User ``u_index``'s whole history: ``item_ids``, ``ratings``, ``timestamps``, each ``[L]`` int64.

        ``u_index`` is a row of this log (``0..num_users-1``), not a dataset user id. The tensors
        are views into the log.
        """
        self._check_index(u_index)
        lo, hi = int(self.offsets[u_index]), int(self.offsets[u_index + 1])
        return {
            "item_ids": self.item_ids[lo:hi],
            "ratings": self.ratings[lo:hi],
            "timestamps": self.timestamps[lo:hi],
        }

    def subset(self, u_indices: torch.Tensor | list[int]) -> InteractionLog:
        """A new log holding only rows ``u_indices`` (in that order); ``num_items`` is kept."""
        idx = torch.as_tensor(u_indices, dtype=torch.int64)
        if idx.dim() != 1:
            raise ValueError(f"u_indices must be 1-D, got shape {tuple(idx.shape)}")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.num_users):
            bad = int(idx.min()) if int(idx.min()) < 0 else int(idx.max())
            raise ValueError(f"user index {bad} outside 0..{self.num_users - 1}")
        lengths = self.lengths[idx]
        offsets = torch.zeros(idx.numel() + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        events = gather_ranges(self.offsets[idx], lengths)
        return InteractionLog(
            user_ids=self.user_ids[idx].clone(),
            offsets=offsets,
            item_ids=self.item_ids[events],
            ratings=self.ratings[events],
            timestamps=self.timestamps[events],
            num_items=self.num_items,
        )


def gather_ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Flat indices of the ranges ``[starts[i], starts[i] + lengths[i])``, concatenated.

    ``starts``, ``lengths``: ``[N]`` int64 (lengths >= 0). Returns ``[sum(lengths)]`` int64.
    """
    total = int(lengths.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.int64)
    range_offsets = torch.cumsum(lengths, 0) - lengths
    which = torch.repeat_interleave(torch.arange(lengths.numel()), lengths, output_size=total)
    return starts[which] + torch.arange(total) - range_offsets[which]
