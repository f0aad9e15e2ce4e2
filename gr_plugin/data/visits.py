"""Where a user's history is cut into visits: the moments a returning user sends a request.

Owns `Visits` (CSR over a log's users) and `split_visits`. A visit ``[start, end)`` means: the
request carries the history prefix ``[0, start)`` and the events ``[start, end)`` are what the user
did in that visit (the items a ranking request should score high). It does not build candidates or
batches (see `requests`).
"""

from __future__ import annotations

import dataclasses

import torch

from gr_plugin.data._util import check_int
from gr_plugin.data.log import InteractionLog

DEFAULT_SESSION_GAP_S = 1800


@dataclasses.dataclass(frozen=True)
class Visits:
    """Every user's visits, in time order, as CSR int64 tensors over the rows of a log.

    - ``offsets``: ``[U+1]`` user row ``u`` owns visits ``offsets[u]:offsets[u+1]``.
    - ``starts``: ``[V]`` history prefix length of each visit (events before the visit).
    - ``ends``: ``[V]`` exclusive end of the visit's own events (``starts < ends``).
    Positions count from the user's first event, not from the start of the log.
    """

    offsets: torch.Tensor
    starts: torch.Tensor
    ends: torch.Tensor

    def __post_init__(self) -> None:
        n = self.starts.numel()
        if self.ends.numel() != n:
            raise ValueError(f"ends has {self.ends.numel()} visits but starts has {n}")
        if self.offsets.numel() < 1 or int(self.offsets[0]) != 0 or int(self.offsets[-1]) != n:
            raise ValueError(f"offsets must run from 0 to {n}, got {self.offsets.tolist()[:8]}...")
        if n and (self.ends <= self.starts).any():
            v = int(torch.nonzero(self.ends <= self.starts)[0])
            raise ValueError(f"visit {v} is empty: [{int(self.starts[v])}, {int(self.ends[v])})")

    @property
    def num_users(self) -> int:
        return self.offsets.numel() - 1

    @property
    def num_visits(self) -> int:
        return self.starts.numel()

    @property
    def counts(self) -> torch.Tensor:
        """``[U]`` int64: visits per user."""
        return self.offsets.diff()

    def of_user(self, u_index: int) -> list[tuple[int, int]]:
        """User row ``u_index``'s visits as ``(start, end)`` pairs, in time order."""
        if not 0 <= u_index < self.num_users:
            raise ValueError(f"user index {u_index!r} outside 0..{self.num_users - 1}")
        lo, hi = int(self.offsets[u_index]), int(self.offsets[u_index + 1])
        return list(zip(self.starts[lo:hi].tolist(), self.ends[lo:hi].tolist()))


def split_visits(
    log: InteractionLog,
    *,
    session_gap_s: float | None = DEFAULT_SESSION_GAP_S,
    max_visit_len: int | None = None,
    stride: int | None = None,
    min_history: int = 1,
    max_visits_per_user: int | None = None,
) -> Visits:
    """Cut every user's history into visits.

    Default (sessions): a visit is a session, a run of events each less than ``session_gap_s``
    seconds after the one before; ``session_gap_s=None`` makes a user's whole history one session.
    ``max_visit_len`` further cuts each session into consecutive chunks of at most that many events.
    ``stride=k`` is the fixed-stride alternative, the same as ``session_gap_s=None,
    max_visit_len=k``: visits start at events ``k, 2k, ...`` whatever the timestamps. MovieLens-1M
    needs one of the two: it is a rating dump whose median user has a single 30-minute session.

    Visits whose history is shorter than ``min_history`` events are dropped (a ranking request
    needs history). ``max_visits_per_user`` keeps only each user's most recent visits.
    """
    if stride is not None:
        if max_visit_len is not None:
            raise ValueError(f"give stride={stride} or max_visit_len={max_visit_len}, not both")
        check_int("stride", stride, min_value=1)
        session_gap_s, max_visit_len = None, stride
    if session_gap_s is not None and not session_gap_s > 0:
        raise ValueError(f"session_gap_s must be > 0 or None, got {session_gap_s!r}")
    check_int("max_visit_len", max_visit_len, min_value=1, allow_none=True)
    check_int("min_history", min_history, min_value=0)
    check_int("max_visits_per_user", max_visits_per_user, min_value=1, allow_none=True)

    num_events, lengths = log.num_events, log.lengths
    user_of_event = torch.repeat_interleave(torch.arange(log.num_users), lengths, output_size=num_events)
    local = torch.arange(num_events) - log.offsets[user_of_event]
    is_start = local == 0
    if session_gap_s is not None and num_events:
        gap = torch.zeros(num_events, dtype=torch.float64)
        gap[1:] = log.timestamps.diff().double()
        is_start |= gap >= session_gap_s
    if max_visit_len is not None:
        session_start = torch.cummax(torch.where(is_start, torch.arange(num_events), 0), 0).values
        is_start |= (torch.arange(num_events) - session_start) % max_visit_len == 0
    starts = torch.nonzero(is_start).flatten()
    # NOTE: the next start is the end of a visit even across users: the user's last visit then
    # ends at the next non-empty user's first event, which is this user's end.
    ends = torch.cat([starts[1:], torch.tensor([num_events])])
    users = user_of_event[starts]
    local_starts = local[starts]
    keep = local_starts >= min_history
    users, local_starts, ends = users[keep], local_starts[keep], ends[keep] - log.offsets[users[keep]]
    counts = torch.bincount(users, minlength=log.num_users)
    if max_visits_per_user is not None:
        visit_offsets = torch.cumsum(counts, 0) - counts
        from_end = counts[users] - 1 - (torch.arange(users.numel()) - visit_offsets[users])
        keep = from_end < max_visits_per_user
        users, local_starts, ends = users[keep], local_starts[keep], ends[keep]
        counts = torch.bincount(users, minlength=log.num_users)
    offsets = torch.zeros(log.num_users + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=offsets[1:])
    return Visits(offsets=offsets, starts=local_starts, ends=ends)
