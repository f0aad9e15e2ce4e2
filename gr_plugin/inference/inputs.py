"""From a `RequestBatch` to what the model and the cache take.

Owns the mapping of the data layer's fields to the model's KJT keys (``item`` <- items, ``action``
<- ratings, ``time`` <- time buckets) and the cache identity of each history event. The cache keys
are computed from the *host* copy of a batch (`host_batch`), so no device sync is needed.
"""

from __future__ import annotations

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gr_plugin.data import RequestBatch
from gr_plugin.modules import cache_token_keys
from gr_plugin.modules.tokens import CANDIDATE_KEYS, HISTORY_KEYS


def host_batch(batch: RequestBatch) -> RequestBatch:
    """The CPU copy of ``batch``: itself on the CPU, else the copy it was moved from."""
    if batch.device.type == "cpu":
        return batch
    host = getattr(batch, "host", None)
    if host is None:
        raise ValueError(
            f"batch is on {batch.device} without its host copy; move batches with RequestBatch.to() "
            "so the cache can read the history on the host without a device sync"
        )
    return host


def batch_to_kjts(batch: RequestBatch) -> tuple[KeyedJaggedTensor, KeyedJaggedTensor]:
    """``(history, candidates)`` KJTs on the batch's device."""
    lengths = batch.history_lengths
    history = KeyedJaggedTensor(
        keys=list(HISTORY_KEYS),
        values=torch.cat([batch.history_items, batch.history_ratings, batch.history_time_buckets]),
        lengths=lengths.repeat(len(HISTORY_KEYS)),
    )
    candidates = KeyedJaggedTensor(keys=list(CANDIDATE_KEYS), values=batch.candidate_items,
                                   lengths=batch.candidate_lengths)
    return history, candidates


def batch_cache_keys(batch: RequestBatch, *, check: bool = True) -> torch.Tensor:
    """int64 CPU ``[sum(L)]``: one cache identity per history event (see `cache_token_keys`;
    ``check=False`` only for a batch already validated against tables that `keys_fit`)."""
    host = host_batch(batch)
    return cache_token_keys(host.history_items, host.history_ratings, host.history_time_buckets, check=check)
