"""Per-event input features derived from the log: the time-gap bucket.

Owns `time_gap_buckets`. A feature here may depend only on an event and events before it, so a
token's feature never changes when later events are appended; the KV cache relies on that to reuse
a history's K/V. It does not embed features (the model does) or read datasets.
"""

from __future__ import annotations

import torch

DEFAULT_NUM_TIME_BUCKETS = 32


def time_gap_buckets(timestamps: torch.Tensor, offsets: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """Log2-scale bucket of each event's gap to the previous event of the same sequence.

    ``timestamps``: ``[E]`` int64 seconds, non-decreasing within each sequence.
    ``offsets``: ``[N+1]`` int64 CSR offsets of the ``N`` sequences (users of a log, or the
    histories of a batch, which are whole prefixes so their first event is the user's first).
    Returns ``[E]`` int64 on the input's device: ``0`` for a sequence's first event, else
    ``1 + #{k : 2**k <= gap}`` capped at ``num_buckets - 1`` (gap 0 -> 1, 1 -> 2, 2..3 -> 3, ...;
    exact for gaps below 2**53 s).
    Raises ``ValueError`` for ``num_buckets < 2``, bad offsets, or time going back inside a sequence.
    """
    if isinstance(num_buckets, bool) or not isinstance(num_buckets, int) or num_buckets < 2:
        raise ValueError(f"num_buckets must be an int >= 2, got {num_buckets!r}")
    for name, t in (("timestamps", timestamps), ("offsets", offsets)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 1:
            raise ValueError(f"{name} must be a 1-D int64 tensor, got {_describe(t)}")
    num_events = timestamps.numel()
    if offsets.numel() < 1 or int(offsets[0]) != 0 or int(offsets[-1]) != num_events:
        raise ValueError(
            f"offsets must run from 0 to {num_events} (the number of timestamps), "
            f"got {offsets.tolist()[:8]}..."
        )
    lengths = offsets.diff()
    if (lengths < 0).any():
        raise ValueError(f"offsets must be non-decreasing, got lengths {lengths.tolist()[:8]}...")
    gaps = torch.zeros_like(timestamps)
    gaps[1:] = timestamps.diff()
    is_first = torch.zeros(num_events, dtype=torch.bool, device=timestamps.device)
    is_first[offsets[:-1][lengths > 0]] = True
    if (gaps < 0).logical_and(~is_first).any():
        e = int(torch.nonzero((gaps < 0) & ~is_first)[0])
        raise ValueError(f"time goes back at event {e}: {int(timestamps[e - 1])} then {int(timestamps[e])}")
    # NOTE: frexp's exponent of g >= 1 is floor(log2(g)) + 1, exact for g < 2**53 (float64 holds g
    # exactly), and 0 for g == 0; so the same gap always lands in the same bucket, on any device.
    exponent = torch.frexp(gaps.to(torch.float64)).exponent
    buckets = (1 + exponent.to(torch.int64)).clamp_(max=num_buckets - 1)
    buckets[is_first] = 0
    return buckets


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__
