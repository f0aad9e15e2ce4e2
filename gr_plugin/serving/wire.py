"""The wire format of the served ranking model: tensor names, dtypes, shapes and padding.

One Triton request scores ``B`` distinct users (Triton's batch dimension, ``1 <= B <=
max_batch_size``). Inputs, all int64:

- per user ``[B, 1]``: ``user_id`` (>= 0), ``history_length`` (events, >= 1), ``candidate_length``
  (>= 1);
- per history event ``[B, W]``: ``history_items`` (1..num_items), ``history_ratings`` (the action,
  0..num_actions-1), ``history_time_buckets`` (0..num_time_buckets-1); each row is the user's whole
  history, oldest first, padded on the right to the common width ``W >= max(history_length)``;
- ``candidate_items`` ``[B, Wc]``, padded the same way to ``Wc >= max(candidate_length)``.

Padding values are never read. Triton's dynamic batcher merges only requests whose padded widths
are equal, so `encode_batch` pads to a few widths (`bucket_width`: powers of two), which bounds the
bytes wasted to 2x and lets requests of similar lengths share a batch.

Outputs: ``scores`` float32 ``[B, Wc, num_tasks]`` (NaN in the padding) and ``error`` bytes
``[B, 1]``: empty when the request was scored, otherwise why it was rejected (every row of a
rejected request carries the same message and its scores are NaN). Requests that Triton itself
rejects (unknown model, missing input, wrong dtype or rank, batch too large) get a Triton error
instead. This module owns the format and the client-side encoding; the server-side checks are in
`validation`.
"""

from __future__ import annotations

import numpy as np
import torch

from gr_plugin.data import RequestBatch

PER_USER_INPUTS = ("user_id", "history_length", "candidate_length")
HISTORY_INPUTS = ("history_items", "history_ratings", "history_time_buckets")
CANDIDATE_INPUTS = ("candidate_items",)
INPUTS = (*PER_USER_INPUTS, *HISTORY_INPUTS, *CANDIDATE_INPUTS)
SCORES, ERROR = "scores", "error"
MIN_WIDTH = 16


def bucket_width(n: int, min_width: int = MIN_WIDTH) -> int:
    """The padded width for rows of up to ``n`` entries: the next power of two, at least ``min_width``."""
    if n < 0:
        raise ValueError(f"a row length must be >= 0, got {n}")
    return max(min_width, 1 << max(0, int(n) - 1).bit_length())


def _pad_rows(values: torch.Tensor, lengths: np.ndarray, width: int) -> np.ndarray:
    out = np.zeros((lengths.size, width), dtype=np.int64)
    out[np.arange(width)[None, :] < lengths[:, None]] = values.numpy()
    return out


def encode_batch(batch: RequestBatch, *, min_width: int = MIN_WIDTH) -> dict[str, np.ndarray]:
    """The Triton inputs of a `RequestBatch` (CPU), rows padded to `bucket_width` widths."""
    hist = batch.history_lengths.numpy()
    cand = batch.candidate_lengths.numpy()
    w_hist, w_cand = bucket_width(int(hist.max()), min_width), bucket_width(int(cand.max()), min_width)
    return {
        "user_id": batch.user_ids.numpy().reshape(-1, 1).copy(),
        "history_length": hist.reshape(-1, 1).copy(),
        "candidate_length": cand.reshape(-1, 1).copy(),
        "history_items": _pad_rows(batch.history_items, hist, w_hist),
        "history_ratings": _pad_rows(batch.history_ratings, hist, w_hist),
        "history_time_buckets": _pad_rows(batch.history_time_buckets, hist, w_hist),
        "candidate_items": _pad_rows(batch.candidate_items, cand, w_cand),
    }


def decode_scores(scores: np.ndarray, candidate_lengths: np.ndarray) -> np.ndarray:
    """``scores [B, Wc, T]`` -> ``[sum(C), T]`` float32, users concatenated in batch order (the
    layout of `RankingEngine.score`'s logits)."""
    lengths = np.asarray(candidate_lengths).reshape(-1)
    mask = np.arange(scores.shape[1])[None, :] < lengths[:, None]
    return scores[mask]


def error_messages(error: np.ndarray) -> list[str]:
    """The ``error`` output ``[B, 1]`` as one string per row ("" = scored)."""
    return [e.decode("utf-8", "replace") if isinstance(e, bytes) else str(e) for e in np.asarray(error).reshape(-1)]
