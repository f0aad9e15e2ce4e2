"""A synthetic `InteractionLog` with long histories, for benchmarks and tests.

Owns `synthetic_log`: history lengths log-uniform in ``[min_len, max_len]``, items drawn from a
Zipf-like popularity, ratings from a user bias plus an item quality (so "liked" is learnable), and
timestamps that come in sessions (gaps of seconds to minutes) separated by hours to weeks. Output
is a pure function of the arguments. It does not model repeat consumption or user taste beyond that.
"""

from __future__ import annotations

import math

import torch

from gr_plugin.data._util import check_int
from gr_plugin.data.log import MAX_RATING, MIN_RATING, InteractionLog

SYNTHETIC_START_TIME = 1_577_836_800  # 2020-01-01T00:00:00Z
_MAX_IN_SESSION_GAP_S = 1_799  # NOTE: below the default session gap (1800 s), so sessions split cleanly
_MIN_BETWEEN_SESSION_GAP_S = 1_800


def synthetic_log(
    num_users: int,
    min_len: int,
    max_len: int,
    num_items: int,
    seed: int,
    *,
    zipf_exponent: float = 1.0,
    mean_session_len: float = 24.0,
) -> InteractionLog:
    """A log of ``num_users`` users (ids ``1..num_users``) over items ``1..num_items``.

    Each user's length is drawn log-uniformly from ``[min_len, max_len]`` (so e.g. 256 -> 4096
    gives as many users near 256 as near 4096). Items are drawn with probability proportional to
    ``rank ** -zipf_exponent`` over a seeded random ranking of the ids. Within a session events are
    1-1799 s apart (mean about 45 s); a new session starts with probability ``1 / mean_session_len``
    after 1800 s plus a log-normal gap (median one day). The same arguments give the same log.
    """
    check_int("num_users", num_users, min_value=1)
    check_int("min_len", min_len, min_value=1)
    check_int("max_len", max_len, min_value=1)
    check_int("num_items", num_items, min_value=1)
    if max_len < min_len:
        raise ValueError(f"max_len={max_len} is below min_len={min_len}")
    if not zipf_exponent >= 0:
        raise ValueError(f"zipf_exponent must be >= 0, got {zipf_exponent!r}")
    if not mean_session_len >= 1:
        raise ValueError(f"mean_session_len must be >= 1, got {mean_session_len!r}")
    g = torch.Generator().manual_seed(seed)

    u = torch.rand(num_users, generator=g, dtype=torch.float64)
    lengths = torch.exp(math.log(min_len) + u * (math.log(max_len + 1) - math.log(min_len)))
    lengths = lengths.floor().to(torch.int64).clamp_(min_len, max_len)
    offsets = torch.zeros(num_users + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    num_events = int(offsets[-1])
    user_of_event = torch.repeat_interleave(torch.arange(num_users), lengths, output_size=num_events)

    # Items: inverse-CDF sampling of a Zipf law over a random ranking (works for any vocabulary size).
    rank_weights = torch.arange(1, num_items + 1, dtype=torch.float64).pow(-zipf_exponent)
    cdf = torch.cumsum(rank_weights, 0)
    cdf /= cdf[-1].clone()
    ranks = torch.searchsorted(cdf, torch.rand(num_events, generator=g, dtype=torch.float64))
    ranks.clamp_(max=num_items - 1)
    item_of_rank = torch.randperm(num_items, generator=g) + 1
    item_ids = item_of_rank[ranks]

    item_quality = 0.8 * torch.randn(num_items + 1, generator=g)
    user_bias = 0.5 * torch.randn(num_users, generator=g)
    noise = 0.9 * torch.randn(num_events, generator=g)
    score = 3.6 + item_quality[item_ids] + user_bias[user_of_event] + noise
    ratings = score.round().clamp_(MIN_RATING, MAX_RATING).to(torch.int64)

    in_session = (1 + torch.empty(num_events).exponential_(1 / 45.0, generator=g)).floor()
    in_session.clamp_(max=_MAX_IN_SESSION_GAP_S)
    between = _MIN_BETWEEN_SESSION_GAP_S + torch.exp(
        math.log(86_400.0) + 1.5 * torch.randn(num_events, generator=g, dtype=torch.float64)
    ).clamp_(max=90 * 86_400.0)
    new_session = torch.rand(num_events, generator=g) < 1.0 / mean_session_len
    gaps = torch.where(new_session, between.floor(), in_session.double()).to(torch.int64)
    gaps[offsets[:-1]] = 0
    start_times = SYNTHETIC_START_TIME + torch.randint(0, 180 * 86_400, (num_users,), generator=g)
    elapsed = torch.cumsum(gaps, 0)
    elapsed -= elapsed[offsets[:-1]].repeat_interleave(lengths, output_size=num_events)
    timestamps = start_times[user_of_event] + elapsed

    return InteractionLog(
        user_ids=torch.arange(1, num_users + 1, dtype=torch.int64),
        offsets=offsets,
        item_ids=item_ids,
        ratings=ratings,
        timestamps=timestamps,
        num_items=num_items,
    )
