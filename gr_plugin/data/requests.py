"""The request stream the inference side replays: one request per user visit.

Owns `Request` (one user's visit: a history prefix length plus candidates and labels),
`make_request` / `build_requests` (candidates = the visit's real next items + sampled negatives),
`replay_order` (returning users interleaved), and `group_requests` / `batch_requests` /
`collate_requests` (into `RequestBatch`). Histories are always whole prefixes of a user's log,
never truncated from the left, because a cached history must be append-only. It does not decide
where visits fall (see `visits`).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterable, Sequence

import torch

from gr_plugin.data._util import check_counts, check_int, mix_seed
from gr_plugin.data.batch import RequestBatch
from gr_plugin.data.features import DEFAULT_NUM_TIME_BUCKETS, time_gap_buckets
from gr_plugin.data.log import InteractionLog
from gr_plugin.data.visits import Visits, split_visits

__all__ = [
    "Request",
    "RequestBatch",
    "batch_requests",
    "build_requests",
    "collate_requests",
    "group_requests",
    "make_request",
    "replay_order",
    "split_visits",
]

LIKED_MIN_RATING = 4


@dataclasses.dataclass(frozen=True)
class Request:
    """One user's visit.

    ``user_index`` is the user's row in the log, ``user_id`` its dataset number. The history is
    the user's first ``history_len`` events. ``candidate_items`` ``[C]`` int64 and ``labels``
    ``[C, 2]`` float32 (liked, watched) are in a seeded shuffled order.
    """

    user_index: int
    user_id: int
    visit_index: int
    history_len: int
    candidate_items: torch.Tensor
    labels: torch.Tensor

    @property
    def num_candidates(self) -> int:
        return self.candidate_items.numel()


def make_request(
    log: InteractionLog,
    u_index: int,
    history_len: int,
    visit_end: int,
    *,
    visit_index: int,
    num_candidates: int,
    max_next: int,
    seed: int,
) -> Request:
    """The request of user row ``u_index`` whose visit covers events ``[history_len, visit_end)``.

    Candidates: the distinct items of the first ``max_next`` visit events (labels: liked =
    rating >= 4, watched = 1), then negatives drawn uniformly without replacement from items the
    user has not touched in events ``[0, visit_end)`` (labels 0, 0), to exactly
    ``num_candidates``, shuffled. The draw is seeded by ``(seed, user_id, history_len)``, so a
    request does not depend on which other requests are built. Raises ``ValueError`` when the
    visit is out of range or too few untouched items are left.
    """
    if not 0 <= u_index < log.num_users:
        raise ValueError(f"user row {u_index} outside 0..{log.num_users - 1}")
    length = int(log.offsets[u_index + 1] - log.offsets[u_index])
    if not 1 <= history_len < visit_end <= length:
        raise ValueError(
            f"visit [{history_len}, {visit_end}) of user row {u_index} must satisfy "
            f"1 <= history_len < visit_end <= {length} (its length)"
        )
    user_id = int(log.user_ids[u_index])
    lo = int(log.offsets[u_index])
    seen_items = log.item_ids[lo : lo + visit_end]
    next_end = min(visit_end, history_len + max_next)
    positives: dict[int, bool] = {}
    next_ratings = log.ratings[lo + history_len : lo + next_end].tolist()
    for item, rating in zip(seen_items[history_len:next_end].tolist(), next_ratings):
        positives.setdefault(item, rating >= LIKED_MIN_RATING)
    excluded = set(seen_items.tolist())
    num_negatives = num_candidates - len(positives)
    available = log.num_items - len(excluded)
    if num_negatives > available:
        raise ValueError(
            f"user {user_id} at history {history_len}: {num_negatives} negatives needed but only "
            f"{available} of num_items={log.num_items} items are untouched"
        )
    g = torch.Generator().manual_seed(mix_seed(seed, user_id, history_len))
    negatives = _sample_untouched(log.num_items, excluded, num_negatives, available, g)
    items = torch.tensor([*positives, *negatives], dtype=torch.int64)
    labels = torch.zeros(num_candidates, 2, dtype=torch.float32)
    labels[: len(positives), 0] = torch.tensor(list(positives.values()), dtype=torch.float32)
    labels[: len(positives), 1] = 1.0
    perm = torch.randperm(num_candidates, generator=g)
    return Request(
        user_index=u_index,
        user_id=user_id,
        visit_index=visit_index,
        history_len=history_len,
        candidate_items=items[perm],
        labels=labels[perm],
    )


def _sample_untouched(
    num_items: int, excluded: set[int], count: int, available: int, g: torch.Generator
) -> list[int]:
    """``count`` distinct ids from ``1..num_items`` outside ``excluded``, uniformly at random."""
    if count == 0:
        return []
    if 2 * count > available:
        # Dense case: enumerate what is left and take a random subset.
        allowed = torch.ones(num_items + 1, dtype=torch.bool)
        allowed[0] = False
        allowed[torch.tensor(sorted(excluded), dtype=torch.int64)] = False
        pool = torch.nonzero(allowed).flatten()
        return pool[torch.randperm(pool.numel(), generator=g)[:count]].tolist()
    # Sparse case: rejection sampling; each round keeps at least half its draws on average.
    chosen: dict[int, None] = {}
    while len(chosen) < count:
        draws = torch.randint(1, num_items + 1, (2 * (count - len(chosen)) + 8,), generator=g)
        for item in draws.tolist():
            if item not in excluded and item not in chosen:
                chosen[item] = None
                if len(chosen) == count:
                    break
    return list(chosen)


def build_requests(
    log: InteractionLog,
    visits: Visits,
    *,
    num_candidates: int,
    max_next: int,
    seed: int,
    max_history_len: int | None = None,
) -> list[Request]:
    """One `Request` per visit, users in log order, each user's visits in time order.

    ``visit_index`` counts a user's visits from 0. Histories are whole prefixes (a cached history
    is append-only, so it is never cut from the left); ``max_history_len`` instead drops every
    request whose history is longer (those are a user's last visits, so numbering is unchanged).
    """
    check_counts(num_candidates, max_next)
    if visits.num_users != log.num_users:
        raise ValueError(f"visits cover {visits.num_users} users but the log has {log.num_users}")
    check_int("max_history_len", max_history_len, min_value=1, allow_none=True)
    out = []
    for u in range(log.num_users):
        for v, (start, end) in enumerate(visits.of_user(u)):
            if max_history_len is not None and start > max_history_len:
                break
            out.append(
                make_request(
                    log,
                    u,
                    start,
                    end,
                    visit_index=v,
                    num_candidates=num_candidates,
                    max_next=max_next,
                    seed=seed,
                )
            )
    return out


def replay_order(requests: Iterable[Request], *, interleave_users: int = 8, seed: int = 0) -> list[Request]:
    """A deterministic serving order that mimics returning users.

    Users enter in a seeded random order; ``interleave_users`` of them are active at a time and
    are served round-robin, one visit per turn, a finished user's slot going to the next user. So
    each user's visits stay in time order (by history length), and between two visits of a user
    the other active users are served (``interleave_users - 1`` of them while enough remain).
    """
    check_int("interleave_users", interleave_users, min_value=1)
    per_user: dict[int, list[Request]] = {}
    for r in requests:
        per_user.setdefault(r.user_index, []).append(r)
    users = sorted(per_user)
    g = torch.Generator().manual_seed(mix_seed(seed))
    waiting = deque(users[i] for i in torch.randperm(len(users), generator=g).tolist())
    queues = {u: deque(sorted(per_user[u], key=lambda r: r.history_len)) for u in users}
    active: deque[int] = deque()
    out: list[Request] = []
    while waiting or active:
        while waiting and len(active) < interleave_users:
            active.append(waiting.popleft())
        u = active.popleft()
        out.append(queues[u].popleft())
        if queues[u]:
            active.append(u)
    return out


def collate_requests(
    requests: Sequence[Request], log: InteractionLog, *, num_time_buckets: int = DEFAULT_NUM_TIME_BUCKETS
) -> RequestBatch:
    """Stack requests of distinct users into a `RequestBatch`, histories gathered from ``log``."""
    if not requests:
        raise ValueError("cannot collate an empty list of requests")
    for r in requests:
        if not 0 <= r.user_index < log.num_users or int(log.user_ids[r.user_index]) != r.user_id:
            raise ValueError(f"request of user {r.user_id} (row {r.user_index}) does not belong to this log")
    starts = [int(log.offsets[r.user_index]) for r in requests]
    for r, lo in zip(requests, starts):
        num_events = int(log.offsets[r.user_index + 1]) - lo
        if not 0 < r.history_len <= num_events:
            raise ValueError(
                f"user {r.user_id}: history_len {r.history_len} outside 1..{num_events} (its events)"
            )
    history_lengths = torch.tensor([r.history_len for r in requests], dtype=torch.int64)
    history_offsets = torch.zeros(len(requests) + 1, dtype=torch.int64)
    torch.cumsum(history_lengths, 0, out=history_offsets[1:])

    def prefixes(column: torch.Tensor) -> torch.Tensor:
        # NOTE: each history is a contiguous slice of the log, so slicing beats an index gather.
        return torch.cat([column[lo : lo + r.history_len] for r, lo in zip(requests, starts)])

    timestamps = prefixes(log.timestamps)
    return RequestBatch(
        user_ids=torch.tensor([r.user_id for r in requests], dtype=torch.int64),
        history_lengths=history_lengths,
        history_items=prefixes(log.item_ids),
        history_ratings=prefixes(log.ratings),
        history_timestamps=timestamps,
        history_time_buckets=time_gap_buckets(timestamps, history_offsets, num_time_buckets),
        candidate_lengths=torch.tensor([r.num_candidates for r in requests], dtype=torch.int64),
        candidate_items=torch.cat([r.candidate_items for r in requests]),
        labels=torch.cat([r.labels for r in requests]),
        visit_index=torch.tensor([r.visit_index for r in requests], dtype=torch.int64),
    )


def group_requests(requests: Iterable[Request], batch_size: int) -> list[list[Request]]:
    """Cut an ordered request stream into groups of at most ``batch_size``, keeping the order.

    A group never holds a user twice: when a user repeats, the current group is closed early.
    """
    check_int("batch_size", batch_size, min_value=1)
    groups: list[list[Request]] = []
    current: list[Request] = []
    users: set[int] = set()
    for r in requests:
        if len(current) == batch_size or r.user_index in users:
            groups.append(current)
            current, users = [], set()
        current.append(r)
        users.add(r.user_index)
    if current:
        groups.append(current)
    return groups


def batch_requests(
    requests: Iterable[Request],
    batch_size: int,
    log: InteractionLog,
    *,
    num_time_buckets: int = DEFAULT_NUM_TIME_BUCKETS,
) -> list[RequestBatch]:
    """`group_requests`, each group collated into a `RequestBatch` (never a user twice)."""
    return [
        collate_requests(group, log, num_time_buckets=num_time_buckets)
        for group in group_requests(requests, batch_size)
    ]
